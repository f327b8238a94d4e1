package scheduler

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

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
