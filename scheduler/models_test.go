package scheduler

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvgate/kvgate/gpu"
)

// Snapshots of backends in the states that decide routing.
func ejectedSnap(name string, until time.Time) *gpu.Snapshot {
	s := backendSnap(name, 1000)
	s.Ejected, s.EjectedUntil, s.HealthErr = true, until, "connection refused"
	return s
}

func undiscoveredSnap(name string, configured ...string) *gpu.Snapshot {
	return &gpu.Snapshot{Name: name, URL: "http://" + name, Configured: configured, HealthErr: "connection refused", StaleAfter: time.Hour}
}

func TestReach(t *testing.T) {
	now := time.Now()
	failedGPU := backendSnap("gpu", 1000)
	failedGPU.GPUHealth = gpu.Failed
	for _, tc := range []struct {
		name    string
		snaps   []*gpu.Snapshot
		model   string
		exclude []string
		want    error // nil, ErrNoBackend or ErrNoRoutableBackend
		retry   time.Duration
	}{
		{"routable", []*gpu.Snapshot{backendSnap("a", 1000)}, model, nil, nil, 0},
		{"one of two ejected", []*gpu.Snapshot{ejectedSnap("a", now.Add(time.Hour)), backendSnap("b", 1000)}, model, nil, nil, 0},
		{"unknown model", []*gpu.Snapshot{backendSnap("a", 1000)}, "other", nil, ErrNoBackend, 0},
		{"ejected", []*gpu.Snapshot{ejectedSnap("a", now.Add(5*time.Second))}, model, nil, ErrNoRoutableBackend, 5 * time.Second},
		{"earliest ejection", []*gpu.Snapshot{ejectedSnap("a", now.Add(50*time.Second)), ejectedSnap("b", now.Add(7*time.Second))}, model, nil, ErrNoRoutableBackend, 7 * time.Second},
		{"ejection ends in a minute at most", []*gpu.Snapshot{ejectedSnap("a", now.Add(time.Hour))}, model, nil, ErrNoRoutableBackend, time.Minute},
		{"ejection over, probes failing", []*gpu.Snapshot{ejectedSnap("a", now.Add(-time.Minute))}, model, nil, ErrNoRoutableBackend, 2 * time.Second},
		{"GPU failed", []*gpu.Snapshot{failedGPU}, model, nil, ErrNoRoutableBackend, 30 * time.Second},
		{"configured, not reached", []*gpu.Snapshot{undiscoveredSnap("a", model)}, model, nil, ErrNoRoutableBackend, 2 * time.Second},
		{"configured for another model", []*gpu.Snapshot{undiscoveredSnap("a", "other")}, model, nil, ErrNoBackend, 0},
		{"models not known yet", []*gpu.Snapshot{undiscoveredSnap("a")}, "anything", nil, ErrNoRoutableBackend, 2 * time.Second},
		{"only routable one excluded", []*gpu.Snapshot{backendSnap("a", 1000), ejectedSnap("b", now.Add(time.Hour))}, model, []string{"a"}, ErrNoRoutableBackend, time.Second},
		{"another routable one", []*gpu.Snapshot{backendSnap("a", 1000), backendSnap("b", 1000)}, model, []string{"a"}, nil, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := reach(tc.snaps, tc.model, tc.exclude, now)
			switch {
			case tc.want == nil && err != nil:
				t.Fatalf("reach = %v, want nil", err)
			case tc.want != nil && !errors.Is(err, tc.want):
				t.Fatalf("reach = %v, want %v", err, tc.want)
			}
			var ue *UnroutableError
			if errors.As(err, &ue) {
				if ue.Model != tc.model || len(ue.Backends) == 0 {
					t.Errorf("UnroutableError %+v lacks the model or the backends' reasons", ue)
				}
				if ue.RetryAfter < tc.retry-time.Second || ue.RetryAfter > tc.retry {
					t.Errorf("RetryAfter %v, want about %v", ue.RetryAfter, tc.retry)
				}
			}
		})
	}
}

