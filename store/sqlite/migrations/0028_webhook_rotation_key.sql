-- The Idempotency-Key of an endpoint's last secret rotation (''; none): a
-- rotation sent again with the same key (a retried call, a reloaded
-- console page) returns the secret it made instead of rotating again,
-- which would end the overlap of the secret receivers still verify with.
ALTER TABLE webhook_endpoints ADD COLUMN rotation_key TEXT NOT NULL DEFAULT '';
