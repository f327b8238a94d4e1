package scheduler

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"path/filepath"

	"github.com/kvgate/kvgate/bench/eventually"

	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/kvgate/kvgate/gpu"
	"github.com/kvgate/kvgate/store"
	"github.com/kvgate/kvgate/store/sqlite"
)

// scriptedExecutor answers each call with the next outcome from calls,
// waiting for release first when hold is set.
type scriptedExecutor struct {
	calls     atomic.Int64
	hold      chan struct{} // nil: answer at once
	started   chan struct{} // receives one value per call
	fail      error         // when set, every call fails so
	failFirst int64         // with fail: only the first calls fail
}

func (e *scriptedExecutor) Prepare(ctx context.Context, j store.Job) (*Call, error) {
	return &Call{
		Ticket: &Ticket{Model: j.Model, PromptTokens: 10, MaxTokens: 10},
		Admit:  func(context.Context) error { return nil },
		Run: func(ctx context.Context, g *Grant, sending func() error) (Outcome, error) {
			if err := sending(); err != nil {
				return Outcome{}, err
			}
			return e.execute(ctx)
		},
		Release: func() {},
	}, nil
}

func (e *scriptedExecutor) execute(ctx context.Context) (Outcome, error) {
	n := e.calls.Add(1)
	if e.started != nil {
		e.started <- struct{}{}
	}
	if e.hold != nil {
		select {
		case <-e.hold:
		case <-ctx.Done():
			return Outcome{}, &ExecError{Class: ClassBackend, Err: ctx.Err()}
		}
	}
	if e.fail != nil && (e.failFirst == 0 || n <= e.failFirst) {
		return Outcome{}, e.fail
	}
	return Outcome{Body: []byte(`{"answer":42}`), PromptTokens: 10, CompletionTokens: 2}, nil
}

type runnerFixture struct {
	st     store.Store
	runner *Runner
	cancel context.CancelFunc
	done   chan struct{}
}

func startRunner(t *testing.T, exec Executor, lease time.Duration) *runnerFixture {
	t.Helper()
	return startRunnerOn(t, openStore(t), &staticSource{snaps: []*gpu.Snapshot{backendSnap("a", 100_000)}}, exec, lease)
}

func openStore(t *testing.T) store.Store {
	t.Helper()
	st, err := sqlite.Open(context.Background(), filepath.Join(t.TempDir(), "jobs.db"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := sqlite.Migrate(context.Background(), st); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	return st
}

// startRunnerOn runs a runner over st with backends from src; tune, if
// any, changes its configuration first.
func startRunnerOn(t *testing.T, st store.Store, src snapshotSource, exec Executor, lease time.Duration, tune ...func(*RunnerConfig)) *runnerFixture {
	t.Helper()
	sched, err := New(src, Options{})
	if err != nil {
		t.Fatal(err)
	}
	cfg := RunnerConfig{Concurrency: 4, Lease: lease, Poll: 10 * time.Millisecond,
		ReapEvery: time.Hour, Backoff: Backoff{Base: time.Millisecond, Max: 5 * time.Millisecond}}
	for _, f := range tune {
		f(&cfg)
	}
	r := NewRunner(st, sched, exec, cfg)
	ctx, cancel := context.WithCancel(context.Background())
	f := &runnerFixture{st: st, runner: r, cancel: cancel, done: make(chan struct{})}
	go func() { _ = r.Run(ctx); close(f.done) }()
	t.Cleanup(f.stop)
	return f
}

func (f *runnerFixture) stop() {
	f.cancel()
	<-f.done
}

func (f *runnerFixture) submit(t *testing.T, key string, opts ...func(*store.NewJob)) store.Job {
	t.Helper()
	j := acceptJob(t, f.st, key, opts...)
	f.runner.Wake()
	return j
}

// acceptJob puts a job of tenant acme in st, waking no runner.
func acceptJob(t *testing.T, st store.Store, key string, opts ...func(*store.NewJob)) store.Job {
	t.Helper()
	n := store.NewJob{
		ID: uuid.Must(uuid.NewV7()).String(), Tenant: "acme", IdempotencyKey: key, RequestHash: key,
		Endpoint: "/v1/completions", Model: model, Body: json.RawMessage(`{}`), MaxAttempts: 5,
		Deadline: time.Now().Add(time.Hour), Now: time.Now(),
	}
	for _, o := range opts {
		o(&n)
	}
	j, _, err := st.Accept(context.Background(), n)
	if err != nil {
		t.Fatal(err)
	}
	return j
}

func (f *runnerFixture) waitState(t *testing.T, id string, want store.State) store.Job {
	t.Helper()
	var j store.Job
	eventually.True(t, "job "+id+" to reach "+string(want), func() bool {
		var err error
		j, err = f.st.Get(context.Background(), "acme", id)
		return err == nil && j.State == want
	})
	return j
}

func TestRunnerCompletesAJob(t *testing.T) {
	exec := &scriptedExecutor{}
	f := startRunner(t, exec, time.Minute)
	j := f.submit(t, "k")
	f.waitState(t, j.ID, store.Succeeded)
	res, err := f.st.Result(context.Background(), "acme", j.ID)
	if err != nil || string(res) != `{"answer":42}` {
		t.Errorf("result %s, %v", res, err)
	}
	// The counter moves just after the completion commits.
	for deadline := time.Now().Add(5 * time.Second); testutil.ToFloat64(f.runner.m.finished.WithLabelValues("succeeded")) != 1; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("finished counter not incremented")
		}
	}
}

