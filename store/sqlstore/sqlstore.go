package sqlstore

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"github.com/google/uuid"

	"github.com/kvgate/kvgate/store"
)

// Dialect is what differs between the SQL backends.
type Dialect struct {
	Name string
	// Positional renders the nth (1-based) placeholder: "$1" or "?".
	Positional func(n int) string
	// LockRunnable is appended to the claim's candidate query: "FOR
	// UPDATE SKIP LOCKED" where several claimers may race, "" where the
	// database serialises writers.
	LockRunnable string
	// Unavailable reports whether a driver error means the database could
	// not be reached, so nothing was written.
	Unavailable func(error) bool
	// LockMigrations, run first in the migration transaction, keeps
	// several processes from migrating at once ("" where the database
	// serialises writers anyway).
	LockMigrations string
	// LockFeed, run first in MarkPublished's transaction, makes feed
	// places follow commit order where several relays may mark at once
	// ("" where the database serialises writers anyway).
	LockFeed string
	// WritableCTE says the database runs INSERT and UPDATE inside WITH
	// (PostgreSQL). Accept, Claim, Complete and Fail then write the job,
	// its attempt record and its events in one statement: one round trip
	// and one implicit transaction instead of BEGIN, two to four
	// statements and COMMIT, each a round trip. Without it (SQLite, where
	// a round trip is a function call) they run as explicit transactions.
	WritableCTE bool
	// LockShared is appended to a read of the job row that a write
	// depends on: "FOR SHARE" where a concurrent update must be waited
	// for and seen, "" where the database serialises writers.
	LockShared string
	// TryPruneTenant renders the condition that takes the listing key of
	// the tenant named by expression t exclusively, without waiting
	// (true when taken), for the reaper's prune of job_tenants (fair.go);
	// nil where the database serialises writers, so that no listing can
	// be in flight during a prune.
	TryPruneTenant func(t string) string
	// ModelIn renders the condition that column col is one of a list of
	// models, or that the list is empty; it takes ModelsArg's value twice.
	ModelIn   func(col string) string
	ModelsArg func(models []string) any
	// HasTable counts the tables named by its one argument that the
	// store's queries reach (0 or 1).
	HasTable string
}

// Store is store.Store over a *sql.DB.
type Store struct {
	db *sql.DB
	d  Dialect
	q  queries

	// Statements prepared once, before the first operation: parsing and
	// planning the claim's UPDATE ... RETURNING on every call would cost
	// more than running it, and inside a write transaction that time holds
	// the write lock. They are prepared before any transaction begins: a
	// preparation needs a connection of its own, and with every
	// connection held by a transaction waiting on it, none would come.
	mu       sync.Mutex
	prepared atomic.Bool // set once stmts holds every static statement
	stmts    map[string]*sql.Stmt

	// Group commit, where the dialect has writable CTEs (else nil).
	accepts  *group[acceptCall]
	finishes *group[end]
	renews   *group[renewCall]
	stages   *group[stageCall]
	quotas   *group[quotaCall] // every dialect: quotabatch.go
	behind   *group[quotaCall] // the calls no request waits for: quotabatch.go
	// quotaWait bounds a limiter call's wait for its batch [quotaWait;
	// tests shorten it].
	quotaWait time.Duration
	// batchLinesBytes ends a page of BatchLines once its results hold this
	// many bytes [batchLinesBytes], so that a finalization's memory does
	// not grow with the size of the lines' results.
	batchLinesBytes int

	fair fairList // the fair claim's copy of the listing (fair.go)
}

// New returns a store over db, whose schema is already migrated.
func New(db *sql.DB, d Dialect) *Store {
	s := &Store{db: db, d: d, stmts: map[string]*sql.Stmt{}, quotaWait: quotaWait, batchLinesBytes: batchLinesBytes}
	s.q = buildQueries(d)
	s.quotas = newGroup(quotaSlots(d), groupMax, s.quotaGroup)
	s.behind = newGroup(quotaSlots(d), groupMax, s.quotaGroup)
	s.behind.linger = behindLinger
	s.quotas.abandoned, s.behind.abandoned = s.undoAcquire, s.undoAcquire
	if d.WritableCTE {
		s.accepts = newGroup(groupSlots, groupMax, s.acceptGroup)
		s.finishes = newGroup(workerSlots, workerMax, s.finishGroup)
		s.finishes.linger = finishLinger
		s.renews = newGroup(workerSlots, workerMax, s.renewGroup)
		s.stages = newGroup(workerSlots, workerMax, s.stageGroup)
	}
	return s
}

