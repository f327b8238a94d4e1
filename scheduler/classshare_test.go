package scheduler

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/kvgate/kvgate/gpu"
)

func TestDecideClassShare(t *testing.T) {
	p := Policy{}
	p.defaults()
	p.KVTarget, p.BatchShare = 1, 0.5 // of 100k: batch is admitted up to 50k
	base := func() load {
		return load{routable: true, capacity: 100_000, maxNumSeqs: 256, exact: true, share: 1,
			class: classLoad{capped: true}}
	}
	in := func(l *load, batch bool, fs ...flight) {
		for _, f := range fs {
			l.flights = append(l.flights, f)
			l.reserved += f.held + f.remaining
		}
		l.inflight += len(fs)
		if batch {
			l.class.inflight += len(fs)
		}
		sortFlights(l.flights)
	}
	tests := []struct {
		name        string
		policy      func(*Policy)
		mod         func(*load)
		prompt, out int
		ok          bool
		reason      string
	}{
		{name: "first batch flight on a backend is admitted", prompt: 30_000, out: 30_000, ok: true},
		{name: "within the share", mod: func(l *load) { in(l, true, flight{20_000, 10_000}) }, prompt: 5_000, out: 5_000, ok: true},
		// Both end together: 36k + 20k > 50k.
		{name: "past the share while interactive work is about", mod: func(l *load) { in(l, true, flight{30_000, 10_000}) }, prompt: 6_000, out: 10_000, reason: reasonKV},
		{name: "no interactive work: batch fills the backend", mod: func(l *load) {
			in(l, true, flight{30_000, 10_000})
			l.class.capped = false
		}, prompt: 6_000, out: 10_000, ok: true},
		{name: "a share of 1 is no cap", policy: func(p *Policy) { p.BatchShare = 1 }, mod: func(l *load) { in(l, true, flight{30_000, 10_000}) }, prompt: 6_000, out: 10_000, ok: true},
		{name: "interactive flights take their room from the batch class", mod: func(l *load) {
			in(l, true, flight{10_000, 10_000})
			in(l, false, flight{25_000, 10_000})
		}, prompt: 5_000, out: 5_000, reason: reasonKV},
		{name: "load kvgate did not send counts too", mod: func(l *load) {
			in(l, true, flight{10_000, 0})
			l.measuredUsed = 45_000
			l.heldBeforeScrape = 10_000
		}, prompt: 10_000, out: 5_000, reason: reasonKV},
		{name: "interactive tickets keep the whole budget", mod: func(l *load) {
			in(l, true, flight{30_000, 10_000})
			l.class.capped = false // as tryAdmit sets it for an interactive ticket
		}, prompt: 20_000, out: 10_000, ok: true},
		{
			// Σ reservations 40k + 15k > 50k, but the flight ends before
			// the new one grows: the projection admits.
			name: "the projection admits what the sum refuses",
			mod:  func(l *load) { in(l, true, flight{39_990, 10}) }, prompt: 5_000, out: 10_000, ok: true,
		},
		{name: "batch stays out of vLLM's queue", mod: func(l *load) {
			in(l, true, flight{1_000, 1_000})
			l.measuredWaiting = 1
		}, prompt: 100, out: 100, reason: reasonClassShare},
		{name: "nor adds to what vLLM may not have scheduled yet", mod: func(l *load) { l.unscheduled = 1 }, prompt: 100, out: 100, reason: reasonClassShare},
		{name: "the share of sequences", mod: func(l *load) {
			l.maxNumSeqs = 10
			for range 5 {
				in(l, true, flight{100, 100})
			}
		}, prompt: 100, out: 100, reason: reasonSeqs},
		{name: "beside another replica, a share of its share", mod: func(l *load) {
			l.share = 0.5 // batch is admitted up to 25k of this replica's 50k
			in(l, true, flight{10_000, 10_000})
		}, prompt: 6_000, out: 5_000, reason: reasonShare},
		{name: "a ticket larger than the share waits for the batch flights to end", mod: func(l *load) { in(l, true, flight{100, 100}) },
			prompt: 30_000, out: 30_000, reason: reasonClassShare},
		{name: "and then runs", policy: func(p *Policy) { p.BatchShare = 0.1 }, mod: func(l *load) { in(l, false, flight{10_000, 10_000}) },
			prompt: 30_000, out: 30_000, ok: true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			pp := p
			if tc.policy != nil {
				tc.policy(&pp)
			}
			l := base()
			if tc.mod != nil {
				tc.mod(&l)
			}
			v := decide(&l, tc.prompt, tc.out, &pp)
			if v.ok != tc.ok || (!tc.ok && v.reason != tc.reason) {
				t.Errorf("decide = %+v, want ok=%v reason=%q", v, tc.ok, tc.reason)
			}
		})
	}
}

