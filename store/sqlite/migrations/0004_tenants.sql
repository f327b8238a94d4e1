-- Tenants, API keys (hashes only), the shared limiter state and the usage
-- ledger. Times are Unix microseconds; 0 means none. Limits of 0 mean
-- unlimited.
CREATE TABLE tenants (
    name               TEXT PRIMARY KEY,
    weight             INTEGER NOT NULL,
    rpm                BIGINT NOT NULL,
    tpm                BIGINT NOT NULL,
    max_concurrency    BIGINT NOT NULL,
    max_pending_jobs   BIGINT NOT NULL,
    max_pending_tokens BIGINT NOT NULL,
    daily_tokens       BIGINT NOT NULL,
    monthly_tokens     BIGINT NOT NULL,
    created_at         BIGINT NOT NULL,
    updated_at         BIGINT NOT NULL
);

CREATE TABLE api_keys (
    id              TEXT PRIMARY KEY,
    hash            TEXT NOT NULL UNIQUE,          -- hex SHA-256 of the key
    prefix          TEXT NOT NULL,
    tenant          TEXT NOT NULL,
    role            TEXT NOT NULL CHECK (role IN ('user', 'operator', 'admin')),
    name            TEXT NOT NULL,
    rpm             BIGINT NOT NULL,
    tpm             BIGINT NOT NULL,
    max_concurrency BIGINT NOT NULL,
    created_at      BIGINT NOT NULL,
    revoked_at      BIGINT NOT NULL
);
CREATE INDEX api_keys_tenant ON api_keys (tenant, created_at);

-- One fixed one-minute window per scope ('t:TENANT' or 'k:KEYID'). Its
-- row is locked first by every acquisition of the scope: acquisitions of
-- one tenant are serialised, on every replica.
CREATE TABLE quota_windows (
    scope        TEXT PRIMARY KEY,
    window_start BIGINT NOT NULL,
    requests     BIGINT NOT NULL,
    tokens       BIGINT NOT NULL
);

-- Concurrency permits: one row per admitted request in flight, leased so
-- that a crashed replica's permits expire.
CREATE TABLE quota_permits (
    id           TEXT PRIMARY KEY,
    tenant       TEXT NOT NULL,
    key_id       TEXT NOT NULL,
    day          INTEGER NOT NULL,
    window_start BIGINT NOT NULL,
    tokens       BIGINT NOT NULL,
    expires_at   BIGINT NOT NULL,
    swept        INTEGER NOT NULL     -- 1: expired, its reservation moved to uncertain usage
);
CREATE INDEX quota_permits_tenant ON quota_permits (tenant, swept, expires_at);
CREATE INDEX quota_permits_key ON quota_permits (key_id, swept) WHERE key_id <> '';

-- Room held for jobs being accepted under pending-job limits.
CREATE TABLE job_reservations (
    id         TEXT PRIMARY KEY,
    tenant     TEXT NOT NULL,
    tokens     BIGINT NOT NULL,
    expires_at BIGINT NOT NULL
);
CREATE INDEX job_reservations_tenant ON job_reservations (tenant, expires_at);
-- Pending jobs per tenant, counted only where a pending limit is set.
CREATE INDEX jobs_tenant_pending ON jobs (tenant) WHERE state IN ('READY', 'RUNNING', 'RETRY_SCHEDULED');

-- The usage ledger: per tenant per UTC day (yyyymmdd).
CREATE TABLE usage_days (
    tenant            TEXT NOT NULL,
    day               INTEGER NOT NULL,
    requests          BIGINT NOT NULL,
    attempts          BIGINT NOT NULL,
    prompt_tokens     BIGINT NOT NULL,
    completion_tokens BIGINT NOT NULL,
    reserved_tokens   BIGINT NOT NULL,
    uncertain         BIGINT NOT NULL,
    uncertain_tokens  BIGINT NOT NULL,
    PRIMARY KEY (tenant, day)
);