// ready prepares the static statements, once; every operation calls it
// before it takes a connection. It fails, to be tried again, while the
// schema is missing.
func (s *Store) ready(ctx context.Context) error {
	if s.prepared.Load() {
		return nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.prepared.Load() {
		return nil
	}
	v := reflect.ValueOf(s.q)
	for i := range v.NumField() {
		q := v.Field(i).String()
		if q == "" { // a form this dialect does not use
			continue
		}
		if _, ok := s.stmts[q]; ok {
			continue
		}
		st, err := s.db.PrepareContext(ctx, q)
		if err != nil {
			return s.err("prepare statements", err)
		}
		s.stmts[q] = st
	}
	s.prepared.Store(true)
	return nil
}

// stmt returns q prepared (bound to tx when tx is not nil). A query that
// was not prepared up front is prepared on tx's own connection (closed
// with tx), never on a new one; without tx it is not prepared at all
// (nil): the caller runs it on the pool, as a statement prepared for one
// call outside a transaction would never be closed (a driver statement
// kept on each connection, for every call).
func (s *Store) stmt(ctx context.Context, tx *sql.Tx, q string) (*sql.Stmt, error) {
	s.mu.Lock()
	st, ok := s.stmts[q]
	s.mu.Unlock()
	switch {
	case ok && tx != nil:
		return tx.StmtContext(ctx, st), nil
	case ok:
		return st, nil
	case tx != nil:
		return tx.PrepareContext(ctx, q)
	}
	return nil, nil
}

func (s *Store) exec(ctx context.Context, tx *sql.Tx, q string, args ...any) (sql.Result, error) {
	if err := s.ready(ctx); err != nil {
		return nil, err
	}
	st, err := s.stmt(ctx, tx, q)
	switch {
	case err != nil:
		return nil, err
	case st == nil:
		return s.db.ExecContext(ctx, q, args...)
	}
	return st.ExecContext(ctx, args...)
}

func (s *Store) query(ctx context.Context, tx *sql.Tx, q string, args ...any) (*sql.Rows, error) {
	if err := s.ready(ctx); err != nil {
		return nil, err
	}
	st, err := s.stmt(ctx, tx, q)
	switch {
	case err != nil:
		return nil, err
	case st == nil:
		return s.db.QueryContext(ctx, q, args...)
	}
	return st.QueryContext(ctx, args...)
}

// scanTexts reads a query's rows of one text column, closing them; err is
// the query's own, returned as it is.
func scanTexts(rows *sql.Rows, err error) ([]string, error) {
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []string
	for rows.Next() {
		var v string
		if err := rows.Scan(&v); err != nil {
			return nil, err
		}
		out = append(out, v)
	}
	return out, rows.Err()
}

// queryRow is QueryRowContext on q prepared; a preparation error comes
// back from Scan.
func (s *Store) queryRow(ctx context.Context, tx *sql.Tx, q string, args ...any) scanner {
	if err := s.ready(ctx); err != nil {
		return errRow{err}
	}
	st, err := s.stmt(ctx, tx, q)
	switch {
	case err != nil:
		return errRow{err}
	case st == nil:
		return s.db.QueryRowContext(ctx, q, args...)
	}
	return st.QueryRowContext(ctx, args...)
}

type errRow struct{ err error }

func (r errRow) Scan(...any) error { return r.err }

// storedText makes s storable in a text column of every dialect: a
// backend's or a webhook receiver's bytes, quoted in an error or kept as
// a response body, may hold a NUL or invalid UTF-8, which PostgreSQL
// refuses, failing the whole statement that carries them (a batch of
// other callers' writes with it). Each is replaced by U+FFFD.
func storedText(s string) string {
	if utf8.ValidString(s) && strings.IndexByte(s, 0) < 0 {
		return s
	}
	return strings.ReplaceAll(strings.ToValidUTF8(s, "\uFFFD"), "\x00", "\uFFFD")
}

// DB returns the underlying database.
func (s *Store) DB() *sql.DB { return s.db }

// Close closes the prepared statements and the database.
func (s *Store) Close() error {
	s.mu.Lock()
	for _, st := range s.stmts {
		_ = st.Close()
	}
	clear(s.stmts)
	s.mu.Unlock()
	return s.db.Close()
}

var _ store.Store = (*Store)(nil)

// rebind turns ? placeholders into the dialect's. Statements are built
// from a fixed set of texts, so each text is rewritten once per dialect
// and kept (rewriting on every call cost a request's quota permit more
// than some of its statements). Texts with lists of varying length are
// kept up to a bound.
func rebind(d Dialect, q string) string {
	k := rebound{d.Name, q}
	if r, ok := rebinds.Load(k); ok {
		return r.(string)
	}
	r := rebindText(d, q)
	if reboundN.Add(1) <= maxRebound { // a few texts vary (IN lists): bounded
		rebinds.Store(k, r)
	}
	return r
}

type rebound struct{ dialect, q string }

const maxRebound = 4096

var (
	rebinds  sync.Map // rebound → string
	reboundN atomic.Int64
)

func rebindText(d Dialect, q string) string {
	var sb strings.Builder
	n := 0
	for _, c := range q {
		if c == '?' {
			n++
			sb.WriteString(d.Positional(n))
			continue
		}
		sb.WriteRune(c)
	}
	return sb.String()
}

// newJobColumns are the columns an acceptance writes (the rest keep their
// defaults); jobColumns those a job is read with (scanJob).
const (
	newJobColumns = `id, tenant, idempotency_key, request_hash, endpoint, model, body, metadata, priority, token_estimate,
	state, state_version, attempt, max_attempts, fence, lease_until, available_at, deadline_at, created_at, updated_at,
	error_class, last_error`
	jobColumns = newJobColumns + `, replay_fence`
)

type queries struct {
	insertKey, insertJob, selectByKey, selectJob, insertAttempt, insertEvent,
	cancel, result, attempts, stage, unpublished, markPublished, markPlaced, feedUnpublished,
	feedHead, events, eventsOfJob, countEvents, insertInbox, selectInbox string
	// Ownership (ownership.go).
	anyRunnable, heartbeat, markSent, ownedBy, saveStage, finish, reapLock, reapLeases, reapDeadlines string
	// The fair claim's listing (fair.go).
	fairList, fairFresh string
	// One-statement forms, where the dialect has writable CTEs (else "").
	acceptCTE, claimCTE, acceptBatch, finishBatch, renewBatch, saveStageBatch, markPublishedBatch, recordInbox string
	// The inbox's batch (inbox_batch.go).
	recordInboxBatch string
}

// A job's keys (its tenant, idempotency key and id) are in job_keys,
// written once when it is accepted (migration 23): insertKey takes the
// idempotency key, and only the acceptance that took it inserts the job.
// jobByKey reads a job through its keys; listJobs starts a List query
// (the filters complete it per call), newest first through the keys'
// listing index, and listBatch one of a batch's lines, through the
// batch's index (jobs_batch) rather than the tenant's whole listing.
const (
	insertKey = `INSERT INTO job_keys (tenant, idempotency_key, id) VALUES (?, ?, ?)
		ON CONFLICT (tenant, idempotency_key) DO NOTHING`
	fromKeys = ` FROM job_keys k JOIN jobs ON jobs.id = k.id`
)

var (
	jobsColumns = qualified("jobs", jobColumns) // jobColumns qualified by the jobs table
	// listColumns are jobsColumns without the request body, which no
	// listing shows: a page of 1,000 jobs of 8 MiB bodies would be read
	// whole into memory.
	listColumns = qualified("jobs", strings.Replace(jobColumns, "body, metadata", "NULL AS body, metadata", 1))
	listJobs    = `SELECT ` + listColumns + fromKeys + ` WHERE k.tenant = ?`
	listBatch   = `SELECT ` + listColumns + ` FROM jobs WHERE jobs.tenant = ? AND jobs.batch_id = ?`
	jobByKey    = `SELECT ` + jobsColumns + fromKeys + ` WHERE k.tenant = ? AND k.idempotency_key = ?`
)

func buildQueries(d Dialect) queries {
	r := func(q string) string { return rebind(d, q) }
	q := queries{
		insertKey: r(insertKey),
		insertJob: r(`INSERT INTO jobs (` + newJobColumns + `)
			VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)`),
		selectByKey: r(jobByKey),
		selectJob:   r(`SELECT ` + jobColumns + ` FROM jobs WHERE tenant = ? AND id = ?`),
		insertAttempt: r(`INSERT INTO attempts (job_id, attempt, fence, backend, outcome, spent, sent, error_class, error,
				prompt_tokens, completion_tokens, started_at, ended_at)
			VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)`),
		insertEvent: r(eventsStatement(d, "", `INSERT INTO outbox (id, job_id, tenant, type, state, state_version, created_at)
			VALUES (?, ?, ?, ?, ?, ?, ?)`)),
		cancel: r(`UPDATE jobs SET ` + keepSent + `, state = 'CANCELLED', state_version = state_version + 1, updated_at = ?,
				lease_until = 0
			WHERE tenant = ? AND id = ? AND state NOT IN ` + finalStatesSQL() + `
			RETURNING ` + jobColumns + `, sent_tokens, sent_cost`),
		result:   r(`SELECT result FROM jobs WHERE tenant = ? AND id = ?`),
		attempts: r(`SELECT job_id, attempt, fence, backend, outcome, spent, sent, error_class, error, prompt_tokens, completion_tokens, started_at, ended_at FROM attempts WHERE job_id = ? ORDER BY fence, attempt`),
		stage:    r(`SELECT data FROM stages WHERE job_id = ? AND stage = ?`),
		// The placed events first (an empty index but in a broker's
		// outage), then the others.
		unpublished: r(`SELECT seq, id, job_id, tenant, type, state, state_version, created_at, 0, feed FROM (
				SELECT * FROM (SELECT 0 AS placed, seq, id, job_id, tenant, type, state, state_version, created_at, feed_seq AS feed
					FROM outbox WHERE published_at = ` + placed + ` ORDER BY feed_seq LIMIT ?) p
				UNION ALL
				SELECT * FROM (SELECT 1, seq, id, job_id, tenant, type, state, state_version, created_at, 0
					FROM outbox WHERE published_at = 0 ORDER BY seq LIMIT ?) u) o
			ORDER BY placed, feed, seq`),
		markPublished: r(`UPDATE outbox SET published_at = ?, feed_seq = ? WHERE id = ? AND published_at = 0`),
		markPlaced:    r(`UPDATE outbox SET published_at = ? WHERE id = ? AND published_at = ` + placed),
		feedUnpublished: r(`UPDATE outbox SET published_at = ` + placed + `, feed_seq = CAST(? AS BIGINT) + todo.n
			FROM (SELECT id, row_number() OVER (ORDER BY seq) AS n FROM (
				SELECT id, seq FROM outbox WHERE published_at = 0 ORDER BY seq LIMIT ?) o) todo
			WHERE outbox.id = todo.id`),
		feedHead:    r(`SELECT COALESCE(MAX(feed_seq), 0) FROM outbox WHERE feed_seq IS NOT NULL`),
		events:      r(`SELECT seq, id, job_id, tenant, type, state, state_version, created_at, published_at, feed_seq FROM outbox WHERE tenant = ? AND feed_seq > ? ORDER BY feed_seq LIMIT ?`),
		eventsOfJob: r(`SELECT seq, id, job_id, tenant, type, state, state_version, created_at, published_at, feed_seq FROM outbox WHERE tenant = ? AND job_id = ? AND feed_seq > ? ORDER BY feed_seq LIMIT ?`),
		countEvents: r(`SELECT COUNT(*) FROM (SELECT 1 FROM outbox WHERE tenant = ? AND feed_seq > ? ORDER BY feed_seq LIMIT ?) behind`),
		insertInbox: r(`INSERT INTO inbox (event_id, digest, received_at) VALUES (?, ?, ?) ON CONFLICT (event_id) DO NOTHING`),
		selectInbox: r(`SELECT digest FROM inbox WHERE event_id = ?`),
	}
	ownershipQueries(d, &q)
	inboxBatchQueries(d, &q)
	if d.WritableCTE {
		q.acceptCTE, q.acceptBatch = r(acceptCTE), r(acceptBatch)
		// MarkPublished in one statement: the events not yet published
		// take the places after head in the order given (the first
		// mention of an id counts), under the feed's lock. Each id is
		// looked up through outbox's key on id (the lateral join): as a
		// plain join, the generic plan (a row or two estimated on each
		// side) read the unpublished events and joined each to every
		// id given, the pairs a batch's size squared: 8 of the 11 ms of
		// a relay's batch of 133 in the acceptance test. The update
		// finds its rows through the same key, the primary key since
		// migration 24 (seq has none).
		// An event placed in the feed while the broker was away
		// (FeedUnpublished) keeps its place, and takes none of the new.
		q.markPublishedBatch = r(`WITH input AS (
				SELECT id, min(ord) AS ord FROM unnest(?::text[]) WITH ORDINALITY AS t(id, ord) GROUP BY id),
			todo AS (
				SELECT o.id, o.feed_seq, row_number() OVER (PARTITION BY o.feed_seq IS NULL ORDER BY input.ord) AS n
				FROM input CROSS JOIN LATERAL (
					SELECT id, feed_seq FROM outbox WHERE outbox.id = input.id AND outbox.published_at IN (0, ` + placed + `)) o)
			UPDATE outbox SET published_at = ?, feed_seq = COALESCE(todo.feed_seq, ?::bigint + todo.n) FROM todo WHERE outbox.id = todo.id`)
		// RecordInbox in one statement: the record, or the digest of the
		// one there (a record inserted by a transaction that commits while
		// this one waits is not seen: RecordInbox reads again).
		q.recordInbox = r(`WITH ins AS (
				INSERT INTO inbox (event_id, digest, received_at) VALUES (?, ?, ?) ON CONFLICT (event_id) DO NOTHING RETURNING digest)
			SELECT digest, FALSE FROM ins
			UNION ALL
			SELECT digest, TRUE FROM inbox WHERE event_id = ? AND NOT EXISTS (SELECT 1 FROM ins)`)
	}
	return q
}

func micros(t time.Time) int64 {
	if t.IsZero() {
		return 0
	}
	return t.UnixMicro()
}

func fromMicros(v int64) time.Time {
	if v == 0 {
		return time.Time{}
	}
	return time.UnixMicro(v).UTC()
}

// err turns a driver error into a store error, in one place.
func (s *Store) err(op string, err error) error {
	switch {
	case err == nil:
		return nil
	case errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded):
		return err
	case errors.Is(err, sql.ErrNoRows):
		return store.ErrNotFound
	case s.d.Unavailable != nil && s.d.Unavailable(err):
		// Both in the chain: callers test for ErrUnavailable, and the
		// dialect's Unavailable (lostTouch) for the driver's error.
		return fmt.Errorf("%s: %w: %w", op, store.ErrUnavailable, err)
	}
	return fmt.Errorf("%s: %w: %w", op, store.ErrFailed, err)
}