// TestRunnerLeaseLostMidInference: the reaper re-leases a job while its
// worker waits on the backend. The worker's heartbeat finds the fence
// moved, cancels the call, and writes nothing; the next attempt completes.
func TestRunnerLeaseLostMidInference(t *testing.T) {
	exec := &scriptedExecutor{hold: make(chan struct{}), started: make(chan struct{}, 4)}
	f := startRunner(t, exec, 300*time.Millisecond)
	j := f.submit(t, "k")
	<-exec.started
	// As the reaper would after the lease ran out.
	// One second ahead: past the 300 ms lease; the retry is due then too.
	if n, err := f.st.Reap(context.Background(), time.Now().Add(time.Second), 10); err != nil || n != 1 {
		t.Fatalf("reap: %d, %v", n, err)
	}
	// The next attempt starts; let it answer.
	<-exec.started
	close(exec.hold)
	f.waitState(t, j.ID, store.Succeeded)
	for deadline := time.Now().Add(5 * time.Second); testutil.ToFloat64(f.runner.m.stale) != 1; time.Sleep(2 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("stale attempts counted: %v, want 1", testutil.ToFloat64(f.runner.m.stale))
		}
	}
	as, _ := f.st.Attempts(context.Background(), j.ID)
	if len(as) != 2 || as[0].Outcome != "lease_expired" || as[1].Outcome != "succeeded" {
		t.Errorf("attempts %+v: want the lost lease, then the success", as)
	}
}

// TestRunnerReusesCheckpointedInference: a job whose inference was saved
// by an earlier attempt completes without calling the model again.
func TestRunnerReusesCheckpointedInference(t *testing.T) {
	exec := &scriptedExecutor{}
	f := startRunner(t, exec, time.Minute)
	f.stop() // set the job up by hand first
	ctx := context.Background()
	j := f.submit(t, "k")
	claimed, err := f.st.Claim(ctx, time.Now(), time.Second, 1)
	if err != nil || len(claimed) != 1 {
		t.Fatal(claimed, err)
	}
	c := claimed[0]
	if err := f.st.MarkSent(ctx, c.ID, c.Fence, time.Now(), time.Second, nil); err != nil {
		t.Fatal(err)
	}
	if err := f.st.SaveStage(ctx, c.ID, c.Fence, stageInference, []byte(`{"answer":"saved"}`), time.Now()); err != nil {
		t.Fatal(err)
	}
	// The earlier worker died before recording its end: its lease expires.
	if _, err := f.st.Reap(ctx, time.Now().Add(2*time.Second), 10); err != nil {
		t.Fatal(err)
	}
	f2 := &runnerFixture{st: f.st, runner: f.runner, done: make(chan struct{})}
	rctx, cancel := context.WithCancel(ctx)
	f2.cancel = cancel
	go func() { _ = f.runner.Run(rctx); close(f2.done) }()
	defer f2.stop()
	f.runner.Wake()
	f2.waitState(t, j.ID, store.Succeeded)
	if exec.calls.Load() != 0 {
		t.Errorf("the model was called %d times for a checkpointed job", exec.calls.Load())
	}
	if res, _ := f.st.Result(ctx, "acme", j.ID); string(res) != `{"answer":"saved"}` {
		t.Errorf("result %s, want the checkpoint", res)
	}
	// One backend call, counted once (when its lease was lost), not again
	// by the completion that reused it.
	if got, _ := f.st.Get(ctx, "acme", j.ID); got.Attempt != 1 {
		t.Errorf("attempt %d, want 1", got.Attempt)
	}
}

