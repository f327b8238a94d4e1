package sqlstore

import (
	"cmp"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/google/uuid"

	"github.com/kvgate/kvgate/store"
)

// Ownership of a job: who may change a claimed job, and what becomes of
// it when an attempt ends. Every statement that claims a job, renews or
// uses a claim (heartbeat, sent mark, stage checkpoint), ends an attempt
// (complete, fail, single or batched) or takes an expired claim away
// (reap) is built here, from the three conditions below, each written
// once:
//
//   - runnable: a job a claim may take;
//   - owned: the claim under a fence still owns the job at a time;
//   - nextState: where the end of an attempt leaves the job: the one
//     retry-or-terminal rule, applied by Fail and Reap alike.
//
// An attempt counts (the job's attempt column +1) only when it ends
// having spent: a completion, a failure of a request that reached a
// backend, an invalid input, or a lease lost after the claim marked its
// request sent. A claim that waited or was interrupted ends without
// spending, and the job is retried while its deadline allows.

// owned is the condition that the claim under fence owns job row t at
// now: the job is RUNNING under that fence and its lease has not expired.
func owned(t, fence, now string) string {
	return t + ".state = 'RUNNING' AND " + t + ".fence = " + fence + " AND " + t + ".lease_until > " + now
}

// runnable is the condition that a claim at now may take job row t.
func runnable(t, now string) string {
	return t + ".state IN ('READY', 'RETRY_SCHEDULED') AND " + t + ".available_at <= " + now + " AND " + t + ".deadline_at > " + now
}

// nextState is the state an attempt's end leaves job row t in, given the
// state the worker asks for (SUCCEEDED, REVIEW_REQUIRED, FAILED_TERMINAL
// or RETRY_SCHEDULED), whether the attempt spent, and when a retry would
// run: a retry becomes FAILED_TERMINAL when the attempt spent the job's
// last one, or when it would run at or after the deadline. Expressions
// are evaluated on the row before the update.
func nextState(t, state, spent, retryAt string) string {
	return "CASE WHEN " + state + " <> 'RETRY_SCHEDULED' THEN " + state +
		" WHEN " + spent + " AND " + t + ".attempt + 1 >= " + t + ".max_attempts THEN 'FAILED_TERMINAL'" +
		" WHEN " + retryAt + " >= " + t + ".deadline_at THEN 'FAILED_TERMINAL'" +
		" ELSE 'RETRY_SCHEDULED' END"
}

// endedClass is the error class an attempt's end records: a retry that
// spent nothing and that the deadline forbids ends the job as
// deadline_exceeded, which no attempt of its own caused.
func endedClass(t, state, spent, retryAt, class string) string {
	return "CASE WHEN NOT " + spent + " AND " + state + " = 'RETRY_SCHEDULED' AND " + retryAt + " >= " + t + ".deadline_at" +
		" THEN 'deadline_exceeded' ELSE " + class + " END"
}

// spentAttempts is the attempt counter after an end that spent or not.
func spentAttempts(t, spent string) string {
	return t + ".attempt + CASE WHEN " + spent + " THEN 1 ELSE 0 END"
}

// eventTypes names the events whose type is not "job." + the lowercase
// state; eventType and eventTypeSQL render this one table.
var eventTypes = map[store.State]string{store.Ready: "job.accepted", store.FailedTerminal: "job.dead_lettered"}

// eventType names the event that reports a job entering st.
func eventType(st store.State) string {
	if t, ok := eventTypes[st]; ok {
		return t
	}
	return "job." + strings.ToLower(string(st))
}

// eventTypeSQL is eventType in SQL, of a state column.
func eventTypeSQL(col string) string {
	var b strings.Builder
	b.WriteString("CASE " + col)
	for _, st := range slices.Sorted(func(yield func(store.State) bool) {
		for st := range eventTypes {
			if !yield(st) {
				return
			}
		}
	}) {
		fmt.Fprintf(&b, " WHEN '%s' THEN '%s'", st, eventTypes[st])
	}
	b.WriteString(" ELSE 'job.' || lower(" + col + ") END")
	return b.String()
}

// deadlineIndexed is the condition, true of every job, that the reaper's
// index of runnable jobs' deadlines (jobs_runnable_deadline, migration 19)
// adds to its predicate: the reaper's deadline pass states it and so may
// use the index, a claim does not and so never reads that index (stale
// statistics once made it the claims' choice).
const deadlineIndexed = `(deadline_at >= 0 OR deadline_at < 0)`

