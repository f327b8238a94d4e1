package sqlstore

import (
	"context"
	"database/sql"
	"errors"
	"slices"
	"strings"
	"time"

	"github.com/kvgate/kvgate/store"
)

// Webhook endpoints and deliveries (store/webhooks.go). Deliveries are
// inserted by the outbox trigger of migration 0013, never here, except a
// webhook.test.

const endpointColumns = `id, tenant, url, events, description, secret, prev_secret, prev_until, include_result, disabled,
	disabled_reason, created_at, updated_at`

const deliveryColumns = `seq, id, endpoint_id, tenant, event_id, job_id, type, job_state, state_version, event_at, state,
	attempts, base, fence, due_at, last_status, last_error, created_at, updated_at`

// joinEvents renders an endpoint's events as the trigger matches them:
// ",a,b,".
func joinEvents(evs []string) string { return "," + strings.Join(evs, ",") + "," }

func splitEvents(s string) []string {
	s = strings.Trim(s, ",")
	if s == "" {
		return []string{}
	}
	return strings.Split(s, ",")
}

func scanEndpoint(r scanner) (store.WebhookEndpoint, error) {
	var e store.WebhookEndpoint
	var events string
	var prevUntil, created, updated int64
	err := r.Scan(&e.ID, &e.Tenant, &e.URL, &events, &e.Description, &e.Secret, &e.PrevSecret, &prevUntil, &e.IncludeResult,
		&e.Disabled, &e.DisabledReason, &created, &updated)
	e.Events = splitEvents(events)
	e.PrevUntil, e.CreatedAt, e.UpdatedAt = fromMicros(prevUntil), fromMicros(created), fromMicros(updated)
	return e, err
}

func scanDelivery(r scanner) (store.Delivery, error) {
	var d store.Delivery
	var jobState string
	var eventAt, due, created, updated int64
	err := r.Scan(&d.Seq, &d.ID, &d.EndpointID, &d.Tenant, &d.EventID, &d.JobID, &d.Type, &jobState, &d.StateVersion, &eventAt,
		&d.State, &d.Attempts, &d.Base, &d.Fence, &due, &d.LastStatus, &d.LastError, &created, &updated)
	d.JobState = store.State(jobState)
	d.EventAt, d.DueAt, d.CreatedAt, d.UpdatedAt = fromMicros(eventAt), fromMicros(due), fromMicros(created), fromMicros(updated)
	return d, err
}

// tenantCond narrows a query to a tenant's rows unless tenant is "".
func tenantCond(tenant string, args []any) (string, []any) {
	if tenant == "" {
		return "", args
	}
	return " AND tenant = ?", append(args, tenant)
}

// CreateEndpoint implements store.Store. The deleted ids are read after
// the insert, in its transaction: a delete of the id that the insert
// waited for (PostgreSQL) has committed by then, its id recorded.
func (s *Store) CreateEndpoint(ctx context.Context, e store.WebhookEndpoint) error {
	return s.tx(ctx, "create webhook endpoint", func(tx *sql.Tx) error {
		res, err := tx.ExecContext(ctx, s.rb(`INSERT INTO webhook_endpoints (`+endpointColumns+`)
			VALUES (?, ?, ?, ?, ?, ?, '', 0, ?, ?, ?, ?, ?) ON CONFLICT (id) DO NOTHING`),
			e.ID, e.Tenant, e.URL, joinEvents(e.Events), e.Description, e.Secret, e.IncludeResult, e.Disabled, e.DisabledReason,
			micros(e.CreatedAt), micros(e.CreatedAt))
		if err != nil {
			return err
		}
		n, err := res.RowsAffected()
		if err != nil {
			return err
		}
		var deleted int
		switch err := tx.QueryRowContext(ctx, s.rb(`SELECT 1 FROM webhook_endpoints_deleted WHERE id = ?`), e.ID).Scan(&deleted); {
		case err == nil:
			return store.ErrEndpointDeleted
		case !errors.Is(err, sql.ErrNoRows):
			return err
		case n == 0:
			return store.ErrExists
		}
		return nil
	})
}

// Endpoint implements store.Store.
func (s *Store) Endpoint(ctx context.Context, tenant, id string) (store.WebhookEndpoint, error) {
	return s.endpointOn(ctx, s.db, tenant, id)
}