// forUpdate is the clause that locks a row read for a change to it, where
// the dialect locks rows ("" where writers are serialised anyway).
func (s *Store) forUpdate() string {
	if s.d.LockShared == "" {
		return ""
	}
	return " FOR UPDATE"
}

// tx runs fn in a transaction and commits it, or rolls it back on error.
func (s *Store) tx(ctx context.Context, op string, fn func(*sql.Tx) error) error {
	if err := s.ready(ctx); err != nil {
		return err
	}
	tx, err := s.db.BeginTx(ctx, nil)
	if err != nil {
		return s.err(op, err)
	}
	if err := fn(tx); err != nil {
		_ = tx.Rollback()
		if isStoreErr(err) {
			return err
		}
		return s.err(op, err)
	}
	return s.err(op, tx.Commit())
}

func isStoreErr(err error) bool {
	for _, e := range []error{store.ErrNotFound, store.ErrConflict, store.ErrLeaseLost, store.ErrFinal, store.ErrDigestMismatch, store.ErrUnavailable, store.ErrFailed} {
		if errors.Is(err, e) {
			return true
		}
	}
	return false
}

type scanner interface{ Scan(dest ...any) error }

// scanJob scans jobColumns, then any extra columns into extra.
func scanJob(r scanner, extra ...any) (store.Job, error) {
	var j store.Job
	var state string
	var lease, avail, deadline, created, updated int64
	var body, meta []byte
	err := r.Scan(append([]any{&j.ID, &j.Tenant, &j.IdempotencyKey, &j.RequestHash, &j.Endpoint, &j.Model, &body, &meta,
		&j.Priority, &j.TokenEstimate, &state, &j.StateVersion, &j.Attempt, &j.MaxAttempts, &j.Fence,
		&lease, &avail, &deadline, &created, &updated, &j.ErrorClass, &j.LastError, &j.ReplayFence}, extra...)...)
	if err != nil {
		return j, err
	}
	j.State = store.State(state)
	j.Body, j.Metadata = body, meta
	j.LeaseUntil, j.AvailableAt, j.Deadline = fromMicros(lease), fromMicros(avail), fromMicros(deadline)
	j.CreatedAt, j.UpdatedAt = fromMicros(created), fromMicros(updated)
	return j, nil
}