// claimOrderIndexed is the condition, true of every job, that the index
// of runnable jobs in claim order (jobs_runnable, migration 21) adds to
// its predicate, for job row t: the statements that take or count jobs
// across tenants in claim order state it and so may use the index; a
// fair claim's head probe of one tenant does not, and so walks
// jobs_runnable_tenant (stale statistics had made it filter the whole
// queue's head for its tenant instead).
func claimOrderIndexed(t string) string {
	return "(" + t + ".priority >= 0 OR " + t + ".priority < 0)"
}

// ownershipQueries fills the ownership statements of q.
func ownershipQueries(d Dialect, q *queries) {
	r := func(s string) string { return rebind(d, s) }
	q.fairList, q.fairFresh = r(fairListQuery), r(fairFreshQuery)
	q.anyRunnable = r(`SELECT 1 FROM jobs WHERE ` + runnable("jobs", "?") + ` AND ` + claimOrderIndexed("jobs") + ` AND ` + d.ModelIn("jobs.model") + ` LIMIT 1`)
	q.heartbeat = r(`UPDATE jobs SET lease_until = ? WHERE id = ? AND ` + owned("jobs", "?", "?"))
	q.markSent = r(`UPDATE jobs SET lease_until = ?, sent_fence = fence, sent_tokens = ?, sent_cost = ?, sent_charge_fence = fence
		WHERE id = ? AND ` + owned("jobs", "?", "?"))
	q.ownedBy = r(`SELECT 1 FROM jobs WHERE id = ? AND ` + owned("jobs", "?", "?"))
	// The job row is locked (where the dialect locks rows) so that a reap
	// committing meanwhile is seen: its new fence fails the condition.
	q.saveStage = r(`INSERT INTO stages (job_id, stage, fence, data, created_at)
		SELECT id, ?, fence, ?, ? FROM jobs WHERE id = ? AND ` + owned("jobs", "?", "?") + ` ` + d.LockShared + `
		ON CONFLICT (job_id, stage) DO NOTHING`)
	if d.WritableCTE {
		q.claimCTE, q.finishBatch = r(claimCTE(d)), r(finishBatch)
		// A mark's tokens are -1 without a reservation (NULL in the row).
		q.renewBatch = r(`UPDATE jobs SET lease_until = input.lease_until,
				sent_fence = CASE WHEN input.mark THEN jobs.fence ELSE jobs.sent_fence END,
				sent_tokens = CASE WHEN input.mark THEN NULLIF(input.tokens, -1) ELSE jobs.sent_tokens END,
				sent_cost = CASE WHEN input.mark THEN input.cost ELSE jobs.sent_cost END,
				sent_charge_fence = CASE WHEN input.mark THEN jobs.fence ELSE jobs.sent_charge_fence END
			FROM unnest(?::text[], ?::bigint[], ?::bigint[], ?::bigint[], ?::boolean[], ?::bigint[], ?::bigint[])
				WITH ORDINALITY AS input(id, fence, now, lease_until, mark, tokens, cost, ord)
			WHERE jobs.id = ANY(?::text[]) AND jobs.id = input.id AND ` + owned("jobs", "input.fence", "input.now") + `
			RETURNING input.ord`)
		q.saveStageBatch = r(`INSERT INTO stages (job_id, stage, fence, data, created_at)
			SELECT jobs.id, input.stage, jobs.fence, input.data, input.now
			FROM unnest(?::text[], ?::bigint[], ?::text[], ?::bytea[], ?::bigint[]) WITH ORDINALITY AS input(id, fence, stage, data, now, ord)
			JOIN jobs ON jobs.id = input.id
			WHERE jobs.id = ANY(?::text[]) AND ` + owned("jobs", "input.fence", "input.now") + ` ` + d.LockShared + ` OF jobs
			ON CONFLICT (job_id, stage) DO NOTHING
			RETURNING job_id, stage, fence`)
	} else {
		q.finish = r(finishOne)
	}
	// Expired leases, by the same rule as Fail: the lost attempt spent
	// when its claim had marked the request sent. A job with its
	// inference checkpointed is never ended by it: the next claim
	// finishes from the checkpoint without calling a backend again. Part
	// of it (an embeddings job's batches) is no such job: the next claim
	// calls a backend for the rest.
	lost := "(jobs.sent_fence = jobs.fence)"
	ends := "(" + lost + " AND NOT EXISTS (SELECT 1 FROM stages WHERE stages.job_id = jobs.id AND stages.stage = '" +
		store.StageInference + "'))"
	expired := `SELECT id FROM jobs WHERE state = 'RUNNING' AND lease_until <= ? ORDER BY lease_until LIMIT ? ` + d.LockRunnable
	taken := `id IN (` + expired + `)`
	if d.LockRunnable != "" {
		// Where writers run at once (PostgreSQL), the expired jobs are
		// locked by a statement of their own (reapLock), then ended by
		// one whose snapshot comes after the locks. In a single
		// statement the stage check read the statement's snapshot, older
		// than its lock of the row: a checkpoint that held the row
		// shared, and committed after the reap began but before the reap
		// reached that row, went unseen, and the job could end on its
		// last attempt with its answer checkpointed.
		q.reapLock = r(expired)
		taken = `id = ANY(?::text[]) AND state = 'RUNNING'`
	}
	q.reapLeases = r(`UPDATE jobs SET ` + keepSent + `,
			state = ` + nextState("jobs", "'RETRY_SCHEDULED'", ends, "?") + `,
			attempt = ` + spentAttempts("jobs", lost) + `,
			fence = fence + 1, state_version = state_version + 1, updated_at = ?, lease_until = 0, available_at = ?,
			error_class = ` + endedClass("jobs", "'RETRY_SCHEDULED'", lost, "?", "'lease_expired'") + `,
			last_error = 'the worker stopped renewing its lease'
		WHERE ` + taken + `
		RETURNING id, tenant, state, state_version, attempt, fence, sent_fence = fence - 1, sent_tokens, sent_cost`)
	q.reapDeadlines = r(`UPDATE jobs SET state = 'FAILED_TERMINAL', state_version = state_version + 1, updated_at = ?,
			error_class = 'deadline_exceeded', last_error = 'the deadline passed before the job could run'
		WHERE id IN (SELECT id FROM jobs WHERE state IN ('READY', 'RETRY_SCHEDULED') AND ` + deadlineIndexed + ` AND deadline_at <= ? LIMIT ? ` + d.LockRunnable + `)
		RETURNING id, tenant, state, state_version, attempt, fence, FALSE, NULL, 0`)
}