func (s *Store) endpointOn(ctx context.Context, q querier, tenant, id string) (store.WebhookEndpoint, error) {
	cond, args := tenantCond(tenant, []any{id})
	e, err := scanEndpoint(q.QueryRowContext(ctx, s.rb(`SELECT `+endpointColumns+` FROM webhook_endpoints WHERE id = ?`+cond), args...))
	if errors.Is(err, sql.ErrNoRows) {
		return e, store.ErrNotFound
	}
	return e, s.err("get webhook endpoint", err)
}

// Endpoints implements store.Store.
func (s *Store) Endpoints(ctx context.Context, tenant string) ([]store.WebhookEndpoint, error) {
	rows, err := s.db.QueryContext(ctx, s.rb(`SELECT `+endpointColumns+` FROM webhook_endpoints WHERE tenant = ? ORDER BY id`), tenant)
	if err != nil {
		return nil, s.err("list webhook endpoints", err)
	}
	defer rows.Close()
	out := []store.WebhookEndpoint{}
	for rows.Next() {
		e, err := scanEndpoint(rows)
		if err != nil {
			return nil, s.err("list webhook endpoints", err)
		}
		out = append(out, e)
	}
	return out, s.err("list webhook endpoints", rows.Err())
}

// UpdateEndpoint implements store.Store.
func (s *Store) UpdateEndpoint(ctx context.Context, tenant, id string, p store.EndpointPatch) (store.WebhookEndpoint, error) {
	var out store.WebhookEndpoint
	err := s.tx(ctx, "update webhook endpoint", func(tx *sql.Tx) error {
		e, err := s.endpointOn(ctx, tx, tenant, id)
		if err != nil {
			return err
		}
		if p.URL != nil {
			e.URL = *p.URL
		}
		if p.Events != nil {
			e.Events = p.Events
		}
		if p.Description != nil {
			e.Description = *p.Description
		}
		if p.IncludeResult != nil {
			e.IncludeResult = *p.IncludeResult
		}
		if p.Disabled != nil {
			e.Disabled, e.DisabledReason = *p.Disabled, ""
			if e.Disabled {
				e.DisabledReason = p.Reason
			}
		}
		e.UpdatedAt = p.Now
		if _, err := tx.ExecContext(ctx, s.rb(`UPDATE webhook_endpoints SET url = ?, events = ?, description = ?, include_result = ?,
			disabled = ?, disabled_reason = ?, updated_at = ? WHERE id = ?`),
			e.URL, joinEvents(e.Events), e.Description, e.IncludeResult, e.Disabled, e.DisabledReason, micros(p.Now), e.ID); err != nil {
			return err
		}
		out = e
		return nil
	})
	return out, err
}

// DeleteEndpoint implements store.Store.
func (s *Store) DeleteEndpoint(ctx context.Context, tenant, id string) error {
	return s.tx(ctx, "delete webhook endpoint", func(tx *sql.Tx) error {
		if _, err := s.endpointOn(ctx, tx, tenant, id); err != nil {
			return err
		}
		// Explicitly, not only by the cascade: SQLite enforces foreign
		// keys only where the connection asked for them.
		for _, q := range []string{
			`DELETE FROM webhook_attempts WHERE delivery_id IN (SELECT id FROM webhook_deliveries WHERE endpoint_id = ?)`,
			`DELETE FROM webhook_deliveries WHERE endpoint_id = ?`,
			`DELETE FROM webhook_endpoints WHERE id = ?`,
			// Kept, so that its Idempotency-Key, sent again, does not
			// make the endpoint anew (CreateEndpoint).
			`INSERT INTO webhook_endpoints_deleted (id) VALUES (?) ON CONFLICT (id) DO NOTHING`,
		} {
			if _, err := tx.ExecContext(ctx, s.rb(q), id); err != nil {
				return err
			}
		}
		return nil
	})
}