func (s *Store) addEvent(ctx context.Context, tx *sql.Tx, id, jobID, tenant string, st store.State, version int64, now time.Time) error {
	if id == "" {
		id = uuid.Must(uuid.NewV7()).String()
	}
	_, err := s.exec(ctx, tx, s.q.insertEvent, id, jobID, tenant, eventType(st), string(st), version, micros(now))
	return err
}

// Accept implements store.Store. A job that pins a policy or names an
// entity is accepted in a transaction of its own, which writes its
// outcome and entity rows too (outcomes.go, outcomes_entities.go).
func (s *Store) Accept(ctx context.Context, n store.NewJob) (store.Job, bool, error) {
	defer s.fair.note(n.Tenant)
	if s.accepts != nil && n.Outcome == nil && n.Entity == nil {
		c := &acceptCall{n: n}
		if err := s.accepts.do(ctx, c); err != nil {
			return store.Job{}, false, err
		}
		return c.job, c.created, c.err
	}
	var job store.Job
	created := false
	err := s.tx(ctx, "accept job", func(tx *sql.Tx) error {
		var err error
		job, created, err = s.acceptTx(ctx, tx, n)
		return err
	})
	return job, created, err
}

// acceptTx is Accept in a transaction.
func (s *Store) acceptTx(ctx context.Context, tx *sql.Tx, n store.NewJob) (store.Job, bool, error) {
	var job store.Job
	now := micros(n.Now)
	meta := []byte(n.Metadata)
	res, err := s.exec(ctx, tx, s.q.insertKey, n.Tenant, n.IdempotencyKey, n.ID)
	if err != nil {
		return job, false, err
	}
	rows, err := res.RowsAffected()
	if err != nil {
		return job, false, err
	}
	if rows == 1 {
		if _, err := s.exec(ctx, tx, s.q.insertJob, n.ID, n.Tenant, n.IdempotencyKey, n.RequestHash, n.Endpoint, n.Model,
			[]byte(n.Body), meta, n.Priority, n.TokenEstimate, string(store.Ready), 1, 0, max(n.MaxAttempts, 1), 0,
			0, now, micros(n.Deadline), now, now, "", ""); err != nil {
			return job, false, err
		}
	}
	job, err = scanJob(s.queryRow(ctx, tx, s.q.selectByKey, n.Tenant, n.IdempotencyKey))
	if err != nil {
		return job, false, err
	}
	if rows == 0 {
		if job.RequestHash != n.RequestHash {
			return job, false, store.ErrConflict
		}
		return job, false, nil
	}
	if n.Outcome != nil {
		if err := s.pinOutcome(ctx, tx, job, n.Outcome); err != nil {
			return job, false, err
		}
	}
	if n.Entity != nil {
		if err := s.pinEntity(ctx, tx, job, n.Entity); err != nil {
			return job, false, err
		}
	}
	return job, true, s.addEvent(ctx, tx, n.EventID, job.ID, job.Tenant, store.Ready, job.StateVersion, n.Now)
}

