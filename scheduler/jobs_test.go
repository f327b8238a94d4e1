package scheduler

import (
	"context"
	"encoding/json"
	"errors"
	"path/filepath"

	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/kvgate/kvgate/store"
	"github.com/kvgate/kvgate/store/sqlite"
)

// scriptedExecutor answers each call with the next outcome from calls,
// waiting for release first when hold is set.
type scriptedExecutor struct {
	calls   atomic.Int64
	hold    chan struct{} // nil: answer at once
	started chan struct{} // receives one value per call
	fail    error         // when set, every call fails so
}

func (e *scriptedExecutor) Ticket(j store.Job) (*Ticket, error) {
	return &Ticket{Model: model, PromptTokens: 10, MaxTokens: 10}, nil
}

func (e *scriptedExecutor) Execute(ctx context.Context, j store.Job, g *Grant) (Outcome, error) {
	e.calls.Add(1)
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
	if e.fail != nil {
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
	st, err := sqlite.Open(context.Background(), filepath.Join(t.TempDir(), "jobs.db"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := sqlite.Migrate(context.Background(), st); err != nil {
		t.Fatal(err)
	}
	sched := newTestScheduler(t, Policy{}, backendSnap("a", 100_000))
	r := NewRunner(st, sched, exec, RunnerConfig{Concurrency: 4, Lease: lease, Poll: 10 * time.Millisecond,
		ReapEvery: time.Hour, Backoff: Backoff{Base: time.Millisecond, Max: 5 * time.Millisecond}})
	ctx, cancel := context.WithCancel(context.Background())
	f := &runnerFixture{st: st, runner: r, cancel: cancel, done: make(chan struct{})}
	go func() { _ = r.Run(ctx); close(f.done) }()
	t.Cleanup(func() {
		f.stop()
		st.Close()
	})
	return f
}

func (f *runnerFixture) stop() {
	f.cancel()
	<-f.done
}

func (f *runnerFixture) submit(t *testing.T, key string) store.Job {
	t.Helper()
	j, _, err := f.st.Accept(context.Background(), store.NewJob{
		ID: uuid.Must(uuid.NewV7()).String(), Tenant: "acme", IdempotencyKey: key, RequestHash: key,
		Endpoint: "/v1/completions", Model: model, Body: json.RawMessage(`{}`), MaxAttempts: 5,
		Deadline: time.Now().Add(time.Hour), Now: time.Now(),
	})
	if err != nil {
		t.Fatal(err)
	}
	f.runner.Wake()
	return j
}

func (f *runnerFixture) waitState(t *testing.T, id string, want store.State) store.Job {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(2 * time.Millisecond) {
		j, err := f.st.Get(context.Background(), "acme", id)
		if err == nil && j.State == want {
			return j
		}
		if time.Now().After(deadline) {
			t.Fatalf("job %s is %s, want %s", id, j.State, want)
		}
	}
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
	claimed, err := f.st.Claim(ctx, time.Now(), time.Millisecond, 1)
	if err != nil || len(claimed) != 1 {
		t.Fatal(claimed, err)
	}
	c := claimed[0]
	if err := f.st.SaveStage(ctx, c.ID, c.Fence, stageInference, []byte(`{"answer":"saved"}`)); err != nil {
		t.Fatal(err)
	}
	// The earlier worker died before recording its end: its lease expires.
	if _, err := f.st.Reap(ctx, time.Now().Add(10*time.Millisecond), 10); err != nil {
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
}

// TestRunnerHandsJobsBackOnShutdown: stopping the runner mid-call records
// the attempt as interrupted and makes the job runnable at once.
func TestRunnerHandsJobsBackOnShutdown(t *testing.T) {
	exec := &scriptedExecutor{hold: make(chan struct{}), started: make(chan struct{}, 1)}
	f := startRunner(t, exec, time.Minute)
	j := f.submit(t, "k")
	<-exec.started
	f.stop()
	got, _ := f.st.Get(context.Background(), "acme", j.ID)
	if got.State != store.RetryScheduled || got.AvailableAt.After(time.Now()) {
		t.Errorf("after shutdown: %s available at %v, want RETRY_SCHEDULED now", got.State, got.AvailableAt)
	}
	as, _ := f.st.Attempts(context.Background(), j.ID)
	if len(as) != 1 || as[0].Outcome != "interrupted" {
		t.Errorf("attempts %+v", as)
	}
}

func TestRunnerClassifiesFailures(t *testing.T) {
	for _, tc := range []struct {
		name string
		err  error
		want store.State
	}{
		{"invalid request ends the job", &ExecError{Class: ClassInvalid, Status: 400, Err: errors.New("bad")}, store.FailedTerminal},
		{"429 retries until attempts run out", &ExecError{Class: ClassRateLimited, Status: 429, Err: errors.New("slow down")}, store.FailedTerminal},
	} {
		t.Run(tc.name, func(t *testing.T) {
			exec := &scriptedExecutor{fail: tc.err}
			f := startRunner(t, exec, time.Minute)
			j := f.submit(t, "k")
			f.waitState(t, j.ID, tc.want)
			as, _ := f.st.Attempts(context.Background(), j.ID)
			var wantAttempts = 1
			if tc.err.(*ExecError).Class.Transient() {
				wantAttempts = 5 // MaxAttempts
			}
			if len(as) != wantAttempts {
				t.Errorf("%d attempts, want %d: %+v", len(as), wantAttempts, as)
			}
		})
	}
}
