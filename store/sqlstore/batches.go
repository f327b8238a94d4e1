package sqlstore

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/kvgate/kvgate/store"
)

// Batches: a row per batch, whose lines are ordinary jobs (batch_id,
// custom_id) that the runner claims, admits and retries like any other.
// The work of a batch itself (validating its input, finalizing its
// output) is leased to one replica at a time: fence names a claim, and
// every write of the claim is conditioned on it, so that a replica that
// lost the lease (it stalled, it was killed) writes nothing more.

const batchColumns = `id, tenant, endpoint, input_file_id, completion_window, status, end_status, model,
	output_file_id, error_file_id, errors, metadata, output_expires_s, total, completed, failed, usage, priority_base,
	created_at, in_progress_at, expires_at, finalizing_at, completed_at, failed_at, expired_at, cancelling_at, cancelled_at,
	fence, lease_until, pending_output, pending_error`

func scanBatch(r scanner) (store.Batch, error) {
	var b store.Batch
	var errs, meta, usage []byte
	var outExp int64
	var t [9]int64
	var lease int64
	err := r.Scan(&b.ID, &b.Tenant, &b.Endpoint, &b.InputFileID, &b.CompletionWindow, &b.Status, &b.EndStatus, &b.Model,
		&b.OutputFileID, &b.ErrorFileID, &errs, &meta, &outExp, &b.Total, &b.Completed, &b.Failed, &usage, &b.PriorityBase,
		&t[0], &t[1], &t[2], &t[3], &t[4], &t[5], &t[6], &t[7], &t[8],
		&b.Fence, &lease, &b.PendingOutput, &b.PendingError)
	if err != nil {
		return b, err
	}
	b.Errors, b.Metadata, b.Usage = nilIfEmpty(errs), nilIfEmpty(meta), nilIfEmpty(usage)
	b.OutputExpiresAfter = time.Duration(outExp) * time.Second
	b.CreatedAt, b.InProgressAt, b.ExpiresAt = fromMicros(t[0]), fromMicros(t[1]), fromMicros(t[2])
	b.FinalizingAt, b.CompletedAt, b.FailedAt = fromMicros(t[3]), fromMicros(t[4]), fromMicros(t[5])
	b.ExpiredAt, b.CancellingAt, b.CancelledAt = fromMicros(t[6]), fromMicros(t[7]), fromMicros(t[8])
	b.LeaseUntil = fromMicros(lease)
	return b, nil
}

func nilIfEmpty(b []byte) json.RawMessage {
	if len(b) == 0 {
		return nil
	}
	return b
}

// CreateBatch records a new batch (validating).
func (s *Store) CreateBatch(ctx context.Context, b store.Batch) error {
	_, err := s.db.ExecContext(ctx, rebind(s.d, `INSERT INTO batches (id, tenant, endpoint, input_file_id, completion_window,
		status, metadata, output_expires_s, created_at, expires_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)`),
		b.ID, b.Tenant, b.Endpoint, b.InputFileID, b.CompletionWindow, store.BatchValidating, []byte(b.Metadata),
		int64(b.OutputExpiresAfter/time.Second), micros(b.CreatedAt), micros(b.ExpiresAt))
	return s.err("create batch", err)
}

// Batch returns a tenant's batch.
func (s *Store) Batch(ctx context.Context, tenant, id string) (store.Batch, error) {
	b, err := scanBatch(s.db.QueryRowContext(ctx, rebind(s.d, `SELECT `+batchColumns+` FROM batches WHERE tenant = ? AND id = ?`), tenant, id))
	return b, s.err("get batch", err)
}

// ListBatches returns a page of a tenant's batches, newest first, after
// the cursor (a batch id), and whether more follow.
func (s *Store) ListBatches(ctx context.Context, tenant, after string, limit int) ([]store.Batch, bool, error) {
	q, args := `SELECT `+batchColumns+` FROM batches WHERE tenant = ?`, []any{tenant}
	if after != "" {
		q += ` AND id < ?`
		args = append(args, after)
	}
	rows, err := s.db.QueryContext(ctx, rebind(s.d, q+` ORDER BY id DESC LIMIT ?`), append(args, limit+1)...)
	if err != nil {
		return nil, false, s.err("list batches", err)
	}
	out, err := scanBatches(rows)
	if err != nil {
		return nil, false, s.err("list batches", err)
	}
	out, more := cutPage(out, limit)
	return out, more, nil
}