// Get implements store.Store.
func (s *Store) Get(ctx context.Context, tenant, id string) (store.Job, error) {
	j, err := scanJob(s.queryRow(ctx, nil, s.q.selectJob, tenant, id))
	return j, s.err("get job", err)
}

// GetByKey implements store.Store.
func (s *Store) GetByKey(ctx context.Context, tenant, key string) (store.Job, error) {
	j, err := scanJob(s.queryRow(ctx, nil, s.q.selectByKey, tenant, key))
	return j, s.err("get job by key", err)
}

// List implements store.Store.
func (s *Store) List(ctx context.Context, tenant string, f store.ListFilter) ([]store.Job, string, error) {
	limit := f.Limit
	if limit <= 0 || limit > 1000 {
		limit = 100
	}
	q, id := listJobs, "k.id"
	args := []any{tenant}
	if f.Batch != "" {
		q, id = listBatch, "jobs.id"
		args = append(args, f.Batch)
	}
	if f.After != "" {
		q += ` AND ` + id + ` < ?`
		args = append(args, f.After)
	}
	if len(f.States) > 0 {
		q += ` AND jobs.state IN (` + strings.TrimSuffix(strings.Repeat("?, ", len(f.States)), ", ") + `)`
		for _, st := range f.States {
			args = append(args, string(st))
		}
	}
	q += ` ORDER BY ` + id + ` DESC LIMIT ?`
	args = append(args, limit+1)
	rows, err := s.db.QueryContext(ctx, rebind(s.d, q), args...)
	if err != nil {
		return nil, "", s.err("list jobs", err)
	}
	defer rows.Close()
	var jobs []store.Job
	for rows.Next() {
		j, err := scanJob(rows)
		if err != nil {
			return nil, "", s.err("list jobs", err)
		}
		jobs = append(jobs, j)
	}
	if err := rows.Err(); err != nil {
		return nil, "", s.err("list jobs", err)
	}
	next := ""
	if len(jobs) > limit {
		jobs = jobs[:limit]
		next = jobs[limit-1].ID
	}
	return jobs, next, nil
}

