package sqlstore

import (
	"context"
	"errors"
	"time"

	"github.com/kvgate/kvgate/store"
)

// Group commit for Accept and for the end of an attempt (Complete,
// Fail), where the dialect has writable CTEs: one statement writes a
// whole batch from arrays, each call's rows joined by its place in the
// batch (ord). A call the statement could not decide alone (a key taken
// by another call of the same batch, or by a transaction that committed
// while the statement waited on it) is run again on its own afterwards;
// and when the statement fails, which writes nothing, every call is run
// on its own, so that one call's error stays its own.

// Group commit's shape for the calls a client waits for (acceptances, and
// the limiter's writes on PostgreSQL): at most groupSlots batches run at
// once, each of at most groupMax calls. A batch in a slot keeps a server
// process busy; beyond the cores' worth, a further slot only splits the
// calls queued behind the running batches into more, smaller batches,
// each with its own statement, commit and WAL flush, all queueing on the
// same CPUs (and, for a tenant's limiter, on the same row's lock). On two
// cores four slots against two, alternated: 32 clients accepting
// (BenchmarkAccept) 8,178-8,730 against 9,754-12,152 jobs/s, p99 13-14
// against 8 ms; the acceptance test at 1,000 jobs/s with the runner
// working, PostgreSQL's CPU a job about 1.05 ms against 0.99; permits
// under one tenant's concurrency cap (BenchPermits) 402-442 against
// 1,054-1,108 pairs/s. One slot did no better than two.
const (
	groupSlots = 2
	groupMax   = 64
)

var acceptBatch = `WITH input AS (
		SELECT * FROM unnest(?::text[], ?::text[], ?::text[], ?::text[], ?::text[], ?::text[], ?::bytea[], ?::bytea[],
			?::integer[], ?::integer[], ?::integer[], ?::bigint[], ?::bigint[], ?::text[])
			WITH ORDINALITY AS t(id, tenant, idempotency_key, request_hash, endpoint, model, body, metadata,
				priority, token_estimate, max_attempts, deadline_at, now, event_id, ord)),
	taken AS (
		INSERT INTO job_keys (tenant, idempotency_key, id)
		SELECT tenant, idempotency_key, id FROM input ORDER BY tenant, idempotency_key, ord -- one lock order for every batch
		ON CONFLICT (tenant, idempotency_key) DO NOTHING
		RETURNING id),
	ins AS (
		INSERT INTO jobs (` + newJobColumns + `)
		SELECT input.id, tenant, idempotency_key, request_hash, endpoint, model, body, metadata, priority, token_estimate,
			'READY', 1, 0, max_attempts, 0, 0, now, deadline_at, now, now, '', ''
		FROM input JOIN taken ON taken.id = input.id
		RETURNING ` + jobColumns + `),
	` + eventsCTE("job.accepted", `INSERT INTO outbox (id, job_id, tenant, type, state, state_version, created_at)
		SELECT input.event_id, ins.id, ins.tenant, 'job.accepted', ins.state, ins.state_version, ins.created_at
		FROM ins JOIN input ON input.id = ins.id ORDER BY input.ord`) + `
	SELECT ` + jobColumns + `, TRUE FROM ins
	UNION ALL
	SELECT ` + jobsColumns + `, FALSE
	FROM input JOIN job_keys k ON k.tenant = input.tenant AND k.idempotency_key = input.idempotency_key JOIN jobs ON jobs.id = k.id
	WHERE NOT EXISTS (SELECT 1 FROM ins WHERE ins.tenant = input.tenant AND ins.idempotency_key = input.idempotency_key)`

// acceptCall is one Accept in a batch, with its outcome.
type acceptCall struct {
	n       store.NewJob
	job     store.Job
	created bool
	err     error
}