// TestRunnerHandsJobsBackOnShutdown: stopping the runner mid-call records
// the attempt as interrupted, spends nothing, and makes the job runnable
// at once, even on its last attempt.
func TestRunnerHandsJobsBackOnShutdown(t *testing.T) {
	exec := &scriptedExecutor{hold: make(chan struct{}), started: make(chan struct{}, 1)}
	f := startRunner(t, exec, time.Minute)
	j := f.submit(t, "k", func(n *store.NewJob) { n.MaxAttempts = 1 })
	<-exec.started
	f.stop()
	got, _ := f.st.Get(context.Background(), "acme", j.ID)
	if got.State != store.RetryScheduled || got.AvailableAt.After(time.Now()) || got.Attempt != 0 {
		t.Errorf("after shutdown: %s available at %v attempt %d, want RETRY_SCHEDULED now with none spent", got.State, got.AvailableAt, got.Attempt)
	}
	as, _ := f.st.Attempts(context.Background(), j.ID)
	if len(as) != 1 || as[0].Outcome != store.OutcomeInterrupted || as[0].Spent || !as[0].Sent || as[0].ErrorClass != string(ClassShutdown) {
		t.Errorf("attempts %+v, want one unspent interruption of a sent request", as)
	}
}

// TestRunnerDrains: a draining runner claims nothing new and lets the
// attempt in flight finish.
func TestRunnerDrains(t *testing.T) {
	exec := &scriptedExecutor{hold: make(chan struct{}), started: make(chan struct{}, 2)}
	f := startRunner(t, exec, time.Minute)
	j := f.submit(t, "k")
	<-exec.started
	f.runner.Drain()
	later := f.submit(t, "later")
	close(exec.hold)
	f.waitState(t, j.ID, store.Succeeded)
	for range 20 { // the runner wakes at every poll: it would have claimed by now
		f.runner.Wake()
		time.Sleep(5 * time.Millisecond)
	}
	if got, _ := f.st.Get(context.Background(), "acme", later.ID); got.State != store.Ready {
		t.Errorf("a draining runner claimed a job: %s", got.State)
	}
}

// TestRunnerHoldsJobsWithoutBackend is the cold start: with no routable
// backend for the jobs' model (vLLM still loading it), the jobs stay READY
// in the store, unclaimed and unspent, for as long as it takes; once a
// backend serves the model they run with one attempt each.
func TestRunnerHoldsJobsWithoutBackend(t *testing.T) {
	st := openStore(t)
	down := backendSnap("a", 100_000)
	down.Models = nil // /v1/models not answering yet
	src := &staticSource{snaps: []*gpu.Snapshot{down}}
	exec := &scriptedExecutor{}
	f := startRunnerOn(t, st, src, exec, time.Minute)
	var jobs []store.Job
	for i := range 20 {
		jobs = append(jobs, f.submit(t, fmt.Sprint("k", i)))
	}
	for range 20 {
		f.runner.Wake()
		time.Sleep(5 * time.Millisecond)
	}
	for _, j := range jobs {
		if got, _ := st.Get(context.Background(), "acme", j.ID); got.State != store.Ready || got.Attempt != 0 || got.Fence != 0 {
			t.Fatalf("job %s without a backend: %s attempt %d fence %d, want READY and untouched", j.ID, got.State, got.Attempt, got.Fence)
		}
	}
	src.mu.Lock()
	src.snaps = []*gpu.Snapshot{backendSnap("a", 100_000)}
	src.mu.Unlock()
	f.runner.Wake()
	for _, j := range jobs {
		if got := f.waitState(t, j.ID, store.Succeeded); got.Attempt != 1 {
			t.Errorf("job %s: attempt %d, want 1", j.ID, got.Attempt)
		}
	}
	if n := exec.calls.Load(); n != 20 {
		t.Errorf("%d backend calls, want 20", n)
	}
}

