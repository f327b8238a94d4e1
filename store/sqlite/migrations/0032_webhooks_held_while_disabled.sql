-- A disabled endpoint (by its owner, or by a 410 from its receiver) keeps
-- its events: they fan out to it as to any endpoint, and its deliveries
-- wait, claimed by nobody, until it is enabled again. Before, its events
-- made no delivery at all (nothing to list among the dead letters, nothing
-- to replay) and its queued deliveries were failed without being sent.
DROP TRIGGER outbox_webhooks;
CREATE TRIGGER outbox_webhooks AFTER INSERT ON outbox BEGIN
    INSERT INTO webhook_deliveries (seq, id, endpoint_id, tenant, event_id, job_id, type, job_state, state_version, event_at,
        state, due_at, created_at, updated_at)
    SELECT (SELECT COALESCE(MAX(seq), 0) FROM webhook_deliveries) + ROW_NUMBER() OVER (ORDER BY e.id),
        'msg_' || lower(hex(randomblob(16))), e.id, NEW.tenant, NEW.id, NEW.job_id,
        CASE NEW.type WHEN 'job.dead_lettered' THEN 'job.failed' ELSE NEW.type END, NEW.state,
        NEW.state_version, NEW.created_at, 'PENDING', NEW.created_at, NEW.created_at, NEW.created_at
    FROM webhook_endpoints e
    WHERE e.tenant = NEW.tenant
        AND instr(e.events, ',' || (CASE NEW.type WHEN 'job.dead_lettered' THEN 'job.failed' ELSE NEW.type END) || ',') > 0;
END;
