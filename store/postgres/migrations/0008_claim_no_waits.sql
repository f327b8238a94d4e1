-- A job becoming runnable lists its tenant for the fair claim (migration
-- 5). INSERT ... ON CONFLICT DO NOTHING waits for any transaction that
-- has an uncommitted version of the conflicting row, and every claim
-- updates the rows of the tenants it considered: each acceptance of a
-- listed tenant's job waited for the claim in flight. Look first: a
-- tenant already listed (any committed version) needs nothing, and only a
-- tenant missing from the table is inserted.
CREATE OR REPLACE FUNCTION kvgate_job_tenant() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM job_tenants WHERE tenant = NEW.tenant) THEN
        INSERT INTO job_tenants (tenant) VALUES (NEW.tenant) ON CONFLICT DO NOTHING;
    END IF;
    RETURN NULL;
END
$$;

-- Every claim moves the tenants it considered to the back (served_at).
-- With served_at indexed, each such update wrote a new version into both
-- of the table's indexes and the WAL; without the index the update is
-- HOT (heap-only: no index entry, pruned in place on its page, which the
-- free space left by the fill factor makes likely). The claim's pick of
-- the least recently served tenants reads the small table whole instead:
-- it lists only tenants that may have runnable jobs.
DROP INDEX job_tenants_served;
ALTER TABLE job_tenants SET (fillfactor = 50);
