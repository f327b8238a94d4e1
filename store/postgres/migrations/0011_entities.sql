-- Per-entity ordering (store/entities.go). A job may name an entity and a
-- version of it; entities records, per tenant and key, the highest version
-- that SUCCEEDED, which the completing transaction of every version
-- checks and moves under the entity row's lock: a lower version that ends
-- after it is SUPERSEDED, a new final state.
ALTER TABLE jobs DROP CONSTRAINT jobs_state_check;
ALTER TABLE jobs ADD CONSTRAINT jobs_state_check CHECK (state IN ('READY', 'RUNNING', 'RETRY_SCHEDULED', 'SUCCEEDED',
    'REVIEW_REQUIRED', 'FAILED_TERMINAL', 'CANCELLED', 'SUPERSEDED'));

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