// TestBatchShareKeepsRoomForInteractive drives the scheduler: with no
// interactive work about, batch tickets fill the backend; after an
// interactive arrival they stop while the backend holds more than the
// share, interactive work included, the room left admits interactive
// tickets at once, and Room offers the runner no more batch work than the
// share lets in.
func TestBatchShareKeepsRoomForInteractive(t *testing.T) {
	now := time.Now()
	clock := func() time.Time { return now }
	sn := backendSnap("a", 10_000)
	sn.MaxNumSeqs = 100
	s, err := New(&staticSource{snaps: []*gpu.Snapshot{sn}}, Options{Policy: Policy{KVTarget: 1, BatchShare: 0.5, BatchShareHold: time.Minute}, Now: clock})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	batch := func(deadline time.Duration) (*Grant, error) {
		return s.Acquire(ctx, &Ticket{Class: Batch, Model: model, PromptTokens: 500, MaxTokens: 500, Deadline: time.Now().Add(deadline)})
	}
	var held []*Grant
	defer func() {
		for _, g := range held {
			g.Release()
		}
	}()
	// Alone, batch work takes the whole backend: ten of 1,000 tokens.
	for i := range 6 {
		g, err := batch(time.Second)
		if err != nil {
			t.Fatalf("batch ticket %d with no interactive work about: %v", i, err)
		}
		held = append(held, g)
	}
	if r := s.Room(); r != 4 {
		t.Errorf("Room with no interactive work about = %d, want 4", r)
	}
	// An interactive arrival: 8k held, past the 5k share.
	g, err := s.Acquire(ctx, &Ticket{Class: Interactive, Model: model, PromptTokens: 1000, MaxTokens: 1000})
	if err != nil {
		t.Fatal(err)
	}
	inter := g
	if r := s.Room(); r != 0 {
		t.Errorf("Room past the batch share = %d, want 0", r)
	}
	var rej *RejectedError
	if _, err := batch(20 * time.Millisecond); !errors.As(err, &rej) {
		t.Fatalf("batch ticket past the share: %v, want a rejection after its wait", err)
	}
	// The room left still admits interactive work at once.
	g, err = s.Acquire(ctx, &Ticket{Class: Interactive, Model: model, PromptTokens: 500, MaxTokens: 500, Deadline: time.Now().Add(20 * time.Millisecond)})
	if err != nil {
		t.Fatalf("interactive ticket beside the batch share: %v", err)
	}
	// Five batch flights and one interactive end: 3k held, of which 2k
	// interactive, and the share lets two more batch tickets in.
	g.Release()
	for _, g := range held[:5] {
		g.Release()
	}
	held = append(held[5:], inter)
	if r := s.Room(); r != 1 {
		t.Errorf("Room under the batch share = %d, want 1", r)
	}
	for range 2 { // 4k, then 5k
		g, err = batch(time.Second)
		if err != nil {
			t.Fatalf("batch ticket under the share: %v", err)
		}
		held = append(held, g)
	}
	if _, err := batch(20 * time.Millisecond); !errors.As(err, &rej) {
		t.Fatalf("batch ticket at the share: %v, want a rejection after its wait", err)
	}
	// Once the hold has passed with no interactive arrival, batch fills
	// again what is left: 6k held.
	now = now.Add(2 * time.Minute)
	g, err = batch(time.Second)
	if err != nil {
		t.Fatalf("batch ticket after the hold: %v", err)
	}
	held = append(held, g)
}

// TestRoomFollowsShareQueueRefusal checks that Room offers no batch work
// for a backend whose vLLM queue shows work while interactive work is
// about there (decide refuses every batch ticket for it: they would only
// wait in kvgate's memory), and room again once the queue is empty or no
// interactive work is about (work-conserving).
func TestRoomFollowsShareQueueRefusal(t *testing.T) {
	now := time.Now()
	clock := func() time.Time { return now }
	sn := backendSnap("a", 10_000)
	sn.MaxNumSeqs = 100
	sn.Metrics.Waiting = 1
	s, err := New(&staticSource{snaps: []*gpu.Snapshot{sn}}, Options{Policy: Policy{KVTarget: 1, BatchShare: 0.5, BatchShareHold: time.Minute}, Now: clock})
	if err != nil {
		t.Fatal(err)
	}
	if r := s.Room(); r <= 0 {
		t.Fatalf("Room with a queue but no interactive work about = %d, want some", r)
	}
	ctx := context.Background()
	g, err := s.Acquire(ctx, &Ticket{Class: Interactive, Model: model, PromptTokens: 500, MaxTokens: 500})
	if err != nil {
		t.Fatal(err)
	}
	defer g.Release()
	if r := s.Room(); r != 0 {
		t.Errorf("Room with vLLM's queue showing work beside interactive work = %d, want 0", r)
	}
	var rej *RejectedError
	if _, err := s.Acquire(ctx, &Ticket{Class: Batch, Model: model, PromptTokens: 500, MaxTokens: 500, Deadline: time.Now().Add(20 * time.Millisecond)}); !errors.As(err, &rej) {
		t.Fatalf("batch ticket beside vLLM's queue: %v, want a rejection after its wait", err)
	}
	sn.Metrics.Waiting = 0
	if r := s.Room(); r <= 0 {
		t.Errorf("Room with the queue empty = %d, want some", r)
	}
}
