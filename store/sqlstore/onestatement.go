package sqlstore

import (
	"cmp"
	"context"
	"database/sql"
	"errors"
	"slices"
	"strings"
	"time"

	"github.com/google/uuid"

	"github.com/kvgate/kvgate/store"
)

// The hot operations as single statements, for dialects with writable
// CTEs (Dialect.WritableCTE). A statement outside BEGIN is its own
// transaction, durable at its commit like the explicit ones, and every
// CTE of it runs to completion or none does: the job, its attempt record
// and its event are still written together or not at all. What it saves
// is round trips: over database/sql each statement, BEGIN and COMMIT is
// one, and on a machine with few cores the context switches they cost
// the client and the server are most of the work.
//
// Parameters are cast where PostgreSQL would otherwise infer text for a
// value selected into an INSERT.

// acceptCTE inserts the job and its job.accepted event, or, when the key
// exists, returns the existing job; the last column says which. A job
// inserted by a transaction that commits while this statement waits on
// the key is invisible to the statement's snapshot: no row comes back and
// acceptOne reads it again.
var acceptCTE = `WITH ins AS (
		INSERT INTO jobs (` + jobColumns + `)
		VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
		ON CONFLICT (tenant, idempotency_key) DO NOTHING
		RETURNING ` + jobColumns + `),
	ev AS (
		INSERT INTO outbox (id, job_id, tenant, type, state, state_version, created_at)
		SELECT ?::text, id, tenant, 'job.accepted', state, state_version, created_at FROM ins)
	SELECT ` + jobColumns + `, TRUE FROM ins
	UNION ALL
	SELECT ` + jobColumns + `, FALSE FROM jobs
	WHERE tenant = ? AND idempotency_key = ? AND NOT EXISTS (SELECT 1 FROM ins)`

// claimCTE leases up to limit runnable jobs, fairly across tenants by
// their weights (see fair.go), and writes a job.running event for each, in claim order, with
// ids from the array parameter.
//
// The candidates are read without locks, twice the batch spread over the
// considered tenants and at least 16 of each; the batch locks them in
// fair order, skipping any that a concurrent claimer holds and taking the
// next (LIMIT above FOR UPDATE SKIP LOCKED), so that claimers racing for
// the same tenants' heads each get their own jobs instead of none.
func claimCTE() string {
	return `WITH considered AS (
		SELECT jt.tenant, jt.served_at, COALESCE(tn.weight, 1) AS weight
		FROM (SELECT tenant, served_at FROM job_tenants ORDER BY served_at, tenant LIMIT ?) jt
		LEFT JOIN tenants tn ON tn.name = jt.tenant),
	oldest AS (
		SELECT id, tenant FROM jobs
		WHERE state IN ('READY', 'RETRY_SCHEDULED') AND available_at <= ? AND deadline_at > ?
		ORDER BY priority, available_at, id LIMIT 1),
	cand AS MATERIALIZED (
		SELECT c.id, (c.rn - 1)::float8 / GREATEST(t.weight, 1) AS turn, t.served_at, t.tenant FROM considered t CROSS JOIN LATERAL (
			SELECT id, row_number() OVER (ORDER BY priority, available_at, id) AS rn FROM jobs
			WHERE tenant = t.tenant AND state IN ('READY', 'RETRY_SCHEDULED') AND available_at <= ? AND deadline_at > ?
			ORDER BY priority, available_at, id
			LIMIT (SELECT GREATEST(16, CEIL(2.0 * ?::int / GREATEST(count(*), 1)))::int FROM considered)) c
		UNION ALL
		SELECT h.id, CASE WHEN EXISTS (SELECT 1 FROM job_tenants jt WHERE jt.tenant = h.tenant) THEN 2147483647 ELSE 0 END,
			-1, h.tenant FROM oldest h),
	picked AS (
		SELECT j.id FROM cand c JOIN jobs j ON j.id = c.id
		WHERE j.state IN ('READY', 'RETRY_SCHEDULED') AND j.available_at <= ? AND j.deadline_at > ?
		ORDER BY c.turn, c.served_at, c.tenant LIMIT ? FOR UPDATE OF j SKIP LOCKED),
	claimed AS (
		UPDATE jobs SET state = 'RUNNING', attempt = attempt + 1, fence = fence + 1,
			lease_until = ?, state_version = state_version + 1, updated_at = ?
		FROM picked WHERE jobs.id = picked.id
		RETURNING ` + qualified("jobs", jobColumns) + `),
	served AS (
		UPDATE job_tenants SET served_at = GREATEST(?, (SELECT max(served_at) FROM job_tenants) + 1)
		WHERE EXISTS (SELECT 1 FROM oldest) AND tenant IN (
			SELECT tenant FROM job_tenants WHERE tenant IN (SELECT tenant FROM considered)
			ORDER BY tenant FOR UPDATE SKIP LOCKED)),
	healed AS (
		INSERT INTO job_tenants (tenant) SELECT DISTINCT tenant FROM claimed ON CONFLICT DO NOTHING),
	ev AS (
		INSERT INTO outbox (id, job_id, tenant, type, state, state_version, created_at)
		SELECT (?::text[])[row_number() OVER (ORDER BY priority, available_at, id)],
			id, tenant, 'job.running', state, state_version, ?::bigint
		FROM claimed ORDER BY priority, available_at, id)
	SELECT ` + jobColumns + ` FROM claimed`
}