// RotateSecret implements store.Store.
func (s *Store) RotateSecret(ctx context.Context, tenant, id, secret, key string, overlapUntil, now time.Time) (store.WebhookEndpoint, error) {
	var out store.WebhookEndpoint
	err := s.tx(ctx, "rotate webhook secret", func(tx *sql.Tx) error {
		lock := s.forUpdate() // two rotations with one key: the second sees the first's
		var last string
		if err := tx.QueryRowContext(ctx, s.rb(`SELECT rotation_key FROM webhook_endpoints WHERE id = ?`+lock), id).Scan(&last); err != nil {
			return s.err("rotate webhook secret", err)
		}
		e, err := s.endpointOn(ctx, tx, tenant, id)
		if err != nil {
			return err
		}
		if key != "" && key == last {
			out = e
			return nil
		}
		e.PrevSecret, e.PrevUntil, e.Secret, e.UpdatedAt = e.Secret, overlapUntil, secret, now
		if _, err := tx.ExecContext(ctx, s.rb(`UPDATE webhook_endpoints SET secret = ?, prev_secret = ?, prev_until = ?, updated_at = ?,
			rotation_key = ? WHERE id = ?`), e.Secret, e.PrevSecret, micros(e.PrevUntil), micros(now), key, e.ID); err != nil {
			return err
		}
		out = e
		return nil
	})
	return out, err
}

// insertDelivery writes a delivery that no outbox event made.
func (s *Store) insertDelivery(ctx context.Context, tx *sql.Tx, d store.Delivery) error {
	seq := "DEFAULT"
	if !s.d.WritableCTE && s.d.LockRunnable == "" {
		// SQLite: no sequence; writers are serialised.
		seq = "(SELECT COALESCE(MAX(seq), 0) + 1 FROM webhook_deliveries)"
	}
	_, err := tx.ExecContext(ctx, s.rb(`INSERT INTO webhook_deliveries (seq, id, endpoint_id, tenant, event_id, job_id, type, job_state,
		state_version, event_at, state, due_at, created_at, updated_at) VALUES (`+seq+`, ?, ?, ?, ?, '', ?, '', 0, ?, 'PENDING', ?, ?, ?)`),
		d.ID, d.EndpointID, d.Tenant, d.EventID, d.Type, micros(d.EventAt), micros(d.EventAt), micros(d.EventAt), micros(d.EventAt))
	return err
}

// SendTest implements store.Store.
func (s *Store) SendTest(ctx context.Context, tenant, endpointID, eventID string, now time.Time) (store.Delivery, error) {
	var out store.Delivery
	err := s.tx(ctx, "webhook test", func(tx *sql.Tx) error {
		e, err := s.endpointOn(ctx, tx, tenant, endpointID)
		if err != nil {
			return err
		}
		if e.Disabled {
			return store.ErrEndpointDisabled
		}
		d := store.Delivery{ID: "msg_" + strings.ReplaceAll(eventID, "-", ""), EndpointID: e.ID, Tenant: e.Tenant, EventID: eventID,
			Type: store.WebhookTest, EventAt: now}
		if err := s.insertDelivery(ctx, tx, d); err != nil {
			return err
		}
		out, err = scanDelivery(tx.QueryRowContext(ctx, s.rb(`SELECT `+deliveryColumns+` FROM webhook_deliveries WHERE id = ?`), d.ID))
		return err
	})
	if errors.Is(err, store.ErrEndpointDisabled) {
		return out, store.ErrEndpointDisabled
	}
	return out, err
}

// ClaimDeliveries implements store.Store.
func (s *Store) ClaimDeliveries(ctx context.Context, now time.Time, lease time.Duration, limit int) ([]store.Delivery, error) {
	if err := s.ready(ctx); err != nil {
		return nil, err
	}
	due := `state IN ('PENDING', 'RETRY_SCHEDULED', 'SENDING') AND due_at <= ?`
	// A disabled endpoint's deliveries wait, claimed by nobody, until it
	// is enabled again.
	enabled := `NOT EXISTS (SELECT 1 FROM webhook_endpoints e WHERE e.id = webhook_deliveries.endpoint_id AND e.disabled <> FALSE)`
	rows, err := s.db.QueryContext(ctx, s.rb(`UPDATE webhook_deliveries SET state = 'SENDING', fence = fence + 1, due_at = ?, updated_at = ?
		WHERE id IN (SELECT id FROM webhook_deliveries WHERE `+due+` AND `+enabled+` ORDER BY due_at LIMIT ? `+s.d.LockRunnable+`)
		AND `+due+` RETURNING `+deliveryColumns), micros(now.Add(lease)), micros(now), micros(now), limit, micros(now))
	if err != nil {
		return nil, s.err("claim deliveries", err)
	}
	defer rows.Close()
	var out []store.Delivery
	for rows.Next() {
		d, err := scanDelivery(rows)
		if err != nil {
			return nil, s.err("claim deliveries", err)
		}
		out = append(out, d)
	}
	return out, s.err("claim deliveries", rows.Err())
}

