-- A job's keys in a table of their own, as on PostgreSQL (see its
-- migration of the same number): acceptance takes the idempotency key
-- there, and a tenant's listing reads its index. SQLite updates only the
-- indexes whose columns a change touches, so its jobs table gains nothing
-- by it; the statements are the same on both stores. The UNIQUE
-- constraint of the jobs table stays (SQLite drops an inline constraint
-- only by rebuilding the table); acceptance reaches it only through
-- job_keys, so it never decides anything.
CREATE TABLE job_keys (
    tenant          TEXT NOT NULL,
    idempotency_key TEXT NOT NULL,
    id              TEXT NOT NULL,
    PRIMARY KEY (tenant, idempotency_key)
) WITHOUT ROWID;
INSERT INTO job_keys (tenant, idempotency_key, id) SELECT tenant, idempotency_key, id FROM jobs;
CREATE INDEX job_keys_listing ON job_keys (tenant, id);
DROP INDEX jobs_tenant;
