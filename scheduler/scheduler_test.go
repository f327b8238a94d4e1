package scheduler

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvgate/kvgate/bench/eventually"

	"github.com/kvgate/kvgate/gpu"
)

const model = "m"

// staticSource serves fixed snapshots, as a pool would with fresh metrics.
type staticSource struct {
	mu    sync.Mutex
	snaps []*gpu.Snapshot
}

func (s *staticSource) Snapshots() []*gpu.Snapshot {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.snaps
}

// backendSnap is a healthy, freshly scraped, idle backend.
func backendSnap(name string, capacity int) *gpu.Snapshot {
	return &gpu.Snapshot{
		Name: name, URL: "http://" + name, Models: []gpu.Model{{ID: model, MaxModelLen: 100_000}},
		ScrapedAt: time.Now().Add(time.Hour), StaleAfter: time.Hour, // fresh for the whole test
		MaxNumSeqs: 256, CapacityTokens: capacity,
	}
}

func newTestScheduler(t *testing.T, p Policy, snaps ...*gpu.Snapshot) *Scheduler {
	t.Helper()
	s, err := New(&staticSource{snaps: snaps}, Options{Policy: p})
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// acquireOn acquires tk and fails the test unless it is granted on want.
func acquireOn(t *testing.T, s *Scheduler, tk *Ticket, want string) *Grant {
	t.Helper()
	g, err := s.Acquire(context.Background(), tk)
	if err != nil {
		t.Fatal(err)
	}
	if g.Backend != want {
		t.Fatalf("granted on %s, want %s", g.Backend, want)
	}
	return g
}

// acquireAsync starts an Acquire and returns where its outcome arrives.
func acquireAsync(ctx context.Context, s *Scheduler, t *Ticket) <-chan outcome {
	ch := make(chan outcome, 1)
	go func() {
		g, err := s.Acquire(ctx, t)
		ch <- outcome{g, err}
	}()
	return ch
}

type outcome struct {
	g   *Grant
	err error
}

// waitQueued waits until n tickets are queued.
func waitQueued(t *testing.T, s *Scheduler, n int) {
	t.Helper()
	eventually.True(t, fmt.Sprint(n, " tickets queued"), func() bool {
		q := s.Queued()
		return q[Interactive]+q[Batch] == n
	})
}

func TestAcquireAdmitsAndReleases(t *testing.T) {
	s := newTestScheduler(t, Policy{}, backendSnap("a", 10_000))
	g, err := s.Acquire(context.Background(), &Ticket{Model: model, PromptTokens: 100, MaxTokens: 100})
	if err != nil {
		t.Fatal(err)
	}
	if g.Backend != "a" || g.URL != "http://a" {
		t.Errorf("granted %s at %s", g.Backend, g.URL)
	}
	if l := s.Loads(); len(l) != 1 || l[0].Inflight != 1 || l[0].Reserved != 200 {
		t.Errorf("loads %+v, want one request reserving 200", l)
	}
	g.Release()
	g.Release() // idempotent
	if l := s.Loads(); l[0].Inflight != 0 || l[0].Reserved != 0 {
		t.Errorf("after release: %+v", l)
	}
}

func TestQueueWaitsForCapacity(t *testing.T) {
	s := newTestScheduler(t, Policy{KVTarget: 1}, backendSnap("a", 1000))
	first, err := s.Acquire(context.Background(), &Ticket{Model: model, PromptTokens: 500, MaxTokens: 400})
	if err != nil {
		t.Fatal(err)
	}
	second := acquireAsync(context.Background(), s, &Ticket{Model: model, PromptTokens: 300, MaxTokens: 300})
	waitQueued(t, s, 1)
	first.Release()
	o := <-second
	if o.err != nil {
		t.Fatal(o.err)
	}
	if o.g.Waited <= 0 {
		t.Errorf("queued ticket reports no wait")
	}
	o.g.Release()
}

func TestDeadlineRejects(t *testing.T) {
	s := newTestScheduler(t, Policy{KVTarget: 1}, backendSnap("a", 1000))
	hold, _ := s.Acquire(context.Background(), &Ticket{Model: model, PromptTokens: 900, MaxTokens: 100})
	defer hold.Release()
	// It would outgrow the held request: a true overlap.
	_, err := s.Acquire(context.Background(), &Ticket{Model: model, PromptTokens: 10, MaxTokens: 200, Deadline: time.Now().Add(20 * time.Millisecond)})
	var rej *RejectedError
	if !errors.As(err, &rej) || rej.Reason != "queue_timeout" || rej.RetryAfter < time.Second {
		t.Fatalf("err = %v, want a queue_timeout rejection with Retry-After >= 1s", err)
	}
	if q := s.Queued(); q[Interactive] != 0 {
		t.Errorf("expired ticket still queued: %v", q)
	}
}

func TestCancelLeavesQueue(t *testing.T) {
	s := newTestScheduler(t, Policy{KVTarget: 1}, backendSnap("a", 1000))
	hold, _ := s.Acquire(context.Background(), &Ticket{Model: model, PromptTokens: 900, MaxTokens: 100})
	ctx, cancel := context.WithCancel(context.Background())
	o := acquireAsync(ctx, s, &Ticket{Model: model, PromptTokens: 10, MaxTokens: 200})
	waitQueued(t, s, 1)
	cancel()
	if r := <-o; !errors.Is(r.err, context.Canceled) {
		t.Fatalf("err = %v, want context.Canceled", r.err)
	}
	waitQueued(t, s, 0)
	hold.Release()
	if l := s.Loads(); l[0].Inflight != 0 {
		t.Errorf("a cancelled ticket holds capacity: %+v", l)
	}
}

func TestInteractiveBeforeBatch(t *testing.T) {
	s := newTestScheduler(t, Policy{KVTarget: 1}, backendSnap("a", 1000))
	hold, _ := s.Acquire(context.Background(), &Ticket{Model: model, PromptTokens: 900, MaxTokens: 100})
	batch := acquireAsync(context.Background(), s, &Ticket{Model: model, Class: Batch, PromptTokens: 500, MaxTokens: 400})
	waitQueued(t, s, 1)
	inter := acquireAsync(context.Background(), s, &Ticket{Model: model, Class: Interactive, PromptTokens: 500, MaxTokens: 400})
	waitQueued(t, s, 2)
	hold.Release()
	first := <-inter
	if first.err != nil {
		t.Fatal(first.err)
	}
	select {
	case o := <-batch:
		t.Fatalf("batch ticket admitted while the interactive one holds the capacity: %v", o.err)
	default:
	}
	first.g.Release()
	if o := <-batch; o.err != nil {
		t.Fatal(o.err)
	} else {
		o.g.Release()
	}
}

func TestFailFast(t *testing.T) {
	s := newTestScheduler(t, Policy{}, backendSnap("a", 1000), backendSnap("b", 2000))
	_, err := s.Acquire(context.Background(), &Ticket{Model: model, PromptTokens: 1000, MaxTokens: 1001})
	var tl *TooLargeError
	if !errors.As(err, &tl) || tl.Need != 2001 || tl.Capacity != 2000 { // the larger backend's whole capacity
		t.Errorf("err = %v, want TooLargeError{2001, 2000}", err)
	}
	if _, err := s.Acquire(context.Background(), &Ticket{Model: "other", PromptTokens: 1, MaxTokens: 1}); !errors.Is(err, ErrNoBackend) {
		t.Errorf("unknown model: err = %v, want ErrNoBackend", err)
	}
}

func TestQueueFull(t *testing.T) {
	s := newTestScheduler(t, Policy{KVTarget: 1, MaxQueue: 1}, backendSnap("a", 1000))
	hold, _ := s.Acquire(context.Background(), &Ticket{Model: model, PromptTokens: 900, MaxTokens: 100})
	defer hold.Release()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	acquireAsync(ctx, s, &Ticket{Model: model, PromptTokens: 1, MaxTokens: 200})
	waitQueued(t, s, 1)
	_, err := s.Acquire(context.Background(), &Ticket{Model: model, PromptTokens: 1, MaxTokens: 200})
	var rej *RejectedError
	if !errors.As(err, &rej) || rej.Reason != "queue_full" {
		t.Errorf("err = %v, want queue_full", err)
	}
}

func TestShutdownRejectsQueued(t *testing.T) {
	s := newTestScheduler(t, Policy{KVTarget: 1}, backendSnap("a", 1000))
	hold, _ := s.Acquire(context.Background(), &Ticket{Model: model, PromptTokens: 900, MaxTokens: 100})
	o := acquireAsync(context.Background(), s, &Ticket{Model: model, PromptTokens: 10, MaxTokens: 200})
	waitQueued(t, s, 1)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- s.Run(ctx) }()
	cancel()
	<-done
	var rej *RejectedError
	if r := <-o; !errors.As(r.err, &rej) || rej.Reason != "shutting_down" {
		t.Errorf("err = %v, want shutting_down", r.err)
	}
	hold.Release() // no pump after close: must not panic
}

