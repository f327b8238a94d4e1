package storetest

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/kvgate/kvgate/store"
)

var inboxBatchTests = []struct {
	name string
	fn   func(*testing.T, store.Store)
}{
	{"InboxBatch", testInboxBatch},
	{"InboxBatchConcurrent", testInboxBatchConcurrent},
}

// A batch records each id once, in one call: later mentions in the batch,
// and in later batches, are duplicates, or mismatches when their payload
// differs, which write nothing; RecordInbox and the batch agree.
func testInboxBatch(t *testing.T, s store.Store) {
	ctx := context.Background()
	rec := func(id, d string) store.InboxRecord { return store.InboxRecord{EventID: id, Digest: d} }
	if _, err := s.RecordInbox(ctx, "e0", "d0", t0); err != nil {
		t.Fatal(err)
	}
	got, err := s.RecordInboxBatch(ctx, []store.InboxRecord{
		rec("e1", "d1"), rec("e2", "d2"), rec("e1", "d1"), rec("e0", "d0"), rec("e3", "d3"), rec("e2", "other"), rec("e0", "other"),
	}, t0)
	want := []store.InboxOutcome{store.InboxRecorded, store.InboxRecorded, store.InboxDuplicate, store.InboxDuplicate,
		store.InboxRecorded, store.InboxMismatch, store.InboxMismatch}
	if err != nil || !slices.Equal(got, want) {
		t.Fatalf("first batch: %v, %v; want %v", got, err, want)
	}
	got, err = s.RecordInboxBatch(ctx, []store.InboxRecord{rec("e1", "d1"), rec("e3", "other"), rec("e4", "d4")}, t0.Add(time.Hour))
	want = []store.InboxOutcome{store.InboxDuplicate, store.InboxMismatch, store.InboxRecorded}
	if err != nil || !slices.Equal(got, want) {
		t.Fatalf("second batch: %v, %v; want %v", got, err, want)
	}
	if got, err := s.RecordInboxBatch(ctx, nil, t0); err != nil || len(got) != 0 {
		t.Errorf("empty batch: %v, %v", got, err)
	}
	// The mismatches wrote nothing: the first payload stands.
	for id, d := range map[string]string{"e2": "d2", "e3": "d3", "e4": "d4", "e0": "d0"} {
		if dup, err := s.RecordInbox(ctx, id, d, t0); err != nil || !dup {
			t.Errorf("%s after the batches: dup %v, %v; want a duplicate of the first payload", id, dup, err)
		}
	}
	// Each record keeps its batch's time, for the pruning.
	if n, err := s.PruneInbox(ctx, t0.Add(30*time.Minute), 100); err != nil || n != 4 {
		t.Errorf("pruned %d, %v; want e0 to e3", n, err)
	}
	if dup, err := s.RecordInbox(ctx, "e4", "d4", t0); err != nil || !dup {
		t.Errorf("e4 was pruned with the older batch: dup %v, %v", dup, err)
	}
}

// Consumers recording overlapping batches at once (a redelivery racing
// the first delivery, several replicas) record each id exactly once
// between them, and every other mention is a duplicate.
func testInboxBatchConcurrent(t *testing.T, s store.Store) {
	ctx := context.Background()
	const ids, workers = 40, 6
	recorded := make([]int, ids)
	var mu sync.Mutex
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			var recs []store.InboxRecord
			for i := range ids {
				id := (i*7 + w*3) % ids // each worker its own order
				recs = append(recs, store.InboxRecord{EventID: fmt.Sprintf("c%d", id), Digest: "d"})
			}
			for off := 0; off < ids; off += 8 {
				part := recs[off:min(off+8, ids)]
				got, err := s.RecordInboxBatch(ctx, part, t0)
				if err != nil {
					t.Errorf("worker %d: %v", w, err)
					return
				}
				mu.Lock()
				for i, o := range got {
					var id int
					fmt.Sscanf(part[i].EventID, "c%d", &id)
					switch o {
					case store.InboxRecorded:
						recorded[id]++
					case store.InboxMismatch:
						t.Errorf("%s: a mismatch for the same payload", part[i].EventID)
					}
				}
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	for id, n := range recorded {
		if n != 1 {
			t.Errorf("c%d recorded %d times, want once", id, n)
		}
	}
}
