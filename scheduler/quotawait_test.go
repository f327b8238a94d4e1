package scheduler

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/kvgate/kvgate/bench/eventually"
	"github.com/kvgate/kvgate/store"
)

// quotaExecutor refuses the first refusals calls as over the tenant's
// quota, resetting after reset, then answers.
type quotaExecutor struct {
	scriptedExecutor
	refusals int64
	reset    time.Duration
	seen     atomic.Int64
	prepared atomic.Int64 // calls of Prepare: one per claim
}

func (e *quotaExecutor) Prepare(ctx context.Context, j store.Job) (*Call, error) {
	e.prepared.Add(1)
	c, err := e.scriptedExecutor.Prepare(ctx, j)
	if err != nil {
		return nil, err
	}
	c.Admit = func(context.Context) error {
		if e.seen.Add(1) <= e.refusals {
			return &ExecError{Class: ClassQuota, Status: 429, RetryAfter: e.reset, Err: errors.New("tenant quota tokens")}
		}
		return nil
	}
	return c, nil
}

// A short quota wait happens inside the attempt: the job succeeds on its
// first attempt however often its tenant's quota refused it.
func TestRunnerWaitsForQuotaInPlace(t *testing.T) {
	for _, tc := range []struct {
		name  string
		reset time.Duration
	}{
		{"rate window resets", 3 * time.Millisecond},
		{"concurrency frees up (no reset)", 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			exec := &quotaExecutor{refusals: 20, reset: tc.reset}
			f := startRunner(t, exec, time.Minute)
			j := f.submit(t, "k")
			got := f.waitState(t, j.ID, store.Succeeded)
			if got.Attempt != 1 {
				t.Errorf("attempt %d, want 1: quota waits must not spend attempts", got.Attempt)
			}
			as, _ := f.st.Attempts(context.Background(), j.ID)
			if len(as) != 1 || as[0].Outcome != "succeeded" {
				t.Errorf("attempts %+v, want one success", as)
			}
			if n := testutil.ToFloat64(f.runner.m.quotaWaits); n != 20 {
				t.Errorf("%v quota waits, want 20", n)
			}
			if n := exec.prepared.Load(); n != 1 {
				t.Errorf("the request was prepared %d times, want once however long its quota wait", n)
			}
		})
	}
}

// A reset later than QuotaWait (a minute) hands the job back for a retry at the
// reset (spending nothing), or ends it when the reset is past the deadline.
func TestRunnerHandsLongQuotaWaitsBack(t *testing.T) {
	for _, tc := range []struct {
		name  string
		reset time.Duration
		want  store.State
	}{
		{"budget resets before the deadline", 30 * time.Minute, store.RetryScheduled},
		{"budget resets after the deadline", 2 * time.Hour, store.FailedTerminal},
	} {
		t.Run(tc.name, func(t *testing.T) {
			exec := &quotaExecutor{refusals: 1 << 30, reset: tc.reset}
			f := startRunner(t, exec, time.Minute)
			start := time.Now()
			j := f.submit(t, "k")
			got := f.waitState(t, j.ID, tc.want)
			if tc.want == store.RetryScheduled && got.AvailableAt.Before(start.Add(tc.reset)) {
				t.Errorf("available at %v, want at the reset, %v or later", got.AvailableAt, start.Add(tc.reset))
			}
			as, _ := f.st.Attempts(context.Background(), j.ID)
			if len(as) != 1 || as[0].ErrorClass != string(ClassQuota) || as[0].Spent || got.Attempt != 0 {
				t.Errorf("attempts %+v (%d counted), want one unspent %s", as, got.Attempt, ClassQuota)
			}
			if tc.want == store.FailedTerminal && got.ErrorClass != "deadline_exceeded" {
				t.Errorf("error class %s, want deadline_exceeded: no attempt of its own failed", got.ErrorClass)
			}
			if n := testutil.ToFloat64(f.runner.m.quotaWaits); n != 0 {
				t.Errorf("%v quota waits in place, want 0", n)
			}
		})
	}
}

// A drain hands back at once, spending nothing, a job that waits in place
// for its tenant's quota: its request has not left, and a replica that
// stays can take it.
func TestRunnerDrainHandsBackWaitingJobs(t *testing.T) {
	exec := &quotaExecutor{refusals: 1 << 30, reset: 5 * time.Millisecond}
	f := startRunner(t, exec, time.Minute)
	j := f.submit(t, "k", func(n *store.NewJob) { n.MaxAttempts = 1 })
	eventually.True(t, "the job to wait for its quota", func() bool { return testutil.ToFloat64(f.runner.m.quotaWaits) > 2 })
	f.runner.Drain()
	got := f.waitState(t, j.ID, store.RetryScheduled)
	as, _ := f.st.Attempts(context.Background(), j.ID)
	if got.Attempt != 0 || len(as) != 1 || as[0].Outcome != store.OutcomeInterrupted || as[0].Spent || as[0].Sent {
		t.Errorf("after the drain: attempt %d, attempts %+v; want one unspent, unsent interruption", got.Attempt, as)
	}
	select {
	case <-f.done: // drained: nothing left in flight
	case <-time.After(eventually.Timeout):
		t.Fatal("the runner did not return after its drain")
	}
}
