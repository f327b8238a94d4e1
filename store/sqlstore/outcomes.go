package sqlstore

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"strings"
	"time"

	"github.com/kvgate/kvgate/store"
)

// Validation policies, job outcomes, reviews, replay, audit, dead letters
// and retention (store/outcomes.go). These statements are not on the hot
// path: they run unprepared, on the transaction's connection or the pool.

// odb runs an outcome statement on tx, or on the pool when tx is nil.
type odb interface {
	ExecContext(ctx context.Context, q string, args ...any) (sql.Result, error)
	QueryContext(ctx context.Context, q string, args ...any) (*sql.Rows, error)
	QueryRowContext(ctx context.Context, q string, args ...any) *sql.Row
}

func (s *Store) on(tx *sql.Tx) odb {
	if tx != nil {
		return tx
	}
	return s.db
}

const policyColumns = `tenant, name, version, document, created_by, created_at`

func scanPolicy(r scanner) (store.Policy, error) {
	var p store.Policy
	var doc []byte
	var created int64
	if err := r.Scan(&p.Tenant, &p.Name, &p.Version, &doc, &p.CreatedBy, &created); err != nil {
		return p, err
	}
	p.Document, p.CreatedAt = doc, fromMicros(created)
	return p, nil
}

// PutPolicy implements store.Outcomes. Two puts racing for a version
// conflict on the key; the loser takes the next.
func (s *Store) PutPolicy(ctx context.Context, p store.Policy) (store.Policy, error) {
	for range 8 {
		var out store.Policy
		err := s.tx(ctx, "put policy", func(tx *sql.Tx) error {
			var v int
			if err := tx.QueryRowContext(ctx, rebind(s.d, `SELECT COALESCE(MAX(version), 0) + 1 FROM validation_policies
				WHERE tenant = ? AND name = ?`), p.Tenant, p.Name).Scan(&v); err != nil {
				return err
			}
			res, err := tx.ExecContext(ctx, rebind(s.d, `INSERT INTO validation_policies (`+policyColumns+`)
				VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (tenant, name, version) DO NOTHING`),
				p.Tenant, p.Name, v, []byte(p.Document), p.CreatedBy, micros(p.CreatedAt))
			if err != nil {
				return err
			}
			if n, err := res.RowsAffected(); err != nil || n == 0 {
				return err // n == 0: a concurrent put took the version
			}
			out = p
			out.Version, out.CreatedAt = v, fromMicros(micros(p.CreatedAt))
			return nil
		})
		if err != nil || out.Version > 0 {
			return out, err
		}
	}
	return store.Policy{}, s.err("put policy", errors.New("too many concurrent versions of one policy"))
}

// GetPolicy implements store.Outcomes.
func (s *Store) GetPolicy(ctx context.Context, tenant, name string, version int) (store.Policy, error) {
	q := `SELECT ` + policyColumns + ` FROM validation_policies WHERE tenant = ? AND name = ?`
	args := []any{tenant, name}
	if version > 0 {
		q += ` AND version = ?`
		args = append(args, version)
	}
	p, err := scanPolicy(s.db.QueryRowContext(ctx, rebind(s.d, q+` ORDER BY version DESC LIMIT 1`), args...))
	if errors.Is(err, sql.ErrNoRows) {
		return p, store.ErrPolicyNotFound
	}
	return p, s.err("get policy", err)
}

func (s *Store) policies(ctx context.Context, op, q string, args ...any) ([]store.Policy, error) {
	rows, err := s.db.QueryContext(ctx, rebind(s.d, q), args...)
	if err != nil {
		return nil, s.err(op, err)
	}
	defer rows.Close()
	var out []store.Policy
	for rows.Next() {
		p, err := scanPolicy(rows)
		if err != nil {
			return nil, s.err(op, err)
		}
		out = append(out, p)
	}
	return out, s.err(op, rows.Err())
}

// PolicyVersions implements store.Outcomes.
func (s *Store) PolicyVersions(ctx context.Context, tenant, name string) ([]store.Policy, error) {
	ps, err := s.policies(ctx, "list policy versions", `SELECT `+policyColumns+` FROM validation_policies
		WHERE tenant = ? AND name = ? ORDER BY version`, tenant, name)
	if err == nil && len(ps) == 0 {
		return nil, store.ErrPolicyNotFound
	}
	return ps, err
}

