-- Validation policies, the policy each job is pinned to, and the audit
-- trail of reviews and replays (store/outcomes.go).
CREATE TABLE validation_policies (
    tenant     TEXT NOT NULL,
    name       TEXT NOT NULL,
    version    INTEGER NOT NULL,
    document   BYTEA NOT NULL,
    created_by TEXT NOT NULL,
    created_at BIGINT NOT NULL,
    PRIMARY KEY (tenant, name, version)
);

-- One row per job that names a policy, written in Accept's transaction:
-- the version it is pinned to (a replay may re-pin it) and the source
-- text its evidence must occur in.
CREATE TABLE job_outcomes (
    job_id         TEXT PRIMARY KEY REFERENCES jobs (id),
    tenant         TEXT NOT NULL,
    policy_name    TEXT NOT NULL,
    policy_version INTEGER NOT NULL,
    source         TEXT NOT NULL
);

CREATE TABLE audit (
    seq            BIGSERIAL PRIMARY KEY,
    tenant         TEXT NOT NULL,
    job_id         TEXT NOT NULL REFERENCES jobs (id),
    actor          TEXT NOT NULL,
    action         TEXT NOT NULL,
    policy_name    TEXT NOT NULL,
    policy_version INTEGER NOT NULL,
    detail         BYTEA,
    prev_state     TEXT NOT NULL,
    state          TEXT NOT NULL,
    created_at     BIGINT NOT NULL
);
CREATE INDEX audit_job ON audit (job_id, seq);

-- Dead letters and reviews are read by state; pruning by age.
CREATE INDEX jobs_final ON jobs (tenant, state, id) WHERE state IN ('REVIEW_REQUIRED', 'FAILED_TERMINAL');
CREATE INDEX jobs_final_age ON jobs (updated_at) WHERE state IN ('SUCCEEDED', 'REVIEW_REQUIRED', 'FAILED_TERMINAL', 'CANCELLED');
