package scheduler

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/kvgate/kvgate/gpu"
)

// refusalsCounted sums the refusals the backends counted
// (kvgate_scheduler_backend_refusals_total): one a backend a check.
func refusalsCounted(t *testing.T, s *Scheduler) float64 {
	t.Helper()
	var n float64
	ch := make(chan prometheus.Metric, 64)
	go func() { s.m.blocks.Collect(ch); close(ch) }()
	for m := range ch {
		var d dto.Metric
		if err := m.Write(&d); err != nil {
			t.Fatal(err)
		}
		n += d.GetCounter().GetValue()
	}
	return n
}

// TestPumpPrefixWaitsAndMisses: a ticket waiting for the backend that
// holds its prefix, while another backend could take it, costs a pass a
// scan and not a miss, so that a ticket behind more such than
// maxScanMisses still gets the room it fits; one waiting there while no
// backend could take it is a miss like any other, so that a saturated
// fleet's pass stops after maxScanMisses of them instead of checking the
// whole queue again on every release.
func TestPumpPrefixWaitsAndMisses(t *testing.T) {
	for _, saturated := range []bool{false, true} {
		s := newTestScheduler(t, Policy{KVTarget: 1, MaxQueueWait: time.Minute}, backendSnap("a", 40_000), backendSnap("b", 40_000))
		sys := text("one client's system prompt", 24_000) // 6,000 tokens
		ask := func() *Ticket {
			prompt := sys + text("the same question", 4_000)
			return &Ticket{Model: model, PromptTokens: len(prompt) / 4, MaxTokens: 500, Prefix: NewPrefix("", prompt, len(prompt)/4)}
		}
		acquireOn(t, s, ask(), "a")                                                     // the prefix, on a
		acquireOn(t, s, &Ticket{Model: model, PromptTokens: 20_000, MaxTokens: 1}, "b") // b, the emptier
		acquireOn(t, s, &Ticket{Model: model, PromptTokens: 30_000, MaxTokens: 1}, "a") // a full: ~2,500 free
		if saturated {
			acquireOn(t, s, &Ticket{Model: model, PromptTokens: 18_000, MaxTokens: 1}, "b") // b full too
		}
		ctx, cancel := context.WithCancel(context.Background())
		const waiting = 3 * maxScanMisses
		for i := range waiting {
			acquireAsync(ctx, s, ask())
			waitQueued(t, s, i+1)
		}
		small := acquireAsync(ctx, s, &Ticket{Model: model, PromptTokens: 500, MaxTokens: 10})
		waitQueued(t, s, waiting+1)
		before := refusalsCounted(t, s)
		s.Wake()
		checks := (refusalsCounted(t, s) - before) / 2 // both backends refuse each
		if saturated {
			if checks > maxScanMisses {
				t.Errorf("saturated fleet: one pass checked %v tickets, want at most maxScanMisses (%d)", checks, maxScanMisses)
			}
		} else {
			select {
			case o := <-small:
				if o.err != nil || o.g.Backend != "b" {
					t.Errorf("the small ticket behind %d waiting for their prefix: %v, %v; want b", waiting, o.g, o.err)
				}
			case <-time.After(10 * time.Second):
				t.Errorf("the small ticket behind %d waiting for their prefix, with room on b, was not admitted", waiting)
			}
		}
		cancel()
	}
}

// TestPumpMissesByModel: tickets of a model that fit nowhere end a pass's
// checks of that model's tickets, not of another model's, whose backend
// has room again.
func TestPumpMissesByModel(t *testing.T) {
	s := newTestScheduler(t, Policy{KVTarget: 1, MaxQueueWait: time.Minute}, backendSnap("a", 40_000), m2Snap("c"))
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	// Both backends full.
	if _, err := s.Acquire(ctx, &Ticket{Model: model, PromptTokens: 39_000, MaxTokens: 1}); err != nil {
		t.Fatal(err)
	}
	hog, m2 := m2BehindModel(ctx, t, s)
	hog.Release() // room on c: the pass it starts reaches the m2 ticket
	wantOnC(t, m2, "the m2 ticket behind tickets of m that fit nowhere, with c free")
}

// m2Snap is a backend serving model m2 alone.
func m2Snap(name string) *gpu.Snapshot {
	sn := backendSnap(name, 40_000)
	sn.Models = []gpu.Model{{ID: "m2", MaxModelLen: 100_000}}
	return sn
}

// waitingOfModel is how many tickets of model m2BehindModel queues.
const waitingOfModel = 2 * maxScanMisses

// m2BehindModel fills the m2 backend with a hog, then queues
// waitingOfModel tickets of model and one of m2 behind them; it returns
// the hog and the m2 ticket's outcome.
func m2BehindModel(ctx context.Context, t *testing.T, s *Scheduler) (*Grant, <-chan outcome) {
	t.Helper()
	hog, err := s.Acquire(ctx, &Ticket{Model: "m2", PromptTokens: 39_000, MaxTokens: 1})
	if err != nil {
		t.Fatal(err)
	}
	for i := range waitingOfModel {
		acquireAsync(ctx, s, &Ticket{Model: model, PromptTokens: 2_000 + i, MaxTokens: 10})
		waitQueued(t, s, i+1)
	}
	m2 := acquireAsync(ctx, s, &Ticket{Model: "m2", PromptTokens: 1_000, MaxTokens: 10})
	waitQueued(t, s, waitingOfModel+1)
	return hog, m2
}