// Policies implements store.Outcomes.
func (s *Store) Policies(ctx context.Context, tenant string) ([]store.Policy, error) {
	return s.policies(ctx, "list policies", `SELECT `+policyColumns+` FROM validation_policies p
		WHERE tenant = ? AND version = (SELECT MAX(version) FROM validation_policies q WHERE q.tenant = p.tenant AND q.name = p.name)
		ORDER BY name`, tenant)
}

// pinVersion is the version of a tenant's policy a job pins: the one
// named, which must exist, or the latest.
func (s *Store) pinVersion(ctx context.Context, tx *sql.Tx, tenant, name string, version int) (int, error) {
	var v sql.NullInt64
	q := `SELECT MAX(version) FROM validation_policies WHERE tenant = ? AND name = ?`
	args := []any{tenant, name}
	if version > 0 {
		q += ` AND version = ?`
		args = append(args, version)
	}
	if err := s.on(tx).QueryRowContext(ctx, rebind(s.d, q), args...).Scan(&v); err != nil {
		return 0, err
	}
	if !v.Valid {
		return 0, store.ErrPolicyNotFound
	}
	return int(v.Int64), nil
}

// pinOutcome writes a new job's outcome row in Accept's transaction.
func (s *Store) pinOutcome(ctx context.Context, tx *sql.Tx, j store.Job, o *store.NewOutcome) error {
	v, err := s.pinVersion(ctx, tx, j.Tenant, o.Policy, o.Version)
	if err != nil {
		return err
	}
	_, err = tx.ExecContext(ctx, rebind(s.d, `INSERT INTO job_outcomes (job_id, tenant, policy_name, policy_version, source)
		VALUES (?, ?, ?, ?, ?)`), j.ID, j.Tenant, o.Policy, v, o.Source)
	return err
}

// JobOutcome implements store.Outcomes.
func (s *Store) JobOutcome(ctx context.Context, jobID string) (store.JobOutcome, error) {
	var o store.JobOutcome
	var doc []byte
	err := s.db.QueryRowContext(ctx, rebind(s.d, `SELECT o.job_id, o.tenant, o.policy_name, o.policy_version, p.document, o.source
		FROM job_outcomes o JOIN validation_policies p ON p.tenant = o.tenant AND p.name = o.policy_name AND p.version = o.policy_version
		WHERE o.job_id = ?`), jobID).Scan(&o.JobID, &o.Tenant, &o.Policy, &o.Version, &doc, &o.Source)
	o.Document = doc
	return o, s.err("get job outcome", err)
}

// outcomeOf reads a job's pinned policy in tx: ("", 0) when it has none.
func (s *Store) outcomeOf(ctx context.Context, tx *sql.Tx, jobID string) (string, int, error) {
	var name string
	var v int
	err := tx.QueryRowContext(ctx, rebind(s.d, `SELECT policy_name, policy_version FROM job_outcomes WHERE job_id = ?`), jobID).Scan(&name, &v)
	if errors.Is(err, sql.ErrNoRows) {
		return "", 0, nil
	}
	return name, v, err
}

func (s *Store) addAudit(ctx context.Context, tx *sql.Tx, a store.AuditRecord) error {
	var detail []byte
	if len(a.Detail) > 0 {
		detail = a.Detail
	}
	_, err := tx.ExecContext(ctx, rebind(s.d, `INSERT INTO audit (tenant, job_id, actor, action, policy_name, policy_version,
		detail, prev_state, state, created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)`),
		a.Tenant, a.JobID, a.Actor, a.Action, a.Policy, a.Version, detail, string(a.Previous), string(a.State), micros(a.At))
	return err
}

// lockedJob reads a tenant's job in tx, locking its row where the
// dialect locks rows, so that the change that follows is decided on the
// version it replaces.
func (s *Store) lockedJob(ctx context.Context, tx *sql.Tx, tenant, id string) (store.Job, error) {
	lock := s.forUpdate()
	j, err := scanJob(tx.QueryRowContext(ctx, rebind(s.d, `SELECT `+jobColumns+` FROM jobs WHERE tenant = ? AND id = ?`+lock), tenant, id))
	if errors.Is(err, sql.ErrNoRows) {
		return j, store.ErrNotFound
	}
	return j, err
}

