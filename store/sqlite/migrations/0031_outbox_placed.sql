-- Events placed in the feed while the broker is away (published_at -1,
-- FeedUnpublished): the event streams go on reading them, and the relay
-- publishes them, in their feed order, once the broker is back. Empty
-- but in an outage, so the index costs the hot path nothing.
CREATE INDEX outbox_placed ON outbox (feed_seq) WHERE published_at = -1;
