-- The inbox is pruned by age (a record older than the stream keeps
-- messages can no longer meet a redelivery): find old records by index.
CREATE INDEX inbox_received ON inbox (received_at);
