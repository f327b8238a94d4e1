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
    complete   BOOLEAN NOT NULL DEFAULT FALSE,
    created_at BIGINT NOT NULL,
    expires_at BIGINT NOT NULL DEFAULT 0
);
CREATE INDEX files_tenant ON files (tenant, id) WHERE complete;
-- Incomplete files (an upload cut, a finalization overtaken) are swept by age.
CREATE INDEX files_incomplete ON files (created_at) WHERE NOT complete;

CREATE TABLE file_chunks (
    file_id TEXT NOT NULL REFERENCES files (id) ON DELETE CASCADE,
    seq     INTEGER NOT NULL,
    data    BYTEA NOT NULL,
    PRIMARY KEY (file_id, seq)
);
-- JSON lines compress well, but compressing 200 MB costs more CPU than
-- the disk it saves is worth here.
ALTER TABLE file_chunks ALTER COLUMN data SET STORAGE EXTERNAL;

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
    errors            BYTEA,
    metadata          BYTEA,
    output_expires_s  BIGINT NOT NULL DEFAULT 0,
    total             INTEGER NOT NULL DEFAULT 0,
    completed         INTEGER NOT NULL DEFAULT 0,
    failed            INTEGER NOT NULL DEFAULT 0,
    usage             BYTEA,
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

-- A batch's own events (batch.completed, ...) name the batch, not a job.
ALTER TABLE outbox DROP CONSTRAINT IF EXISTS outbox_job_id_fkey;
