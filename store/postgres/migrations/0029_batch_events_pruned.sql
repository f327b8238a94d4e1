-- A batch's event (batch.completed, failed, expired or cancelled: one a
-- batch, at its end) is pruned with the final jobs past their retention
-- (PruneFinal), found by its time through this index; the batch itself
-- is kept. Before, those events stayed in the outbox for good.
CREATE INDEX outbox_batch_events ON outbox (created_at) WHERE type LIKE 'batch.%';
