package storetest

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/kvgate/kvgate/store"
)

// Conformance cases of store.Entities: latest wins, serial ordering, and
// two versions finishing at once.
var entityTests = []struct {
	name string
	fn   func(*testing.T, store.Store)
}{
	{"EntityLatestWins", testEntityLatestWins},
	{"EntitySerial", testEntitySerial},
	{"EntityConcurrentFinish", testEntityConcurrentFinish},
	{"EntityReviewDecides", testEntityReviewDecides},
	{"AttemptFacts", testAttemptFacts}, // facts.go
}

func withEntity(key string, version int64, ordering string) func(*store.NewJob) {
	return func(n *store.NewJob) { n.Entity = &store.NewEntity{Key: key, Version: version, Ordering: ordering} }
}

func completeAs(t *testing.T, s store.Store, j store.Job, st store.State, now time.Time) error {
	t.Helper()
	e, err := s.JobEntity(context.Background(), j.ID)
	if err != nil {
		t.Fatalf("entity of %s: %v", j.ID, err)
	}
	return s.Complete(context.Background(), store.Completion{JobID: j.ID, Fence: j.Fence, State: st, Result: json.RawMessage(`{"v":1}`), Entity: &e,
		Attempt: store.Attempt{JobID: j.ID, Attempt: j.Attempt + 1, Fence: j.Fence, Outcome: store.OutcomeSucceeded, StartedAt: now, EndedAt: now}, Now: now})
}

func stateOf(t *testing.T, s store.Store, id string) store.State {
	t.Helper()
	j, err := s.Get(context.Background(), "acme", id)
	if err != nil {
		t.Fatal(err)
	}
	return j.State
}

func testEntityLatestWins(t *testing.T, s store.Store) {
	ctx := context.Background()
	v2 := accept(t, s, newJob("acme", "v2", withEntity("invoice-4711", 2, "")))
	v3 := accept(t, s, newJob("acme", "v3", withEntity("invoice-4711", 3, "")))
	js, err := s.Claim(ctx, t0, time.Minute, 2)
	if err != nil || len(js) != 2 {
		t.Fatalf("claim: %v, %v", js, err)
	}
	v1 := accept(t, s, newJob("acme", "v1", withEntity("invoice-4711", 1, "")))
	other := accept(t, s, newJob("acme", "other", withEntity("invoice-9", 1, "")))
	if _, _, err := s.Accept(ctx, newJob("acme", "v3-again", withEntity("invoice-4711", 3, ""))); !errors.Is(err, store.ErrEntityVersionExists) {
		t.Errorf("a second job for version 3: %v", err)
	}
	if _, err := s.GetByKey(ctx, "acme", "v3-again"); !errors.Is(err, store.ErrNotFound) {
		t.Errorf("the refused version made a job: %v", err)
	}
	if _, created, err := s.Accept(ctx, newJob("globex", "theirs", withEntity("invoice-4711", 3, ""))); err != nil || !created {
		t.Errorf("another tenant's entity of the same key: %v", err)
	}
	claimed := map[string]store.Job{js[0].ID: js[0], js[1].ID: js[1]}
	// v3 finishes first and wins; v1, not started, is superseded at once.
	if err := completeAs(t, s, claimed[v3.ID], store.Succeeded, t0); err != nil {
		t.Fatal(err)
	}
	if st := stateOf(t, s, v3.ID); st != store.Succeeded {
		t.Errorf("v3: %s", st)
	}
	if st := stateOf(t, s, v1.ID); st != store.Superseded {
		t.Errorf("v1, not started: %s, want SUPERSEDED", st)
	}
	if st := stateOf(t, s, other.ID); st != store.Ready {
		t.Errorf("another entity's job: %s", st)
	}
	// v2 finishes after v3: superseded, whatever it asked.
	if err := completeAs(t, s, claimed[v2.ID], store.Succeeded, t0); err != nil {
		t.Fatal(err)
	}
	j2, _ := s.Get(ctx, "acme", v2.ID)
	if j2.State != store.Superseded || !j2.State.Final() {
		t.Errorf("v2, finished after v3: %s, want SUPERSEDED", j2.State)
	}
	if _, err := s.Cancel(ctx, "acme", v2.ID, "ev-cancel-v2", t0); !errors.Is(err, store.ErrFinal) {
		t.Errorf("cancelling a superseded job: %v", err)
	}
	je, _ := s.JobEntity(ctx, v2.ID)
	if turn, err := s.EntityTurn(ctx, je); err != nil || turn != store.TurnSuperseded {
		t.Errorf("turn of v2: %v, %v", turn, err)
	}
	ent, err := s.Entity(ctx, "acme", "invoice-4711", 10)
	if err != nil || ent.WonVersion != 3 || len(ent.Versions) != 3 || ent.Versions[0].Version != 3 || ent.Versions[0].JobID != v3.ID ||
		ent.Versions[2].State != store.Superseded {
		t.Errorf("entity: %+v, %v", ent, err)
	}
	if _, err := s.Entity(ctx, "globex", "invoice-9", 10); !errors.Is(err, store.ErrNotFound) {
		t.Errorf("another tenant's entity: %v", err)
	}
	evs, _ := s.Unpublished(ctx, 100)
	superseded := 0
	for _, e := range evs {
		if e.Type == "job.superseded" {
			superseded++
		}
	}
	if superseded != 2 {
		t.Errorf("%d job.superseded events, want 2", superseded)
	}
	// A stale completion changes nothing.
	if err := completeAs(t, s, claimed[v2.ID], store.Succeeded, t0); !errors.Is(err, store.ErrLeaseLost) {
		t.Errorf("completing twice: %v", err)
	}
}

