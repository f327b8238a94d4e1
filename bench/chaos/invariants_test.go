package chaos

import (
	"context"
	"fmt"
	"os"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"
)

// snapshot is what the invariants are checked on: the store's jobs,
// attempts and outbox, the simulators' counters, and what the client was
// told.
type snapshot struct {
	at       time.Time
	jobs     []jobRec // by id
	attempts map[string][]attemptRec
	events   map[string][]eventRec
	accepted map[string]string // idempotency key -> the job id of its 202
	// calls: requests the simulators' engines took in, read before the
	// store (a call that starts later has its record later too); served:
	// requests they ran to their end, read after it.
	calls, served float64
	perSim        []string // each simulator's counters, for reports
	// spentColumns: the store records per attempt whether it spent and
	// whether its request may have been sent (attempts.spent, .sent).
	// Without them every record spent (the claim counted it) and sent
	// unless it waited for kvgate's own admission or quota.
	spentColumns bool
	// keys: each job id's tenant and idempotency key as job_keys holds
	// them (nil where the store has no job_keys table: an older build).
	keys map[string][2]string
}

type jobRec struct {
	id, tenant, key, state, errorClass, lastError string
	attempt, maxAttempts                          int
	fence                                         int64
	deadline, updated                             time.Time
	hasResult                                     bool
}

type attemptRec struct {
	attempt            int
	fence              int64
	backend, outcome   string
	class, err         string
	spent, sent        bool
	startedAt, endedAt time.Time
}

type eventRec struct {
	typ, state string
	published  bool
}

// Attempt outcomes and error classes the invariants know. Waits and
// interruptions are kvgate's own: they never spend an attempt. The
// uncertain outcomes are those whose request may have reached a backend
// without kvgate learning how it ended.
var (
	knownOutcomes = []string{"succeeded", "failed", "retry", "review", "wait", "interrupted", "lease_expired", "lease_lost"}
	waitOutcomes  = []string{"wait", "interrupted"}
	// waitClasses are failures of kvgate's own admission, quota or a
	// backend's refusal to take the request (429): none reached a GPU.
	waitClasses = []string{"no_capacity", "quota_wait", "rate_limited", "no_backend", "connection_refused", "interrupted", "shutdown"}
)

// violation is one broken invariant, for one job where it is about one.
type violation struct {
	invariant string
	job       string // "" for the fleet as a whole
	detail    string
}

// The invariants, in report order.
const (
	invAccounted   = "accounted"
	invTerminal    = "no_silent_terminal"
	invOnce        = "completed_once"
	invExplained   = "explained"
	invBudget      = "backend_budget"
	invServed      = "served"
	invExpectation = "scenario_expectation"
)

// checkInvariants reads the store and the simulators and fails the test
// with every invariant that does not hold, naming the job. Every scenario
// ends with it; it returns the snapshot for the scenario's own
// expectations and figures.
func checkInvariants(t *testing.T, e *env) snapshot {
	t.Helper()
	s, err := e.snapshot()
	if err != nil {
		t.Fatalf("read the store and the simulators: %v", err)
	}
	report(t, s, violations(s))
	return s
}

