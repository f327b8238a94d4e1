-- The delivery trigger numbers new deliveries from MAX(seq): without an
-- index that begins with seq, each event of a tenant with an endpoint
-- read every delivery ever made, under SQLite's one write lock. Unique,
-- as PostgreSQL's sequence makes it.
CREATE UNIQUE INDEX webhook_deliveries_seq ON webhook_deliveries (seq);
