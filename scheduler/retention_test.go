package scheduler

import (
	"context"
	"encoding/json"
	"fmt"
	"testing"
	"time"

	"github.com/kvgate/kvgate/store"
)

// countingStore counts the pruner's batches.
type countingStore struct {
	store.Store
	batches []int
}

func (c *countingStore) PruneFinal(ctx context.Context, before time.Time, limit int) (int, error) {
	n, err := c.Store.PruneFinal(ctx, before, limit)
	c.batches = append(c.batches, n)
	return n, err
}

// TestPrunerBatches: a pass deletes every final job past its retention,
// in batches no larger than Batch, and nothing younger or still running.
func TestPrunerBatches(t *testing.T) {
	st := openStore(t)
	ctx := context.Background()
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	old := make([]string, 7)
	for i := range old {
		j, _, err := st.Accept(ctx, store.NewJob{ID: fmt.Sprintf("old-%d", i), EventID: fmt.Sprintf("ev-old-%d", i), Tenant: "acme",
			IdempotencyKey: fmt.Sprint("old", i), RequestHash: "h", Endpoint: "/v1/chat/completions", Model: "m",
			Body: json.RawMessage(`{}`), MaxAttempts: 1, Deadline: t0.Add(time.Hour), Now: t0})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := st.Cancel(ctx, "acme", j.ID, fmt.Sprintf("ev-cancel-%d", i), t0); err != nil {
			t.Fatal(err)
		}
		old[i] = j.ID
	}
	young, _, err := st.Accept(ctx, store.NewJob{ID: "young", EventID: "ev-young", Tenant: "acme", IdempotencyKey: "young", RequestHash: "h",
		Endpoint: "/v1/chat/completions", Model: "m", Body: json.RawMessage(`{}`), MaxAttempts: 1, Deadline: t0.Add(1000 * time.Hour), Now: t0})
	if err != nil {
		t.Fatal(err)
	}
	// The relay published their events (a job keeps until it has).
	evs, err := st.Unpublished(ctx, 100)
	if err != nil {
		t.Fatal(err)
	}
	ids := make([]string, len(evs))
	for i, e := range evs {
		ids[i] = e.ID
	}
	if err := st.MarkPublished(ctx, ids, t0); err != nil {
		t.Fatal(err)
	}
	cs := &countingStore{Store: st}
	p := NewPruner(cs, RetentionConfig{Retention: 24 * time.Hour, Batch: 3, Pause: time.Millisecond,
		Now: func() time.Time { return t0.Add(48 * time.Hour) }})
	n, err := p.Pass(ctx)
	if err != nil || n != 7 {
		t.Fatalf("pass: %d, %v; want 7", n, err)
	}
	if fmt.Sprint(cs.batches) != "[3 3 1]" {
		t.Errorf("batches %v, want [3 3 1]", cs.batches)
	}
	for _, id := range old {
		if _, err := st.Get(ctx, "acme", id); err == nil {
			t.Errorf("%s survived its retention", id)
		}
	}
	if _, err := st.Get(ctx, "acme", young.ID); err != nil {
		t.Errorf("a READY job was pruned: %v", err)
	}
}