func scanBatches(rows *sql.Rows) ([]store.Batch, error) {
	defer rows.Close()
	var out []store.Batch
	for rows.Next() {
		b, err := scanBatch(rows)
		if err != nil {
			return nil, err
		}
		out = append(out, b)
	}
	return out, rows.Err()
}

// BatchesToWork implements store.Store: the batches to validate, to watch
// (in progress, cancelling) and to finalize (a finalizer that lost its
// lease), by id. Batches in progress have no lease: ordered by lease, as
// they were, the oldest limit of them filled every page, and a batch
// submitted after them was never validated.
func (s *Store) BatchesToWork(ctx context.Context, now time.Time, after string, limit int) ([]store.Batch, error) {
	rows, err := s.db.QueryContext(ctx, rebind(s.d, `SELECT `+batchColumns+` FROM batches
		WHERE status IN ('validating', 'in_progress', 'finalizing', 'cancelling') AND lease_until < ? AND id > ?
		ORDER BY id LIMIT ?`), micros(now), after, limit)
	if err != nil {
		return nil, s.err("batches to work", err)
	}
	out, err := scanBatches(rows)
	return out, s.err("batches to work", err)
}

// LeaseBatch claims a batch's work for lease from now, if the lease is
// free and the batch is still at fence (as BatchesToWork saw it): it
// returns the claim's fence, or ErrLeaseLost when another took it.
func (s *Store) LeaseBatch(ctx context.Context, id string, fence int64, now time.Time, lease time.Duration) (int64, error) {
	res, err := s.db.ExecContext(ctx, rebind(s.d, `UPDATE batches SET fence = fence + 1, lease_until = ?
		WHERE id = ? AND fence = ? AND lease_until < ? AND status IN ('validating', 'in_progress', 'finalizing', 'cancelling')`),
		micros(now.Add(lease)), id, fence, micros(now))
	if err := affected(res, err); err != nil {
		return 0, s.err("lease batch", err)
	}
	return fence + 1, nil
}

// RenewBatch extends a claim's lease while it holds it.
func (s *Store) RenewBatch(ctx context.Context, id string, fence int64, now time.Time, lease time.Duration) error {
	res, err := s.db.ExecContext(ctx, rebind(s.d, `UPDATE batches SET lease_until = ? WHERE id = ? AND fence = ? AND lease_until >= ?`),
		micros(now.Add(lease)), id, fence, micros(now))
	return s.err("renew batch", affected(res, err))
}

// ReleaseBatch gives a claim's lease up (the batch waits for its lines).
func (s *Store) ReleaseBatch(ctx context.Context, id string, fence int64) error {
	res, err := s.db.ExecContext(ctx, rebind(s.d, `UPDATE batches SET lease_until = 0 WHERE id = ? AND fence = ?`), id, fence)
	return s.err("release batch", affected(res, err))
}

// affected turns "no row changed" into ErrLeaseLost.
func affected(res sql.Result, err error) error {
	if err != nil {
		return err
	}
	n, err := res.RowsAffected()
	if err != nil {
		return err
	}
	if n == 0 {
		return store.ErrLeaseLost
	}
	return nil
}

// BatchPriorityBase returns where a tenant's new batch starts: the lowest
// priority among its runnable batch lines (the line its other batches
// have reached), so that the new batch takes its turns beside them
// instead of behind them; 1 when it has none. Ordinary jobs run at 0.
func (s *Store) BatchPriorityBase(ctx context.Context, tenant string) (int, error) {
	var p sql.NullInt64
	err := s.db.QueryRowContext(ctx, rebind(s.d, `SELECT min(priority) FROM jobs WHERE tenant = ? AND priority >= 1
		AND state IN ('READY', 'RETRY_SCHEDULED')`), tenant).Scan(&p)
	if err != nil {
		return 0, s.err("batch priority", err)
	}
	if !p.Valid {
		return 1, nil
	}
	return int(p.Int64), nil
}

