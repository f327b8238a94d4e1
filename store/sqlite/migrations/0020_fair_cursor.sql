-- The fair claim's turn cursor: see the PostgreSQL migration of the same
-- number for the design.
CREATE TABLE fair_cursor (
    id     INTEGER PRIMARY KEY CHECK (id = 1),
    tenant TEXT NOT NULL
);
INSERT INTO fair_cursor (id, tenant) VALUES (1, '');
DROP INDEX job_tenants_served;
CREATE INDEX job_tenants_new ON job_tenants (tenant) WHERE served_at = 0;
