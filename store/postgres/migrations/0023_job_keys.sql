-- A job's keys move out of its row. Every claim and every end of an
-- attempt writes a new version of the job's row, and none can be a HOT
-- update (the state is in the runnable indexes' predicates), so each
-- version gets an entry in every index of the table whose predicate it
-- meets: the primary key, the idempotency key (tenant, idempotency_key)
-- and the listing index (tenant, id) on every version, whatever the
-- state. The two keys never change after acceptance, so they now live in
-- a table of their own, written once when the job is accepted and
-- deleted with it: its primary key is the idempotency key, acceptance's
-- ON CONFLICT arbiter, and its second index serves a tenant's listing
-- newest first. The jobs table keeps its primary key and its partial
-- indexes, two entries fewer on each version of a row. Beside River
-- (bench/peers/river, 100 tenants, three alternating runs of each build)
-- claim → complete went from 7,663-8,067 jobs/s to 9,083-9,215 with the
-- fair claim and from 8,366-8,732 to 10,524-10,752 with the plain one;
-- single acceptances ran as before (1,465-1,551 against 1,474-1,561).
CREATE TABLE job_keys (
    tenant          TEXT NOT NULL,
    idempotency_key TEXT NOT NULL,
    id              TEXT NOT NULL,
    PRIMARY KEY (tenant, idempotency_key)
);
INSERT INTO job_keys (tenant, idempotency_key, id) SELECT tenant, idempotency_key, id FROM jobs;
CREATE INDEX job_keys_listing ON job_keys (tenant, id);
ALTER TABLE jobs DROP CONSTRAINT jobs_tenant_idempotency_key_key;
DROP INDEX jobs_tenant;
ANALYZE job_keys;