// finishDeliveriesBatch records plain attempt ends (not deferrals, no
// endpoint to disable) in one statement, where the dialect has writable
// CTEs: the deliveries' updates and their attempt records, fenced.
const finishDeliveriesBatch = `WITH input AS (
		SELECT * FROM unnest(?::text[], ?::bigint[], ?::text[], ?::bigint[], ?::integer[], ?::text[], ?::bigint[], ?::bigint[],
			?::bigint[], ?::text[]) AS t(id, fence, state, due, status, error, now, started, latency, body)),
	upd AS (
		UPDATE webhook_deliveries d SET state = i.state, attempts = d.attempts + 1, due_at = i.due, last_status = i.status,
			last_error = i.error, updated_at = i.now
		FROM input i WHERE d.id = i.id AND d.fence = i.fence AND d.state = 'SENDING'
		RETURNING d.id, d.attempts, i.fence, i.started, i.latency, i.status, i.error, i.body),
	ins AS (
		INSERT INTO webhook_attempts (delivery_id, attempt, fence, started_at, latency_us, status, error, body)
		SELECT id, attempts, fence, started, latency, status, error, body FROM upd)
	SELECT id, fence FROM upd`

func (s *Store) finishBatch(ctx context.Context, rs []store.DeliveryResult, idx []int, errs []error) error {
	n := len(idx)
	ids, states, msgs, bodies := make([]string, n), make([]string, n), make([]string, n), make([]string, n)
	fences, dues, nows, starts, lats := make([]int64, n), make([]int64, n), make([]int64, n), make([]int64, n), make([]int64, n)
	statuses := make([]int32, n)
	for k, i := range idx {
		r := rs[i]
		ids[k], fences[k], states[k], nows[k] = r.ID, r.Fence, r.State, micros(r.Now)
		if r.State == store.DeliveryRetryScheduled {
			dues[k] = micros(r.RetryAt)
		}
		a := r.Attempt
		statuses[k], msgs[k], bodies[k], starts[k], lats[k] = int32(a.Status), a.Error, a.Body, micros(a.StartedAt), a.Latency.Microseconds()
	}
	rows, err := s.db.QueryContext(ctx, s.rb(finishDeliveriesBatch), ids, fences, states, dues, statuses, msgs, nows, starts, lats, bodies)
	if err != nil {
		return err
	}
	defer rows.Close()
	type claim struct {
		id    string
		fence int64
	}
	done := map[claim]bool{}
	for rows.Next() {
		var c claim
		if err := rows.Scan(&c.id, &c.fence); err != nil {
			return err
		}
		done[c] = true
	}
	if err := rows.Err(); err != nil {
		return err
	}
	for _, i := range idx {
		if !done[claim{rs[i].ID, rs[i].Fence}] {
			errs[i] = store.ErrLeaseLost
		}
	}
	return nil
}