// wantOnC fails unless the ticket of ch is admitted on backend c.
func wantOnC(t *testing.T, ch <-chan outcome, what string) {
	t.Helper()
	select {
	case o := <-ch:
		if o.err != nil || o.g.Backend != "c" {
			t.Errorf("%s: %v, %v; want c", what, o.g, o.err)
		}
	case <-time.After(10 * time.Second):
		t.Errorf("%s was not admitted", what)
	}
}

// TestPumpStopsAtBackendsThatRefuseAll: once every backend serving a
// model refuses for a reason of its load alone (here vLLM's own queue), a
// pass checks none of the model's other tickets, where it used to check
// maxScanMisses of them against every backend on each release; another
// model's ticket behind them is still checked and admitted.
func TestPumpStopsAtBackendsThatRefuseAll(t *testing.T) {
	a, b := backendSnap("a", 40_000), backendSnap("b", 40_000)
	a.Metrics.Waiting, b.Metrics.Waiting = 3, 3 // over max_backend_waiting (2)
	s := newTestScheduler(t, Policy{KVTarget: 1, MaxQueueWait: time.Minute}, a, b, m2Snap("c"))
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	hog, m2 := m2BehindModel(ctx, t, s)
	before := refusalsCounted(t, s)
	hog.Release() // room on c: a pass
	if checks := refusalsCounted(t, s) - before; checks != 2 {
		t.Errorf("the pass counted %v refusals, want 2: one check of the first ticket on a and on b, none of the %d behind it", checks, waitingOfModel-1)
	}
	wantOnC(t, m2, "the m2 ticket behind tickets of m whose backends refuse all")
	if q := s.Queued(); q[Interactive] != waitingOfModel {
		t.Errorf("%d tickets queued, want the %d of m", q[Interactive], waitingOfModel)
	}
}

// TestPumpFailsTicketThatOutgrowsEveryBackend: a queued ticket whose
// prompt, counted again as it waits (PromptEstimate), no longer fits any
// backend's whole KV capacity fails at once with a *TooLargeError, as it
// would have at Acquire, instead of waiting out its deadline; the
// model's other tickets go on being admitted.
func TestPumpFailsTicketThatOutgrowsEveryBackend(t *testing.T) {
	s := newTestScheduler(t, Policy{}, backendSnap("a", 1_000))
	ctx := context.Background()
	hold, err := s.Acquire(ctx, &Ticket{Model: model, PromptTokens: 400, MaxTokens: 400})
	if err != nil {
		t.Fatal(err)
	}
	var estimate atomic.Int64
	estimate.Store(400)
	big := &Ticket{Model: model, PromptTokens: 400, MaxTokens: 100, Deadline: time.Now().Add(3 * time.Second),
		PromptEstimate: func() int { return int(estimate.Load()) }}
	bigDone := acquireAsync(ctx, s, big)
	waitQueued(t, s, 1)
	small := acquireAsync(ctx, s, &Ticket{Model: model, PromptTokens: 100, MaxTokens: 100, Deadline: time.Now().Add(time.Hour)})
	waitQueued(t, s, 2)
	estimate.Store(5_000) // the prompt is five times what its bytes suggested
	hold.Release()
	o := <-bigDone
	var tl *TooLargeError
	if !errors.As(o.err, &tl) || tl.Need != 5_100 {
		t.Fatalf("the outgrown ticket: %v, %v; want a TooLargeError for 5,100 tokens", o.g, o.err)
	}
	if o := <-small; o.err != nil {
		t.Fatalf("the model's next ticket: %v", o.err)
	} else {
		o.g.Release()
	}
}

// TestPanicInPumpLeavesSchedulerUsable: a panic inside admission (here a
// ticket's prompt estimate, run by the pump a Release starts) reaches
// the caller (net/http recovers a handler's) without leaving the
// scheduler locked: other requests are admitted and released after it.
func TestPanicInPumpLeavesSchedulerUsable(t *testing.T) {
	s := newTestScheduler(t, Policy{}, backendSnap("a", 1_000))
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	hold, err := s.Acquire(ctx, &Ticket{Model: model, PromptTokens: 400, MaxTokens: 400})
	if err != nil {
		t.Fatal(err)
	}
	bad := acquireAsync(ctx, s, &Ticket{Model: model, PromptTokens: 400, MaxTokens: 400,
		PromptEstimate: func() int { panic("estimate broke") }})
	waitQueued(t, s, 1)
	func() {
		defer func() {
			if r := recover(); r != "estimate broke" {
				t.Errorf("recovered %v, want the estimate's panic", r)
			}
		}()
		hold.Release()
	}()
	done := make(chan error, 1)
	go func() {
		g, err := s.Acquire(ctx, &Ticket{Model: model, PromptTokens: 10, MaxTokens: 10, Deadline: time.Now().Add(100 * time.Millisecond)})
		if err == nil {
			g.Release()
		}
		done <- err
	}()
	select {
	case <-done: // admitted, or refused for room: either way not locked out
	case <-time.After(10 * time.Second):
		t.Fatal("the scheduler stayed locked after a panic in its pump")
	}
	cancel()
	<-bad
}