// acceptGroup runs a batch of Accepts.
func (s *Store) acceptGroup(ctx context.Context, cs []*acceptCall) {
	if len(cs) == 1 {
		c := cs[0]
		c.job, c.created, c.err = s.acceptOne(ctx, c.n)
		return
	}
	cols := struct {
		id, tenant, key, hash, endpoint, model, event []string
		body, meta                                    [][]byte
		priority, tokens, attempts                    []int32
		deadline, now                                 []int64
	}{}
	for _, c := range cs {
		n := c.n
		cols.id, cols.tenant, cols.key = append(cols.id, n.ID), append(cols.tenant, n.Tenant), append(cols.key, n.IdempotencyKey)
		cols.hash, cols.endpoint, cols.model = append(cols.hash, n.RequestHash), append(cols.endpoint, n.Endpoint), append(cols.model, n.Model)
		cols.body, cols.meta = append(cols.body, []byte(n.Body)), append(cols.meta, []byte(n.Metadata))
		cols.priority, cols.tokens = append(cols.priority, int32(n.Priority)), append(cols.tokens, int32(n.TokenEstimate))
		cols.attempts = append(cols.attempts, int32(max(n.MaxAttempts, 1)))
		cols.deadline, cols.now = append(cols.deadline, micros(n.Deadline)), append(cols.now, micros(n.Now))
		cols.event = append(cols.event, eventID(n.EventID))
	}
	err := func() error {
		rows, err := s.query(ctx, nil, s.q.acceptBatch, cols.id, cols.tenant, cols.key, cols.hash, cols.endpoint, cols.model,
			cols.body, cols.meta, cols.priority, cols.tokens, cols.attempts, cols.deadline, cols.now, cols.event)
		if err != nil {
			return err
		}
		defer rows.Close()
		created := map[string]store.Job{}     // by job id
		existing := map[[2]string]store.Job{} // by tenant and key
		for rows.Next() {
			var isNew bool
			j, err := scanJob(rows, &isNew)
			if err != nil {
				return err
			}
			if isNew {
				created[j.ID] = j
			} else {
				existing[[2]string{j.Tenant, j.IdempotencyKey}] = j
			}
		}
		if err := rows.Err(); err != nil {
			return err
		}
		rows.Close() // committed: the calls left over may look again
		for _, c := range cs {
			if j, ok := created[c.n.ID]; ok && j.Tenant == c.n.Tenant && j.IdempotencyKey == c.n.IdempotencyKey {
				c.job, c.created = j, true
				continue
			}
			j, ok := existing[[2]string{c.n.Tenant, c.n.IdempotencyKey}]
			switch {
			case !ok:
				c.job, c.created, c.err = s.acceptOne(ctx, c.n)
			case j.RequestHash != c.n.RequestHash:
				c.err = store.ErrConflict
			default:
				c.job = j
			}
		}
		return nil
	}()
	switch {
	case err == nil:
	case s.lostTouch(err):
		for _, c := range cs {
			c.err = s.err("accept job", err)
		}
	default:
		// Nothing was written: each call on its own.
		for _, c := range cs {
			c.job, c.created, c.err = s.acceptOne(ctx, c.n)
		}
	}
}

// finishGroup runs a batch of attempt ends (ownership.go's finishBatch);
// one end is a batch of one.
func (s *Store) finishGroup(ctx context.Context, cs []*end) {
	run := func(cs []*end) error {
		var (
			ids, states, classes, errs, backends, outcomes, events []string
			spent, sent                                            []bool
			fences, nows, avails, starts, ends                     []int64
			results                                                [][]byte
			attempts, prompts, completions, days                   []int32
			charges                                                [10][]int64 // ledgerChange.columns
		)
		for _, c := range cs {
			day, d := 0, ledgerChange{}
			if c.a.Charge != nil {
				var ok bool
				if d, ok = chargedChange(*c.a.Charge); ok {
					day = store.DayOf(c.now)
				}
			}
			days = append(days, int32(day))
			for i, v := range d.columns() {
				charges[i] = append(charges[i], v)
			}
			ids, fences, states = append(ids, c.id), append(fences, c.fence), append(states, string(c.state))
			spent, sent = append(spent, c.a.Spent), append(sent, c.a.Sent)
			nows, avails, results = append(nows, micros(c.now)), append(avails, micros(c.avail)), append(results, c.result)
			classes, errs = append(classes, c.a.ErrorClass), append(errs, c.a.Error)
			attempts, backends, outcomes = append(attempts, int32(c.a.Attempt)), append(backends, c.a.Backend), append(outcomes, c.a.Outcome)
			prompts, completions = append(prompts, int32(c.a.PromptTokens)), append(completions, int32(c.a.CompletionTokens))
			starts, ends = append(starts, micros(c.a.StartedAt)), append(ends, micros(c.a.EndedAt))
			events = append(events, eventID(c.eventID))
		}
		args := []any{ids, fences, states, spent, sent, nows, avails, results, classes, errs,
			attempts, backends, outcomes, prompts, completions, starts, ends, events, days}
		for _, c := range charges {
			args = append(args, c)
		}
		rows, err := s.query(ctx, nil, s.q.finishBatch, append(args, ids)...)
		if err != nil {
			return err
		}
		defer rows.Close()
		ok := make([]bool, len(cs))
		for rows.Next() {
			var ord int
			if err := rows.Scan(&ord); err != nil {
				return err
			}
			if ord < 1 || ord > len(cs) {
				return errors.New("finish batch: row out of range")
			}
			ok[ord-1] = true
		}
		if err := rows.Err(); err != nil {
			return err
		}
		for i, c := range cs {
			if !ok[i] {
				c.err = store.ErrLeaseLost
			}
		}
		return nil
	}
	err := run(cs)
	switch {
	case err == nil:
	case len(cs) == 1 || s.lostTouch(err):
		for _, c := range cs {
			c.err = s.err(c.op, err)
		}
	default:
		// Nothing was written: each call on its own, so that one call's
		// error stays its own.
		for _, c := range cs {
			if err := run([]*end{c}); err != nil {
				c.err = s.err(c.op, err)
			}
		}
	}
}

// renewCall is one Heartbeat or MarkSent (mark, with its reservation).
type renewCall struct {
	op, id     string
	fence      int64
	now, until time.Time
	mark       bool
	reserved   *store.Charge
	err        error
}