// TestRunnerWaitsSpendNothing: a job of one attempt whose claims meet
// waits (kvgate's queue full or timed out, a backend's 429s, a refused
// connection) is handed back each time without spending, and succeeds on
// its one attempt.
func TestRunnerWaitsSpendNothing(t *testing.T) {
	for _, tc := range []struct {
		name string
		err  error
	}{
		{"429 storm", &ExecError{Class: ClassRateLimited, Status: 429, Err: errors.New("slow down")}},
		{"connection refused", &ExecError{Class: ClassRefused, Err: errors.New("dial tcp: connection refused")}},
		{"no capacity", &ExecError{Class: ClassCapacity, Err: errors.New("queue timeout")}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			exec := &scriptedExecutor{fail: tc.err, failFirst: 6}
			f := startRunner(t, exec, time.Minute)
			j := f.submit(t, "k", func(n *store.NewJob) { n.MaxAttempts = 1 })
			got := f.waitState(t, j.ID, store.Succeeded)
			if got.Attempt != 1 {
				t.Errorf("attempt %d, want 1", got.Attempt)
			}
			as, _ := f.st.Attempts(context.Background(), j.ID)
			if len(as) != 7 || as[6].Outcome != store.OutcomeSucceeded {
				t.Fatalf("attempts %+v: want 6 waits, then the success", as)
			}
			for _, a := range as[:6] {
				if a.Spent || a.Outcome != store.OutcomeWait || a.ErrorClass != string(tc.err.(*ExecError).Class) {
					t.Errorf("wait recorded as %+v", a)
				}
			}
		})
	}
}

func TestRunnerClassifiesFailures(t *testing.T) {
	for _, tc := range []struct {
		name string
		err  error
		want store.State
	}{
		{"invalid request ends the job", &ExecError{Class: ClassInvalid, Status: 400, Err: errors.New("bad")}, store.FailedTerminal},
		{"5xx retries until attempts run out", &ExecError{Class: ClassBackend, Status: 500, Err: errors.New("boom")}, store.FailedTerminal},
	} {
		t.Run(tc.name, func(t *testing.T) {
			exec := &scriptedExecutor{fail: tc.err}
			f := startRunner(t, exec, time.Minute)
			j := f.submit(t, "k")
			got := f.waitState(t, j.ID, tc.want)
			as, _ := f.st.Attempts(context.Background(), j.ID)
			var wantAttempts = 1
			if tc.err.(*ExecError).Class.Transient() {
				wantAttempts = 5 // MaxAttempts
			}
			if len(as) != wantAttempts || got.Attempt != wantAttempts {
				t.Errorf("%d attempts (%d counted), want %d: %+v", len(as), got.Attempt, wantAttempts, as)
			}
			for _, a := range as {
				if !a.Spent || a.Outcome != store.OutcomeFailed {
					t.Errorf("failure recorded as %+v", a)
				}
			}
		})
	}
}

// TestRunnerClaimsOnlyWhatCanStart: with room for two sequences in the
// fleet, a runner of many slots leases two jobs and leaves the rest in
// the store for any replica, instead of holding them in its own queue.
func TestRunnerClaimsOnlyWhatCanStart(t *testing.T) {
	snap := backendSnap("a", 100_000)
	snap.MaxNumSeqs = 2
	exec := &scriptedExecutor{hold: make(chan struct{}), started: make(chan struct{}, 10)}
	f := startRunnerOn(t, openStore(t), &staticSource{snaps: []*gpu.Snapshot{snap}}, exec, time.Minute)
	var jobs []store.Job
	for i := range 10 {
		jobs = append(jobs, f.submit(t, fmt.Sprint("k", i)))
	}
	<-exec.started
	<-exec.started
	for range 20 {
		f.runner.Wake()
		time.Sleep(5 * time.Millisecond)
	}
	running := 0
	for _, j := range jobs {
		if got, _ := f.st.Get(context.Background(), "acme", j.ID); got.State == store.Running {
			running++
		}
	}
	if running != 2 {
		t.Errorf("%d jobs leased, want 2: the fleet has room for two", running)
	}
	close(exec.hold)
	for _, j := range jobs {
		f.waitState(t, j.ID, store.Succeeded)
	}
}

