-- A fair claim takes each considered tenant's share from the head of that
-- tenant's queue (jobs_runnable_tenant, keyed by tenant first). The index
-- of all runnable jobs in claim order (jobs_runnable) had the same
-- predicate, so the planner could serve that probe with it too, reading
-- the whole queue's head and filtering out the other tenants' jobs. A
-- generic plan made after an ANALYZE taken at the end of a drain (nothing
-- runnable: every runnable-jobs index costed at one row) chose it: ten
-- claims of 32 read 14,369 entries of jobs_runnable and none of the
-- tenants' index, with 16 tenants and 4,000 jobs runnable, and the fair
-- benchmark's rounds fell to a third of their rate until the next
-- ANALYZE. As migration 19 did for the deadline index, the predicate now
-- also says that the priority is a number, true of every row, in words
-- that the statements taking jobs across tenants in claim order repeat
-- (ownership.go's claimOrderIndexed) and that a tenant's head probe does
-- not: the probes walk jobs_runnable_tenant whatever the statistics.
DROP INDEX jobs_runnable;
CREATE INDEX jobs_runnable ON jobs (priority, available_at, id)
    WHERE state IN ('READY', 'RETRY_SCHEDULED') AND (priority >= 0 OR priority < 0);
