-- The reaper found expired claims through an index on lease_until, so
-- every heartbeat and every sent mark (a new lease_until) wrote a new
-- entry into every index of the jobs table: in PostgreSQL no renewal
-- could be a HOT update, and each added five index entries and their WAL
-- to the job's claim and end. The running jobs are indexed by tenant
-- instead, which no renewal changes: a renewal touches no indexed column
-- (lease_until and sent_fence are in no index), so in PostgreSQL it is a
-- HOT update (the new version on the same page, no index entry) and in
-- SQLite it rewrites no index. The reaper reads the running jobs whole
-- and sorts those expired by lease_until: they are at most the fleet's
-- slots, never the backlog.
--
-- The same index counts a tenant's running jobs for its pending-jobs
-- limit, and jobs_runnable_tenant its runnable ones (quota.go counts the
-- two apart): jobs_tenant_pending, a third index that every acceptance
-- and every claim wrote an entry into, goes.
DROP INDEX jobs_leases;
DROP INDEX jobs_tenant_pending;
CREATE INDEX jobs_running ON jobs (tenant) WHERE state = 'RUNNING';