// Decide implements store.Outcomes.
func (s *Store) Decide(ctx context.Context, r store.Review) (store.Job, error) {
	var out store.Job
	err := s.tx(ctx, "review job", func(tx *sql.Tx) error {
		j, err := s.lockedJob(ctx, tx, r.Tenant, r.JobID)
		if err != nil {
			return err
		}
		if j.State != store.ReviewRequired {
			return store.ErrWrongState
		}
		st, class, lastErr, action := store.Succeeded, "", "", store.AuditApprove
		if !r.Approve {
			st, class, lastErr, action = store.FailedTerminal, store.ClassRejected, r.Reason, store.AuditReject
		}
		// An approval is a success like the runner's: for a job of an
		// entity it is judged under the entity's lock, so a version lower
		// than one that already succeeded ends SUPERSEDED (the audit
		// record keeps the approval), and a winning one supersedes the
		// lower versions not yet started.
		je, hasEntity, err := s.txJobEntity(ctx, tx, r.JobID)
		if err != nil {
			return err
		}
		wins := false
		if r.Approve && hasEntity {
			won, err := s.lockEntity(ctx, tx, je)
			if err != nil {
				return err
			}
			if won > je.Version {
				st, lastErr = store.Superseded, "a later version of its entity succeeded first"
			} else {
				wins = true
			}
		}
		var res any
		if r.Result != nil {
			res = []byte(r.Result)
		}
		out, err = scanJob(tx.QueryRowContext(ctx, rebind(s.d, `UPDATE jobs SET state = ?, state_version = state_version + 1,
			updated_at = ?, result = COALESCE(?, result), error_class = ?, last_error = ?
			WHERE tenant = ? AND id = ? AND state = 'REVIEW_REQUIRED' RETURNING `+jobColumns),
			string(st), micros(r.Now), res, class, lastErr, r.Tenant, r.JobID))
		if err != nil {
			return err
		}
		a := r.Audit
		a.Tenant, a.JobID, a.Action, a.At, a.Previous, a.State = r.Tenant, r.JobID, action, r.Now, j.State, st
		if a.Policy, a.Version, err = s.outcomeOf(ctx, tx, r.JobID); err != nil {
			return err
		}
		if err := s.addAudit(ctx, tx, a); err != nil {
			return err
		}
		if wins {
			if err := s.winEntity(ctx, tx, je, r.Now); err != nil {
				return err
			}
		}
		return s.addEvent(ctx, tx, r.EventID, out.ID, out.Tenant, out.State, out.StateVersion, r.Now)
	})
	return out, err
}

// Replay implements store.Outcomes.
func (s *Store) Replay(ctx context.Context, r store.Replay) (store.Job, error) {
	var out store.Job
	err := s.tx(ctx, "replay job", func(tx *sql.Tx) error {
		j, err := s.lockedJob(ctx, tx, r.Tenant, r.JobID)
		if err != nil {
			return err
		}
		if j.State != store.FailedTerminal && j.State != store.ReviewRequired {
			return store.ErrWrongState
		}
		var batch sql.NullString
		if err := tx.QueryRowContext(ctx, rebind(s.d, `SELECT b.status FROM jobs j JOIN batches b ON b.id = j.batch_id
			WHERE j.id = ? `+s.d.LockShared), r.JobID).Scan(&batch); err != nil && !errors.Is(err, sql.ErrNoRows) {
			return err
		}
		if batch.Valid && batch.String != store.BatchInProgress {
			return store.ErrBatchClosed
		}
		name, version, err := s.outcomeOf(ctx, tx, r.JobID)
		if err != nil {
			return err
		}
		if name != "" {
			if version, err = s.pinVersion(ctx, tx, r.Tenant, name, r.Version); err != nil {
				return err
			}
			if _, err := tx.ExecContext(ctx, rebind(s.d, `UPDATE job_outcomes SET policy_version = ? WHERE job_id = ?`), version, r.JobID); err != nil {
				return err
			}
		}
		// The validation stage always runs again (it is what a replay
		// re-decides); the inference only when asked for.
		drop := `DELETE FROM stages WHERE job_id = ? AND stage = '` + store.StageValidation + `'`
		if r.FromInference {
			drop = `DELETE FROM stages WHERE job_id = ?`
		}
		if _, err := tx.ExecContext(ctx, rebind(s.d, drop), r.JobID); err != nil {
			return err
		}
		out, err = scanJob(tx.QueryRowContext(ctx, rebind(s.d, `UPDATE jobs SET state = 'READY', state_version = state_version + 1,
			attempt = 0, replay_fence = fence, max_attempts = ?, deadline_at = ?, available_at = ?, updated_at = ?, lease_until = 0,
			error_class = '', last_error = '', result = NULL
			WHERE tenant = ? AND id = ? RETURNING `+jobColumns),
			max(r.MaxAttempts, 1), micros(r.Deadline), micros(r.Now), micros(r.Now), r.Tenant, r.JobID))
		if err != nil {
			return err
		}
		a := r.Audit
		a.Tenant, a.JobID, a.Action, a.At, a.Previous, a.State = r.Tenant, r.JobID, store.AuditReplay, r.Now, j.State, store.Ready
		a.Policy, a.Version = name, version
		if err := s.addAudit(ctx, tx, a); err != nil {
			return err
		}
		return s.addEvent(ctx, tx, r.EventID, out.ID, out.Tenant, out.State, out.StateVersion, r.Now)
	})
	return out, err
}