// TestAcquireWithoutRoutableBackend: Acquire refuses at once, with
// ErrNoRoutableBackend rather than a queue timeout, a ticket whose
// model's backends are all down; a model nobody serves stays ErrNoBackend.
func TestAcquireWithoutRoutableBackend(t *testing.T) {
	s := newTestScheduler(t, Policy{MaxQueueWait: time.Hour}, ejectedSnap("a", time.Now().Add(time.Hour)), undiscoveredSnap("b", "configured"))
	for _, m := range []string{model, "configured"} {
		if _, err := s.Acquire(context.Background(), &Ticket{Model: m, PromptTokens: 1, MaxTokens: 1}); !errors.Is(err, ErrNoRoutableBackend) {
			t.Errorf("%s: err = %v, want ErrNoRoutableBackend", m, err)
		}
	}
	if _, err := s.Acquire(context.Background(), &Ticket{Model: "other", PromptTokens: 1, MaxTokens: 1}); !errors.Is(err, ErrNoBackend) {
		t.Errorf("unknown model: err = %v, want ErrNoBackend", err)
	}
	if err := s.CheckModel(model); !errors.Is(err, ErrNoRoutableBackend) {
		t.Errorf("CheckModel = %v, want ErrNoRoutableBackend", err)
	}
	if got := s.Queued(); got[Interactive]+got[Batch] != 0 {
		t.Errorf("queued %v, want nothing", got)
	}
}

// TestQueuedTicketFailsWhenLastBackendGoes: a ticket waiting for room
// fails with ErrNoRoutableBackend as soon as its model's last routable
// backend (for it: one it does not exclude) is ejected, not at its
// deadline; tickets of a model still served keep waiting.
func TestQueuedTicketFailsWhenLastBackendGoes(t *testing.T) {
	src := &staticSource{snaps: []*gpu.Snapshot{backendSnap("a", 1000), backendSnap("b", 1000)}}
	s, err := New(src, Options{Policy: Policy{KVTarget: 1, MaxQueueWait: time.Hour}})
	if err != nil {
		t.Fatal(err)
	}
	var holds []*Grant
	for range 2 { // fill both backends
		g, err := s.Acquire(context.Background(), &Ticket{Model: model, PromptTokens: 900, MaxTokens: 100})
		if err != nil {
			t.Fatal(err)
		}
		holds = append(holds, g)
	}
	defer func() {
		for _, g := range holds {
			g.Release()
		}
	}()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	plain := acquireAsync(ctx, s, &Ticket{Model: model, PromptTokens: 10, MaxTokens: 10})
	offA := acquireAsync(ctx, s, &Ticket{Model: model, PromptTokens: 10, MaxTokens: 10, Exclude: []string{"a"}})
	waitQueued(t, s, 2)

	// b goes: the ticket that excludes a has nowhere left; the other waits for a.
	src.mu.Lock()
	src.snaps = []*gpu.Snapshot{backendSnap("a", 1000), ejectedSnap("b", time.Now().Add(time.Hour))}
	src.mu.Unlock()
	s.Wake()
	if o := <-offA; !errors.Is(o.err, ErrNoRoutableBackend) {
		t.Fatalf("ticket excluding a: %v, want ErrNoRoutableBackend", o.err)
	}
	waitQueued(t, s, 1)

	// a goes too.
	src.mu.Lock()
	src.snaps = []*gpu.Snapshot{ejectedSnap("a", time.Now().Add(time.Hour)), ejectedSnap("b", time.Now().Add(time.Hour))}
	src.mu.Unlock()
	s.Wake()
	o := <-plain
	var ue *UnroutableError
	if !errors.As(o.err, &ue) || len(ue.Backends) != 2 {
		t.Fatalf("queued ticket: %v, want an UnroutableError naming both backends", o.err)
	}
	waitQueued(t, s, 0)
}

// TestClaimRoomModelsRoutable: the models an idle fleet has room for are
// those a routable backend serves, not an ejected or undiscovered one's.
func TestClaimRoomModelsRoutable(t *testing.T) {
	two := backendSnap("b", 1000)
	two.Models = []gpu.Model{{ID: "z"}, {ID: model}}
	ej := ejectedSnap("c", time.Now().Add(time.Hour))
	ej.Models = []gpu.Model{{ID: "only-ejected"}}
	s := newTestScheduler(t, Policy{}, backendSnap("a", 1000), two, ej, undiscoveredSnap("d", "configured"))
	_, got := s.ClaimRoom()
	if want := []string{model, "z"}; strings.Join(got, ",") != strings.Join(want, ",") {
		t.Errorf("ClaimRoom's models = %v, want %v", got, want)
	}
}

