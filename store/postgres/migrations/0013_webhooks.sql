-- Signed webhooks (store/webhooks.go): tenant-registered endpoints, one
-- delivery per (event, endpoint) with its own leased and fenced state
-- machine, and every attempt's record. Times are Unix microseconds.
CREATE TABLE webhook_endpoints (
    id               TEXT PRIMARY KEY,
    tenant           TEXT NOT NULL,
    url              TEXT NOT NULL,
    events           TEXT NOT NULL,             -- ",job.succeeded,job.failed,": matched with position()
    description      TEXT NOT NULL,
    secret           TEXT NOT NULL,             -- whsec_...: the HMAC key must be kept to sign
    prev_secret      TEXT NOT NULL DEFAULT '',  -- a rotated-out secret, signing beside the new one
    prev_until       BIGINT NOT NULL DEFAULT 0, -- until then
    include_result   BOOLEAN NOT NULL DEFAULT FALSE,
    disabled         BOOLEAN NOT NULL DEFAULT FALSE,
    disabled_reason  TEXT NOT NULL DEFAULT '',
    created_at       BIGINT NOT NULL,
    updated_at       BIGINT NOT NULL
);
CREATE INDEX webhook_endpoints_tenant ON webhook_endpoints (tenant, id);

-- state: PENDING -> SENDING -> DELIVERED | RETRY_SCHEDULED | FAILED.
-- due_at is when the row next needs a dispatcher: the next attempt's time
-- for PENDING and RETRY_SCHEDULED, the lease's end for SENDING (a
-- dispatcher killed mid-send leaves it to be claimed again, under the same
-- id and a new fence).
CREATE TABLE webhook_deliveries (
    seq           BIGSERIAL,
    id            TEXT PRIMARY KEY,             -- the webhook-id: stable across attempts
    endpoint_id   TEXT NOT NULL REFERENCES webhook_endpoints (id) ON DELETE CASCADE,
    tenant        TEXT NOT NULL,
    event_id      TEXT NOT NULL,                -- the outbox event's id
    job_id        TEXT NOT NULL,                -- '' for webhook.test
    type          TEXT NOT NULL,                -- the webhook event name
    job_state     TEXT NOT NULL,
    state_version BIGINT NOT NULL,
    event_at      BIGINT NOT NULL,
    state         TEXT NOT NULL CHECK (state IN ('PENDING', 'SENDING', 'DELIVERED', 'RETRY_SCHEDULED', 'FAILED')),
    attempts      INTEGER NOT NULL DEFAULT 0,   -- attempts made, every round
    base          INTEGER NOT NULL DEFAULT 0,   -- attempts before the latest redelivery: the schedule restarts there
    fence         BIGINT NOT NULL DEFAULT 0,
    due_at        BIGINT NOT NULL,
    last_status   INTEGER NOT NULL DEFAULT 0,
    last_error    TEXT NOT NULL DEFAULT '',
    created_at    BIGINT NOT NULL,
    updated_at    BIGINT NOT NULL,
    UNIQUE (event_id, endpoint_id)
);
CREATE INDEX webhook_deliveries_due ON webhook_deliveries (due_at) WHERE state IN ('PENDING', 'RETRY_SCHEDULED', 'SENDING');
CREATE INDEX webhook_deliveries_endpoint ON webhook_deliveries (endpoint_id, seq);
CREATE INDEX webhook_deliveries_failed ON webhook_deliveries (tenant, seq) WHERE state = 'FAILED';

CREATE TABLE webhook_attempts (
    delivery_id TEXT NOT NULL REFERENCES webhook_deliveries (id) ON DELETE CASCADE,
    attempt     INTEGER NOT NULL,
    fence       BIGINT NOT NULL,
    started_at  BIGINT NOT NULL,
    latency_us  BIGINT NOT NULL,
    status      INTEGER NOT NULL,               -- 0: no HTTP answer
    error       TEXT NOT NULL,
    body        TEXT NOT NULL,                  -- the response body, truncated
    PRIMARY KEY (delivery_id, attempt)
);

-- Operators' redeliveries (and other decisions about deliveries).
CREATE TABLE webhook_audit (
    seq         BIGSERIAL PRIMARY KEY,
    tenant      TEXT NOT NULL,
    delivery_id TEXT NOT NULL,
    actor       TEXT NOT NULL,
    action      TEXT NOT NULL,
    prev_state  TEXT NOT NULL,
    created_at  BIGINT NOT NULL
);

-- The one rule that makes deliveries: every outbox insert, whoever writes
-- it, fans out in its own transaction to the tenant's enabled endpoints
-- that subscribe to the event. job.dead_lettered is delivered as
-- job.failed; events no endpoint can subscribe to (store.WebhookEvents)
-- match nothing.
CREATE FUNCTION webhook_fanout() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    name TEXT := CASE NEW.type WHEN 'job.dead_lettered' THEN 'job.failed' ELSE NEW.type END;
BEGIN
    INSERT INTO webhook_deliveries (id, endpoint_id, tenant, event_id, job_id, type, job_state, state_version, event_at,
        state, due_at, created_at, updated_at)
    SELECT 'msg_' || replace(gen_random_uuid()::text, '-', ''), e.id, NEW.tenant, NEW.id, NEW.job_id, name, NEW.state,
        NEW.state_version, NEW.created_at, 'PENDING', NEW.created_at, NEW.created_at, NEW.created_at
    FROM webhook_endpoints e
    WHERE e.tenant = NEW.tenant AND NOT e.disabled AND position(',' || name || ',' IN e.events) > 0;
    RETURN NULL;
END $$;
CREATE TRIGGER outbox_webhooks AFTER INSERT ON outbox FOR EACH ROW EXECUTE FUNCTION webhook_fanout();