// Audit implements store.Outcomes.
func (s *Store) Audit(ctx context.Context, tenant, jobID string) ([]store.AuditRecord, error) {
	rows, err := s.db.QueryContext(ctx, rebind(s.d, `SELECT seq, tenant, job_id, actor, action, policy_name, policy_version,
		detail, prev_state, state, created_at FROM audit WHERE tenant = ? AND job_id = ? ORDER BY seq`), tenant, jobID)
	if err != nil {
		return nil, s.err("list audit records", err)
	}
	defer rows.Close()
	var out []store.AuditRecord
	for rows.Next() {
		var a store.AuditRecord
		var detail []byte
		var prev, st string
		var at int64
		if err := rows.Scan(&a.Seq, &a.Tenant, &a.JobID, &a.Actor, &a.Action, &a.Policy, &a.Version, &detail, &prev, &st, &at); err != nil {
			return nil, s.err("list audit records", err)
		}
		a.Detail, a.Previous, a.State, a.At = detail, store.State(prev), store.State(st), fromMicros(at)
		out = append(out, a)
	}
	return out, s.err("list audit records", rows.Err())
}

// refColumns are jobColumns without the request body and metadata: what
// a listing by reference reads.
var refColumns = strings.Replace(jobColumns, "body, metadata", "NULL AS body, NULL AS metadata", 1)

// finalIndexed repeats the predicate of the partial index jobs_final
// (tenant, state, id): SQLite uses a partial index only when the query's
// WHERE names the index's own predicate, and does not infer it from
// state = '...'. Without it, a tenant's review queue or dead letters scan
// all its jobs (about 100 ms with 100,000 jobs; BenchmarkConsolePages).
const finalIndexed = ` AND jobs.state IN ('REVIEW_REQUIRED', 'FAILED_TERMINAL')`

// Reviews implements store.Outcomes.
func (s *Store) Reviews(ctx context.Context, tenant, after string, limit int) ([]store.Job, []store.Validation, string, error) {
	return s.reviews(ctx, tenant, "", after, limit)
}

// Review implements store.Store.
func (s *Store) Review(ctx context.Context, tenant, id string) (store.Job, store.Validation, error) {
	jobs, vals, _, err := s.reviews(ctx, tenant, id, "", 1)
	if err == nil && len(jobs) == 0 {
		err = store.ErrNotFound
	}
	if err != nil {
		return store.Job{}, store.Validation{}, err
	}
	return jobs[0], vals[0], nil
}

