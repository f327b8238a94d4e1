-- Every tenant's keys, oldest first, a page at a time (GET /v1/admin/keys
-- without ?tenant=): each page starts at its cursor's place in this order
-- rather than sorting the whole table again.
CREATE INDEX api_keys_created ON api_keys (created_at, id);
