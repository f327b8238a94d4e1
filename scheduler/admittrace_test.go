package scheduler

import (
	"context"
	"sync"
	"testing"
)

// TestAdmitObserver: each admission is reported once, with the backend,
// where its prefix was expected, and the refusals a waiting ticket met.
func TestAdmitObserver(t *testing.T) {
	s := newTestScheduler(t, Policy{KVTarget: 1}, backendSnap("a", 20_000))
	var (
		mu   sync.Mutex
		recs []AdmitRecord
	)
	s.SetAdmitObserver(func(r AdmitRecord) {
		mu.Lock()
		recs = append(recs, r)
		mu.Unlock()
	})
	sys := text("tenant's system prompt", 24_000)
	tk := func(q string) *Ticket {
		prompt := sys + text(q, 2_000)
		return &Ticket{Tenant: "t", Model: model, PromptTokens: len(prompt) / 4, MaxTokens: 100, Prefix: NewPrefix("", prompt, len(prompt)/4)}
	}
	first, err := s.Acquire(context.Background(), tk("q0"))
	if err != nil {
		t.Fatal(err)
	}
	hog, err := s.Acquire(context.Background(), &Ticket{Tenant: "t", Model: model, PromptTokens: 13_300, MaxTokens: 10})
	if err != nil {
		t.Fatal(err)
	}
	// a holds ~19,900 of 20,000: the next one (its system prompt pinned
	// there, ~500 tokens of its own question + 100 out) waits for the hog.
	ch := acquireAsync(context.Background(), s, tk("q1"))
	waitQueued(t, s, 1)
	hog.Release()
	o := <-ch
	if o.err != nil {
		t.Fatal(o.err)
	}
	first.Release()
	o.g.Release()

	mu.Lock()
	defer mu.Unlock()
	if len(recs) != 3 {
		t.Fatalf("%d records, want 3: %+v", len(recs), recs)
	}
	r := recs[2]
	if r.Backend != "a" || r.BestPrefix != "a" || r.Hit < 0.9 || r.Admitted.Before(r.Enqueued) {
		t.Errorf("record %+v: want backend a with its prefix expected there", r)
	}
	if r.Refusals[reasonKV] == 0 {
		t.Errorf("refusals %v: want the KV budget's", r.Refusals)
	}
	if len(recs[0].Refusals) != 0 || recs[0].Hit != 0 {
		t.Errorf("first record %+v: admitted at once, nothing cached", recs[0])
	}
	s.SetAdmitObserver(nil)
	g, err := s.Acquire(context.Background(), tk("q2"))
	if err != nil {
		t.Fatal(err)
	}
	g.Release()
	if len(recs) != 3 {
		t.Errorf("an admission after the observer was removed was reported")
	}
}