// violations is the invariants proper: a pure function of a snapshot.
func violations(s snapshot) []violation {
	var vs []violation
	add := func(inv, job, format string, args ...any) {
		vs = append(vs, violation{inv, job, fmt.Sprintf(format, args...)})
	}
	byID := map[string]*jobRec{}
	for i := range s.jobs {
		byID[s.jobs[i].id] = &s.jobs[i]
	}
	given := map[string]string{}
	for key, id := range s.accepted {
		given[id] = key
		if byID[id] == nil {
			add(invAccounted, id, "accepted (202, key %s) but not in the store", key)
		}
	}
	for id, k := range s.keys {
		if byID[id] == nil {
			add(invAccounted, id, "job_keys holds key %s of tenant %s for a job the store does not have", k[1], k[0])
		}
	}
	recordsThatMaySend, running, succeeded := 0, 0, 0
	for _, j := range s.jobs {
		as := s.attempts[j.id]
		if _, ok := given[j.id]; !ok {
			add(invAccounted, j.id, "in the store (key %s, %s) but the client was never given it", j.key, j.state)
		}
		if k, ok := s.keys[j.id]; s.keys != nil && (!ok || k != [2]string{j.tenant, j.key}) {
			add(invAccounted, j.id, "its keys (tenant %s, key %s) are not in job_keys (found %q): its key and its tenant's listing cannot find it", j.tenant, j.key, k)
		}
		switch j.state {
		case "SUCCEEDED", "REVIEW_REQUIRED", "FAILED_TERMINAL", "CANCELLED":
		case "READY", "RETRY_SCHEDULED":
			if !j.deadline.After(s.at) {
				add(invAccounted, j.id, "%s past its deadline %s: it can never run", j.state, j.deadline.Format(time.RFC3339))
			}
		case "RUNNING":
			running++
		default:
			add(invAccounted, j.id, "unknown state %q", j.state)
		}

		spent, succ, backendFailure, paid := 0, 0, false, false
		for _, a := range as {
			if a.spent || a.sent {
				recordsThatMaySend++
			}
			switch {
			case a.outcome == "":
				add(invExplained, j.id, "attempt %d (fence %d) has no outcome", a.attempt, a.fence)
			case !slices.Contains(knownOutcomes, a.outcome):
				add(invExplained, j.id, "attempt %d (fence %d) has an unknown outcome %q", a.attempt, a.fence, a.outcome)
			}
			if a.class == "" && a.outcome != "succeeded" {
				add(invExplained, j.id, "attempt %d (fence %d) ended %s with no error class", a.attempt, a.fence, a.outcome)
			}
			if a.spent {
				spent++
				switch {
				case slices.Contains(waitOutcomes, a.outcome):
					add(invExplained, j.id, "attempt %d (fence %d) spent an attempt, though its outcome is %s (%s: %s)", a.attempt, a.fence, a.outcome, a.class, a.err)
				case slices.Contains(waitClasses, a.class):
					add(invExplained, j.id, "attempt %d (fence %d) spent an attempt waiting, not at a backend (%s %s: %s)", a.attempt, a.fence, a.outcome, a.class, a.err)
				case !a.sent && a.class != "invalid_request":
					add(invExplained, j.id, "attempt %d (fence %d) spent an attempt without sending the request (%s %s: %s)", a.attempt, a.fence, a.outcome, a.class, a.err)
				case a.outcome != "succeeded":
					backendFailure = true
				}
			} else if a.outcome == "succeeded" && !paid {
				// A success that spends nothing reused the inference an
				// earlier spent attempt checkpointed; there must be one.
				add(invExplained, j.id, "attempt %d (fence %d) succeeded without counting, and no earlier attempt that spent sent the request", a.attempt, a.fence)
			}
			if a.spent && a.sent {
				paid = true
			}
			if a.outcome == "succeeded" {
				succ++
			}
		}
		// A claim in flight has no record yet; without per-record spent
		// columns its claim has already counted it.
		if want := spent; j.attempt != want && !(j.state == "RUNNING" && !s.spentColumns && j.attempt == want+1) {
			add(invExplained, j.id, "attempt counter %d, but %d spent attempt record(s): %s", j.attempt, spent, history(as))
		}

		if j.state == "FAILED_TERMINAL" && !backendFailure {
			deadline := j.errorClass == "deadline_exceeded" && !j.deadline.After(j.updated)
			if !deadline {
				add(invTerminal, j.id, "FAILED_TERMINAL (%s: %s) after %d/%d attempt(s) with no spent attempt that failed at a backend: %s",
					j.errorClass, j.lastError, j.attempt, j.maxAttempts, history(as))
			}
		}

		doneEvents := 0
		for _, ev := range s.events[j.id] {
			if ev.state == "SUCCEEDED" {
				doneEvents++
			}
		}
		switch {
		case succ > 1 || doneEvents > 1:
			add(invOnce, j.id, "completed more than once: %d succeeded attempt(s), %d SUCCEEDED event(s): %s", succ, doneEvents, history(as))
		case j.state == "SUCCEEDED" && (succ != 1 || !j.hasResult || doneEvents != 1):
			add(invOnce, j.id, "SUCCEEDED with %d succeeded attempt(s), %d SUCCEEDED event(s), result stored %v: %s", succ, doneEvents, j.hasResult, history(as))
		case j.state != "SUCCEEDED" && (succ > 0 || doneEvents > 0):
			add(invOnce, j.id, "%s, yet %d attempt(s) succeeded and %d SUCCEEDED event(s): %s", j.state, succ, doneEvents, history(as))
		}
		if j.state == "SUCCEEDED" {
			succeeded++
		}
	}
	if s.calls > float64(recordsThatMaySend+running) {
		add(invBudget, "", "the engines took in %.0f request(s), but only %d attempt record(s) may have sent one and %d job(s) are running (%s)",
			s.calls, recordsThatMaySend, running, strings.Join(s.perSim, "; "))
	}
	if s.served < float64(succeeded) {
		add(invServed, "", "%d job(s) SUCCEEDED, but the engines ran only %.0f request(s) to their end (%s)",
			succeeded, s.served, strings.Join(s.perSim, "; "))
	}
	return vs
}