func TestBackendChoice(t *testing.T) {
	busy, idle := backendSnap("busy", 10_000), backendSnap("idle", 10_000)
	busy.Metrics.KVUsage = 0.5
	s := newTestScheduler(t, Policy{}, busy, idle)
	g, err := s.Acquire(context.Background(), &Ticket{Model: model, PromptTokens: 100, MaxTokens: 100})
	if err != nil {
		t.Fatal(err)
	}
	if g.Backend != "idle" {
		t.Errorf("chose %s, want the backend with headroom", g.Backend)
	}
	g.Release()
	g, err = s.Acquire(context.Background(), &Ticket{Model: model, PromptTokens: 100, MaxTokens: 100, Exclude: []string{"idle"}})
	if err != nil || g.Backend != "busy" {
		t.Fatalf("with idle excluded: %v, %v", g, err)
	}
	g.Release()
}

func TestStaleBackendIsSaturated(t *testing.T) {
	sn := backendSnap("a", 10_000)
	sn.ScrapedAt = time.Now().Add(-time.Minute)
	sn.StaleAfter = time.Second
	s := newTestScheduler(t, Policy{}, sn)
	_, err := s.Acquire(context.Background(), &Ticket{Model: model, PromptTokens: 1, MaxTokens: 1, Deadline: time.Now().Add(20 * time.Millisecond)})
	var rej *RejectedError
	if !errors.As(err, &rej) {
		t.Errorf("stale backend admitted work: %v", err)
	}
}

// TestConcurrentAcquireRelease hammers one backend from many goroutines and
// checks that the reservations never exceed the target and add up to zero.
func TestConcurrentAcquireRelease(t *testing.T) {
	s := newTestScheduler(t, Policy{KVTarget: 1}, backendSnap("a", 10_000))
	var peak, cur atomic.Int64
	var wg sync.WaitGroup
	for range 32 {
		wg.Go(func() {
			for range 200 {
				g, err := s.Acquire(context.Background(), &Ticket{Model: model, PromptTokens: 500, MaxTokens: 500})
				if err != nil {
					t.Error(err)
					return
				}
				n := cur.Add(1000)
				for p := peak.Load(); n > p && !peak.CompareAndSwap(p, n); p = peak.Load() {
				}
				cur.Add(-1000)
				g.Release()
			}
		})
	}
	wg.Wait()
	if peak.Load() > 10_000 {
		t.Errorf("reserved %d tokens at once on a 10,000-token backend", peak.Load())
	}
	if l := s.Loads(); l[0].Inflight != 0 || l[0].Reserved != 0 {
		t.Errorf("ledger after the storm: %+v", l)
	}
}
