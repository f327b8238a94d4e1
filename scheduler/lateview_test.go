package scheduler

import (
	"context"
	"fmt"
	"math"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/kvgate/kvgate/gpu"
)

// TestProgressSourceGauge: /metrics says, per backend, which source
// admission follows non-streaming progress by.
func TestProgressSourceGauge(t *testing.T) {
	steps := backendSnap("steps", 1000)
	steps.Metrics.HasSteps = true
	rate := backendSnap("rate", 1000)
	rate.DecodeRate = 49
	none := backendSnap("none", 1000)
	s := newTestScheduler(t, Policy{}, steps, rate, none)
	want := `
# HELP kvgate_scheduler_backend_progress_source 1 for the source admission follows a backend's non-streaming requests by: steps (vllm:iteration_tokens_total), decode_rate (generation_tokens_total over running, bounded), none (assumes no progress); 0 for the others.
# TYPE kvgate_scheduler_backend_progress_source gauge
kvgate_scheduler_backend_progress_source{backend="none",source="decode_rate"} 0
kvgate_scheduler_backend_progress_source{backend="none",source="none"} 1
kvgate_scheduler_backend_progress_source{backend="none",source="steps"} 0
kvgate_scheduler_backend_progress_source{backend="rate",source="decode_rate"} 1
kvgate_scheduler_backend_progress_source{backend="rate",source="none"} 0
kvgate_scheduler_backend_progress_source{backend="rate",source="steps"} 0
kvgate_scheduler_backend_progress_source{backend="steps",source="decode_rate"} 0
kvgate_scheduler_backend_progress_source{backend="steps",source="none"} 0
kvgate_scheduler_backend_progress_source{backend="steps",source="steps"} 1
`
	if err := testutil.CollectAndCompare(stateCollector{s}, strings.NewReader(want), "kvgate_scheduler_backend_progress_source"); err != nil {
		t.Error(err)
	}
}

// TestDecideWaitingSinceScrape: the waiting-queue guard counts what kvgate
// sent since the scrape that vLLM may not have taken in yet, as the
// sequence guard counts what it sent: one pass cannot pile tickets into
// vLLM's queue against one scrape.
func TestDecideWaitingSinceScrape(t *testing.T) {
	p := Policy{}
	p.defaults() // max_backend_waiting 2
	for _, tc := range []struct {
		name                 string
		waiting, unscheduled int
		share                float64
		ok                   bool
	}{
		{"nothing waits", 0, 0, 1, true},
		{"two sent since, none seen waiting", 0, 2, 1, true},
		{"three sent since and not scheduled", 0, 3, 1, false},
		{"one waiting, two sent since", 1, 2, 1, false},
		{"two waiting, none sent since", 2, 0, 1, true},
		{"three waiting", 3, 0, 1, false},
		{"beside another replica, one sent since", 0, 2, 0.5, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l := load{routable: true, capacity: 100_000, maxNumSeqs: 256, exact: true, share: tc.share,
				measuredWaiting: tc.waiting, unscheduled: tc.unscheduled, newSinceScrape: tc.unscheduled}
			v := decide(&l, 100, 100, &p)
			if v.ok != tc.ok || (!v.ok && v.reason != reasonWaiting) {
				t.Errorf("decide = %+v, want ok=%v (or %s)", v, tc.ok, reasonWaiting)
			}
		})
	}
}

func TestScheduledSince(t *testing.T) {
	for _, tc := range []struct {
		name              string
		admitted, stepsAt float64
		want              bool
	}{
		{"no step counter", -1, -1, false},
		{"admitted before the counter was known", -1, 500, false},
		{"no step since", 100, 100, false},
		{"one step since: maybe its prefill", 100, 101, false},
		{"two steps since", 100, 102, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := scheduledSince(&Grant{admittedStep: tc.admitted}, tc.stepsAt); got != tc.want {
				t.Errorf("scheduledSince = %v, want %v", got, tc.want)
			}
		})
	}
}