// Cancel implements store.Store.
func (s *Store) Cancel(ctx context.Context, tenant, id, eventID string, now time.Time) (store.Job, error) {
	var j store.Job
	err := s.tx(ctx, "cancel job", func(tx *sql.Tx) error {
		var (
			err    error
			tokens sql.NullInt64
			cost   int64
		)
		j, err = scanJob(s.queryRow(ctx, tx, s.q.cancel, micros(now), tenant, id), &tokens, &cost)
		if errors.Is(err, sql.ErrNoRows) {
			_, gerr := scanJob(s.queryRow(ctx, tx, s.q.selectJob, tenant, id))
			switch {
			case gerr == nil:
				return store.ErrFinal
			case errors.Is(gerr, sql.ErrNoRows):
				return store.ErrNotFound
			}
			return gerr // the read failed: not an answer about the job
		}
		if err != nil {
			return err
		}
		taken := takenCharges{}
		taken.add(j.Tenant, tokens, cost)
		if err := s.addEvent(ctx, tx, eventID, j.ID, j.Tenant, store.Cancelled, j.StateVersion, now); err != nil {
			return err
		}
		return s.chargeTaken(ctx, tx, taken, now)
	})
	return j, err
}

// Result implements store.Store.
func (s *Store) Result(ctx context.Context, tenant, id string) (json.RawMessage, error) {
	var res []byte
	if err := s.queryRow(ctx, nil, s.q.result, tenant, id).Scan(&res); err != nil {
		return nil, s.err("get result", err)
	}
	if res == nil {
		return nil, store.ErrNotFound
	}
	return res, nil
}