// claimCTE leases up to limit runnable jobs, fairly across tenants by
// their weights (see fair.go), and writes a job.running event for each,
// in claim order, their ids numbered from the claim's own (claimEventID);
// claimArgs lists its parameters.
//
// The store chooses the tenants and their shares (fair.go's choose);
// each tenant's head is locked through jobs_runnable_tenant, exactly its
// share (LIMIT above FOR UPDATE SKIP LOCKED: claimers racing for the same
// heads each get their own jobs), and what the shares could not fill is
// filled oldest-first (fill), skipping the locked. No job is read that
// the claim does not take, so a claim costs what an oldest-first claim of
// the same size costs, plus one index probe per tenant with a share. The
// statement returns, with each job, how many listed tenants were never
// served, for the store's copy of the listing (fairList's check).
func claimCTE(d Dialect) string {
	run := runnable("jobs", "?") + ` AND ` + d.ModelIn("jobs.model")
	ordered := run + ` AND ` + claimOrderIndexed("jobs")
	return `WITH shares AS (SELECT tenant, n FROM unnest(?::text[], ?::int[]) AS s(tenant, n)),
	fair AS MATERIALIZED (
		SELECT f.id FROM shares s CROSS JOIN LATERAL (
			SELECT id FROM jobs WHERE jobs.tenant = s.tenant AND ` + run + `
			ORDER BY priority, available_at, id LIMIT s.n FOR UPDATE SKIP LOCKED) f),
	fill AS MATERIALIZED (
		SELECT id FROM jobs WHERE ` + ordered + `
			AND id NOT IN (SELECT id FROM fair)
		ORDER BY priority, available_at, id
		LIMIT GREATEST(?::int - (SELECT count(*) FROM fair), 0)
		FOR UPDATE SKIP LOCKED),
	picked AS (
		SELECT id FROM fair UNION ALL SELECT id FROM fill),
	claimed AS (
		UPDATE jobs SET state = 'RUNNING', fence = fence + 1,
			lease_until = ?, state_version = state_version + 1, updated_at = ?
		WHERE jobs.id = ANY(ARRAY(SELECT id FROM picked))
		RETURNING ` + jobColumns + `),
	served AS (
		-- The considered tenants never served, or not for fairRefresh:
		-- rarely any, and none written when the claim took nothing (an
		-- idle poll writes nothing). The tests of the array and of picked
		-- are checked once, so that a claim with no such tenant (the
		-- usual one) skips the update's lookups altogether.
		UPDATE job_tenants SET served_at = ?
		WHERE cardinality(?::text[]) > 0 AND EXISTS (SELECT 1 FROM picked) AND tenant IN (
			SELECT tenant FROM job_tenants WHERE tenant = ANY(?::text[]) AND served_at < ?
			ORDER BY tenant FOR UPDATE SKIP LOCKED)),
	` + eventsCTE("job.running", `INSERT INTO outbox (id, job_id, tenant, type, state, state_version, created_at)
		SELECT `+claimEventID("?::text", "row_number() OVER (ORDER BY priority, available_at, id)")+`,
			id, tenant, 'job.running', state, state_version, ?::bigint
		FROM claimed ORDER BY priority, available_at, id`) + `
	SELECT ` + jobColumns + `, (` + fairFreshQuery + `) FROM claimed`
}