// FinishDeliveries implements store.Store.
func (s *Store) FinishDeliveries(ctx context.Context, rs []store.DeliveryResult) ([]error, error) {
	errs := make([]error, len(rs))
	if err := s.ready(ctx); err != nil {
		return errs, err
	}
	// The receiver's answer, as text any dialect stores (the caller's
	// results untouched).
	rs = slices.Clone(rs)
	for i := range rs {
		a := &rs[i].Attempt
		a.Error, a.Body, rs[i].DisableEndpoint = storedText(a.Error), storedText(a.Body), storedText(rs[i].DisableEndpoint)
	}
	var plain []int
	if s.d.WritableCTE {
		for i, r := range rs {
			if !r.Deferred && r.DisableEndpoint == "" {
				plain = append(plain, i)
			}
		}
		if len(plain) > 0 {
			if err := s.finishBatch(ctx, rs, plain, errs); err != nil {
				return errs, s.err("finish deliveries", err)
			}
		}
	}
	if len(plain) == len(rs) {
		return errs, nil
	}
	err := s.tx(ctx, "finish deliveries", func(tx *sql.Tx) error {
		for i, r := range rs {
			if s.d.WritableCTE && !r.Deferred && r.DisableEndpoint == "" {
				continue // recorded by the batch
			}
			errs[i] = nil
			if r.Deferred {
				res, err := tx.ExecContext(ctx, s.rb(`UPDATE webhook_deliveries SET due_at = ?, updated_at = ?,
					state = CASE WHEN attempts = base THEN 'PENDING' ELSE 'RETRY_SCHEDULED' END
					WHERE id = ? AND fence = ? AND state = 'SENDING'`), micros(r.RetryAt), micros(r.Now), r.ID, r.Fence)
				if err != nil {
					return err
				}
				if n, err := res.RowsAffected(); err != nil {
					return err
				} else if n == 0 {
					errs[i] = store.ErrLeaseLost
				}
				continue
			}
			due := int64(0)
			if r.State == store.DeliveryRetryScheduled {
				due = micros(r.RetryAt)
			}
			a := r.Attempt
			var attempt int
			var endpoint string
			err := tx.QueryRowContext(ctx, s.rb(`UPDATE webhook_deliveries SET state = ?, attempts = attempts + 1, due_at = ?,
				last_status = ?, last_error = ?, updated_at = ? WHERE id = ? AND fence = ? AND state = 'SENDING'
				RETURNING attempts, endpoint_id`), r.State, due, a.Status, a.Error, micros(r.Now), r.ID, r.Fence).Scan(&attempt, &endpoint)
			if errors.Is(err, sql.ErrNoRows) {
				errs[i] = store.ErrLeaseLost
				continue
			}
			if err != nil {
				return err
			}
			if _, err := tx.ExecContext(ctx, s.rb(`INSERT INTO webhook_attempts (delivery_id, attempt, fence, started_at, latency_us,
				status, error, body) VALUES (?, ?, ?, ?, ?, ?, ?, ?)`), r.ID, attempt, r.Fence, micros(a.StartedAt),
				a.Latency.Microseconds(), a.Status, a.Error, a.Body); err != nil {
				return err
			}
			if r.DisableEndpoint != "" {
				if _, err := tx.ExecContext(ctx, s.rb(`UPDATE webhook_endpoints SET disabled = ?, disabled_reason = ?, updated_at = ?
					WHERE id = ?`), true, r.DisableEndpoint, micros(r.Now), endpoint); err != nil {
					return err
				}
			}
		}
		return nil
	})
	return errs, err
}

// DeferEndpoint implements store.Store.
func (s *Store) DeferEndpoint(ctx context.Context, endpointID string, until time.Time) (int, error) {
	// Rows a claim or a record holds are skipped, not waited for: they
	// are being sent, or their dispatcher defers them itself.
	cand := `endpoint_id = ? AND state IN ('PENDING', 'RETRY_SCHEDULED') AND due_at < ?`
	res, err := s.db.ExecContext(ctx, s.rb(`UPDATE webhook_deliveries SET due_at = ? WHERE id IN (SELECT id FROM webhook_deliveries
		WHERE `+cand+` `+s.d.LockRunnable+`) AND `+cand), micros(until), endpointID, micros(until), endpointID, micros(until))
	if err != nil {
		return 0, s.err("defer webhook endpoint", err)
	}
	n, err := res.RowsAffected()
	return int(n), s.err("defer webhook endpoint", err)
}

// Delivery implements store.Store.
func (s *Store) Delivery(ctx context.Context, tenant, id string) (store.Delivery, error) {
	return s.deliveryOn(ctx, s.db, tenant, id)
}

func (s *Store) deliveryOn(ctx context.Context, q querier, tenant, id string) (store.Delivery, error) {
	cond, args := tenantCond(tenant, []any{id})
	d, err := scanDelivery(q.QueryRowContext(ctx, s.rb(`SELECT `+deliveryColumns+` FROM webhook_deliveries WHERE id = ?`+cond), args...))
	if errors.Is(err, sql.ErrNoRows) {
		return d, store.ErrNotFound
	}
	return d, s.err("get webhook delivery", err)
}