// history is a job's attempt records in one line.
func history(as []attemptRec) string {
	if len(as) == 0 {
		return "no attempt records"
	}
	parts := make([]string, 0, len(as))
	for _, a := range as {
		flags := ""
		if a.spent {
			flags += " spent"
		}
		if a.sent {
			flags += " sent"
		}
		msg := a.err
		if len(msg) > 80 {
			msg = msg[:80] + "..."
		}
		p := fmt.Sprintf("[#%d fence %d %s %s%s", a.attempt, a.fence, a.outcome, a.class, flags)
		if a.backend != "" {
			p += " on " + a.backend
		}
		if msg != "" {
			p += ": " + msg
		}
		parts = append(parts, p+"]")
	}
	return strings.Join(parts, " ")
}

// report fails the test once per broken invariant, naming its jobs.
func report(t *testing.T, s snapshot, vs []violation) {
	t.Helper()
	by := map[string][]violation{}
	var order []string
	for _, v := range vs {
		if by[v.invariant] == nil {
			order = append(order, v.invariant)
		}
		by[v.invariant] = append(by[v.invariant], v)
	}
	for _, inv := range order {
		list := by[inv]
		jobs := map[string]bool{}
		for _, v := range list {
			jobs[v.job] = true
		}
		var lines []string
		for i, v := range list {
			if i == 12 {
				lines = append(lines, fmt.Sprintf("  ... and %d more", len(list)-12))
				break
			}
			if v.job == "" {
				lines = append(lines, "  "+v.detail)
			} else {
				lines = append(lines, fmt.Sprintf("  job %s: %s", v.job, v.detail))
			}
		}
		t.Errorf("invariant %s broken (%d violation(s), %d of %d job(s)):\n%s", inv, len(list), len(jobs), len(s.jobs), strings.Join(lines, "\n"))
	}
}

// expect checks a scenario's own expectation on every job (all SUCCEEDED,
// one spent attempt each, ...): want says what is wrong with a job, or "".
func expect(t *testing.T, s snapshot, what string, want func(j jobRec, as []attemptRec) string) {
	t.Helper()
	var vs []violation
	for _, j := range s.jobs {
		if msg := want(j, s.attempts[j.id]); msg != "" {
			vs = append(vs, violation{invExpectation + ": " + what, j.id, msg + ": " + history(s.attempts[j.id])})
		}
	}
	report(t, s, vs)
}

// allSucceeded is the expectation of most scenarios.
func allSucceeded(j jobRec, _ []attemptRec) string {
	if j.state != "SUCCEEDED" {
		return fmt.Sprintf("%s (%s: %s) after %d attempt(s)", j.state, j.errorClass, j.lastError, j.attempt)
	}
	return ""
}

// oneSpentAttempt: the job SUCCEEDED having spent exactly one attempt,
// whatever it waited for.
func oneSpentAttempt(j jobRec, as []attemptRec) string {
	if msg := allSucceeded(j, as); msg != "" {
		return msg
	}
	if j.attempt != 1 {
		return fmt.Sprintf("SUCCEEDED with %d spent attempts, not 1", j.attempt)
	}
	return ""
}