// flakyStore fails its first writes of each kind with ErrUnavailable, as
// a database restarting would (or, for completions, with completeErr).
type flakyStore struct {
	store.Store
	completes, marks atomic.Int64 // failures left
	completeErr      error
}

func (s *flakyStore) Complete(ctx context.Context, c store.Completion) error {
	if s.completes.Add(-1) >= 0 {
		return cmp.Or(s.completeErr, fmt.Errorf("complete job: %w: connection refused", store.ErrUnavailable))
	}
	return s.Store.Complete(ctx, c)
}

func (s *flakyStore) MarkSent(ctx context.Context, id string, fence int64, now time.Time, lease time.Duration, reserved *store.Charge) error {
	if s.marks.Add(-1) >= 0 {
		return fmt.Errorf("mark sent: %w: connection refused", store.ErrUnavailable)
	}
	return s.Store.MarkSent(ctx, id, fence, now, lease, reserved)
}

// TestRunnerOutlastsAStoreRestart: the store out of reach when the answer
// is in hand does not lose it (the end is written again, once the store
// answers, without a second backend call); out of reach before the request
// leaves, it sends nothing and spends nothing.
func TestRunnerOutlastsAStoreRestart(t *testing.T) {
	st := &flakyStore{Store: openStore(t)}
	st.completes.Store(3)
	st.marks.Store(2)
	exec := &scriptedExecutor{}
	f := startRunnerOn(t, st, &staticSource{snaps: []*gpu.Snapshot{backendSnap("a", 100_000)}}, exec, time.Minute)
	j := f.submit(t, "k", func(n *store.NewJob) { n.MaxAttempts = 1 })
	got := f.waitState(t, j.ID, store.Succeeded)
	if got.Attempt != 1 || exec.calls.Load() != 1 {
		t.Errorf("attempt %d, %d backend calls; want 1 and 1", got.Attempt, exec.calls.Load())
	}
	as, _ := st.Attempts(context.Background(), j.ID)
	if len(as) != 3 || as[0].Spent || as[0].Sent || as[0].ErrorClass != string(ClassStore) || as[2].Outcome != store.OutcomeSucceeded {
		t.Errorf("attempts %+v: want two unspent waits for the store, then the success", as)
	}
	if n := testutil.ToFloat64(f.runner.m.recordRetries); n != 3 {
		t.Errorf("%v writes tried again, want 3", n)
	}
}

// TestRunnerOutlastsPassingStoreErrors: an answer in hand outlasts the
// store's passing refusals too, not only its absence: SQLite's file held
// by another process past the busy timeout, a PostgreSQL deadlock or a
// failover's read-only moment. The end is written again; no second
// backend call, no attempt spent, the job not left to its lease.
func TestRunnerOutlastsPassingStoreErrors(t *testing.T) {
	for name, err := range map[string]error{
		"sqlite busy": errors.New("complete job: database is locked (5) (SQLITE_BUSY)"),
		"deadlock":    errors.New("complete job: ERROR: deadlock detected (SQLSTATE 40P01)"),
		"read-only":   errors.New("complete job: ERROR: cannot execute UPDATE in a read-only transaction (SQLSTATE 25006)"),
		// pgconn's connect_timeout to a host out of reach matches the
		// context's error: the store out of reach, not the caller gone.
		"connect timeout": fmt.Errorf("complete job: %w: failed to connect: %w", store.ErrUnavailable, context.DeadlineExceeded),
	} {
		t.Run(name, func(t *testing.T) {
			st := &flakyStore{Store: openStore(t), completeErr: err}
			st.completes.Store(2)
			exec := &scriptedExecutor{}
			f := startRunnerOn(t, st, &staticSource{snaps: []*gpu.Snapshot{backendSnap("a", 100_000)}}, exec, time.Minute)
			j := f.submit(t, "k", func(n *store.NewJob) { n.MaxAttempts = 1 })
			got := f.waitState(t, j.ID, store.Succeeded)
			if got.Attempt != 1 || exec.calls.Load() != 1 {
				t.Errorf("attempt %d, %d backend calls; want 1 and 1", got.Attempt, exec.calls.Load())
			}
			if n := testutil.ToFloat64(f.runner.m.recordRetries); n != 2 {
				t.Errorf("%v writes tried again, want 2", n)
			}
		})
	}
}

