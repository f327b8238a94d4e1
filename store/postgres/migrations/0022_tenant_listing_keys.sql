-- The reaper drops from job_tenants the tenants with nothing runnable
-- (fair.go). Its check raced with an acceptance in flight: the acceptance's
-- trigger found the tenant still listed and inserted nothing, the prune
-- did not see the acceptance's uncommitted job and dropped the row, and
-- the tenant's new job was left out of the fair claim's turns until the
-- reaper's next pass listed it again. To catch that job sooner, every
-- claim looked for the oldest runnable job of all and checked that its
-- tenant was listed: a walk of the queue's head in each claim, nearly a
-- third of the reads that pick a fair claim's jobs under a drain, for a
-- race of a few milliseconds every reaper pass.
--
-- The race is closed instead. A tenant's listing has a key (an advisory
-- lock, below). A transaction that makes a tenant's job runnable takes
-- the key shared before it looks for the tenant's row, and holds it until
-- it ends; the prune takes the key exclusively, without waiting, and only
-- then looks for the tenant's runnable jobs, in a statement of its own
-- (a snapshot taken after the key). Either the prune cannot take the key
-- (a listing transaction is in flight: the tenant stays), or every
-- transaction that found the row has ended and the prune sees its jobs,
-- or the listing transaction waits for the prune to end and finds the
-- row gone (a fresh snapshot for its own statement) and inserts it.
-- Shared keys never wait for one another, and the prune never waits.
CREATE FUNCTION kvgate_tenant_key(tenant text) RETURNS integer LANGUAGE sql IMMUTABLE PARALLEL SAFE
    AS $$ SELECT hashtext(tenant) $$;

-- kvgate_list_tenant_key takes a tenant's key shared, for a transaction
-- that lists it.
CREATE FUNCTION kvgate_list_tenant_key(tenant text) RETURNS void LANGUAGE sql
    AS $$ SELECT pg_advisory_xact_lock_shared(740315394, kvgate_tenant_key(tenant)) $$;

-- kvgate_try_prune_tenant_key takes a tenant's key exclusively if no
-- transaction holds it: the prune's.
CREATE FUNCTION kvgate_try_prune_tenant_key(tenant text) RETURNS boolean LANGUAGE sql
    AS $$ SELECT pg_try_advisory_xact_lock(740315394, kvgate_tenant_key(tenant)) $$;

CREATE OR REPLACE FUNCTION kvgate_job_tenants_inserted() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM kvgate_list_tenant_key(t.tenant)
    FROM (SELECT DISTINCT n.tenant FROM new_jobs n WHERE n.state IN ('READY', 'RETRY_SCHEDULED') ORDER BY n.tenant) t;
    INSERT INTO job_tenants (tenant)
    SELECT DISTINCT n.tenant FROM new_jobs n
    WHERE n.state IN ('READY', 'RETRY_SCHEDULED') AND NOT EXISTS (SELECT 1 FROM job_tenants jt WHERE jt.tenant = n.tenant)
    ORDER BY n.tenant
    ON CONFLICT DO NOTHING;
    RETURN NULL;
END $$;

CREATE OR REPLACE FUNCTION kvgate_job_tenant() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM kvgate_list_tenant_key(NEW.tenant);
    IF NOT EXISTS (SELECT 1 FROM job_tenants WHERE tenant = NEW.tenant) THEN
        INSERT INTO job_tenants (tenant) VALUES (NEW.tenant) ON CONFLICT DO NOTHING;
    END IF;
    RETURN NULL;
END
$$;