// TestUnroutableRefusalsLogged: refusals for one model are logged once
// per interval, the next line counting those in between.
func TestUnroutableRefusalsLogged(t *testing.T) {
	var mu sync.Mutex
	var buf bytes.Buffer
	now := time.Now()
	clock := func() time.Time {
		mu.Lock()
		defer mu.Unlock()
		return now
	}
	s, err := New(&staticSource{snaps: []*gpu.Snapshot{undiscoveredSnap("a", model, "other")}},
		Options{Logger: slog.New(slog.NewTextHandler(&buf, nil)), Now: clock})
	if err != nil {
		t.Fatal(err)
	}
	for range 5 {
		_ = s.CheckModel(model)
		_, _ = s.Acquire(context.Background(), &Ticket{Model: model, PromptTokens: 1, MaxTokens: 1})
	}
	_ = s.CheckModel("other")
	if n := strings.Count(buf.String(), `msg="no routable backend"`); n != 2 {
		t.Fatalf("%d lines for 10 refusals of one model and 1 of another, want 2:\n%s", n, buf.String())
	}
	mu.Lock()
	now = now.Add(unroutableLogEvery)
	mu.Unlock()
	_ = s.CheckModel(model)
	lines := strings.Split(strings.TrimSpace(buf.String()), "\n")
	if last := lines[len(lines)-1]; len(lines) != 3 || !strings.Contains(last, "refused=10") || !strings.Contains(last, "a: not reached yet") {
		t.Errorf("after the interval: %d lines, last %q; want a third counting the 10 refusals since the first", len(lines), last)
	}
}

// TestQueuedTicketFailsWhenBackendGoesAgain: the routing a queued ticket
// was checked against is the one later changes are compared with, even
// when the queue was empty meanwhile. Backend a goes while another
// model's ticket waits, comes back once the queue is empty, and goes
// again after a ticket for its model was queued: that ticket fails at
// once, not at its deadline, though the routing is again what the last
// pump saw.
func TestQueuedTicketFailsWhenBackendGoesAgain(t *testing.T) {
	other := backendSnap("b", 1000)
	other.Models = []gpu.Model{{ID: "other", MaxModelLen: 100_000}}
	set := func(a *gpu.Snapshot, src *staticSource) {
		src.mu.Lock()
		src.snaps = []*gpu.Snapshot{a, other}
		src.mu.Unlock()
	}
	src := &staticSource{}
	set(backendSnap("a", 1000), src)
	s, err := New(src, Options{Policy: Policy{KVTarget: 1, MaxQueueWait: time.Hour}})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	for _, m := range []string{model, "other"} { // fill both backends
		g, err := s.Acquire(ctx, &Ticket{Model: m, PromptTokens: 900, MaxTokens: 100})
		if err != nil {
			t.Fatal(err)
		}
		defer g.Release()
	}
	octx, ocancel := context.WithCancel(ctx)
	otherDone := acquireAsync(octx, s, &Ticket{Model: "other", PromptTokens: 10, MaxTokens: 10})
	waitQueued(t, s, 1)
	set(ejectedSnap("a", time.Now().Add(time.Hour)), src) // a goes while the queue holds other's ticket
	s.Wake()
	ocancel()
	<-otherDone
	waitQueued(t, s, 0)
	set(backendSnap("a", 1000), src) // a comes back; nothing queued sees it
	mine := acquireAsync(ctx, s, &Ticket{Model: model, PromptTokens: 10, MaxTokens: 10, Deadline: time.Now().Add(3 * time.Second)})
	waitQueued(t, s, 1)
	set(ejectedSnap("a", time.Now().Add(time.Hour)), src) // and goes again
	s.Wake()
	if o := <-mine; !errors.Is(o.err, ErrNoRoutableBackend) {
		t.Fatalf("the ticket whose only backend went: %v, want ErrNoRoutableBackend at once", o.err)
	}
}