// TestDecideLargerThanTarget: a request above kv_target × capacity but
// within the capacity waits until the backend can hold it alone, then goes.
func TestDecideLargerThanTarget(t *testing.T) {
	p := Policy{}
	p.defaults()
	p.KVTarget = 0.9 // 90,000 of 100,000
	for _, tc := range []struct {
		name        string
		mod         func(*load)
		prompt, out int
		ok          bool
		reason      string
		needExact   bool
	}{
		{name: "within the target: the usual path", prompt: 45_000, out: 45_000, ok: true},
		{name: "above the target, backend empty", prompt: 60_000, out: 35_000, ok: true},
		{name: "above the target, rounding included", mod: func(l *load) { l.blockSize = 16 }, prompt: 60_000, out: 39_990, reason: reasonKV},
		{name: "above the target, kvgate has work there", mod: func(l *load) { l.inflight, l.reserved = 1, 100 }, prompt: 60_000, out: 35_000, reason: reasonAlone},
		{name: "above the target, foreign load leaves no room", mod: func(l *load) { l.measuredUsed = 10_000 }, prompt: 60_000, out: 35_000, reason: reasonAlone},
		{name: "foreign load may be kvgate's releases: ask for the exact ledger", mod: func(l *load) { l.measuredUsed = 10_000; l.exact = false }, prompt: 60_000, out: 35_000, reason: reasonAlone, needExact: true},
		{name: "releases in the scrape are not foreign", mod: func(l *load) { l.measuredUsed, l.heldBeforeScrape = 10_000, 10_000 }, prompt: 60_000, out: 35_000, ok: true},
		{name: "some foreign load, still room", mod: func(l *load) { l.measuredUsed = 4_000 }, prompt: 60_000, out: 35_000, ok: true},
		{name: "degraded lowers the target, not the capacity", mod: func(l *load) { l.degraded = true }, prompt: 60_000, out: 35_000, ok: true},
		{name: "above the capacity", prompt: 60_000, out: 40_001, reason: reasonKV},
		{name: "the other guards still apply", mod: func(l *load) { l.stale = true }, prompt: 60_000, out: 35_000, reason: reasonStale},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l := load{routable: true, capacity: 100_000, maxNumSeqs: 256, exact: true, share: 1}
			if tc.mod != nil {
				tc.mod(&l)
			}
			v := decide(&l, tc.prompt, tc.out, &p)
			if v.ok != tc.ok || v.reason != tc.reason || v.needExact != tc.needExact {
				t.Errorf("decide = %+v, want ok=%v reason=%q needExact=%v", v, tc.ok, tc.reason, tc.needExact)
			}
		})
	}
}

// TestWaitingGuardCountsSentSinceScrape: against one scrape that showed an
// empty queue, kvgate sends no more than max_backend_waiting+1 requests
// that the backend has not had the steps to take in; once its step
// counter has moved on, the next goes.
func TestWaitingGuardCountsSentSinceScrape(t *testing.T) {
	for _, withSteps := range []bool{true, false} {
		t.Run(fmt.Sprint("steps=", withSteps), func(t *testing.T) {
			t0 := time.Now()
			var mu sync.Mutex
			now := t0
			clock := func() time.Time { mu.Lock(); defer mu.Unlock(); return now }
			sn := backendSnap("a", 100_000)
			sn.ScrapedAt = t0.Add(-time.Millisecond)
			if withSteps {
				sn.Metrics.HasSteps, sn.Metrics.Steps, sn.StepRate = true, 100, 1000 // a step a millisecond
			}
			s, err := New(&staticSource{snaps: []*gpu.Snapshot{sn}}, Options{Policy: Policy{}, Now: clock})
			if err != nil {
				t.Fatal(err)
			}
			for i := range 3 {
				g, err := s.Acquire(t.Context(), &Ticket{Model: model, PromptTokens: 10, MaxTokens: 10})
				if err != nil {
					t.Fatalf("ticket %d: %v", i, err)
				}
				defer g.Release()
			}
			fourth := acquireAsync(t.Context(), s, &Ticket{Model: model, PromptTokens: 10, MaxTokens: 10})
			waitQueued(t, s, 1)
			mu.Lock()
			now = now.Add(5 * time.Millisecond) // five steps, no new scrape
			mu.Unlock()
			s.Wake()
			if withSteps {
				o := <-fourth
				if o.err != nil {
					t.Fatal(o.err)
				}
				o.g.Release()
				return
			}
			if q := s.Queued(); q[Interactive] != 1 {
				t.Fatalf("without a step counter the fourth went before a scrape showed the queue: queued %v", q)
			}
		})
	}
}

