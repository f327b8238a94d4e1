package storetest

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/kvgate/kvgate/store"
)

// testStats checks store.StatsReader: the runnable backlog by tenant, the
// jobs of priority 0 apart from the others (running, future retries, past-deadline and final jobs left
// out), its oldest available time, and the oldest unpublished event.
func testStats(t *testing.T, s store.Store) {
	ctx := context.Background()
	sr, ok := s.(store.StatsReader)
	if !ok {
		t.Fatalf("%T does not implement store.StatsReader", s)
	}
	st, err := sr.Stats(ctx, t0)
	if err != nil || len(st.Backlog) != 0 || !st.OldestUnpublished.IsZero() {
		t.Fatalf("empty store: %+v, %v", st, err)
	}
	at := func(d time.Duration, tokens int, prio int, deadline time.Duration) func(*store.NewJob) {
		return func(n *store.NewJob) {
			n.Now, n.TokenEstimate, n.Priority, n.Deadline = t0.Add(d), tokens, prio, t0.Add(deadline)
		}
	}
	accept(t, s, newJob("acme", "a1", at(0, 100, 0, time.Hour)))
	accept(t, s, newJob("acme", "a2", at(10*time.Second, 250, 0, time.Hour)))
	accept(t, s, newJob("acme", "a3", at(20*time.Second, 40, 5, time.Hour)))
	accept(t, s, newJob("acme", "a4", at(5*time.Second, 60, 6, time.Hour))) // a Batch API line: with a3
	accept(t, s, newJob("globex", "g1", at(30*time.Second, 7, 0, time.Hour)))
	accept(t, s, newJob("globex", "late", at(30*time.Second, 1000, 0, 45*time.Second))) // past its deadline at now
	now := t0.Add(time.Minute)

	// Every event is unpublished: the oldest is a1's acceptance.
	st, err = sr.Stats(ctx, now)
	if err != nil {
		t.Fatal(err)
	}
	if !st.OldestUnpublished.Equal(t0) {
		t.Errorf("oldest unpublished %v, want %v", st.OldestUnpublished, t0)
	}
	want := []store.Backlog{
		{Tenant: "acme", Priority: 0, Jobs: 2, Tokens: 350, OldestAvailable: t0},
		{Tenant: "acme", Priority: 5, Jobs: 2, Tokens: 100, OldestAvailable: t0.Add(5 * time.Second)},
		{Tenant: "globex", Priority: 0, Jobs: 1, Tokens: 7, OldestAvailable: t0.Add(30 * time.Second)},
	}
	checkBacklog(t, "after accepts", st.Backlog, want)

	// A claim takes a1 out of the backlog (running); a failure that
	// schedules a retry in the future keeps it out until then.
	js, err := s.Claim(ctx, now, time.Minute, 1)
	if err != nil || len(js) != 1 {
		t.Fatalf("claim: %v, %v", js, err)
	}
	st, _ = sr.Stats(ctx, now)
	c := js[0]
	for i := range want {
		if want[i].Tenant == c.Tenant && want[i].Priority == c.Priority {
			want[i].Jobs--
			want[i].Tokens -= int64(c.TokenEstimate)
			if c.IdempotencyKey == "a1" {
				want[i].OldestAvailable = t0.Add(10 * time.Second)
			}
		}
	}
	want = slices.DeleteFunc(want, func(b store.Backlog) bool { return b.Jobs == 0 })
	checkBacklog(t, "after claiming "+c.IdempotencyKey, st.Backlog, want)
	retryAt := now.Add(time.Minute)
	if err := s.Fail(ctx, store.Failure{JobID: js[0].ID, Fence: js[0].Fence, RetryAt: retryAt, EventID: newJob("x", "e").EventID, Now: now,
		Attempt: store.Attempt{JobID: js[0].ID, Attempt: 1, Fence: js[0].Fence, Outcome: store.OutcomeFailed, Spent: true, Sent: true,
			ErrorClass: "backend", StartedAt: now, EndedAt: now}}); err != nil {
		t.Fatal(err)
	}
	if st, _ = sr.Stats(ctx, now); total(st.Backlog) != 4 {
		t.Errorf("a retry not yet due counted: %+v", st.Backlog)
	}
	// Once due, it is back, eligible since its retry time.
	st, _ = sr.Stats(ctx, retryAt)
	if total(st.Backlog) != 5 {
		t.Errorf("backlog at the retry time %+v", st.Backlog)
	}
	if c.IdempotencyKey == "g1" {
		for _, b := range st.Backlog {
			if b.Tenant == "globex" && !b.OldestAvailable.Equal(retryAt) {
				t.Errorf("the retried job's group %+v: oldest should be its retry time %v", b, retryAt)
			}
		}
	}

	// Publishing the oldest events moves the outbox age to the next one.
	evs, err := s.Unpublished(ctx, 2)
	if err != nil || len(evs) != 2 {
		t.Fatal(evs, err)
	}
	if err := s.MarkPublished(ctx, []string{evs[0].ID, evs[1].ID}, now); err != nil {
		t.Fatal(err)
	}
	rest, _ := s.Unpublished(ctx, 1)
	st, _ = sr.Stats(ctx, now)
	if len(rest) != 1 || !st.OldestUnpublished.Equal(rest[0].CreatedAt) || !st.OldestUnpublished.After(t0) {
		t.Errorf("oldest unpublished %v after publishing two, want %v", st.OldestUnpublished, rest)
	}
	all, _ := s.Unpublished(ctx, 1000)
	var ids []string
	for _, e := range all {
		ids = append(ids, e.ID)
	}
	if err := s.MarkPublished(ctx, ids, now); err != nil {
		t.Fatal(err)
	}
	if st, _ = sr.Stats(ctx, now); !st.OldestUnpublished.IsZero() {
		t.Errorf("all published, oldest unpublished %v", st.OldestUnpublished)
	}
}

func total(bs []store.Backlog) int {
	n := 0
	for _, b := range bs {
		n += b.Jobs
	}
	return n
}

func checkBacklog(t *testing.T, when string, got, want []store.Backlog) {
	t.Helper()
	if len(got) != len(want) {
		t.Errorf("%s: backlog %+v, want %+v", when, got, want)
		return
	}
	for i := range want {
		g, w := got[i], want[i]
		if g.Tenant != w.Tenant || g.Priority != w.Priority || g.Jobs != w.Jobs || g.Tokens != w.Tokens || !g.OldestAvailable.Equal(w.OldestAvailable) {
			t.Errorf("%s: backlog[%d] %+v, want %+v", when, i, g, w)
		}
	}
}