// deafStore never takes a heartbeat: the store is out of reach for them.
type deafStore struct{ store.Store }

func (deafStore) Heartbeat(context.Context, string, int64, time.Time, time.Duration) error {
	return fmt.Errorf("heartbeat: %w: connection refused", store.ErrUnavailable)
}

// hungStore's heartbeats never answer: a connection half open.
type hungStore struct{ store.Store }

func (hungStore) Heartbeat(ctx context.Context, _ string, _ int64, _ time.Time, _ time.Duration) error {
	<-ctx.Done()
	return ctx.Err()
}

// TestRunnerGivesUpPastItsLease: a worker whose heartbeats cannot land,
// refused or never answered, stops its call once its lease has run out by
// its own clock, rather than run on beside the replica that may own the
// job now.
func TestRunnerGivesUpPastItsLease(t *testing.T) {
	for name, st := range map[string]func(store.Store) store.Store{
		"refused": func(s store.Store) store.Store { return deafStore{s} },
		"hung":    func(s store.Store) store.Store { return hungStore{s} },
	} {
		t.Run(name, func(t *testing.T) {
			exec := &scriptedExecutor{hold: make(chan struct{}), started: make(chan struct{}, 4)}
			defer close(exec.hold)
			f := startRunnerOn(t, st(openStore(t)), &staticSource{snaps: []*gpu.Snapshot{backendSnap("a", 100_000)}}, exec, 300*time.Millisecond)
			f.submit(t, "k")
			// Not waiting for the call to start: on a loaded host the
			// lease can run out before it does, and the worker gives up
			// all the same (the job then waits for a reap, hourly here).
			eventually.True(t, "the worker to give the job up", func() bool { return testutil.ToFloat64(f.runner.m.stale) >= 1 })
		})
	}
}

// TestRetriesKeepWithinTheDeadline: a job handed back again and again (a
// backend refusing connections) keeps trying until near its deadline: a
// jittered backoff that would pass the deadline waits half the time left
// instead of ending the job at once, however early.
func TestRetriesKeepWithinTheDeadline(t *testing.T) {
	exec := &scriptedExecutor{fail: &ExecError{Class: ClassRefused, Err: errors.New("dial tcp: connection refused")}}
	f := startRunnerOn(t, openStore(t), &staticSource{snaps: []*gpu.Snapshot{backendSnap("a", 100_000)}}, exec, time.Minute,
		func(c *RunnerConfig) { c.Backoff = Backoff{Base: 10 * time.Millisecond, Max: time.Hour} })
	deadline := time.Now().Add(4 * time.Second)
	j := f.submit(t, "k", func(n *store.NewJob) { n.Deadline = deadline })
	var got store.Job
	eventually.Within(t, 10*time.Second, "the job to end", func() bool {
		got, _ = f.st.Get(context.Background(), "acme", j.ID)
		return got.State.Final()
	})
	if got.State != store.FailedTerminal || got.ErrorClass != "deadline_exceeded" {
		t.Fatalf("ended %s (%s), want FAILED_TERMINAL deadline_exceeded", got.State, got.ErrorClass)
	}
	if early := deadline.Sub(got.UpdatedAt); early > 150*time.Millisecond {
		t.Errorf("the job ended %v before its deadline, after %d tries: a backoff draw past the deadline ended it", early, exec.calls.Load())
	}
}