// maxClaim is the most jobs one claim takes on PostgreSQL: the events of
// a claim are numbered in four hex digits (claimEventID).
const maxClaim = 1<<16 - 1

// claimEventID is the SQL expression of the id of a claim's n-th event
// (n from 1, at most maxClaim), given the claim's own UUIDv7 base: the
// base with its last four hex digits replaced by n. The ids stay UUIDv7s,
// distinct within the claim by n and across claims by the base's
// timestamp, sub-millisecond sequence and remaining 46 random bits. A
// claim had sent one new UUID per job it might take, its limit's worth
// whatever it found: generating, encoding and decoding them was a
// twentieth of the acceptance test's process CPU in claims, most of
// which took a few jobs of a limit of tens.
func claimEventID(base, n string) string {
	return "left(" + base + ", 32) || lpad(to_hex(" + n + "), 4, '0')"
}

// claimArgs are claimCTE's parameters, in its order, for the store's
// choice c (fair.go); events is the claim's UUIDv7 base for its events'
// ids (claimEventID).
func claimArgs(now time.Time, lease time.Duration, limit int, m any, events string, c fairChoice) []any {
	t := micros(now)
	return []any{c.tenants, c.shares, // shares
		t, t, m, m, // fair
		t, t, m, m, limit, // fill
		micros(now.Add(lease)), t, // claimed
		t, c.due, c.due, micros(now.Add(-fairRefresh)), // served
		events, t} // ev
}

// finishBatch ends many attempts in one statement, each under its own
// fence: the job's new state, the attempt record and the event, for the
// calls whose claim still owns its job; the others change nothing and
// return no row. One call is a batch of one.
var finishBatch = `WITH input AS (
		SELECT * FROM unnest(?::text[], ?::bigint[], ?::text[], ?::boolean[], ?::boolean[], ?::bigint[], ?::bigint[], ?::bytea[],
			?::text[], ?::text[], ?::integer[], ?::text[], ?::text[], ?::integer[], ?::integer[], ?::bigint[], ?::bigint[], ?::text[],
			?::integer[], ?::bigint[], ?::bigint[], ?::bigint[], ?::bigint[], ?::bigint[], ?::bigint[], ?::bigint[], ?::bigint[],
			?::bigint[], ?::bigint[])
			WITH ORDINALITY AS t(id, fence, state, spent, sent, now, available_at, result, error_class, error,
				attempt, backend, outcome, prompt_tokens, completion_tokens, started_at, ended_at, event_id,
				day, c_requests, c_attempts, c_prompt, c_completion, c_reserved, c_uncertain, c_uncertain_tokens,
				c_cost, c_reserved_cost, c_uncertain_cost, ord)),
	f AS (
		UPDATE jobs SET state = ` + nextState("jobs", "input.state", "input.spent", "input.available_at") + `,
			attempt = ` + spentAttempts("jobs", "input.spent") + `,
			state_version = jobs.state_version + 1, updated_at = input.now,
			lease_until = 0, available_at = input.available_at, result = COALESCE(input.result, jobs.result),
			error_class = ` + endedClass("jobs", "input.state", "input.spent", "input.available_at", "input.error_class") + `,
			last_error = input.error
		FROM input
		WHERE jobs.id = ANY(?::text[]) AND jobs.id = input.id AND ` + owned("jobs", "input.fence", "input.now") + `
		RETURNING jobs.id, jobs.tenant, jobs.state, jobs.state_version, jobs.fence, input.ord),
	a AS (
		INSERT INTO attempts (job_id, attempt, fence, backend, outcome, spent, sent, error_class, error,
			prompt_tokens, completion_tokens, started_at, ended_at)
		SELECT f.id, input.attempt, f.fence, input.backend, input.outcome, input.spent, input.sent, input.error_class, input.error,
			input.prompt_tokens, input.completion_tokens, input.started_at, input.ended_at
		FROM f JOIN input ON input.ord = f.ord),
	` + eventsCTE("", `INSERT INTO outbox (id, job_id, tenant, type, state, state_version, created_at)
		SELECT input.event_id, f.id, f.tenant, `+eventTypeSQL("f.state")+`, f.state, f.state_version, input.now
		FROM f JOIN input ON input.ord = f.ord ORDER BY input.ord`) + `,
	charged AS (` + fmt.Sprintf(ledgerUpsert, `SELECT f.tenant, input.day, sum(c_requests)::bigint,
			sum(c_attempts)::bigint, sum(c_prompt)::bigint, sum(c_completion)::bigint, sum(c_reserved)::bigint,
			sum(c_uncertain)::bigint, sum(c_uncertain_tokens)::bigint, sum(c_cost)::bigint, sum(c_reserved_cost)::bigint,
			sum(c_uncertain_cost)::bigint
		FROM f JOIN input ON input.ord = f.ord WHERE input.day > 0
		GROUP BY f.tenant, input.day ORDER BY f.tenant, input.day`) + `)
	SELECT ord FROM f`

