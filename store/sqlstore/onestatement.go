package sqlstore

import (
	"context"
	"database/sql"
	"errors"

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

// acceptCTE takes the job's idempotency key and inserts the job and its
// job.accepted event, or, when the key is taken, returns the job that
// holds it; the last column says which. A job
// inserted by a transaction that commits while this statement waits on
// the key is invisible to the statement's snapshot: no row comes back and
// acceptOne reads it again.
var acceptCTE = `WITH taken AS (
		INSERT INTO job_keys (tenant, idempotency_key, id) VALUES (?, ?, ?)
		ON CONFLICT (tenant, idempotency_key) DO NOTHING
		RETURNING tenant, idempotency_key, id),
	ins AS (
		INSERT INTO jobs (` + newJobColumns + `)
		SELECT id, tenant, idempotency_key, ?::text, ?::text, ?::text, ?::bytea, ?::bytea, ?::integer, ?::integer, ?::text,
			?::bigint, ?::integer, ?::integer, ?::bigint, ?::bigint, ?::bigint, ?::bigint, ?::bigint, ?::bigint, ?::text, ?::text
		FROM taken
		RETURNING ` + jobColumns + `),
	` + eventsCTE("job.accepted", `INSERT INTO outbox (id, job_id, tenant, type, state, state_version, created_at)
		SELECT ?::text, id, tenant, 'job.accepted', state, state_version, created_at FROM ins`) + `
	SELECT ` + jobColumns + `, TRUE FROM ins
	UNION ALL
	SELECT ` + jobsColumns + `, FALSE` + fromKeys + `
	WHERE k.tenant = ? AND k.idempotency_key = ? AND NOT EXISTS (SELECT 1 FROM ins)`

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
	job, err := scanJob(s.queryRow(ctx, nil, s.q.acceptCTE, n.Tenant, n.IdempotencyKey, n.ID, n.RequestHash, n.Endpoint, n.Model,
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