// snapshot reads the simulators and the store for checkInvariants.
func (e *env) snapshot() (snapshot, error) {
	s := snapshot{accepted: e.accepted, attempts: map[string][]attemptRec{}, events: map[string][]eventRec{}}
	for _, sm := range e.sims {
		c, err := sm.counters()
		if err != nil {
			return s, err
		}
		s.calls += c.calls()
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	s.at = time.Now()
	err := e.db.QueryRowContext(ctx, `SELECT count(*) = 2 FROM information_schema.columns
		WHERE table_name = 'attempts' AND column_name IN ('spent', 'sent')`).Scan(&s.spentColumns)
	if err != nil {
		return s, err
	}
	rows, err := e.db.QueryContext(ctx, `SELECT id, tenant, idempotency_key, state, attempt, max_attempts, fence,
		deadline_at, updated_at, error_class, last_error, result IS NOT NULL FROM jobs ORDER BY id`)
	if err != nil {
		return s, err
	}
	for rows.Next() {
		var j jobRec
		var deadline, updated int64
		if err := rows.Scan(&j.id, &j.tenant, &j.key, &j.state, &j.attempt, &j.maxAttempts, &j.fence,
			&deadline, &updated, &j.errorClass, &j.lastError, &j.hasResult); err != nil {
			rows.Close()
			return s, err
		}
		j.deadline, j.updated = time.UnixMicro(deadline), time.UnixMicro(updated)
		s.jobs = append(s.jobs, j)
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return s, err
	}
	var keysTable bool
	if err := e.db.QueryRowContext(ctx, `SELECT to_regclass('job_keys') IS NOT NULL`).Scan(&keysTable); err != nil {
		return s, err
	}
	if keysTable {
		s.keys = map[string][2]string{}
		rows, err := e.db.QueryContext(ctx, `SELECT id, tenant, idempotency_key FROM job_keys`)
		if err != nil {
			return s, err
		}
		for rows.Next() {
			var id string
			var k [2]string
			if err := rows.Scan(&id, &k[0], &k[1]); err != nil {
				rows.Close()
				return s, err
			}
			s.keys[id] = k
		}
		rows.Close()
		if err := rows.Err(); err != nil {
			return s, err
		}
	}
	cols := "TRUE, TRUE"
	if s.spentColumns {
		cols = "spent, sent"
	}
	rows, err = e.db.QueryContext(ctx, `SELECT job_id, attempt, fence, backend, outcome, error_class, error, started_at, ended_at, `+cols+`
		FROM attempts ORDER BY job_id, ended_at, fence`)
	if err != nil {
		return s, err
	}
	for rows.Next() {
		var id string
		var a attemptRec
		var started, ended int64
		if err := rows.Scan(&id, &a.attempt, &a.fence, &a.backend, &a.outcome, &a.class, &a.err, &started, &ended, &a.spent, &a.sent); err != nil {
			rows.Close()
			return s, err
		}
		a.startedAt, a.endedAt = time.UnixMicro(started), time.UnixMicro(ended)
		if !s.spentColumns {
			// Before per-record columns: the claim counted every
			// attempt; the request was sent unless the attempt only
			// waited for kvgate's own admission or quota.
			a.spent, a.sent = true, a.class != "no_capacity" && a.class != "quota_wait" && a.outcome != "wait"
		}
		s.attempts[id] = append(s.attempts[id], a)
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return s, err
	}
	rows, err = e.db.QueryContext(ctx, `SELECT job_id, type, state, published_at > 0 FROM outbox ORDER BY seq`)
	if err != nil {
		return s, err
	}
	for rows.Next() {
		var id string
		var ev eventRec
		if err := rows.Scan(&id, &ev.typ, &ev.state, &ev.published); err != nil {
			rows.Close()
			return s, err
		}
		s.events[id] = append(s.events[id], ev)
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return s, err
	}
	for _, sm := range e.sims {
		c, err := sm.counters()
		if err != nil {
			return s, err
		}
		s.served += c.served()
		s.perSim = append(s.perSim, fmt.Sprintf("%s: %.0f taken in, %.0f run to their end, %.0f aborted", sm.name, c.calls(), c.served(), c.finished["abort"]))
	}
	return s, nil
}

// figures sums a snapshot up for the log and KVGATE_CHAOS_REPORT: one
// Markdown table row per scenario.
func figures(t *testing.T, e *env, s snapshot) {
	t.Helper()
	states := map[string]int{}
	outcomes := map[string]int{}
	spent, sent, uncounted := 0, 0, 0
	for _, j := range s.jobs {
		states[j.state]++
		for _, a := range s.attempts[j.id] {
			outcomes[a.outcome]++
			switch {
			case a.spent:
				spent++
			default:
				uncounted++
			}
			if a.sent {
				sent++
			}
		}
	}
	var oc []string
	for k, v := range outcomes {
		oc = append(oc, fmt.Sprintf("%s %d", k, v))
	}
	sort.Strings(oc)
	row := fmt.Sprintf("| %s | %d | %s | %d | %d | %s | %.0f | %.0f | %s |", t.Name(), len(s.jobs), fmtStates(states), spent, uncounted,
		strings.Join(oc, ", "), s.calls, s.served, time.Since(e.start).Round(time.Second))
	t.Logf("figures: jobs %d (%s); attempt records: %d spent, %d not spent, %d may have sent (%s); engines: %.0f taken in, %.0f run to their end; %s",
		len(s.jobs), fmtStates(states), spent, uncounted, sent, strings.Join(oc, ", "), s.calls, s.served, time.Since(e.start).Round(time.Second))
	t.Logf("timeline:\n  %s", strings.Join(e.marks, "\n  "))
	if suite.report == "" {
		return
	}
	f, err := os.OpenFile(suite.report, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		t.Logf("report: %v", err)
		return
	}
	defer f.Close()
	status := "pass"
	if t.Failed() {
		status = "FAIL"
	}
	fmt.Fprintf(f, "%s %s |\n", row, status)
}
