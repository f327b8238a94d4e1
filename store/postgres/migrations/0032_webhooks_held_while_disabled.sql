-- A disabled endpoint keeps its events (store/sqlstore/fanout.go, from
-- this release): its deliveries wait until it is enabled again. The row
-- trigger kept for replicas of earlier releases (migration 25) follows
-- the same rule.
CREATE OR REPLACE FUNCTION webhook_fanout_row() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    name TEXT := CASE NEW.type WHEN 'job.dead_lettered' THEN 'job.failed' ELSE NEW.type END;
BEGIN
    INSERT INTO webhook_deliveries (id, endpoint_id, tenant, event_id, job_id, type, job_state, state_version, event_at,
        state, due_at, created_at, updated_at)
    SELECT 'msg_' || replace(gen_random_uuid()::text, '-', ''), e.id, NEW.tenant, NEW.id, NEW.job_id, name, NEW.state,
        NEW.state_version, NEW.created_at, 'PENDING', NEW.created_at, NEW.created_at, NEW.created_at
    FROM webhook_endpoints e
    WHERE e.tenant = NEW.tenant AND position(',' || name || ',' IN e.events) > 0
    ORDER BY e.id
    ON CONFLICT (event_id, endpoint_id) DO NOTHING;
    RETURN NULL;
END $$;
