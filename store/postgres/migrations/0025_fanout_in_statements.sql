-- The webhook fan-out moves from the outbox's statement-level trigger
-- (migrations 13 and 14) into the statements that write events
-- (store/sqlstore/fanout.go): the rule is the same, in the same
-- transaction, and only the statements that can write an event an
-- endpoint may subscribe to make deliveries. The trigger cost every
-- statement that inserted events a transition table of its new rows and
-- a PL/pgSQL call, claims and acceptances included (their job.running
-- and job.accepted events match no endpoint): about 30 µs a statement,
-- a fifth of a one-event insert (pgbench, docs/benchmarks.md); a few
-- percent at most of the fair claim → complete rate, within the paired
-- drains' noise.
DROP TRIGGER outbox_webhooks ON outbox;
DROP FUNCTION webhook_fanout();

-- A replica of an earlier release, still running while the new ones
-- start, writes events and relies on a trigger for their deliveries.
-- This row trigger makes them for any connection that does not say that
-- its statements fan out themselves (kvgate's connections set
-- kvgate.fanout to 'inline', store/postgres): per row, as before
-- migration 14, and only for them; for kvgate's own writes the WHEN is
-- false, which queues nothing and calls nothing. A delivery already made
-- is left alone (a connection that fans out without saying so).
CREATE FUNCTION webhook_fanout_row() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    name TEXT := CASE NEW.type WHEN 'job.dead_lettered' THEN 'job.failed' ELSE NEW.type END;
BEGIN
    INSERT INTO webhook_deliveries (id, endpoint_id, tenant, event_id, job_id, type, job_state, state_version, event_at,
        state, due_at, created_at, updated_at)
    SELECT 'msg_' || replace(gen_random_uuid()::text, '-', ''), e.id, NEW.tenant, NEW.id, NEW.job_id, name, NEW.state,
        NEW.state_version, NEW.created_at, 'PENDING', NEW.created_at, NEW.created_at, NEW.created_at
    FROM webhook_endpoints e
    WHERE e.tenant = NEW.tenant AND NOT e.disabled AND position(',' || name || ',' IN e.events) > 0
    ORDER BY e.id
    ON CONFLICT (event_id, endpoint_id) DO NOTHING;
    RETURN NULL;
END $$;
CREATE TRIGGER outbox_webhooks_earlier AFTER INSERT ON outbox FOR EACH ROW
    WHEN (current_setting('kvgate.fanout', true) IS DISTINCT FROM 'inline')
    EXECUTE FUNCTION webhook_fanout_row();