// SetBatchPriorityBase records, under the claim, where the batch's lines
// start (so that a second validation after a crash gives the same).
func (s *Store) SetBatchPriorityBase(ctx context.Context, id string, fence int64, base int) error {
	res, err := s.db.ExecContext(ctx, rebind(s.d, `UPDATE batches SET priority_base = ? WHERE id = ? AND fence = ?`), base, id, fence)
	return s.err("batch priority", affected(res, err))
}

// AcceptBatchLines inserts a batch's lines as READY jobs in bulk, with no
// job.accepted event each (the batch's own status says they were
// accepted); a line already inserted (a validation retried after a crash)
// is left as it is. It writes nothing unless the claim at fence still
// holds the batch.
func (s *Store) AcceptBatchLines(ctx context.Context, batchID string, fence int64, jobs []store.NewJob, customIDs []string) error {
	if len(jobs) == 0 {
		return nil
	}
	if len(customIDs) != len(jobs) {
		return fmt.Errorf("accept batch lines: %d jobs, %d custom ids", len(jobs), len(customIDs))
	}
	defer func() {
		for i, j := range jobs {
			if i == 0 || j.Tenant != jobs[i-1].Tenant {
				s.fair.note(j.Tenant)
			}
		}
	}()
	if s.d.WritableCTE {
		return s.acceptLinesArrays(ctx, batchID, fence, jobs, customIDs)
	}
	return s.tx(ctx, "accept batch lines", func(tx *sql.Tx) error {
		var one int
		if err := tx.QueryRowContext(ctx, rebind(s.d, `SELECT 1 FROM batches WHERE id = ? AND fence = ?`), batchID, fence).Scan(&one); err != nil {
			if errors.Is(err, sql.ErrNoRows) {
				return store.ErrLeaseLost
			}
			return err
		}
		key, err := tx.PrepareContext(ctx, rebind(s.d, insertKey))
		if err != nil {
			return err
		}
		defer key.Close()
		st, err := tx.PrepareContext(ctx, rebind(s.d, `INSERT INTO jobs (`+newJobColumns+`, batch_id, custom_id)
			VALUES (?, ?, ?, ?, ?, ?, ?, NULL, ?, ?, 'READY', 1, 0, ?, 0, 0, ?, ?, ?, ?, '', '', ?, ?)`))
		if err != nil {
			return err
		}
		defer st.Close()
		for i, n := range jobs {
			// A line whose key is taken was accepted before (a validation
			// run again after a crash): it stays as it is.
			res, err := key.ExecContext(ctx, n.Tenant, n.IdempotencyKey, n.ID)
			if err != nil {
				return err
			}
			if taken, err := res.RowsAffected(); err != nil {
				return err
			} else if taken == 0 {
				continue
			}
			now := micros(n.Now)
			if _, err := st.ExecContext(ctx, n.ID, n.Tenant, n.IdempotencyKey, n.RequestHash, n.Endpoint, n.Model, []byte(n.Body),
				n.Priority, n.TokenEstimate, max(n.MaxAttempts, 1), now, micros(n.Deadline), now, now, batchID, customIDs[i]); err != nil {
				return err
			}
		}
		return nil
	})
}