// TestPacingMark: pacing's clock after an admission. The steps since the
// previous pass are credit (a late pass catches up, up to four gaps);
// steps in which passes ran and found no room are not.
func TestPacingMark(t *testing.T) {
	for _, tc := range []struct {
		name                     string
		last, now, gap, prevPass float64
		want                     float64
	}{
		{"no gap applied: the clock restarts", 100, 150, 0, 140, 150},
		{"first admission", -1, 150, 10, -1, 150},
		{"no step counter", 100, -1, 10, 90, -1},
		{"passes every step: no credit", 100, 150, 10, 149, 149},
		{"on time: the gap", 100, 110, 10, 109, 110},
		{"a late pass: credit back to the previous one", 100, 130, 10, 105, 110},
		{"a very late pass: credit up to four gaps", 100, 200, 10, 101, 160},
		{"previous pass unknown: no credit", 100, 150, 10, -1, 150},
		{"previous pass in the future (clock skew): no credit", 100, 150, 10, 170, 150},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := pacingMark(tc.last, tc.now, tc.gap, tc.prevPass); got != tc.want {
				t.Errorf("pacingMark(%v, %v, %v, %v) = %v, want %v", tc.last, tc.now, tc.gap, tc.prevPass, got, tc.want)
			}
		})
	}
}

// TestLateView: a backend past the staleness bound only because its next
// scrape is late keeps admitting, with the target lowered by lateMargin;
// one whose scrapes fail, never scraped, or past twice the bound is stale.
func TestLateView(t *testing.T) {
	now := time.Now()
	for _, tc := range []struct {
		name  string
		age   time.Duration
		err   string
		never bool
		late  bool
	}{
		{"fresh", 500 * time.Millisecond, "", false, false},
		{"just past the bound", 1100 * time.Millisecond, "", false, true},
		{"at twice the bound", 2 * time.Second, "", false, true},
		{"past twice the bound", 2100 * time.Millisecond, "", false, false},
		{"a scrape failed since", 1100 * time.Millisecond, "GET /metrics: status 500", false, false},
		{"never scraped", 0, "", true, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			sn := &gpu.Snapshot{ScrapedAt: now.Add(-tc.age), StaleAfter: time.Second, ScrapeErr: tc.err}
			if tc.never {
				sn.ScrapedAt = time.Time{}
			}
			if got := lateView(sn, now); got != tc.late {
				t.Errorf("lateView = %v, want %v", got, tc.late)
			}
		})
	}
	p := Policy{}
	p.defaults() // kv_target 0.95; at the end of the late window 0.85
	for _, tc := range []struct {
		late     bool
		lateness float64
		need     int
		ok       bool
	}{
		{false, 0, 90_000, true},
		{true, 1, 90_000, false}, // twice the bound: the whole margin
		{true, 1, 84_000, true},
		{true, 0.5, 89_900, true}, // halfway: target 0.90
		{true, 0.5, 90_200, false},
		{true, 0.1, 93_900, true}, // just late: target 0.94
		{true, 0.1, 94_100, false},
		{true, 3, 84_000, true}, // never more than the margin
		{true, 3, 85_100, false},
	} {
		l := load{routable: true, capacity: 100_000, maxNumSeqs: 256, exact: true, share: 1, late: tc.late, lateness: tc.lateness,
			inflight: 1, reserved: 1, flights: []flight{{held: 1, remaining: 0}}}
		if v := decide(&l, tc.need/2, tc.need/2, &p); v.ok != tc.ok {
			t.Errorf("late=%v lateness %v need %d: %+v, want ok=%v", tc.late, tc.lateness, tc.need, v, tc.ok)
		}
	}
}