func testEntitySerial(t *testing.T, s store.Store) {
	ctx := context.Background()
	v1 := accept(t, s, newJob("acme", "s1", withEntity("doc", 1, store.OrderSerial)))
	v2 := accept(t, s, newJob("acme", "s2", withEntity("doc", 2, store.OrderSerial)))
	e2, err := s.JobEntity(ctx, v2.ID)
	if err != nil || e2.Ordering != store.OrderSerial || e2.Version != 2 || e2.Key != "doc" {
		t.Fatalf("entity: %+v, %v", e2, err)
	}
	if turn, err := s.EntityTurn(ctx, e2); err != nil || turn != store.TurnWait {
		t.Errorf("v2 while v1 is READY: %v, %v; want to wait", turn, err)
	}
	e1, _ := s.JobEntity(ctx, v1.ID)
	if turn, err := s.EntityTurn(ctx, e1); err != nil || turn != store.TurnRun {
		t.Errorf("v1: %v, %v", turn, err)
	}
	js, _ := s.Claim(ctx, t0, time.Minute, 1)
	if len(js) != 1 || js[0].ID != v1.ID {
		t.Fatalf("claim: %+v", js)
	}
	if turn, _ := s.EntityTurn(ctx, e2); turn != store.TurnWait {
		t.Errorf("v2 while v1 runs: %v", turn)
	}
	if err := completeAs(t, s, js[0], store.Succeeded, t0); err != nil {
		t.Fatal(err)
	}
	if turn, err := s.EntityTurn(ctx, e2); err != nil || turn != store.TurnRun {
		t.Errorf("v2 once v1 ended: %v, %v", turn, err)
	}
}

// testEntityConcurrentFinish: versions 1 and 2 of many entities finish at
// once; the lower one may succeed only if it finished first.
func testEntityConcurrentFinish(t *testing.T, s store.Store) {
	ctx := context.Background()
	const entities = 12
	for i := range entities {
		accept(t, s, newJob("acme", fmt.Sprint("e", i, "v1"), withEntity(fmt.Sprint("ent-", i), 1, "")))
		accept(t, s, newJob("acme", fmt.Sprint("e", i, "v2"), withEntity(fmt.Sprint("ent-", i), 2, "")))
	}
	js, err := s.Claim(ctx, t0, time.Minute, 2*entities)
	if err != nil || len(js) != 2*entities {
		t.Fatalf("claim: %d, %v", len(js), err)
	}
	var wg sync.WaitGroup
	for _, j := range js {
		wg.Go(func() {
			if err := completeAs(t, s, j, store.Succeeded, t0); err != nil {
				t.Error(err)
			}
		})
	}
	wg.Wait()
	evs, err := s.Unpublished(ctx, 10000)
	if err != nil {
		t.Fatal(err)
	}
	seq := map[string]int64{} // job id -> its final event's place
	for _, e := range evs {
		if e.State.Final() {
			seq[e.JobID] = e.Seq
		}
	}
	for i := range entities {
		ent, err := s.Entity(ctx, "acme", fmt.Sprint("ent-", i), 10)
		if err != nil || ent.WonVersion != 2 {
			t.Fatalf("entity %d: %+v, %v", i, ent, err)
		}
		v2, v1 := ent.Versions[0], ent.Versions[1]
		if v2.State != store.Succeeded {
			t.Errorf("entity %d: v2 %s", i, v2.State)
		}
		switch v1.State {
		case store.Superseded:
		case store.Succeeded:
			if seq[v1.JobID] > seq[v2.JobID] {
				t.Errorf("entity %d: v1 SUCCEEDED after v2 had", i)
			}
		default:
			t.Errorf("entity %d: v1 %s", i, v1.State)
		}
	}
}