// renewGroup runs a batch of lease renewals (ownership.go's renewBatch),
// each under its own fence: a call whose claim no longer owns its job
// gets ErrLeaseLost and changes nothing, the others land.
func (s *Store) renewGroup(ctx context.Context, cs []*renewCall) {
	run := func(cs []*renewCall) error {
		n := len(cs)
		ids, fences, nows, untils, marks := make([]string, n), make([]int64, n), make([]int64, n), make([]int64, n), make([]bool, n)
		tokens, costs := make([]int64, n), make([]int64, n)
		for i, c := range cs {
			ids[i], fences[i], nows[i], untils[i], marks[i] = c.id, c.fence, micros(c.now), micros(c.until), c.mark
			tokens[i] = -1
			if c.reserved != nil {
				tokens[i], costs[i] = c.reserved.Reserved()
			}
		}
		ok, err := s.batchOrds(ctx, s.q.renewBatch, n, ids, fences, nows, untils, marks, tokens, costs, ids)
		if err != nil {
			return err
		}
		for i, c := range cs {
			if !ok[i] {
				c.err = store.ErrLeaseLost
			}
		}
		return nil
	}
	// A job's row is updated once per statement: a second call for the
	// same job goes in a batch of its own.
	seen := map[string]bool{}
	var first, again []*renewCall
	for _, c := range cs {
		if seen[c.id] {
			again = append(again, c)
			continue
		}
		seen[c.id] = true
		first = append(first, c)
	}
	runEach(s, first, run, func(c *renewCall, err error) { c.err = s.err(c.op, err) })
	for _, c := range again {
		runEach(s, []*renewCall{c}, run, func(c *renewCall, err error) { c.err = s.err(c.op, err) })
	}
}

// stageCall is one SaveStage in a batch; saved says its row was written
// (else the stage existed, or the claim lost its job: SaveStage asks).
type stageCall struct {
	op, id, stage string
	fence         int64
	data          []byte
	now           time.Time
	saved         bool
	err           error
}

// stageGroup runs a batch of stage checkpoints (ownership.go's
// saveStageBatch), each written only while its claim owns the job.
func (s *Store) stageGroup(ctx context.Context, cs []*stageCall) {
	run := func(cs []*stageCall) error {
		ids, fences, stages, data, nows := make([]string, len(cs)), make([]int64, len(cs)), make([]string, len(cs)),
			make([][]byte, len(cs)), make([]int64, len(cs))
		for i, c := range cs {
			ids[i], fences[i], stages[i], data[i], nows[i] = c.id, c.fence, c.stage, c.data, micros(c.now)
		}
		rows, err := s.query(ctx, nil, s.q.saveStageBatch, ids, fences, stages, data, nows, ids)
		if err != nil {
			return err
		}
		defer rows.Close()
		// A row is the call's whose claim wrote it: the same job and
		// stage under its fence. A stale claim's call for the same stage
		// in the same batch wrote nothing, whichever came first.
		type written struct {
			id, stage string
			fence     int64
		}
		saved := map[written]bool{}
		for rows.Next() {
			var k written
			if err := rows.Scan(&k.id, &k.stage, &k.fence); err != nil {
				return err
			}
			saved[k] = true
		}
		if err := rows.Err(); err != nil {
			return err
		}
		for _, c := range cs {
			// The first call for a stage under a fence wrote it; a second
			// finds it (SaveStage then checks the ownership alone).
			k := written{c.id, c.stage, c.fence}
			c.saved, saved[k] = saved[k], false
		}
		return nil
	}
	runEach(s, cs, run, func(c *stageCall, err error) { c.err = s.err(c.op, err) })
}

// batchOrds runs a batch statement that returns the 1-based places (ord)
// of the calls it wrote, and says which those are.
func (s *Store) batchOrds(ctx context.Context, q string, n int, args ...any) ([]bool, error) {
	rows, err := s.query(ctx, nil, q, args...)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	ok := make([]bool, n)
	for rows.Next() {
		var ord int
		if err := rows.Scan(&ord); err != nil {
			return nil, err
		}
		if ord < 1 || ord > n {
			return nil, errors.New("batch: row out of range")
		}
		ok[ord-1] = true
	}
	return ok, rows.Err()
}

// runEach runs a batch; when its statement fails, which writes nothing,
// each call is run on its own, so that one call's error stays its own,
// unless the error concerns every call alike (lostTouch).
func runEach[C any](s *Store, cs []*C, run func([]*C) error, fail func(*C, error)) {
	if len(cs) == 0 {
		return
	}
	err := run(cs)
	switch {
	case err == nil:
	case len(cs) == 1 || s.lostTouch(err):
		for _, c := range cs {
			fail(c, err)
		}
	default:
		for _, c := range cs {
			if err := run([]*C{c}); err != nil {
				fail(c, err)
			}
		}
	}
}

// lostTouch reports whether a batch's error leaves its outcome unknown or
// concerns every call alike (the database out of reach, the calls given
// up): then each call gets the error instead of a second try on its own.
func (s *Store) lostTouch(err error) bool {
	return errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) ||
		errors.Is(err, store.ErrUnavailable) || (s.d.Unavailable != nil && s.d.Unavailable(err))
}