// TestWithinDeadline: a retry that would pass the deadline waits half the
// time left, or its floor where that is longer and still fits; a floor
// past the deadline, or too little time left, keeps the retry as it was
// (the job then ends).
func TestWithinDeadline(t *testing.T) {
	r := &Runner{cfg: RunnerConfig{Backoff: Backoff{Base: time.Second}}}
	now := time.Now()
	deadline := now.Add(30 * time.Second)
	past := deadline.Add(time.Minute)
	for _, c := range []struct {
		name  string
		at    time.Time
		floor time.Duration
		want  time.Time
	}{
		{"fits already", now.Add(10 * time.Second), 0, now.Add(10 * time.Second)},
		{"half the time left", past, 0, now.Add(15 * time.Second)},
		{"a floor longer than half that fits", past, 20 * time.Second, now.Add(20 * time.Second)},
		{"a floor past the deadline", past, 40 * time.Second, past},
	} {
		if got := r.withinDeadline(now, deadline, c.at, c.floor); !got.Equal(c.want) {
			t.Errorf("%s: retry at %v, want %v", c.name, got.Sub(now), c.want.Sub(now))
		}
	}
	if got := r.withinDeadline(now, now.Add(time.Second), past, 0); !got.Equal(past) {
		t.Errorf("half a second left: retry at %v, want it left past the deadline", got.Sub(now))
	}
}

// hangsOnce is a store whose first call of one method never answers (a
// connection left half open by a host that crashed) until its caller
// gives up; every other call is the store's.
type hangsOnce struct {
	store.Store
	method string
	hung   atomic.Bool
}

func (s *hangsOnce) hang(ctx context.Context, method string) error {
	if method != s.method || !s.hung.CompareAndSwap(false, true) {
		return nil
	}
	<-ctx.Done()
	return fmt.Errorf("%s: %w", method, ctx.Err())
}

func (s *hangsOnce) Heartbeat(ctx context.Context, id string, fence int64, now time.Time, lease time.Duration) error {
	if err := s.hang(ctx, "Heartbeat"); err != nil {
		return err
	}
	return s.Store.Heartbeat(ctx, id, fence, now, lease)
}

func (s *hangsOnce) Complete(ctx context.Context, c store.Completion) error {
	if err := s.hang(ctx, "Complete"); err != nil {
		return err
	}
	return s.Store.Complete(ctx, c)
}

// TestRunnerOutlastsAHungStoreCall: a call to the store that hangs (its
// connection half open) is given up after a third of the lease and tried
// again, while the lease holds: a hung end does not hold the answered job
// RUNNING until the lease runs out and the reap counts the attempt, and a
// hung beat does not use up the lease and drop the work.
func TestRunnerOutlastsAHungStoreCall(t *testing.T) {
	const lease = 1500 * time.Millisecond
	for _, method := range []string{"Complete", "Heartbeat"} {
		t.Run(method, func(t *testing.T) {
			exec := &scriptedExecutor{}
			if method == "Heartbeat" {
				// The call outlasts the hung beat and the next.
				exec.hold = make(chan struct{})
				time.AfterFunc(2*lease, func() { close(exec.hold) })
			}
			st := &hangsOnce{Store: openStore(t), method: method}
			f := startRunnerOn(t, st, &staticSource{snaps: []*gpu.Snapshot{backendSnap("a", 100_000)}}, exec, lease)
			j := f.submit(t, "k")
			var got store.Job
			eventually.Within(t, 20*time.Second, "the job to end", func() bool {
				got, _ = st.Get(context.Background(), "acme", j.ID)
				return got.State.Final()
			})
			if got.State != store.Succeeded || got.Attempt != 1 || exec.calls.Load() != 1 || !st.hung.Load() {
				t.Errorf("job %s after %d attempts, %d calls (hung: %v); want SUCCEEDED after one", got.State, got.Attempt, exec.calls.Load(), st.hung.Load())
			}
			if n := testutil.ToFloat64(f.runner.m.stale); n != 0 {
				t.Errorf("%v attempts given up", n)
			}
		})
	}
}