// Attempts implements store.Store.
func (s *Store) Attempts(ctx context.Context, id string) ([]store.Attempt, error) {
	rows, err := s.query(ctx, nil, s.q.attempts, id)
	if err != nil {
		return nil, s.err("list attempts", err)
	}
	defer rows.Close()
	var out []store.Attempt
	for rows.Next() {
		var a store.Attempt
		var started, ended int64
		if err := rows.Scan(&a.JobID, &a.Attempt, &a.Fence, &a.Backend, &a.Outcome, &a.Spent, &a.Sent, &a.ErrorClass, &a.Error,
			&a.PromptTokens, &a.CompletionTokens, &started, &ended); err != nil {
			return nil, s.err("list attempts", err)
		}
		a.StartedAt, a.EndedAt = fromMicros(started), fromMicros(ended)
		out = append(out, a)
	}
	return out, s.err("list attempts", rows.Err())
}

// Stage implements store.Store.
func (s *Store) Stage(ctx context.Context, id, stage string) ([]byte, error) {
	var data []byte
	err := s.queryRow(ctx, nil, s.q.stage, id, stage).Scan(&data)
	return data, s.err("get stage "+stage, err)
}

func scanEvents(rows *sql.Rows) ([]store.Event, error) {
	defer rows.Close()
	var out []store.Event
	for rows.Next() {
		var e store.Event
		var st string
		var created, published int64
		if err := rows.Scan(&e.Seq, &e.ID, &e.JobID, &e.Tenant, &e.Type, &st, &e.StateVersion, &created, &published, &e.Cursor); err != nil {
			return nil, err
		}
		e.State, e.CreatedAt, e.PublishedAt = store.State(st), fromMicros(created), fromMicros(max(published, 0))
		out = append(out, e)
	}
	return out, rows.Err()
}

// Unpublished implements store.Store.
func (s *Store) Unpublished(ctx context.Context, limit int) ([]store.Event, error) {
	rows, err := s.query(ctx, nil, s.q.unpublished, limit, limit)
	if err != nil {
		return nil, s.err("list unpublished events", err)
	}
	evs, err := scanEvents(rows)
	return evs[:min(len(evs), limit)], s.err("list unpublished events", err)
}