// Deliveries implements store.Store.
func (s *Store) Deliveries(ctx context.Context, f store.DeliveryFilter) ([]store.Delivery, int64, error) {
	q := `SELECT ` + deliveryColumns + ` FROM webhook_deliveries WHERE seq > ?`
	args := []any{f.After}
	if f.Tenant != "" {
		q, args = q+` AND tenant = ?`, append(args, f.Tenant)
	}
	if f.EndpointID != "" {
		q, args = q+` AND endpoint_id = ?`, append(args, f.EndpointID)
	}
	if f.JobID != "" {
		q, args = q+` AND job_id = ?`, append(args, f.JobID) // webhook_deliveries_job (migration 0017)
	}
	switch f.State {
	case "":
	case store.DeliveryFailed:
		// As the index of webhook dead letters (webhook_deliveries_failed)
		// names it: a bound value never matches a partial index's
		// predicate under PostgreSQL's generic plans.
		q += ` AND state = '` + store.DeliveryFailed + `'`
	default:
		q, args = q+` AND state = ?`, append(args, f.State)
	}
	limit := pageLimit(f.Limit)
	rows, err := s.db.QueryContext(ctx, s.rb(q+` ORDER BY seq LIMIT ?`), append(args, limit+1)...)
	if err != nil {
		return nil, 0, s.err("list webhook deliveries", err)
	}
	defer rows.Close()
	out := []store.Delivery{}
	for rows.Next() {
		d, err := scanDelivery(rows)
		if err != nil {
			return nil, 0, s.err("list webhook deliveries", err)
		}
		out = append(out, d)
	}
	if err := rows.Err(); err != nil {
		return nil, 0, s.err("list webhook deliveries", err)
	}
	var next int64
	if len(out) > limit {
		out = out[:limit]
		next = out[limit-1].Seq
	}
	return out, next, nil
}

// DeliveryAttempts implements store.Store.
func (s *Store) DeliveryAttempts(ctx context.Context, id string) ([]store.DeliveryAttempt, error) {
	rows, err := s.db.QueryContext(ctx, s.rb(`SELECT delivery_id, attempt, fence, started_at, latency_us, status, error, body
		FROM webhook_attempts WHERE delivery_id = ? ORDER BY attempt`), id)
	if err != nil {
		return nil, s.err("webhook attempts", err)
	}
	defer rows.Close()
	out := []store.DeliveryAttempt{}
	for rows.Next() {
		var a store.DeliveryAttempt
		var started, lat int64
		if err := rows.Scan(&a.DeliveryID, &a.Attempt, &a.Fence, &started, &lat, &a.Status, &a.Error, &a.Body); err != nil {
			return nil, s.err("webhook attempts", err)
		}
		a.StartedAt, a.Latency = fromMicros(started), time.Duration(lat)*time.Microsecond
		out = append(out, a)
	}
	return out, s.err("webhook attempts", rows.Err())
}

// Redeliver implements store.Store.
func (s *Store) Redeliver(ctx context.Context, tenant, id, actor string, now time.Time) (store.Delivery, error) {
	var out store.Delivery
	err := s.tx(ctx, "redeliver webhook", func(tx *sql.Tx) error {
		d, err := s.deliveryOn(ctx, tx, tenant, id)
		if err != nil {
			return err
		}
		if d.State != store.DeliveryFailed && d.State != store.DeliveryDelivered {
			return store.ErrWrongState
		}
		// To a disabled endpoint it would fail at once, an attempt spent
		// for nothing: refused, as a test send is.
		if e, err := s.endpointOn(ctx, tx, d.Tenant, d.EndpointID); err == nil && e.Disabled {
			return store.ErrEndpointDisabled
		}
		res, err := tx.ExecContext(ctx, s.rb(`UPDATE webhook_deliveries SET state = 'PENDING', base = attempts, due_at = ?, updated_at = ?
			WHERE id = ? AND state = ?`), micros(now), micros(now), id, d.State)
		if err := s.affected("redeliver webhook", res, err); err != nil {
			return store.ErrWrongState // it moved since the read
		}
		if _, err := tx.ExecContext(ctx, s.rb(`INSERT INTO webhook_audit (tenant, delivery_id, actor, action, prev_state, created_at)
			VALUES (?, ?, ?, ?, ?, ?)`), d.Tenant, id, actor, store.AuditRedeliver, d.State, micros(now)); err != nil {
			return err
		}
		out, err = s.deliveryOn(ctx, tx, "", id)
		return err
	})
	if errors.Is(err, store.ErrWrongState) {
		return out, store.ErrWrongState
	}
	if errors.Is(err, store.ErrEndpointDisabled) {
		return out, store.ErrEndpointDisabled
	}
	return out, err
}

// PendingDeliveries implements store.Store.
func (s *Store) PendingDeliveries(ctx context.Context) (int, error) {
	var n int
	err := s.db.QueryRowContext(ctx, `SELECT COUNT(*) FROM webhook_deliveries WHERE state IN ('PENDING', 'RETRY_SCHEDULED', 'SENDING')`).Scan(&n)
	return n, s.err("pending webhook deliveries", err)
}
