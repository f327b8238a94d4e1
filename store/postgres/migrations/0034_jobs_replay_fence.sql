-- The fence a job had when it was last replayed: the claims before it
-- belong to its earlier run, so the backoff of its waits counts only the
-- claims since (fence - replay_fence - attempt). A constant default: no
-- table rewrite.
ALTER TABLE jobs ADD COLUMN replay_fence BIGINT NOT NULL DEFAULT 0;