// finishOne is one attempt's end, for a dialect without writable CTEs
// (finishBatch is the same for many, in one statement).
var finishOne = `UPDATE jobs SET state = ` + nextState("jobs", "input.state", "input.spent", "input.available_at") + `,
			attempt = ` + spentAttempts("jobs", "input.spent") + `,
			state_version = jobs.state_version + 1, updated_at = input.now, lease_until = 0,
			available_at = input.available_at, result = COALESCE(input.result, jobs.result),
			error_class = ` + endedClass("jobs", "input.state", "input.spent", "input.available_at", "input.error_class") + `,
			last_error = input.error
		FROM (SELECT ? AS id, ? AS fence, ? AS state, ? AS spent, ? AS now, ? AS available_at, ? AS result,
			? AS error_class, ? AS error) AS input
		WHERE jobs.id = input.id AND ` + owned("jobs", "input.fence", "input.now") + `
		RETURNING jobs.tenant, jobs.state, jobs.state_version`

// Claim implements store.Store, fairly across tenants (fair.go). An idle
// poll finds nothing runnable with one read and takes no write lock.
func (s *Store) Claim(ctx context.Context, now time.Time, lease time.Duration, limit int, models ...string) ([]store.Job, error) {
	if limit <= 0 {
		return nil, nil
	}
	if s.d.WritableCTE {
		return s.claimOne(ctx, now, lease, limit, models)
	}
	m := s.d.ModelsArg(models)
	var one int
	err := s.queryRow(ctx, nil, s.q.anyRunnable, micros(now), micros(now), m, m).Scan(&one)
	if errors.Is(err, sql.ErrNoRows) {
		return nil, nil
	}
	if err != nil {
		return nil, s.err("claim jobs", err)
	}
	var jobs []store.Job
	var c fairChoice
	err = s.tx(ctx, "claim jobs", func(tx *sql.Tx) error {
		var err error
		if jobs, c, err = s.claimFairTx(ctx, tx, now, lease, limit, m); err != nil {
			return err
		}
		sortClaimed(jobs)
		for _, j := range jobs {
			if err := s.addEvent(ctx, tx, "", j.ID, j.Tenant, store.Running, j.StateVersion, now); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	s.fair.served(c, now)
	return jobs, nil
}

// sortClaimed puts claimed jobs in claim order: RETURNING keeps none.
func sortClaimed(jobs []store.Job) {
	slices.SortFunc(jobs, func(a, b store.Job) int {
		return cmp.Or(cmp.Compare(a.Priority, b.Priority), a.AvailableAt.Compare(b.AvailableAt), cmp.Compare(a.ID, b.ID))
	})
}

// claimOne is Claim in one statement. With nothing runnable it changes no
// row, so it takes no row lock and commits nothing to flush: an idle poll
// needs no read first.
func (s *Store) claimOne(ctx context.Context, now time.Time, lease time.Duration, limit int, models []string) ([]store.Job, error) {
	limit = min(limit, maxClaim)
	m := s.d.ModelsArg(models)
	// The lock re-reads a row another claimer changed; availability and
	// the deadline are checked again on the version it locks.
	c, err := s.choose(ctx, nil, now, limit)
	if err != nil {
		return nil, s.err("claim jobs", err)
	}
	rows, err := s.query(ctx, nil, s.q.claimCTE, claimArgs(now, lease, limit, m, uuid.Must(uuid.NewV7()).String(), c)...)
	if err != nil {
		return nil, s.err("claim jobs", err)
	}
	defer rows.Close()
	// A claim often finds fewer jobs than its limit (a runner asks for
	// every free slot): the slice grows with what it takes.
	jobs := make([]store.Job, 0, min(limit, 16))
	var fresh int
	for rows.Next() {
		j, err := scanJob(rows, &fresh)
		if err != nil {
			return nil, s.err("claim jobs", err)
		}
		jobs = append(jobs, j)
	}
	if err := rows.Err(); err != nil {
		return nil, s.err("claim jobs", err)
	}
	if len(jobs) > 0 {
		s.fair.served(c, now)
		s.fair.check(c.fresh, fresh)
	}
	sortClaimed(jobs)
	return jobs, nil
}

// Heartbeat implements store.Store.
func (s *Store) Heartbeat(ctx context.Context, id string, fence int64, now time.Time, lease time.Duration) error {
	return s.renew(ctx, &renewCall{op: "heartbeat", id: id, fence: fence, now: now, until: now.Add(lease)})
}

// MarkSent implements store.Store.
func (s *Store) MarkSent(ctx context.Context, id string, fence int64, now time.Time, lease time.Duration, reserved *store.Charge) error {
	return s.renew(ctx, &renewCall{op: "mark sent", id: id, fence: fence, now: now, until: now.Add(lease), mark: true, reserved: reserved})
}

func (s *Store) renew(ctx context.Context, c *renewCall) error {
	if s.renews != nil {
		if err := s.renews.do(ctx, c); err != nil {
			return err
		}
		return c.err
	}
	q, args := s.q.heartbeat, []any{micros(c.until)}
	if c.mark {
		var tokens, cost any = nil, int64(0)
		if c.reserved != nil {
			tokens, cost = c.reserved.Reserved()
		}
		q, args = s.q.markSent, append(args, tokens, cost)
	}
	res, err := s.exec(ctx, nil, q, append(args, c.id, c.fence, micros(c.now))...)
	if err != nil {
		return s.err(c.op, err)
	}
	if n, err := res.RowsAffected(); err != nil {
		return s.err(c.op, err)
	} else if n == 0 {
		return store.ErrLeaseLost
	}
	return nil
}

// end is one attempt's end: what Complete and Fail ask of finish.
type end struct {
	op, id  string
	fence   int64
	state   store.State // asked for; nextState decides
	avail   time.Time   // when a retry may run
	result  []byte
	a       store.Attempt
	eventID string
	now     time.Time
	err     error // the outcome, in a batch
}

// Complete implements store.Store.
func (s *Store) Complete(ctx context.Context, c store.Completion) error {
	if c.State != store.Succeeded && c.State != store.ReviewRequired && (c.State != store.Superseded || c.Entity == nil) {
		return fmt.Errorf("complete job %s: state %s is not a completion", c.JobID, c.State)
	}
	result := []byte(c.Result)
	if result == nil {
		result = []byte("null")
	}
	a := c.Attempt
	a.Spent, a.Sent = !c.Reused, !c.Reused
	e := &end{op: "complete job " + c.JobID, id: c.JobID, fence: c.Fence, state: c.State, avail: c.Now,
		result: result, a: a, eventID: c.EventID, now: c.Now}
	if c.Entity != nil {
		return s.completeEntity(ctx, *c.Entity, e) // outcomes_entities.go
	}
	return s.finish(ctx, e)
}

// Fail implements store.Store; where the job goes is nextState's rule.
func (s *Store) Fail(ctx context.Context, f store.Failure) error {
	e := &end{op: "fail job " + f.JobID, id: f.JobID, fence: f.Fence, state: store.RetryScheduled, avail: f.RetryAt,
		a: f.Attempt, eventID: f.EventID, now: f.Now}
	switch {
	case f.RetryAt.IsZero() && f.Attempt.Spent:
		e.state, e.avail = store.FailedTerminal, f.Now
	case f.RetryAt.IsZero():
		e.avail = f.Now
	}
	return s.finish(ctx, e)
}

// finish applies a worker's end of an attempt under its claim: the state,
// the attempt record and the event, in one transaction, or ErrLeaseLost
// and nothing when the claim no longer owns the job.
func (s *Store) finish(ctx context.Context, e *end) error {
	e.a.Error = storedText(e.a.Error)
	if s.finishes != nil {
		if err := s.finishes.do(ctx, e); err != nil {
			return err
		}
		return e.err
	}
	return s.tx(ctx, e.op, func(tx *sql.Tx) error {
		var tenant, st string
		var version int64
		var res any
		if e.result != nil {
			res = e.result
		}
		err := s.queryRow(ctx, tx, s.q.finish, e.id, e.fence, string(e.state), e.a.Spent, micros(e.now), micros(e.avail), res,
			e.a.ErrorClass, e.a.Error).Scan(&tenant, &st, &version)
		if errors.Is(err, sql.ErrNoRows) {
			return store.ErrLeaseLost
		}
		if err != nil {
			return err
		}
		if err := s.insertAttempt(ctx, tx, e.id, e.fence, e.a); err != nil {
			return err
		}
		if err := s.chargeAttempt(ctx, tx, tenant, e); err != nil {
			return err
		}
		return s.addEvent(ctx, tx, e.eventID, e.id, tenant, store.State(st), version, e.now)
	})
}

// chargeAttempt charges an attempt's end its Charge, if it has one, in tx.
func (s *Store) chargeAttempt(ctx context.Context, tx *sql.Tx, tenant string, e *end) error {
	if e.a.Charge == nil {
		return nil
	}
	d, ok := chargedChange(*e.a.Charge)
	if !ok {
		return nil
	}
	return s.charge(ctx, tx, tenant, store.DayOf(e.now), d)
}

func (s *Store) insertAttempt(ctx context.Context, tx *sql.Tx, id string, fence int64, a store.Attempt) error {
	_, err := s.exec(ctx, tx, s.q.insertAttempt, id, a.Attempt, fence, a.Backend, a.Outcome, a.Spent, a.Sent, a.ErrorClass, storedText(a.Error),
		a.PromptTokens, a.CompletionTokens, micros(a.StartedAt), micros(a.EndedAt))
	return err
}

// keepSent is the SET clause that a statement taking RUNNING jobs from
// their claims other than by the claims' own ends (a reap, a cancel)
// writes: sent_tokens keeps the sent mark's reservation (store.Charge)
// only where the claim had marked its request sent, and that mark wrote it
// (a mark by a replica of an earlier release writes no reservation and
// leaves an earlier claim's behind: migration 26), NULL elsewhere. The
// statement returns sent_tokens and sent_cost, and charges them
// (takenCharges): an attempt without a permit whose end will never be
// recorded (its claim lost the job: the end gets ErrLeaseLost) is charged
// its reservation as uncertain usage, once, by what took its job.
const keepSent = `sent_tokens = CASE WHEN jobs.state = 'RUNNING' AND jobs.sent_fence = jobs.fence
	AND jobs.sent_charge_fence = jobs.fence THEN jobs.sent_tokens END`

// takenCharges sums, by tenant, the reservations that a statement
// taking jobs from their claims returned (keepSent).
type takenCharges map[string]ledgerChange

func (t takenCharges) add(tenant string, tokens sql.NullInt64, cost int64) {
	if tokens.Valid {
		t[tenant] = t[tenant].add(takenChange(tokens.Int64, cost))
	}
}

// chargeTaken charges them in tx, last, by tenant: the order in which
// finishBatch charges the ledger rows.
func (s *Store) chargeTaken(ctx context.Context, tx *sql.Tx, t takenCharges, now time.Time) error {
	for _, tenant := range slices.Sorted(maps.Keys(t)) {
		if err := s.charge(ctx, tx, tenant, store.DayOf(now), t[tenant]); err != nil {
			return err
		}
	}
	return nil
}

// Reap implements store.Store.
func (s *Store) Reap(ctx context.Context, now time.Time, limit int) (int, error) {
	n := 0
	err := s.tx(ctx, "reap", func(tx *sql.Tx) error {
		t := micros(now)
		taken := takenCharges{}
		type statement struct {
			sql  string
			args []any
		}
		leases := statement{s.q.reapLeases, []any{t, t, t, t, t, limit}}
		if s.q.reapLock != "" {
			ids, err := scanTexts(s.query(ctx, tx, s.q.reapLock, t, limit))
			if err != nil {
				return err
			}
			leases.args = []any{t, t, t, t, ids}
			if len(ids) == 0 {
				leases.sql = ""
			}
		}
		for _, q := range []statement{leases, {s.q.reapDeadlines, []any{t, t, limit}}} {
			if q.sql == "" {
				continue
			}
			rows, err := s.query(ctx, tx, q.sql, q.args...)
			if err != nil {
				return err
			}
			type reaped struct {
				id, tenant, state string
				version           int64
				attempt           int
				fence             int64
				spent             bool
				tokens            sql.NullInt64 // the sent mark's reservation (store.Charge)
				cost              int64
			}
			var rs []reaped
			for rows.Next() {
				var r reaped
				if err := rows.Scan(&r.id, &r.tenant, &r.state, &r.version, &r.attempt, &r.fence, &r.spent, &r.tokens, &r.cost); err != nil {
					rows.Close()
					return err
				}
				rs = append(rs, r)
			}
			rows.Close()
			if err := rows.Err(); err != nil {
				return err
			}
			for _, r := range rs {
				if q.sql == s.q.reapLeases {
					// The lost attempt is part of the job's history.
					num := r.attempt
					if !r.spent {
						num++
					}
					if err := s.insertAttempt(ctx, tx, r.id, r.fence-1, store.Attempt{Attempt: num,
						Outcome: store.OutcomeLeaseExpired, Spent: r.spent, Sent: r.spent, ErrorClass: "lease_expired",
						Error: "the worker stopped renewing its lease", EndedAt: now}); err != nil {
						return err
					}
					taken.add(r.tenant, r.tokens, r.cost)
				}
				if err := s.addEvent(ctx, tx, "", r.id, r.tenant, store.State(r.state), r.version, now); err != nil {
					return err
				}
			}
			n += len(rs)
		}
		if err := s.chargeTaken(ctx, tx, taken, now); err != nil {
			return err
		}
		// The fair claim's table (fair.go): tenants it lost are listed
		// again, and tenants left with nothing runnable leave it, last,
		// so that the prune's keys are held only until the commit.
		if _, err := s.exec(ctx, tx, rebind(s.d, fairRelist)); err != nil {
			return err
		}
		return s.pruneTenants(ctx, tx, now)
	})
	return n, err
}

// SaveStage implements store.Store: one statement writes the checkpoint
// only while the claim owns the job. When it wrote nothing, the stage
// existed (the first is kept) or the claim had lost the job.
func (s *Store) SaveStage(ctx context.Context, id string, fence int64, stage string, data []byte, now time.Time) error {
	op := "save stage " + stage
	if s.stages != nil {
		c := &stageCall{op: op, id: id, fence: fence, stage: stage, data: data, now: now}
		if err := s.stages.do(ctx, c); err != nil {
			return err
		}
		if c.err != nil || c.saved {
			return c.err
		}
	} else {
		res, err := s.exec(ctx, nil, s.q.saveStage, stage, data, micros(now), id, fence, micros(now))
		if err != nil {
			return s.err(op, err)
		}
		if n, err := res.RowsAffected(); err != nil {
			return s.err(op, err)
		} else if n == 1 {
			return nil
		}
	}
	var one int
	switch err := s.queryRow(ctx, nil, s.q.ownedBy, id, fence, micros(now)).Scan(&one); {
	case errors.Is(err, sql.ErrNoRows):
		return store.ErrLeaseLost
	case err != nil:
		return s.err(op, err)
	}
	return nil
}

// finishEntity ends an attempt of an entity job with a completion (its
// state decided by the entity's check, outcomes_entities.go), under the
// claim's ownership, as one statement of the transaction that decides.
var finishEntity = `UPDATE jobs SET state = ?, attempt = ` + spentAttempts("jobs", "?") + `, state_version = state_version + 1,
		updated_at = ?, lease_until = 0, available_at = ?, result = COALESCE(?, result), error_class = '', last_error = ''
	WHERE id = ? AND ` + owned("jobs", "?", "?") + ` RETURNING tenant, state, state_version`

// finishEntityTx is finish for an entity job, in tx: the job's new state,
// its attempt record and its event, or ErrLeaseLost and nothing.
func (s *Store) finishEntityTx(ctx context.Context, tx *sql.Tx, e *end) error {
	var tenant, st string
	var version int64
	var res any
	if e.result != nil {
		res = e.result
	}
	err := tx.QueryRowContext(ctx, rebind(s.d, finishEntity), string(e.state), e.a.Spent, micros(e.now), micros(e.avail), res,
		e.id, e.fence, micros(e.now)).Scan(&tenant, &st, &version)
	if errors.Is(err, sql.ErrNoRows) {
		return store.ErrLeaseLost
	}
	if err != nil {
		return err
	}
	if err := s.insertAttempt(ctx, tx, e.id, e.fence, e.a); err != nil {
		return err
	}
	if err := s.chargeAttempt(ctx, tx, tenant, e); err != nil {
		return err
	}
	return s.addEvent(ctx, tx, e.eventID, e.id, tenant, store.State(st), version, e.now)
}
