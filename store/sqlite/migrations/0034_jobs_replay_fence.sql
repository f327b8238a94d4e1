-- The fence a job had when it was last replayed: the claims before it
-- belong to its earlier run, so the backoff of its waits counts only the
-- claims since (fence - replay_fence - attempt).
ALTER TABLE jobs ADD COLUMN replay_fence INTEGER NOT NULL DEFAULT 0;
