-- An attempt counts only when the job's request reached a backend (or the
-- job's input is invalid). sent_fence is the fence of the claim that was
-- about to send the request: a lease that expires under that fence may
-- have reached a backend and counts; one that expires while the job only
-- waited does not. Each attempt record says whether it counted (spent)
-- and whether its request may have reached a backend (sent).
ALTER TABLE jobs ADD COLUMN sent_fence BIGINT NOT NULL DEFAULT 0;
ALTER TABLE attempts ADD COLUMN spent INTEGER NOT NULL DEFAULT 1;
ALTER TABLE attempts ADD COLUMN sent INTEGER NOT NULL DEFAULT 1;
-- A job RUNNING at the upgrade was claimed by a binary that counted the
-- attempt at the claim: the claim may have sent its request.
UPDATE jobs SET sent_fence = fence WHERE state = 'RUNNING';