// TestLateness: the late margin's share grows with the view's age past
// the staleness bound, from 0 there to 1 at twice it; neither a fresh nor
// a stale view has any.
func TestLateness(t *testing.T) {
	now := time.Now()
	for _, tc := range []struct {
		age  time.Duration
		err  string
		want float64
	}{
		{500 * time.Millisecond, "", 0},
		{time.Second, "", 0},
		{1250 * time.Millisecond, "", 0.25},
		{1500 * time.Millisecond, "", 0.5},
		{2 * time.Second, "", 1},
		{2100 * time.Millisecond, "", 0}, // stale, not late
		{1500 * time.Millisecond, "GET /metrics: status 500", 0},
	} {
		sn := &gpu.Snapshot{ScrapedAt: now.Add(-tc.age), StaleAfter: time.Second, ScrapeErr: tc.err}
		if got := lateness(sn, now); math.Abs(got-tc.want) > 1e-9 {
			t.Errorf("age %v (scrape error %q): lateness %v, want %v", tc.age, tc.err, got, tc.want)
		}
	}
}

// TestReleaseCountsFromBackendFinish: a grant whose backend finished
// before a scrape began is not in that scrape's measurement, though the
// caller released it after the scrape (it was still writing the answer to
// its client): its tokens are not credited as kvgate's own in the
// measurement, which would understate the load kvgate did not send.
func TestReleaseCountsFromBackendFinish(t *testing.T) {
	var mu sync.Mutex
	now := time.Now()
	clock := func() time.Time { mu.Lock(); defer mu.Unlock(); return now }
	advance := func(d time.Duration) { mu.Lock(); now = now.Add(d); mu.Unlock() }
	src := &staticSource{snaps: []*gpu.Snapshot{backendSnap("a", 100_000)}}
	s, err := New(src, Options{Now: clock})
	if err != nil {
		t.Fatal(err)
	}
	credited := func() int {
		sn := src.Snapshots()[0]
		s.mu.Lock()
		defer s.mu.Unlock()
		return s.loadOf(sn, s.ledgers["a"], clock(), true).heldBeforeScrape
	}
	// A backend that finished during the fetch may have written the page
	// after: not credited either.
	g, err := s.Acquire(context.Background(), &Ticket{Model: model, PromptTokens: 1_000, MaxTokens: 100})
	if err != nil {
		t.Fatal(err)
	}
	advance(time.Millisecond)
	sn := backendSnap("a", 100_000)
	sn.ScrapedAt = clock() // the fetch begins
	advance(time.Millisecond)
	g.BackendDone()
	advance(time.Millisecond)
	sn.ScrapeDone = clock() // the page has come
	src.mu.Lock()
	src.snaps = []*gpu.Snapshot{sn}
	src.mu.Unlock()
	advance(time.Millisecond)
	g.Release()
	if got := credited(); got != 0 {
		t.Errorf("a request the backend finished during the scrape's fetch is credited %d tokens in it, want 0", got)
	}
	for _, finishFirst := range []bool{true, false} {
		g, err := s.Acquire(context.Background(), &Ticket{Model: model, PromptTokens: 1_000, MaxTokens: 100})
		if err != nil {
			t.Fatal(err)
		}
		advance(time.Millisecond)
		if finishFirst {
			g.BackendDone() // the backend is done; the client still reads
		}
		advance(time.Millisecond)
		sn := backendSnap("a", 100_000)
		sn.ScrapedAt = clock() // a scrape begins: vLLM has freed the request if it finished
		src.mu.Lock()
		src.snaps = []*gpu.Snapshot{sn}
		src.mu.Unlock()
		advance(time.Millisecond)
		g.Release()
		got := credited()
		if finishFirst && got != 0 {
			t.Errorf("a request the backend finished before the scrape is credited %d tokens in it, want 0", got)
		}
		if !finishFirst && got < 1_000 {
			t.Errorf("a request running at the scrape, released after it, is credited %d tokens in it, want its prompt at least", got)
		}
	}
}
