-- A job attempt that holds no permit of its tenant's (one nothing can
-- refuse: store.Charge) keeps its reservation with its sent mark, so that
-- a reap of its lease can charge it to the tenant's ledger as uncertain
-- usage. NULL: the attempt's usage goes through a permit, or nothing was
-- sent. Neither column is in an index: MarkSent stays a HOT update.
ALTER TABLE jobs ADD COLUMN sent_tokens BIGINT;
ALTER TABLE jobs ADD COLUMN sent_cost BIGINT NOT NULL DEFAULT 0;
