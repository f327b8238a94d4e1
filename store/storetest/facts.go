package storetest

import (
	"context"
	"reflect"
	"testing"

	"github.com/kvgate/kvgate/store"
)

// attemptFacts is the read the runner makes once per claim
// (sqlstore.Store.AttemptFacts): each job's entity and pinned policy.
type attemptFacts interface {
	AttemptFacts(ctx context.Context, ids []string) (map[string]store.JobEntity, map[string]store.JobOutcome, error)
}

// testAttemptFacts: the one read of many jobs' entities and policies says
// what JobEntity and JobOutcome say of each, whatever the number of ids
// (the list is padded to a few statement shapes) and for ids it has no
// rows for.
func testAttemptFacts(t *testing.T, s store.Store) {
	ctx := context.Background()
	fs, ok := s.(attemptFacts)
	if !ok {
		t.Fatalf("%T does not read attempt facts", s)
	}
	putPolicy(t, s, "acme", "invoice", invoiceV1)
	putPolicy(t, s, "acme", "invoice", invoiceV2)
	jobs := []store.Job{
		accept(t, s, newJob("acme", "plain")),
		accept(t, s, newJob("acme", "entity", withEntity("invoice-1", 2, store.OrderSerial))),
		accept(t, s, newJob("acme", "policy", withPolicy("invoice", 1))),
		accept(t, s, newJob("acme", "both", withEntity("invoice-2", 7, ""), withPolicy("invoice", 0))),
		accept(t, s, newJob("globex", "latest", withEntity("invoice-1", 1, ""))),
	}
	for n := range len(jobs) + 1 {
		ids := []string{"job-unknown"}
		for _, j := range jobs[:n] {
			ids = append(ids, j.ID)
		}
		ents, outs, err := fs.AttemptFacts(ctx, ids)
		if err != nil {
			t.Fatalf("attempt facts of %d jobs: %v", n, err)
		}
		wantE, wantO := map[string]store.JobEntity{}, map[string]store.JobOutcome{}
		for _, j := range jobs[:n] {
			if e, err := s.JobEntity(ctx, j.ID); err == nil {
				wantE[j.ID] = e
			}
			if o, err := s.JobOutcome(ctx, j.ID); err == nil {
				wantO[j.ID] = o
			}
		}
		if !reflect.DeepEqual(ents, wantE) {
			t.Errorf("entities of %d jobs: %+v, want %+v", n, ents, wantE)
		}
		if !reflect.DeepEqual(outs, wantO) {
			t.Errorf("outcomes of %d jobs: %+v, want %+v", n, outs, wantO)
		}
	}
	if ents, outs, err := fs.AttemptFacts(ctx, nil); err != nil || len(ents) != 0 || len(outs) != 0 {
		t.Errorf("no ids: %v, %v, %v", ents, outs, err)
	}
}
