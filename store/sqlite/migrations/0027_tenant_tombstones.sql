-- A deleted tenant keeps its row, marked with the time of its deletion
-- (0: a live tenant). Its jobs, files, batches, webhook endpoints and
-- usage stay in the store under its name, so the name is not given to a
-- new tenant, which would see them; and a replica that still has the
-- tenant's key cached learns from the mark that the tenant is gone,
-- instead of reading a tenant it does not know, which has no limits.
ALTER TABLE tenants ADD COLUMN deleted_at BIGINT NOT NULL DEFAULT 0;
