-- The index of runnable jobs in claim order keeps apart from a tenant's
-- head probe: see the PostgreSQL migration of the same number. SQLite
-- uses a partial index only for a statement that repeats its predicate's
-- terms, so the same statements use it on both stores.
DROP INDEX jobs_runnable;
CREATE INDEX jobs_runnable ON jobs (priority, available_at, id)
    WHERE state IN ('READY', 'RETRY_SCHEDULED') AND (priority >= 0 OR priority < 0);