// TestReplayedJobWaitsAfresh: the backoff of a job's waits counts the
// claims since its last replay, not its earlier run's: a job that waited
// a dozen times, failed and was replayed waits about the backoff's base
// after its first wait, not up to its cap.
func TestReplayedJobWaitsAfresh(t *testing.T) {
	ctx := context.Background()
	st := openStore(t)
	j := acceptJob(t, st, "k", func(n *store.NewJob) { n.MaxAttempts = 1 })
	now := time.Now()
	claim := func() store.Job {
		t.Helper()
		now = now.Add(time.Millisecond)
		js, err := st.Claim(ctx, now, time.Minute, 1, model)
		if err != nil || len(js) != 1 {
			t.Fatalf("claim: %v, %v", js, err)
		}
		return js[0]
	}
	for range 12 {
		c := claim()
		if err := st.Fail(ctx, store.Failure{JobID: c.ID, Fence: c.Fence, Now: now, RetryAt: now,
			Attempt: store.Attempt{JobID: c.ID, Attempt: 1, Fence: c.Fence, Outcome: store.OutcomeWait, ErrorClass: "refused", StartedAt: now, EndedAt: now}}); err != nil {
			t.Fatal(err)
		}
	}
	c := claim()
	if err := st.Fail(ctx, store.Failure{JobID: c.ID, Fence: c.Fence, Now: now,
		Attempt: store.Attempt{JobID: c.ID, Attempt: 1, Fence: c.Fence, Outcome: store.OutcomeFailed, Spent: true, ErrorClass: "invalid", StartedAt: now, EndedAt: now}}); err != nil {
		t.Fatal(err)
	}
	if _, err := st.(store.Outcomes).Replay(ctx, store.Replay{Tenant: "acme", JobID: j.ID, MaxAttempts: 3, Deadline: time.Now().Add(time.Hour),
		Now: time.Now(), Audit: store.AuditRecord{Actor: "op"}}); err != nil {
		t.Fatal(err)
	}
	exec := &scriptedExecutor{fail: &ExecError{Class: ClassRefused, Err: errors.New("dial tcp: connection refused")}}
	const base = 100 * time.Millisecond
	startRunnerOn(t, st, &staticSource{snaps: []*gpu.Snapshot{backendSnap("a", 100_000)}}, exec, time.Minute,
		func(c *RunnerConfig) { c.Backoff = Backoff{Base: base, Max: time.Hour} })
	var as []store.Attempt
	eventually.True(t, "the replayed job's first wait", func() bool {
		as, _ = st.Attempts(ctx, j.ID)
		return len(as) >= 14
	})
	got, err := st.Get(ctx, "acme", j.ID)
	if err != nil {
		t.Fatal(err)
	}
	if as, _ = st.Attempts(ctx, j.ID); len(as) > 14 {
		return // claimed again already: the wait was short
	}
	if d := got.AvailableAt.Sub(as[13].EndedAt); d > base {
		t.Errorf("the replayed job's first wait is %v, want at most the backoff's base %v", d, base)
	}
}

// landsLate is a store whose first Complete commits, then does not answer
// until its caller gives up: a group commit's batch that went on without
// the caller that left it.
type landsLate struct {
	store.Store
	late atomic.Bool
}

func (s *landsLate) Complete(ctx context.Context, c store.Completion) error {
	err := s.Store.Complete(ctx, c)
	if err == nil && s.late.CompareAndSwap(false, true) {
		<-ctx.Done()
		return ctx.Err()
	}
	return err
}

// TestEndLandedAfterItsTryWasCut: an end whose try was cut by its bound
// but committed is found by the next try as the job ended; the attempt's
// record at its fence says it landed: the job counts as finished, not as
// a result discarded for a lost lease.
func TestEndLandedAfterItsTryWasCut(t *testing.T) {
	st := &landsLate{Store: openStore(t)}
	f := startRunnerOn(t, st, &staticSource{snaps: []*gpu.Snapshot{backendSnap("a", 100_000)}}, &scriptedExecutor{}, 900*time.Millisecond)
	j := f.submit(t, "k")
	eventually.True(t, "the end's second try", func() bool {
		return testutil.ToFloat64(f.runner.m.finished.WithLabelValues("succeeded"))+testutil.ToFloat64(f.runner.m.stale) > 0
	})
	got, _ := st.Get(context.Background(), "acme", j.ID)
	if got.State != store.Succeeded || !st.late.Load() {
		t.Fatalf("job %s (late %v), want SUCCEEDED", got.State, st.late.Load())
	}
	if n := testutil.ToFloat64(f.runner.m.stale); n != 0 {
		t.Errorf("%v results discarded for a lost lease; the end had landed", n)
	}
}
