package chaos

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/kvgate/kvgate/bench/vllmsim"
)

// expectation is a scenario's own check on every job, beyond the
// invariants.
type expectation struct {
	what string
	want func(j jobRec, as []attemptRec) string
}

var (
	expectSucceeded = expectation{"every job SUCCEEDED", allSucceeded}
	expectOneSpent  = expectation{"every job SUCCEEDED with one spent attempt", oneSpentAttempt}
	// expectFinalAfterBudget: with faults that fail requests at the
	// backend, a job may end FAILED_TERMINAL, but only once it spent its
	// whole budget there.
	expectFinalAfterBudget = expectation{"SUCCEEDED, or FAILED_TERMINAL after its budget", func(j jobRec, as []attemptRec) string {
		switch {
		case j.state == "SUCCEEDED":
			return ""
		case j.state == "FAILED_TERMINAL" && j.attempt >= j.maxAttempts:
			return ""
		}
		return fmt.Sprintf("%s (%s: %s) after %d/%d attempt(s)", j.state, j.errorClass, j.lastError, j.attempt, j.maxAttempts)
	}}
)

// finish checks the invariants and the scenario's expectations, and logs
// (and reports) the scenario's figures.
func (e *env) finish(xs ...expectation) {
	e.t.Helper()
	s := checkInvariants(e.t, e)
	for _, x := range xs {
		expect(e.t, s, x.what, x.want)
	}
	figures(e.t, e, s)
}

// logStates marks the store's job states at a moment of the scenario.
func (e *env) logStates(moment string) {
	m, err := e.states()
	if err != nil {
		e.mark("%s: states unreadable: %v", moment, err)
		return
	}
	e.mark("%s: %s", moment, fmtStates(m))
}

// TestColdStart starts kvgate with its backends not yet listening, submits
// 20 jobs, and starts the backends later: two minutes in the full suite
// (vLLM takes minutes to load a model), 25 s in the short one (longer
// than the ~15 s in which five attempts used to pass). Every job must
// succeed having spent exactly one attempt.
func TestColdStart(t *testing.T) {
	need(t, "short")
	delay := 25 * time.Second
	if suite.mode == "full" {
		delay = 2 * time.Minute
	}
	e := newEnv(t, options{coldStart: true})
	e.mark("kvgate up; its %d backends will listen only after %s", len(e.sims), delay)
	e.submitAll(batch{name: "cold", n: 20, maxTokens: 64})
	next := time.Now().Add(15 * time.Second)
	hold(t, time.Until(e.start.Add(delay)), "backends down", func() error {
		if time.Now().After(next) {
			next = time.Now().Add(15 * time.Second)
			e.logStates("backends still down")
		}
		return e.gw.alive()
	})
	e.logStates("backends starting")
	e.startSims()
	e.mark("backends listening")
	e.waitFinal(2 * time.Minute)
	e.finish(expectOneSpent)
}

// TestKillMidBurst kills kvgate with SIGKILL while a burst of jobs runs,
// and starts it again; the full suite does it twice, the second time
// while a second burst is being submitted (the client retries what was
// not answered, under the same Idempotency-Key). Leases expire, the reaper
// hands the jobs back, and every job must succeed.
func TestKillMidBurst(t *testing.T) {
	need(t, "short")
	e := newEnv(t, options{})
	e.submitAll(batch{name: "burst1", n: 150, maxTokens: 200})
	e.waitSucceeded(30, 2*time.Minute)
	e.gw.kill()
	e.logStates("kill -9 kvgate")
	e.gw.start()
	e.mark("kvgate restarted")
	if suite.mode == "full" {
		m, _ := e.states()
		e.waitSucceeded(m["SUCCEEDED"]+30, 2*time.Minute)
		wait := e.submitInBackground(batch{name: "burst2", n: 300, maxTokens: 200})
		e.waitKeys("burst2-", 100, time.Minute)
		e.gw.kill()
		e.logStates("kill -9 kvgate again, with burst2 being submitted")
		e.gw.start()
		e.mark("kvgate restarted")
		wait()
	}
	e.waitFinal(3 * time.Minute)
	e.finish(expectSucceeded)
}

// TestSIGTERMWhileJobsWait stops kvgate with SIGTERM while jobs with
// max_attempts 1 run and wait for room (four sequences per backend), and
// starts it again: a graceful shutdown is kvgate's own business and must
// not spend the jobs' only attempt. With the default drain the jobs in
// flight finish; with a drain of 1 s, shorter than the requests, they are
// cut at the backend and handed back, their request sent but their
// attempt not spent, and must succeed after the restart all the same.
func TestSIGTERMWhileJobsWait(t *testing.T) {
	need(t, "short")
	for _, tc := range []struct {
		name      string
		drain     time.Duration
		n, tokens int
	}{
		{"drain_finishes", 0, 40, 300},
		{"drain_deadline", time.Second, 16, 1000},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t, options{maxAttempts: 1, maxNumSeqs: 4, drainTimeout: tc.drain})
			e.submitAll(batch{name: "term", n: tc.n, maxTokens: tc.tokens})
			e.waitEngines(4, 2*time.Minute)
			e.logStates("SIGTERM kvgate")
			if err := e.gw.terminate(3 * time.Minute); err != nil {
				t.Fatal(err)
			}
			e.logStates("kvgate exited")
			e.gw.start()
			e.mark("kvgate restarted")
			e.waitFinal(3 * time.Minute)
			e.finish(expectOneSpent)
		})
	}
}

