-- Fair claims across tenants. job_tenants lists the tenants that may have
-- runnable jobs, with when a claim last took one of theirs; a claim serves
-- the least recently served tenants first, round-robin within its batch,
-- so that one tenant's backlog cannot hold another's first job behind it.
-- A trigger adds a tenant whenever one of its jobs becomes runnable; the
-- reaper removes tenants with nothing runnable left. Claims read this
-- small table and each chosen tenant's head of queue through
-- jobs_runnable_tenant, never the backlog.
CREATE TABLE job_tenants (
    tenant    TEXT PRIMARY KEY,
    served_at BIGINT NOT NULL DEFAULT 0 -- Unix microseconds; 0: never
);
CREATE INDEX job_tenants_served ON job_tenants (served_at, tenant);
CREATE INDEX jobs_runnable_tenant ON jobs (tenant, priority, available_at, id) WHERE state IN ('READY', 'RETRY_SCHEDULED');
INSERT INTO job_tenants (tenant) SELECT DISTINCT tenant FROM jobs WHERE state IN ('READY', 'RETRY_SCHEDULED');

CREATE FUNCTION kvgate_job_tenant() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO job_tenants (tenant) VALUES (NEW.tenant) ON CONFLICT DO NOTHING;
    RETURN NULL;
END
$$;
CREATE TRIGGER jobs_runnable_tenant_insert AFTER INSERT ON jobs
    FOR EACH ROW WHEN (NEW.state IN ('READY', 'RETRY_SCHEDULED')) EXECUTE FUNCTION kvgate_job_tenant();
CREATE TRIGGER jobs_runnable_tenant_update AFTER UPDATE OF state ON jobs
    FOR EACH ROW WHEN (NEW.state IN ('READY', 'RETRY_SCHEDULED') AND OLD.state <> NEW.state) EXECUTE FUNCTION kvgate_job_tenant();
