-- The Files and Batch APIs. A file is a row and its content in chunk rows
-- of about 1 MiB, each written in its own short transaction; the file is
-- listed once complete. A batch is a row; each of its lines is a job
-- (batch_id, custom_id), run like any other. Times are Unix microseconds;
-- 0 means none.
CREATE TABLE files (
    id         TEXT PRIMARY KEY,
    tenant     TEXT NOT NULL,
    filename   TEXT NOT NULL,
    purpose    TEXT NOT NULL,
    bytes      BIGINT NOT NULL DEFAULT 0,
    lines      BIGINT NOT NULL DEFAULT 0,
    complete   INTEGER NOT NULL DEFAULT 0,
    created_at BIGINT NOT NULL,
    expires_at BIGINT NOT NULL DEFAULT 0
);
CREATE INDEX files_tenant ON files (tenant, id) WHERE complete = 1;
-- Incomplete files (an upload cut, a finalization overtaken) are swept by age.
CREATE INDEX files_incomplete ON files (created_at) WHERE complete = 0;

CREATE TABLE file_chunks (
    file_id TEXT NOT NULL REFERENCES files (id) ON DELETE CASCADE,
    seq     INTEGER NOT NULL,
    data    BLOB NOT NULL,
    PRIMARY KEY (file_id, seq)
);

CREATE TABLE batches (
    id                TEXT PRIMARY KEY,
    tenant            TEXT NOT NULL,
    endpoint          TEXT NOT NULL,
    input_file_id     TEXT NOT NULL,
    completion_window TEXT NOT NULL,
    status            TEXT NOT NULL CHECK (status IN ('validating', 'failed', 'in_progress', 'finalizing', 'completed',
                          'expired', 'cancelling', 'cancelled')),
    -- What finalizing ends in: completed, expired or cancelled.
    end_status        TEXT NOT NULL DEFAULT '',
    model             TEXT NOT NULL DEFAULT '',
    output_file_id    TEXT NOT NULL DEFAULT '',
    error_file_id     TEXT NOT NULL DEFAULT '',
    errors            BLOB,
    metadata          BLOB,
    output_expires_s  BIGINT NOT NULL DEFAULT 0,
    total             INTEGER NOT NULL DEFAULT 0,
    completed         INTEGER NOT NULL DEFAULT 0,
    failed            INTEGER NOT NULL DEFAULT 0,
    usage             BLOB,
    priority_base     INTEGER NOT NULL DEFAULT 0,
    created_at        BIGINT NOT NULL,
    in_progress_at    BIGINT NOT NULL DEFAULT 0,
    expires_at        BIGINT NOT NULL,
    finalizing_at     BIGINT NOT NULL DEFAULT 0,
    completed_at      BIGINT NOT NULL DEFAULT 0,
    failed_at         BIGINT NOT NULL DEFAULT 0,
    expired_at        BIGINT NOT NULL DEFAULT 0,
    cancelling_at     BIGINT NOT NULL DEFAULT 0,
    cancelled_at      BIGINT NOT NULL DEFAULT 0,
    -- The replica working on the batch (validating, finalizing) holds its
    -- lease; fence names one claim of it.
    fence             BIGINT NOT NULL DEFAULT 0,
    lease_until       BIGINT NOT NULL DEFAULT 0,
    -- The files the current finalization writes, not yet the batch's.
    pending_output    TEXT NOT NULL DEFAULT '',
    pending_error     TEXT NOT NULL DEFAULT ''
);
CREATE INDEX batches_tenant ON batches (tenant, id);
CREATE INDEX batches_open ON batches (lease_until) WHERE status IN ('validating', 'in_progress', 'finalizing', 'cancelling');

-- A batch's lines are jobs.
ALTER TABLE jobs ADD COLUMN batch_id TEXT;
ALTER TABLE jobs ADD COLUMN custom_id TEXT;
CREATE INDEX jobs_batch ON jobs (batch_id, id) WHERE batch_id IS NOT NULL;
CREATE INDEX jobs_batch_open ON jobs (batch_id) WHERE batch_id IS NOT NULL AND state IN ('READY', 'RUNNING', 'RETRY_SCHEDULED');

-- A batch's own events (batch.completed, ...) name the batch, not a job:
-- the outbox loses its foreign key to jobs, which SQLite can only drop by
-- rebuilding the table.
CREATE TABLE outbox_new (
    seq           INTEGER PRIMARY KEY AUTOINCREMENT,
    id            TEXT NOT NULL UNIQUE,
    job_id        TEXT NOT NULL,
    tenant        TEXT NOT NULL,
    type          TEXT NOT NULL,
    state         TEXT NOT NULL,
    state_version BIGINT NOT NULL,
    created_at    BIGINT NOT NULL,
    published_at  BIGINT NOT NULL DEFAULT 0,
    feed_seq      BIGINT
);
INSERT INTO outbox_new (seq, id, job_id, tenant, type, state, state_version, created_at, published_at, feed_seq)
    SELECT seq, id, job_id, tenant, type, state, state_version, created_at, published_at, feed_seq FROM outbox;
UPDATE sqlite_sequence SET seq = max(seq, COALESCE((SELECT seq FROM sqlite_sequence WHERE name = 'outbox'), 0))
    WHERE name = 'outbox_new';
DROP TABLE outbox;
ALTER TABLE outbox_new RENAME TO outbox;
CREATE INDEX outbox_unpublished ON outbox (seq) WHERE published_at = 0;
CREATE UNIQUE INDEX outbox_feed ON outbox (feed_seq) WHERE feed_seq IS NOT NULL;
CREATE INDEX outbox_tenant_feed ON outbox (tenant, feed_seq) WHERE feed_seq IS NOT NULL;
CREATE INDEX outbox_job_feed ON outbox (tenant, job_id, feed_seq) WHERE feed_seq IS NOT NULL;