// acceptLinesArrays is AcceptBatchLines in one statement from arrays.
func (s *Store) acceptLinesArrays(ctx context.Context, batchID string, fence int64, jobs []store.NewJob, customIDs []string) error {
	var (
		ids, tenants, keys, hashes, endpoints, models []string
		bodies                                        [][]byte
		prios, tokens, attempts                       []int32
		deadlines, nows                               []int64
	)
	for _, n := range jobs {
		ids, tenants, keys = append(ids, n.ID), append(tenants, n.Tenant), append(keys, n.IdempotencyKey)
		hashes, endpoints, models = append(hashes, n.RequestHash), append(endpoints, n.Endpoint), append(models, n.Model)
		bodies = append(bodies, []byte(n.Body))
		prios, tokens, attempts = append(prios, int32(n.Priority)), append(tokens, int32(n.TokenEstimate)), append(attempts, int32(max(n.MaxAttempts, 1)))
		deadlines, nows = append(deadlines, micros(n.Deadline)), append(nows, micros(n.Now))
	}
	var held bool
	err := s.db.QueryRowContext(ctx, rebind(s.d, `WITH b AS (SELECT id FROM batches WHERE id = ?::text AND fence = ? FOR SHARE),
		t AS (SELECT * FROM unnest(?::text[], ?::text[], ?::text[], ?::text[], ?::text[], ?::text[], ?::bytea[], ?::integer[], ?::integer[],
			?::integer[], ?::bigint[], ?::bigint[], ?::text[])
			WITH ORDINALITY AS t(id, tenant, ikey, hash, endpoint, model, body, prio, tokens, attempts, deadline, now, custom, ord)),
		taken AS (INSERT INTO job_keys (tenant, idempotency_key, id)
			SELECT t.tenant, t.ikey, t.id FROM t CROSS JOIN b ORDER BY t.tenant, t.ikey, t.ord
			ON CONFLICT (tenant, idempotency_key) DO NOTHING
			RETURNING id),
		ins AS (INSERT INTO jobs (`+newJobColumns+`, batch_id, custom_id)
			SELECT t.id, tenant, ikey, hash, endpoint, model, body, NULL, prio, tokens, 'READY', 1, 0, attempts, 0, 0, now, deadline, now, now,
				'', '', b.id, custom
			FROM t JOIN taken ON taken.id = t.id CROSS JOIN b)
		SELECT EXISTS (SELECT 1 FROM b)`),
		batchID, fence, ids, tenants, keys, hashes, endpoints, models, bodies, prios, tokens, attempts, deadlines, nows, customIDs).Scan(&held)
	if err == nil && !held {
		return store.ErrLeaseLost
	}
	return s.err("accept batch lines", err)
}

// StartBatch ends a claim's validation: the batch, with total lines of
// model, is in progress (or stays cancelling, if a cancel came during
// the validation) and waits for its lines, its lease given up.
func (s *Store) StartBatch(ctx context.Context, id string, fence int64, total int, model string, now time.Time) error {
	res, err := s.db.ExecContext(ctx, rebind(s.d, `UPDATE batches SET
			status = CASE WHEN status = 'validating' THEN 'in_progress' ELSE status END,
			in_progress_at = ?, total = ?, model = ?, lease_until = 0
		WHERE id = ? AND fence = ? AND status IN ('validating', 'cancelling')`), micros(now), total, model, id, fence)
	return s.err("start batch", affected(res, err))
}

// FailBatch ends a claim's validation that found the input invalid: the
// batch failed with errors, and its batch.failed event.
func (s *Store) FailBatch(ctx context.Context, tenant, id string, fence int64, errs json.RawMessage, total int, eventID string, now time.Time) error {
	return s.tx(ctx, "fail batch", func(tx *sql.Tx) error {
		res, err := tx.ExecContext(ctx, rebind(s.d, `UPDATE batches SET status = 'failed', failed_at = ?, errors = ?, total = ?,
				lease_until = 0 WHERE id = ? AND fence = ? AND status IN ('validating', 'cancelling')`),
			micros(now), []byte(errs), total, id, fence)
		if err := affected(res, err); err != nil {
			return err
		}
		return s.batchEvent(ctx, tx, eventID, id, tenant, store.BatchFailed, fence, now)
	})
}

func (s *Store) batchEvent(ctx context.Context, tx *sql.Tx, evID, id, tenant, status string, fence int64, now time.Time) error {
	_, err := tx.ExecContext(ctx, rebind(s.d, eventsStatement(s.d, "batch."+status, `INSERT INTO outbox (id, job_id, tenant, type, state, state_version, created_at)
		VALUES (?, ?, ?, ?, ?, ?, ?)`)), eventID(evID), id, tenant, "batch."+status, status, fence, micros(now))
	return err
}