// reviews lists a tenant's REVIEW_REQUIRED jobs, or the one of id.
func (s *Store) reviews(ctx context.Context, tenant, id, after string, limit int) ([]store.Job, []store.Validation, string, error) {
	limit = pageLimit(limit)
	q := `SELECT ` + qualified("jobs", refColumns) + `, st.data FROM jobs
		LEFT JOIN stages st ON st.job_id = jobs.id AND st.stage = '` + store.StageValidation + `'
		WHERE jobs.tenant = ? AND jobs.state = 'REVIEW_REQUIRED'` + finalIndexed
	args := []any{tenant}
	if id != "" {
		q += ` AND jobs.id = ?`
		args = append(args, id)
	}
	if after != "" {
		q += ` AND jobs.id < ?`
		args = append(args, after)
	}
	q += ` ORDER BY jobs.id DESC LIMIT ?`
	rows, err := s.db.QueryContext(ctx, rebind(s.d, q), append(args, limit+1)...)
	if err != nil {
		return nil, nil, "", s.err("list reviews", err)
	}
	defer rows.Close()
	var jobs []store.Job
	var vals []store.Validation
	for rows.Next() {
		var data []byte
		j, err := scanJob(rows, &data)
		if err != nil {
			return nil, nil, "", s.err("list reviews", err)
		}
		var v store.Validation
		if len(data) > 0 {
			_ = json.Unmarshal(data, &v) // a checkpoint the runner wrote
		}
		jobs, vals = append(jobs, j), append(vals, v)
	}
	if err := rows.Err(); err != nil {
		return nil, nil, "", s.err("list reviews", err)
	}
	next := ""
	if len(jobs) > limit {
		jobs, vals = jobs[:limit], vals[:limit]
		next = jobs[limit-1].ID
	}
	return jobs, vals, next, nil
}

func pageLimit(n int) int {
	if n <= 0 || n > 1000 {
		return 100
	}
	return n
}

// qualified is a list of job columns (jobColumns, refColumns) with each
// column qualified by t.
func qualified(t, list string) string {
	cols := strings.Split(list, ",")
	for i, c := range cols {
		c = strings.TrimSpace(c)
		if !strings.HasPrefix(c, "NULL") {
			c = t + "." + c
		}
		cols[i] = c
	}
	return strings.Join(cols, ", ")
}

// DeadLetters implements store.Outcomes.
func (s *Store) DeadLetters(ctx context.Context, f store.DeadLetterFilter) ([]store.DeadLetter, string, error) {
	limit := pageLimit(f.Limit)
	q := `SELECT ` + qualified("jobs", refColumns) + `, COALESCE(o.policy_name, ''), COALESCE(o.policy_version, 0),
		COALESCE((SELECT a.action FROM audit a WHERE a.job_id = jobs.id ORDER BY a.seq DESC LIMIT 1), '')
		FROM jobs LEFT JOIN job_outcomes o ON o.job_id = jobs.id WHERE jobs.state = 'FAILED_TERMINAL'` + finalIndexed
	var args []any
	if f.Tenant != "" {
		q += ` AND jobs.tenant = ?`
		args = append(args, f.Tenant)
	}
	if f.Class != "" {
		q += ` AND jobs.error_class = ?`
		args = append(args, f.Class)
	}
	if !f.Since.IsZero() {
		q += ` AND jobs.updated_at >= ?`
		args = append(args, micros(f.Since))
	}
	if !f.Until.IsZero() {
		q += ` AND jobs.updated_at < ?`
		args = append(args, micros(f.Until))
	}
	if f.After != "" {
		q += ` AND jobs.id < ?`
		args = append(args, f.After)
	}
	q += ` ORDER BY jobs.id DESC LIMIT ?`
	rows, err := s.db.QueryContext(ctx, rebind(s.d, q), append(args, limit+1)...)
	if err != nil {
		return nil, "", s.err("list dead letters", err)
	}
	var out []store.DeadLetter
	for rows.Next() {
		var d store.DeadLetter
		if d.Job, err = scanJob(rows, &d.Policy, &d.Version, &d.Decision); err != nil {
			rows.Close()
			return nil, "", s.err("list dead letters", err)
		}
		out = append(out, d)
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return nil, "", s.err("list dead letters", err)
	}
	next := ""
	if len(out) > limit {
		out = out[:limit]
		next = out[limit-1].Job.ID
	}
	for i := range out {
		if out[i].Attempts, err = s.Attempts(ctx, out[i].Job.ID); err != nil {
			return nil, "", err
		}
	}
	return out, next, nil
}

