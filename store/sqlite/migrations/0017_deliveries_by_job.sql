-- A job's webhook deliveries, to every endpoint, in order (GET
-- /v1/jobs/{id}/deliveries and the console's job page): without it the
-- listing scans the tenant's deliveries.
CREATE INDEX webhook_deliveries_job ON webhook_deliveries (tenant, job_id, seq);
