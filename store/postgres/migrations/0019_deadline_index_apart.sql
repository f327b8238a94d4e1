-- The reaper's index of runnable jobs' deadlines had the claim's own
-- predicate (state IN ('READY', 'RETRY_SCHEDULED')), so the planner could
-- serve a claim with it: read it whole and sort by claim order. A
-- prepared generic plan whose statistics were taken while few jobs were
-- runnable (an autovacuum ANALYZE at the end of a drain) costed every
-- runnable-jobs index at one row and chose this one; each claim then read
-- every runnable job, once for the oldest job, once more for the stray
-- check and once per considered tenant: 89 ms for a claim of 16 jobs with
-- 9,100 runnable, instead of about 1 ms, until the next ANALYZE. Its
-- predicate now also says that the deadline is a number, true of every
-- row, in words that the reaper's condition repeats and that no claim's
-- condition implies: claims walk jobs_runnable and jobs_runnable_tenant
-- in claim order, whatever the statistics.
DROP INDEX jobs_runnable_deadline;
CREATE INDEX jobs_runnable_deadline ON jobs (deadline_at)
    WHERE state IN ('READY', 'RETRY_SCHEDULED') AND (deadline_at >= 0 OR deadline_at < 0);
