-- The ids of deleted webhook endpoints. An endpoint made with an
-- Idempotency-Key takes its id from the key, so the same request sent
-- again after the endpoint was deleted (a late retry, a reloaded console
-- form) would make it anew, sending the tenant's events to a URL someone
-- removed; it is refused instead (409 endpoint_deleted).
CREATE TABLE webhook_endpoints_deleted (id TEXT PRIMARY KEY);
