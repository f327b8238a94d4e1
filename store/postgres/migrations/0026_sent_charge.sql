-- A job attempt that holds no permit of its tenant's (one nothing can
-- refuse: store.Charge) keeps its reservation with its sent mark, so that
-- a reap or cancel that takes the job from its claim can charge it to the
-- tenant's ledger as uncertain usage. sent_tokens NULL: the attempt's
-- usage goes through a permit. sent_charge_fence is the fence of the mark
-- that wrote them: a mark by a replica of an earlier release, which
-- writes neither, leaves an earlier claim's reservation behind, and the
-- fence tells it apart. None of the three is in an index: MarkSent stays
-- a HOT update.
ALTER TABLE jobs ADD COLUMN sent_tokens BIGINT;
ALTER TABLE jobs ADD COLUMN sent_cost BIGINT NOT NULL DEFAULT 0;
ALTER TABLE jobs ADD COLUMN sent_charge_fence BIGINT NOT NULL DEFAULT 0;
