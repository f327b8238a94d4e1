-- Jobs, their attempts and stage checkpoints, the outbox and the inbox.
-- Times are Unix microseconds; 0 means none.
CREATE TABLE jobs (
    id              TEXT PRIMARY KEY,           -- UUIDv7: time-ordered
    tenant          TEXT NOT NULL,
    idempotency_key TEXT NOT NULL,
    request_hash    TEXT NOT NULL,
    endpoint        TEXT NOT NULL,
    model           TEXT NOT NULL,
    body            BYTEA NOT NULL,
    metadata        BYTEA,
    priority        INTEGER NOT NULL,
    token_estimate  INTEGER NOT NULL,
    state           TEXT NOT NULL CHECK (state IN ('READY', 'RUNNING', 'RETRY_SCHEDULED', 'SUCCEEDED',
                        'REVIEW_REQUIRED', 'FAILED_TERMINAL', 'CANCELLED')),
    state_version   BIGINT NOT NULL,
    attempt         INTEGER NOT NULL,
    max_attempts    INTEGER NOT NULL,
    fence           BIGINT NOT NULL,
    lease_until     BIGINT NOT NULL,
    available_at    BIGINT NOT NULL,
    deadline_at     BIGINT NOT NULL,
    created_at      BIGINT NOT NULL,
    updated_at      BIGINT NOT NULL,
    error_class     TEXT NOT NULL,
    last_error      TEXT NOT NULL,
    result          BYTEA,
    UNIQUE (tenant, idempotency_key)
);
-- Claims read only runnable rows, in claim order: the index stays small
-- however many jobs have finished.
CREATE INDEX jobs_runnable ON jobs (priority, available_at, id) WHERE state IN ('READY', 'RETRY_SCHEDULED');
CREATE INDEX jobs_runnable_deadline ON jobs (deadline_at) WHERE state IN ('READY', 'RETRY_SCHEDULED');
CREATE INDEX jobs_leases ON jobs (lease_until) WHERE state = 'RUNNING';
CREATE INDEX jobs_tenant ON jobs (tenant, id);

CREATE TABLE attempts (
    job_id            TEXT NOT NULL REFERENCES jobs (id),
    attempt           INTEGER NOT NULL,
    fence             BIGINT NOT NULL,
    backend           TEXT NOT NULL,
    outcome           TEXT NOT NULL,
    error_class       TEXT NOT NULL,
    error             TEXT NOT NULL,
    prompt_tokens     INTEGER NOT NULL,
    completion_tokens INTEGER NOT NULL,
    started_at        BIGINT NOT NULL,
    ended_at          BIGINT NOT NULL,
    PRIMARY KEY (job_id, attempt, fence)
);

CREATE TABLE stages (
    job_id     TEXT NOT NULL REFERENCES jobs (id),
    stage      TEXT NOT NULL,
    fence      BIGINT NOT NULL,
    data       BYTEA NOT NULL,
    created_at BIGINT NOT NULL,
    PRIMARY KEY (job_id, stage)
);

CREATE TABLE outbox (
    seq           BIGSERIAL PRIMARY KEY,
    id            TEXT NOT NULL UNIQUE,
    job_id        TEXT NOT NULL REFERENCES jobs (id),
    tenant        TEXT NOT NULL,
    type          TEXT NOT NULL,
    state         TEXT NOT NULL,
    state_version BIGINT NOT NULL,
    created_at    BIGINT NOT NULL,
    published_at  BIGINT NOT NULL DEFAULT 0
);
CREATE INDEX outbox_unpublished ON outbox (seq) WHERE published_at = 0;
CREATE INDEX outbox_tenant ON outbox (tenant, seq);
CREATE INDEX outbox_job ON outbox (tenant, job_id, seq);

CREATE TABLE inbox (
    event_id    TEXT PRIMARY KEY,
    digest      TEXT NOT NULL,
    received_at BIGINT NOT NULL
);
