-- The reaper found expired claims through an index on lease_until, so
-- every heartbeat and every sent mark (a new lease_until) wrote a new
-- entry into every index of the jobs table: in PostgreSQL no renewal
-- could be a HOT update, and each added five index entries and their WAL
-- to the job's claim and end. The running jobs are indexed by id
-- instead, which no renewal changes: a renewal touches no indexed column
-- (lease_until and sent_fence are in no index), so in PostgreSQL it is a
-- HOT update (the new version on the same page, no index entry) and in
-- SQLite it rewrites no index. The reaper reads the running jobs whole
-- and sorts those expired by lease_until: they are at most the fleet's
-- slots, never the backlog. An attempt's end finds its job through the
-- same small index.
DROP INDEX jobs_leases;
CREATE INDEX jobs_running ON jobs (id) WHERE state = 'RUNNING';