// finishCTE ends an attempt under the fence: the job's new state, the
// attempt record and the event, or nothing at all when the fence or the
// lease no longer holds (no row comes back).
const finishCTE = `WITH f AS (
		UPDATE jobs SET state = ?, state_version = state_version + 1, updated_at = ?, lease_until = 0,
			available_at = ?, result = COALESCE(?::bytea, result), error_class = ?, last_error = ?
		WHERE id = ? AND state = 'RUNNING' AND fence = ? AND lease_until > ?
		RETURNING id, tenant, state, state_version, fence),
	a AS (
		INSERT INTO attempts (job_id, attempt, fence, backend, outcome, error_class, error,
			prompt_tokens, completion_tokens, started_at, ended_at)
		SELECT id, ?::integer, fence, ?::text, ?::text, ?::text, ?::text, ?::integer, ?::integer, ?::bigint, ?::bigint FROM f),
	ev AS (
		INSERT INTO outbox (id, job_id, tenant, type, state, state_version, created_at)
		SELECT ?::text, id, tenant, ?::text, state, state_version, ?::bigint FROM f)
	SELECT tenant, state_version FROM f`

// qualified prefixes each column of a comma-separated list with table.
func qualified(table, cols string) string {
	parts := strings.Split(cols, ",")
	for i, p := range parts {
		parts[i] = table + "." + strings.TrimSpace(p)
	}
	return strings.Join(parts, ", ")
}

func eventID(id string) string {
	if id == "" {
		return uuid.Must(uuid.NewV7()).String()
	}
	return id
}

// acceptOne is Accept in one statement.
func (s *Store) acceptOne(ctx context.Context, n store.NewJob) (store.Job, bool, error) {
	now := micros(n.Now)
	var created bool
	job, err := scanJob(s.queryRow(ctx, nil, s.q.acceptCTE, n.ID, n.Tenant, n.IdempotencyKey, n.RequestHash, n.Endpoint, n.Model,
		[]byte(n.Body), []byte(n.Metadata), n.Priority, n.TokenEstimate, string(store.Ready), 1, 0, max(n.MaxAttempts, 1), 0,
		0, now, micros(n.Deadline), now, now, "", "",
		eventID(n.EventID), n.Tenant, n.IdempotencyKey), &created)
	if errors.Is(err, sql.ErrNoRows) {
		// The key was committed by another acceptance while this one
		// waited on it; a new statement sees it.
		job, err = scanJob(s.queryRow(ctx, nil, s.q.selectByKey, n.Tenant, n.IdempotencyKey))
	}
	if err != nil {
		return store.Job{}, false, s.err("accept job", err)
	}
	if !created && job.RequestHash != n.RequestHash {
		return store.Job{}, false, store.ErrConflict
	}
	return job, created, nil
}

// claimOne is Claim in one statement. With nothing runnable it changes no
// row, so it takes no row lock and commits nothing to flush: an idle poll
// needs no read first.
func (s *Store) claimOne(ctx context.Context, now time.Time, lease time.Duration, limit int) ([]store.Job, error) {
	if limit <= 0 {
		return nil, nil
	}
	ids := make([]string, limit)
	for i := range ids {
		ids[i] = uuid.Must(uuid.NewV7()).String()
	}
	// The lock re-reads a row another claimer changed; availability and
	// the deadline are checked again on the version it locks.
	rows, err := s.query(ctx, nil, s.q.claimCTE, fairTenants(limit), micros(now), micros(now), micros(now), micros(now), limit,
		micros(now), micros(now), limit, micros(now.Add(lease)), micros(now), micros(now), ids, micros(now))
	if err != nil {
		return nil, s.err("claim jobs", err)
	}
	defer rows.Close()
	jobs := make([]store.Job, 0, limit)
	for rows.Next() {
		j, err := scanJob(rows)
		if err != nil {
			return nil, s.err("claim jobs", err)
		}
		jobs = append(jobs, j)
	}
	if err := rows.Err(); err != nil {
		return nil, s.err("claim jobs", err)
	}
	// RETURNING keeps no order: hand them out in claim order.
	slices.SortFunc(jobs, func(a, b store.Job) int {
		return cmp.Or(cmp.Compare(a.Priority, b.Priority), a.AvailableAt.Compare(b.AvailableAt), cmp.Compare(a.ID, b.ID))
	})
	return jobs, nil
}

// finishOne is finish in one statement.
func (s *Store) finishOne(ctx context.Context, op, id string, fence int64, st store.State, availableAt time.Time,
	result []byte, a store.Attempt, evID string, now time.Time) error {
	var res any
	if result != nil {
		res = result
	}
	var tenant string
	var version int64
	err := s.queryRow(ctx, nil, s.q.finishCTE, string(st), micros(now), micros(availableAt), res, a.ErrorClass, a.Error,
		id, fence, micros(now),
		a.Attempt, a.Backend, a.Outcome, a.ErrorClass, a.Error, a.PromptTokens, a.CompletionTokens,
		micros(a.StartedAt), micros(a.EndedAt),
		eventID(evID), eventType(st), micros(now)).Scan(&tenant, &version)
	if errors.Is(err, sql.ErrNoRows) {
		return store.ErrLeaseLost
	}
	return s.err(op, err)
}
