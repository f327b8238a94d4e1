-- Fair claims across tenants: see the PostgreSQL migration of the same
-- number for the design.
CREATE TABLE job_tenants (
    tenant    TEXT PRIMARY KEY,
    served_at BIGINT NOT NULL DEFAULT 0
);
CREATE INDEX job_tenants_served ON job_tenants (served_at, tenant);
CREATE INDEX jobs_runnable_tenant ON jobs (tenant, priority, available_at, id) WHERE state IN ('READY', 'RETRY_SCHEDULED');
INSERT INTO job_tenants (tenant) SELECT DISTINCT tenant FROM jobs WHERE state IN ('READY', 'RETRY_SCHEDULED');

CREATE TRIGGER jobs_runnable_tenant_insert AFTER INSERT ON jobs
    FOR EACH ROW WHEN NEW.state IN ('READY', 'RETRY_SCHEDULED')
BEGIN
    INSERT OR IGNORE INTO job_tenants (tenant) VALUES (NEW.tenant);
END;
CREATE TRIGGER jobs_runnable_tenant_update AFTER UPDATE OF state ON jobs
    FOR EACH ROW WHEN NEW.state IN ('READY', 'RETRY_SCHEDULED') AND OLD.state <> NEW.state
BEGIN
    INSERT OR IGNORE INTO job_tenants (tenant) VALUES (NEW.tenant);
END;