// CancelBatch asks for a tenant's batch to be cancelled: validating or in
// progress, it becomes cancelling (its worker then cancels its queued
// lines); already cancelling, it is returned as it is. ErrFinal when it
// has ended or is being finalized. The cancel ends any claim on the
// batch (a new fence): a validation still inserting lines inserts no
// more once it has committed.
func (s *Store) CancelBatch(ctx context.Context, tenant, id string, now time.Time) (store.Batch, error) {
	res, err := s.db.ExecContext(ctx, rebind(s.d, `UPDATE batches SET status = 'cancelling', cancelling_at = ?, lease_until = 0, fence = fence + 1
		WHERE tenant = ? AND id = ? AND status IN ('validating', 'in_progress')`), micros(now), tenant, id)
	if err != nil {
		return store.Batch{}, s.err("cancel batch", err)
	}
	b, err := s.Batch(ctx, tenant, id)
	if err != nil {
		return b, err
	}
	if n, _ := res.RowsAffected(); n == 0 && b.Status != store.BatchCancelling {
		return b, store.ErrFinal
	}
	return b, nil
}

// CancelBatchLines cancels a batch's queued lines (READY, RETRY_SCHEDULED)
// and, with running, its running ones too, each with its job.cancelled
// event; it returns how many it cancelled.
func (s *Store) CancelBatchLines(ctx context.Context, id string, running bool, now time.Time) (int, error) {
	states := `'READY', 'RETRY_SCHEDULED'`
	if running {
		states += `, 'RUNNING'`
	}
	// The event id is the job's and its new version: the same cancel
	// written twice would collide, never duplicate.
	evID := `'cancel.' || id || '.' || CAST(state_version AS TEXT)`
	cancel := `UPDATE jobs SET ` + keepSent + `, state = 'CANCELLED', state_version = state_version + 1, updated_at = ?,
		lease_until = 0 WHERE batch_id = ? AND state IN (` + states + `)`
	n := 0
	err := s.tx(ctx, "cancel batch lines", func(tx *sql.Tx) error {
		var rows *sql.Rows
		var err error
		if s.d.WritableCTE {
			rows, err = tx.QueryContext(ctx, rebind(s.d, `WITH c AS (`+cancel+` RETURNING id, tenant, state_version, sent_tokens, sent_cost),
				`+eventsCTE("job.cancelled", `INSERT INTO outbox (id, job_id, tenant, type, state, state_version, created_at)
					SELECT `+evID+`, id, tenant, 'job.cancelled', 'CANCELLED', state_version, ? FROM c`)+`
				SELECT tenant, sent_tokens, sent_cost FROM c`), micros(now), id, micros(now))
		} else {
			if _, err := tx.ExecContext(ctx, rebind(s.d, eventsStatement(s.d, "job.cancelled", `INSERT INTO outbox (id, job_id, tenant, type, state, state_version, created_at)
				SELECT `+strings.ReplaceAll(evID, "state_version AS", "state_version + 1 AS")+`, id, tenant, 'job.cancelled', 'CANCELLED',
					state_version + 1, ? FROM jobs WHERE batch_id = ? AND state IN (`+states+`)`)), micros(now), id); err != nil {
				return err
			}
			rows, err = tx.QueryContext(ctx, rebind(s.d, cancel+` RETURNING tenant, sent_tokens, sent_cost`), micros(now), id)
		}
		if err != nil {
			return err
		}
		defer rows.Close()
		taken := takenCharges{}
		for rows.Next() {
			var tenant string
			var tokens sql.NullInt64
			var cost int64
			if err := rows.Scan(&tenant, &tokens, &cost); err != nil {
				return err
			}
			taken.add(tenant, tokens, cost)
			n++
		}
		if err := rows.Err(); err != nil {
			return err
		}
		rows.Close()
		return s.chargeTaken(ctx, tx, taken, now)
	})
	return n, err
}

// BatchCounts counts a batch's lines by how they stand.
func (s *Store) BatchCounts(ctx context.Context, id string) (store.BatchCounts, error) {
	rows, err := s.db.QueryContext(ctx, rebind(s.d, `SELECT state, count(*) FROM jobs WHERE batch_id = ? GROUP BY state`), id)
	if err != nil {
		return store.BatchCounts{}, s.err("count batch lines", err)
	}
	defer rows.Close()
	var c store.BatchCounts
	for rows.Next() {
		var st string
		var n int
		if err := rows.Scan(&st, &n); err != nil {
			return c, s.err("count batch lines", err)
		}
		c.Total += n
		switch store.State(st) {
		case store.Succeeded, store.ReviewRequired:
			c.Succeeded += n
		case store.FailedTerminal:
			c.Failed += n
		case store.Cancelled:
			c.Cancelled += n
		default:
			c.Open += n
		}
	}
	return c, s.err("count batch lines", rows.Err())
}