// CountOutcomes implements store.Outcomes.
func (s *Store) CountOutcomes(ctx context.Context) (store.OutcomeCounts, error) {
	c := store.OutcomeCounts{DeadLetters: map[string]int{}}
	rows, err := s.db.QueryContext(ctx, `SELECT state, error_class, count(*) FROM jobs
		WHERE state IN ('REVIEW_REQUIRED', 'FAILED_TERMINAL') GROUP BY state, error_class`)
	if err != nil {
		return c, s.err("count outcomes", err)
	}
	defer rows.Close()
	for rows.Next() {
		var st, class string
		var n int
		if err := rows.Scan(&st, &class, &n); err != nil {
			return c, s.err("count outcomes", err)
		}
		if store.State(st) == store.ReviewRequired {
			c.ReviewRequired += n
		} else {
			c.DeadLetters[class] += n
		}
	}
	return c, s.err("count outcomes", rows.Err())
}

// PruneFinal implements store.Outcomes: one bounded batch per call, in
// one transaction, so that a large backlog is pruned a batch at a time
// without holding locks for long.
func (s *Store) PruneFinal(ctx context.Context, before time.Time, limit int) (int, error) {
	if limit <= 0 {
		return 0, nil
	}
	n := 0
	err := s.tx(ctx, "prune final jobs", func(tx *sql.Tx) error {
		// A job goes with its events, so two are kept whatever their
		// age: one with an event the relay has not published yet (its
		// last one would never reach the broker), and the one whose event
		// holds the feed's last place, from which the relay numbers the
		// next places (MarkPublished): without it they would be given
		// again, behind cursors that readers have passed.
		//
		// A line of a batch not yet ended is kept too: its batch's files
		// are written from its lines, and its key stops a validation
		// taken over from accepting it again.
		//
		// The jobs are locked as they are chosen (PostgreSQL: a job a
		// replay or review is changing is passed over; one it changed
		// since is chosen only if still final and old), so that no change
		// committed meanwhile, with its event, is deleted with them.
		// SQLite runs one writer at a time.
		// An ended batch's event goes by its own time (the batch is
		// kept): published, and not the feed's last place. The feed's
		// head is read through its partial index (outbox_feed), which
		// SQLite uses only for a WHERE that names its predicate.
		if _, err := tx.ExecContext(ctx, rebind(s.d, `DELETE FROM outbox WHERE id IN (SELECT id FROM outbox
				WHERE type LIKE 'batch.%' AND created_at < ? AND published_at > 0
					AND feed_seq < (SELECT MAX(feed_seq) FROM outbox WHERE feed_seq IS NOT NULL)
				ORDER BY created_at LIMIT ?)`), micros(before), limit); err != nil {
			return err
		}
		found, err := scanTexts(tx.QueryContext(ctx, rebind(s.d, `SELECT id FROM jobs
			WHERE state IN `+finalStatesSQL()+` AND updated_at < ?
				AND id NOT IN (SELECT job_id FROM outbox WHERE published_at = 0
					UNION ALL SELECT job_id FROM outbox WHERE published_at = `+placed+`)
				AND id <> COALESCE((SELECT job_id FROM outbox WHERE feed_seq = (SELECT MAX(feed_seq) FROM outbox WHERE feed_seq IS NOT NULL)), '')
				AND (batch_id IS NULL OR batch_id NOT IN (SELECT id FROM batches
					WHERE status IN ('validating', 'in_progress', 'finalizing', 'cancelling')))
			ORDER BY updated_at LIMIT ? `+s.d.LockRunnable), micros(before), limit))
		if err != nil || len(found) == 0 {
			return err
		}
		ids := make([]any, len(found))
		for i, id := range found {
			ids[i] = id
		}
		in := `(` + strings.TrimSuffix(strings.Repeat("?, ", len(ids)), ", ") + `)`
		for _, t := range []string{"audit", "job_outcomes", "job_entities", "stages", "attempts", "outbox"} {
			if _, err := tx.ExecContext(ctx, rebind(s.d, `DELETE FROM `+t+` WHERE job_id IN `+in), ids...); err != nil {
				return err
			}
		}
		// The jobs' keys, by their primary key: a pruned job's
		// idempotency key may be used again.
		if _, err := tx.ExecContext(ctx, rebind(s.d, `DELETE FROM job_keys WHERE (tenant, idempotency_key) IN (
				SELECT tenant, idempotency_key FROM jobs WHERE id IN `+in+`)`), ids...); err != nil {
			return err
		}
		res, err := tx.ExecContext(ctx, rebind(s.d, `DELETE FROM jobs WHERE id IN `+in), ids...)
		if err != nil {
			return err
		}
		m, err := res.RowsAffected()
		n = int(m)
		return err
	})
	return n, err
}
