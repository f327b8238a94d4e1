-- Per-entity ordering (store/entities.go). A job may name an entity and a
-- version of it; entities records, per tenant and key, the highest version
-- that SUCCEEDED, which the completing transaction of every version
-- checks and moves: a lower version that ends after it is SUPERSEDED, a
-- new final state.
--
-- SQLite cannot alter a CHECK constraint; widening one changes no stored
-- row, which SQLite documents doing through writable_schema, with a new
-- schema version so that every connection reads the schema again.
PRAGMA writable_schema = ON;
UPDATE sqlite_schema SET sql = replace(sql, '''CANCELLED''))', '''CANCELLED'', ''SUPERSEDED''))')
    WHERE type = 'table' AND name = 'jobs';
PRAGMA writable_schema = OFF;
PRAGMA schema_version = 1011011;

CREATE TABLE entities (
    tenant      TEXT NOT NULL,
    entity_key  TEXT NOT NULL,
    won_version BIGINT NOT NULL DEFAULT 0, -- the highest version that SUCCEEDED; 0: none yet
    PRIMARY KEY (tenant, entity_key)
);

CREATE TABLE job_entities (
    job_id         TEXT PRIMARY KEY REFERENCES jobs (id),
    tenant         TEXT NOT NULL,
    entity_key     TEXT NOT NULL,
    entity_version BIGINT NOT NULL,
    ordering       TEXT NOT NULL CHECK (ordering IN ('latest', 'serial')),
    UNIQUE (tenant, entity_key, entity_version)
);

DROP INDEX jobs_final_age;
CREATE INDEX jobs_final_age ON jobs (updated_at) WHERE state IN ('SUCCEEDED', 'REVIEW_REQUIRED', 'FAILED_TERMINAL', 'CANCELLED', 'SUPERSEDED');