// BatchOpen reports whether any line of a batch has not ended.
func (s *Store) BatchOpen(ctx context.Context, id string) (bool, error) {
	open, err := s.batchOpen(ctx, s.db, id)
	return open, s.err("batch lines open", err)
}

// batchOpen reports whether any line of a batch has not ended, read on q.
func (s *Store) batchOpen(ctx context.Context, q querier, id string) (bool, error) {
	var one int
	err := q.QueryRowContext(ctx, rebind(s.d, `SELECT 1 FROM jobs WHERE batch_id = ?
		AND state IN ('READY', 'RUNNING', 'RETRY_SCHEDULED') LIMIT 1`), id).Scan(&one)
	if err == sql.ErrNoRows {
		return false, nil
	}
	return err == nil, err
}

// BeginFinalize starts (or, after a finalizer lost its lease, restarts)
// a claim's finalization: the batch is finalizing toward endStatus (kept
// when already set), and out and errFile are the files this claim writes,
// created incomplete. The files an earlier claim was writing are dropped
// first: only the claim that ends the batch (EndBatch) makes its files
// complete, so that a crash mid-finalization never leaves a line twice.
func (s *Store) BeginFinalize(ctx context.Context, tenant, id string, fence int64, endStatus string, out, errFile store.File, now time.Time) error {
	var b store.Batch
	err := s.tx(ctx, "begin finalize", func(tx *sql.Tx) error {
		var err error
		b, err = scanBatch(tx.QueryRowContext(ctx, rebind(s.d, `SELECT `+batchColumns+` FROM batches WHERE id = ? AND fence = ?`), id, fence))
		if err == sql.ErrNoRows {
			return store.ErrLeaseLost
		}
		if err != nil {
			return err
		}
		res, err := tx.ExecContext(ctx, rebind(s.d, `UPDATE batches SET status = 'finalizing',
				end_status = CASE WHEN end_status = '' THEN ? ELSE end_status END,
				finalizing_at = CASE WHEN finalizing_at = 0 THEN ? ELSE finalizing_at END,
				pending_output = ?, pending_error = ?
			WHERE id = ? AND fence = ? AND status IN ('in_progress', 'cancelling', 'finalizing')`),
			endStatus, micros(now), out.ID, errFile.ID, id, fence)
		if err := affected(res, err); err != nil {
			return err
		}
		// The update holds the batch's row, which a replay of a line
		// reads under a shared lock (Replay): a replay committed before
		// it is seen here, one after it finds the batch finalizing. A
		// restarted finalization needs no look, as no replay reopens a
		// line once the batch is finalizing.
		if b.Status != store.BatchFinalizing {
			open, err := s.batchOpen(ctx, tx, id)
			if err != nil {
				return err
			}
			if open {
				return store.ErrBatchOpen
			}
		}
		for _, f := range []store.File{out, errFile} {
			if _, err := tx.ExecContext(ctx, rebind(s.d, `INSERT INTO files (`+fileColumns+`) VALUES (?, ?, ?, ?, 0, 0, ?, ?, ?)`),
				f.ID, tenant, f.Filename, f.Purpose, false, micros(f.CreatedAt), micros(f.ExpiresAt)); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		return err
	}
	for _, old := range []string{b.PendingOutput, b.PendingError} {
		if old != "" {
			if err := s.dropFile(ctx, old); err != nil {
				return err
			}
		}
	}
	return nil
}

// batchLinesBytes is the result bytes that end a page of BatchLines.
const batchLinesBytes = 32 << 20

// BatchLines returns up to limit lines of a batch after the job id
// after, in job id order; fewer once their results hold batchLinesBytes
// (an empty page is the end).
func (s *Store) BatchLines(ctx context.Context, id, after string, limit int) ([]store.BatchLine, error) {
	rows, err := s.db.QueryContext(ctx, rebind(s.d, `SELECT id, custom_id, state, result, error_class, last_error, updated_at
		FROM jobs WHERE batch_id = ? AND id > ? ORDER BY id LIMIT ?`), id, after, limit)
	if err != nil {
		return nil, s.err("batch lines", err)
	}
	defer rows.Close()
	var out []store.BatchLine
	size := 0
	for rows.Next() {
		var l store.BatchLine
		var custom sql.NullString
		var st string
		var res []byte
		var updated int64
		if err := rows.Scan(&l.JobID, &custom, &st, &res, &l.ErrorClass, &l.LastError, &updated); err != nil {
			return nil, s.err("batch lines", err)
		}
		l.CustomID, l.State, l.Result, l.UpdatedAt = custom.String, store.State(st), nilIfEmpty(res), fromMicros(updated)
		out = append(out, l)
		if size += len(res); size >= s.batchLinesBytes {
			// A page of large results (embeddings of many inputs) ends
			// early: the next page starts after its last line.
			break
		}
	}
	return out, s.err("batch lines", rows.Err())
}

// EndBatch is a finalization's last write, under its claim, in one
// transaction: the batch's final status, counts and usage, its files
// complete (a file with no line is dropped), and its event.
func (s *Store) EndBatch(ctx context.Context, e store.BatchEnd) error {
	at := map[string]string{store.BatchCompleted: "completed_at", store.BatchExpired: "expired_at", store.BatchCancelled: "cancelled_at"}[e.Status]
	if at == "" {
		return fmt.Errorf("end batch: status %q is not completed, expired or cancelled", e.Status)
	}
	var dropped []string
	err := s.tx(ctx, "end batch", func(tx *sql.Tx) error {
		b, err := scanBatch(tx.QueryRowContext(ctx, rebind(s.d, `SELECT `+batchColumns+` FROM batches WHERE id = ? AND fence = ? AND status = 'finalizing'`), e.ID, e.Fence))
		if err == sql.ErrNoRows {
			return store.ErrLeaseLost
		}
		if err != nil {
			return err
		}
		keep := func(id string, bytes, lines int64) (string, error) {
			if lines == 0 {
				dropped = append(dropped, id)
				return "", nil
			}
			_, err := tx.ExecContext(ctx, rebind(s.d, `UPDATE files SET complete = ?, bytes = ?, lines = ? WHERE id = ?`), true, bytes, lines, id)
			return id, err
		}
		out, err := keep(b.PendingOutput, e.OutputBytes, e.OutputLines)
		if err != nil {
			return err
		}
		errFile, err := keep(b.PendingError, e.ErrorBytes, e.ErrorLines)
		if err != nil {
			return err
		}
		res, err := tx.ExecContext(ctx, rebind(s.d, `UPDATE batches SET status = ?, `+at+` = ?, output_file_id = ?, error_file_id = ?,
				total = ?, completed = ?, failed = ?, usage = ?, lease_until = 0, pending_output = '', pending_error = ''
			WHERE id = ? AND fence = ? AND status = 'finalizing'`),
			e.Status, micros(e.Now), out, errFile, e.Counts.Total, e.Counts.Succeeded, e.Counts.Failed+e.Counts.Cancelled, []byte(e.Usage), e.ID, e.Fence)
		if err := affected(res, err); err != nil {
			return err
		}
		return s.batchEvent(ctx, tx, e.EventID, e.ID, b.Tenant, e.Status, e.Fence, e.Now)
	})
	if err != nil {
		return err
	}
	for _, id := range dropped {
		if id != "" {
			_ = s.dropFile(ctx, id) // an empty file; the sweep takes what this misses
		}
	}
	return nil
}

// ReserveBatch implements store.Batches: one reservation of jobs lines
// (job_reservations.jobs, migration 0016), checked and held in one
// transaction as ReserveJob's.
func (s *Store) ReserveBatch(ctx context.Context, id, tenant string, jobs, tokens int64, l store.Limits, now time.Time, lease time.Duration) error {
	return s.reservePending(ctx, "reserve batch", id, tenant, jobs, tokens, l, now, lease)
}

var _ store.Batches = (*Store)(nil)
