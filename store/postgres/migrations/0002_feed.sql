-- The published feed: each outbox event gets its place in the feed when
-- the relay marks it published. Places are handed out one transaction at a
-- time, so they follow commit order and a reader that has seen place n
-- never later finds a smaller one: a safe replay cursor for SSE. The
-- insertion seq is not (on PostgreSQL a sequence value is taken before
-- its transaction commits).
ALTER TABLE outbox ADD COLUMN feed_seq BIGINT;
CREATE UNIQUE INDEX outbox_feed ON outbox (feed_seq) WHERE feed_seq IS NOT NULL;
CREATE INDEX outbox_tenant_feed ON outbox (tenant, feed_seq) WHERE feed_seq IS NOT NULL;
CREATE INDEX outbox_job_feed ON outbox (tenant, job_id, feed_seq) WHERE feed_seq IS NOT NULL;
DROP INDEX outbox_tenant;
DROP INDEX outbox_job;