// placed is the published_at of an event placed in the feed while the
// broker was away (FeedUnpublished): not published yet, but read.
const placed = "-1"

// FeedUnpublished implements store.Store.
func (s *Store) FeedUnpublished(ctx context.Context, limit int) (int, error) {
	n := 0
	err := s.tx(ctx, "place unpublished events", func(tx *sql.Tx) error {
		head, err := s.lockFeedHead(ctx, tx)
		if err != nil {
			return err
		}
		res, err := s.exec(ctx, tx, s.q.feedUnpublished, head, limit)
		if err != nil {
			return err
		}
		m, err := res.RowsAffected()
		n = int(m)
		return err
	})
	return n, err
}

// lockFeedHead takes the feed's lock and returns its last place.
func (s *Store) lockFeedHead(ctx context.Context, tx *sql.Tx) (int64, error) {
	if s.d.LockFeed != "" {
		if _, err := tx.ExecContext(ctx, s.d.LockFeed); err != nil {
			return 0, err
		}
	}
	var head int64
	err := s.queryRow(ctx, tx, s.q.feedHead).Scan(&head)
	return head, err
}

// MarkPublished implements store.Store. The events get the next feed
// places in the order given; an event published before keeps its place.
func (s *Store) MarkPublished(ctx context.Context, ids []string, at time.Time) error {
	return s.tx(ctx, "mark events published", func(tx *sql.Tx) error {
		head, err := s.lockFeedHead(ctx, tx)
		if err != nil {
			return err
		}
		if s.q.markPublishedBatch != "" {
			_, err := s.exec(ctx, tx, s.q.markPublishedBatch, ids, micros(at), head)
			return err
		}
		for _, id := range ids {
			res, err := s.exec(ctx, tx, s.q.markPlaced, micros(at), id)
			if err != nil {
				return err
			}
			if n, err := res.RowsAffected(); err != nil {
				return err
			} else if n == 1 {
				continue // placed before: its place kept
			}
			res, err = s.exec(ctx, tx, s.q.markPublished, micros(at), head+1, id)
			if err != nil {
				return err
			}
			if n, err := res.RowsAffected(); err != nil {
				return err
			} else if n == 1 {
				head++
			}
		}
		return nil
	})
}

// Events implements store.Store.
func (s *Store) Events(ctx context.Context, tenant, jobID string, after int64, limit int) ([]store.Event, error) {
	var rows *sql.Rows
	var err error
	if jobID != "" {
		rows, err = s.query(ctx, nil, s.q.eventsOfJob, tenant, jobID, after, limit)
	} else {
		rows, err = s.query(ctx, nil, s.q.events, tenant, after, limit)
	}
	if err != nil {
		return nil, s.err("list events", err)
	}
	evs, err := scanEvents(rows)
	return evs, s.err("list events", err)
}

// CountEvents implements store.Store.
func (s *Store) CountEvents(ctx context.Context, tenant string, after int64, limit int) (int, error) {
	var n int
	err := s.queryRow(ctx, nil, s.q.countEvents, tenant, after, limit).Scan(&n)
	return n, s.err("count events", err)
}

// RecordInbox implements store.Store.
func (s *Store) RecordInbox(ctx context.Context, eventID, digest string, now time.Time) (bool, error) {
	if s.q.recordInbox != "" {
		var have string
		var dup bool
		err := s.queryRow(ctx, nil, s.q.recordInbox, eventID, digest, micros(now), eventID).Scan(&have, &dup)
		if errors.Is(err, sql.ErrNoRows) {
			dup = true
			err = s.queryRow(ctx, nil, s.q.selectInbox, eventID).Scan(&have)
		}
		switch {
		case err != nil:
			return false, s.err("record inbox event", err)
		case dup && have != digest:
			return true, store.ErrDigestMismatch
		}
		return dup, nil
	}
	dup := false
	err := s.tx(ctx, "record inbox event", func(tx *sql.Tx) error {
		res, err := s.exec(ctx, tx, s.q.insertInbox, eventID, digest, micros(now))
		if err != nil {
			return err
		}
		if n, err := res.RowsAffected(); err != nil || n == 1 {
			return err
		}
		dup = true
		var have string
		if err := s.queryRow(ctx, tx, s.q.selectInbox, eventID).Scan(&have); err != nil {
			return err
		}
		if have != digest {
			return store.ErrDigestMismatch
		}
		return nil
	})
	return dup, err
}
