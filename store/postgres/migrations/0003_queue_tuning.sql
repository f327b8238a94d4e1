-- The jobs table is a queue inside a table that keeps every job ever
-- accepted. Each claim and each end of an attempt writes a new version
-- of a job's row, and none of them can be a HOT update (the state is in
-- the runnable indexes' predicate), so each leaves a dead entry at the
-- head of jobs_runnable that every later claim steps over until a vacuum
-- removes it. By default autovacuum waits for dead rows worth a fifth of
-- the table: with a million jobs kept, 200,000 dead entries for every
-- claim to skip. Vacuum instead after a fixed number of dead rows,
-- however large the table grows; analyze as often relative to its size.
-- A tenth of each page is left free so that a job's new version usually
-- fits on its old page, and the page is pruned in place.
ALTER TABLE jobs SET (
    fillfactor = 90,
    autovacuum_vacuum_scale_factor = 0,
    autovacuum_vacuum_threshold = 10000,
    autovacuum_analyze_scale_factor = 0.02
);
-- The outbox gets a new row per event and one update when it is
-- published: the same reasoning, without the free space (its rows are
-- updated once).
ALTER TABLE outbox SET (
    autovacuum_vacuum_scale_factor = 0,
    autovacuum_vacuum_threshold = 10000,
    autovacuum_analyze_scale_factor = 0.02
);