// TestNATSKillRestart kills nats-server with SIGKILL mid-burst, submits
// more jobs while it is down, and starts it again after ten seconds on
// the same port and store: jobs are accepted and go on (the runner scans
// the store), and the relay publishes what waited in the outbox.
func TestNATSKillRestart(t *testing.T) {
	need(t, "full")
	e := newEnv(t, options{})
	e.submitAll(batch{name: "nats", n: 200, maxTokens: 200})
	e.waitSucceeded(40, 2*time.Minute)
	e.nats.kill()
	e.logStates("kill -9 nats-server")
	down := time.Now()
	e.submitAll(batch{name: "nats-down", n: 100, maxTokens: 200})
	hold(t, 10*time.Second-time.Since(down), "NATS down", e.gw.alive)
	e.nats.start()
	e.logStates("nats-server restarted")
	e.waitFinal(3 * time.Minute)
	eventually(t, 2*time.Minute, 500*time.Millisecond, "the outbox published", func() (bool, string, error) {
		var n int
		err := e.db.QueryRowContext(context.Background(), `SELECT count(*) FROM outbox WHERE published_at <= 0`).Scan(&n)
		return err == nil && n == 0, fmt.Sprintf("%d event(s) unpublished", n), err
	})
	e.mark("outbox published")
	e.finish(expectSucceeded)
}

// TestPostgresRestart restarts the private PostgreSQL (pg_ctl restart,
// fast mode) mid-burst: kvgate's connections are cut, writes in flight
// fail, and every job must still succeed.
func TestPostgresRestart(t *testing.T) {
	need(t, "full")
	e := newEnv(t, options{})
	e.submitAll(batch{name: "pg", n: 200, maxTokens: 200})
	e.waitSucceeded(40, 2*time.Minute)
	e.logStates("pg_ctl restart")
	if err := suite.pg.restart(); err != nil {
		t.Fatal(err)
	}
	e.logStates("PostgreSQL back")
	e.waitFinal(3 * time.Minute)
	e.finish(expectSucceeded)
}

// TestBackendFaults turns on one of the simulators' faults on every
// backend for 15 s while 100 jobs run, then clears it. A 429 is the
// backend's refusal, a wait that spends nothing: every job succeeds. Hangs
// (cut by a 3 s request timeout), malformed answers and connections cut
// mid-response fail at the backend and count: a job may end
// FAILED_TERMINAL then, but only after its whole budget.
func TestBackendFaults(t *testing.T) {
	need(t, "full")
	for _, tc := range []struct {
		name   string
		faults vllmsim.Faults
		opts   options
		want   expectation
	}{
		{"429_storm", vllmsim.Faults{RateLimitRate: 0.9, RetryAfterSeconds: 1}, options{}, expectSucceeded},
		{"hangs", vllmsim.Faults{HangRate: 0.3}, options{requestTimeout: 3 * time.Second}, expectFinalAfterBudget},
		{"malformed_json", vllmsim.Faults{MalformedRate: 0.4}, options{}, expectFinalAfterBudget},
		{"mid_stream_drops", vllmsim.Faults{DropRate: 0.4}, options{}, expectFinalAfterBudget},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t, tc.opts)
			for _, s := range e.sims {
				if err := s.setFaults(tc.faults); err != nil {
					t.Fatal(err)
				}
			}
			e.mark("faults on: %+v", tc.faults)
			e.submitAll(batch{name: tc.name, n: 100, maxTokens: 32})
			hold(t, 15*time.Second, "faults on", e.gw.alive)
			for _, s := range e.sims {
				if err := s.setFaults(vllmsim.Faults{}); err != nil {
					t.Fatal(err)
				}
			}
			e.logStates("faults off")
			e.waitFinal(3 * time.Minute)
			e.finish(tc.want)
		})
	}
}

// TestQuotaBacklog gives a tenant max_concurrency 1 and a backlog of jobs
// that takes longer to drain than the runner's QuotaWait (one minute): a
// wait for the tenant's own quota, however long, spends no attempt, so
// every job succeeds with one attempt spent, even with max_attempts 2.
func TestQuotaBacklog(t *testing.T) {
	need(t, "full")
	e := newEnv(t, options{maxAttempts: 2})
	e.kvgateCmd("tenants", "create", "acme", "--max-concurrency", "1")
	key := strings.TrimSpace(e.kvgateCmd("keys", "create", "--tenant", "acme", "--name", "chaos"))
	if key == "" {
		t.Fatal("kvgate keys create printed no key")
	}
	e.mark("tenant acme: max_concurrency 1")
	// 45 jobs of 250 tokens, one at a time: about 80 s.
	e.submitAll(batch{name: "quota", n: 45, maxTokens: 250, bearer: key})
	e.waitFinal(6 * time.Minute)
	e.finish(expectOneSpent)
}