// testEntityReviewDecides: an operator's approval is a success under the
// same rule as the runner's. A version approved after a later one
// succeeded ends SUPERSEDED; an approved version that wins supersedes the
// lower versions not yet started.
func testEntityReviewDecides(t *testing.T, s store.Store) {
	ctx := context.Background()
	a1 := accept(t, s, newJob("acme", "a1", withEntity("order-1", 1, "")))
	a2 := accept(t, s, newJob("acme", "a2", withEntity("order-1", 2, "")))
	js, err := s.Claim(ctx, t0, time.Minute, 2)
	if err != nil || len(js) != 2 {
		t.Fatalf("claim: %v, %v", js, err)
	}
	claimed := map[string]store.Job{js[0].ID: js[0], js[1].ID: js[1]}
	if err := completeAs(t, s, claimed[a1.ID], store.ReviewRequired, t0); err != nil {
		t.Fatal(err)
	}
	if err := completeAs(t, s, claimed[a2.ID], store.Succeeded, t0); err != nil {
		t.Fatal(err)
	}
	j, err := s.Decide(ctx, store.Review{Tenant: "acme", JobID: a1.ID, Approve: true, EventID: "ev-approve-a1", Now: t0})
	if err != nil || j.State != store.Superseded {
		t.Fatalf("approving version 1 after version 2 succeeded: %s, %v; want SUPERSEDED", j.State, err)
	}
	if au, err := s.Audit(ctx, "acme", a1.ID); err != nil || len(au) != 1 || au[0].Action != store.AuditApprove || au[0].State != store.Superseded {
		t.Errorf("audit of the late approval: %+v, %v", au, err)
	}
	if ent, err := s.Entity(ctx, "acme", "order-1", 10); err != nil || ent.WonVersion != 2 {
		t.Errorf("entity after the late approval: %+v, %v", ent, err)
	}

	// Version 2 runs while version 1, accepted later, waits unstarted.
	b2 := accept(t, s, newJob("acme", "b2", withEntity("order-2", 2, "")))
	js, err = s.Claim(ctx, t0, time.Minute, 10)
	if err != nil || len(js) != 1 || js[0].ID != b2.ID {
		t.Fatalf("claim of version 2: %v, %v", js, err)
	}
	c2 := js[0]
	b1 := accept(t, s, newJob("acme", "b1", withEntity("order-2", 1, "")))
	if err := completeAs(t, s, c2, store.ReviewRequired, t0); err != nil {
		t.Fatal(err)
	}
	if j, err := s.Decide(ctx, store.Review{Tenant: "acme", JobID: b2.ID, Approve: true, EventID: "ev-approve-b2", Now: t0}); err != nil || j.State != store.Succeeded {
		t.Fatalf("approving version 2: %s, %v", j.State, err)
	}
	if st := stateOf(t, s, b1.ID); st != store.Superseded {
		t.Errorf("version 1, not started, after version 2's approval: %s, want SUPERSEDED", st)
	}
	if ent, err := s.Entity(ctx, "acme", "order-2", 10); err != nil || ent.WonVersion != 2 {
		t.Errorf("entity after the approval: %+v, %v", ent, err)
	}
}
