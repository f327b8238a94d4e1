// Package storetest is the conformance suite every store.Store backend
// must pass: Exercise runs it against a fresh, migrated store per test.
package storetest

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/kvgate/kvgate/store"
)

// Exercise runs the suite. newStore returns an empty, migrated store that
// the test may close.
func Exercise(t *testing.T, newStore func(t *testing.T) store.Store) {
	tests := []struct {
		name string
		fn   func(*testing.T, store.Store)
	}{
		{"Accept", testAccept},
		{"TenantScoping", testTenantScoping},
		{"List", testList},
		{"ClaimOrderAndLease", testClaimOrder},
		{"ClaimFairAcrossTenants", testClaimFairAcrossTenants},
		{"ClaimFairNoStall", testClaimFairNoStall},
		{"ClaimFairWeights", testClaimFairWeights},
		{"ClaimFairRelist", testClaimFairRelist},
		{"ClaimFairPrune", testClaimFairPrune},
		{"AcceptConcurrentSameKey", testAcceptConcurrentSameKey},
		{"ConcurrentAcceptsApart", testConcurrentAcceptsApart},
		{"ClaimConcurrent", testClaimConcurrent},
		{"ClaimBatchEvents", testClaimBatchEvents},
		{"ManyWriters", testManyWriters},
		{"ConcurrentCompletesApart", testConcurrentCompletesApart},
		{"ConcurrentRenewsApart", testConcurrentRenewsApart},
		{"Heartbeat", testHeartbeat},
		{"Complete", testComplete},
		{"Fail", testFail},
		{"Reap", testReap},
		{"WaitsSpendNothing", testWaitsSpendNothing},
		{"ClaimModels", testClaimModels},
		{"SaveStageOwned", testSaveStageOwned},
		{"StaleStageBesideOwner", testStaleStageBesideOwner},
		{"StaleWorkerAfterReap", testStaleWorker},
		{"Cancel", testCancel},
		{"Stages", testStages},
		{"Outbox", testOutbox},
		{"FeedWithoutBroker", testFeedWithoutBroker},
		{"Inbox", testInbox},
		{"PruneInbox", testPruneInbox},
		{"Tenants", testTenants},
		{"Keys", testKeys},
		{"QuotaWindow", testQuotaWindow},
		{"QuotaWindowCutAttempts", testQuotaWindowCutAttempts},
		{"QuotaRefusalWindow", testQuotaRefusalWindow},
		{"QuotaKeyWindowRelease", testQuotaKeyWindowRelease},
		{"QuotaConcurrencyAndLedger", testQuotaConcurrencyAndLedger},
		{"PermitRenewal", testPermitRenewal},
		{"QuotaBudgets", testQuotaBudgets},
		{"SpendBudgets", testSpendBudgets},
		{"QuotaRace", testQuotaRace},
		{"QuotaTogether", testQuotaTogether},
		{"RecordUsage", testRecordUsage},
		{"QuotaPlainTogether", testQuotaPlainTogether},
		{"AttemptCharges", testAttemptCharges}, // charges.go
		{"JobReservations", testJobReservations},
		{"Stats", testStats},
	}
	tests = append(tests, outcomeTests...) // outcomes.go
	tests = append(tests, entityTests...)  // entities.go
	tests = append(tests, webhookTests...) // webhooks.go
	// The inbox's batches (inbox_batch.go).
	tests = append(tests, inboxBatchTests...)
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			s := newStore(t)
			t.Cleanup(func() { _ = s.Close() })
			tc.fn(t, s)
		})
	}
}

var t0 = time.Date(2026, 11, 30, 12, 0, 0, 0, time.UTC)

func newJob(tenant, key string, mods ...func(*store.NewJob)) store.NewJob {
	n := store.NewJob{
		ID: uuid.Must(uuid.NewV7()).String(), EventID: uuid.Must(uuid.NewV7()).String(),
		Tenant: tenant, IdempotencyKey: key, RequestHash: "hash-" + key,
		Endpoint: "/v1/chat/completions", Model: "m", Body: json.RawMessage(`{"model":"m"}`),
		Metadata: json.RawMessage(`{"doc":"` + key + `"}`), TokenEstimate: 100, MaxAttempts: 3,
		Deadline: t0.Add(time.Hour), Now: t0,
	}
	for _, m := range mods {
		m(&n)
	}
	return n
}

func accept(t *testing.T, s store.Store, n store.NewJob) store.Job {
	t.Helper()
	j, created, err := s.Accept(context.Background(), n)
	if err != nil || !created {
		t.Fatalf("accept %s: created %v, %v", n.IdempotencyKey, created, err)
	}
	return j
}

func claimOne(t *testing.T, s store.Store, now time.Time) store.Job {
	t.Helper()
	js, err := s.Claim(context.Background(), now, time.Minute, 1)
	if err != nil || len(js) != 1 {
		t.Fatalf("claim: %d jobs, %v", len(js), err)
	}
	return js[0]
}

func testAccept(t *testing.T, s store.Store) {
	ctx := context.Background()
	n := newJob("acme", "k1")
	j, created, err := s.Accept(ctx, n)
	if err != nil || !created {
		t.Fatalf("accept: %v, created %v", err, created)
	}
	if byKey, err := s.GetByKey(ctx, n.Tenant, n.IdempotencyKey); err != nil || byKey.ID != j.ID {
		t.Errorf("by key: %+v, %v", byKey, err)
	}
	if _, err := s.GetByKey(ctx, "other-tenant", n.IdempotencyKey); !errors.Is(err, store.ErrNotFound) {
		t.Errorf("another tenant's key: %v, want ErrNotFound", err)
	}
	if j.ID != n.ID || j.State != store.Ready || j.StateVersion != 1 || j.Attempt != 0 || j.Fence != 0 ||
		string(j.Body) != string(n.Body) || string(j.Metadata) != string(n.Metadata) || !j.Deadline.Equal(n.Deadline) {
		t.Errorf("accepted job %+v", j)
	}
	// Same key, same request: the same job, nothing new.
	again := newJob("acme", "k1")
	j2, created, err := s.Accept(ctx, again)
	if err != nil || created || j2.ID != j.ID {
		t.Errorf("same key and hash: %s created %v err %v, want the first job %s", j2.ID, created, err, j.ID)
	}
	// Same key, different request: conflict.
	diff := newJob("acme", "k1", func(n *store.NewJob) { n.RequestHash = "other" })
	if _, _, err := s.Accept(ctx, diff); !errors.Is(err, store.ErrConflict) {
		t.Errorf("same key, different hash: %v, want ErrConflict", err)
	}
	// Another tenant may use the same key.
	if _, created, err := s.Accept(ctx, newJob("globex", "k1")); err != nil || !created {
		t.Errorf("other tenant, same key: created %v, %v", created, err)
	}
	evs, err := s.Unpublished(ctx, 10)
	if err != nil || len(evs) != 2 || evs[0].ID != n.EventID || evs[0].Type != "job.accepted" || evs[0].JobID != j.ID {
		t.Errorf("outbox after two acceptances: %+v, %v", evs, err)
	}
}

func testTenantScoping(t *testing.T, s store.Store) {
	ctx := context.Background()
	j := accept(t, s, newJob("acme", "k"))
	if _, err := s.Get(ctx, "globex", j.ID); !errors.Is(err, store.ErrNotFound) {
		t.Errorf("another tenant's job: %v, want ErrNotFound", err)
	}
	if _, err := s.Cancel(ctx, "globex", j.ID, "", t0); !errors.Is(err, store.ErrNotFound) {
		t.Errorf("cancelling another tenant's job: %v, want ErrNotFound", err)
	}
	if _, err := s.Result(ctx, "globex", j.ID); !errors.Is(err, store.ErrNotFound) {
		t.Errorf("another tenant's result: %v", err)
	}
	if evs, err := s.Events(ctx, "globex", "", 0, 10); err != nil || len(evs) != 0 {
		t.Errorf("another tenant's events: %v %v", evs, err)
	}
	if got, err := s.Get(ctx, "acme", j.ID); err != nil || got.ID != j.ID {
		t.Errorf("own job: %v", err)
	}
}

func testList(t *testing.T, s store.Store) {
	ctx := context.Background()
	var ids []string
	for i := range 7 {
		ids = append(ids, accept(t, s, newJob("acme", fmt.Sprint("k", i))).ID)
	}
	accept(t, s, newJob("globex", "x"))
	var got []string
	cursor := ""
	for pages := 0; ; pages++ {
		page, next, err := s.List(ctx, "acme", store.ListFilter{After: cursor, Limit: 3})
		if err != nil {
			t.Fatal(err)
		}
		for _, j := range page {
			got = append(got, j.ID)
			// A listing reads no request body (a page of large ones
			// would be read whole), and keeps the metadata it shows.
			if j.Body != nil || j.IdempotencyKey == "" {
				t.Errorf("listed %s with body %q, key %q", j.ID, j.Body, j.IdempotencyKey)
			}
		}
		if next == "" {
			break
		}
		cursor = next
		if pages > 5 {
			t.Fatal("pagination does not end")
		}
	}
	slices.Reverse(ids) // newest first
	if !slices.Equal(got, ids) {
		t.Errorf("pages gave %v, want %v", got, ids)
	}
	claimOne(t, s, t0)
	running, _, err := s.List(ctx, "acme", store.ListFilter{States: []store.State{store.Running}})
	if err != nil || len(running) != 1 || running[0].State != store.Running {
		t.Errorf("filter by state: %+v, %v", running, err)
	}
}

func testClaimOrder(t *testing.T, s store.Store) {
	ctx := context.Background()
	late := accept(t, s, newJob("acme", "late", func(n *store.NewJob) { n.Now = t0.Add(time.Second) }))
	early := accept(t, s, newJob("acme", "early"))
	urgent := accept(t, s, newJob("acme", "urgent", func(n *store.NewJob) { n.Priority = -1; n.Now = t0.Add(2 * time.Second) }))
	future := accept(t, s, newJob("acme", "future", func(n *store.NewJob) { n.Now = t0.Add(time.Hour) }))
	expired := accept(t, s, newJob("acme", "expired", func(n *store.NewJob) { n.Deadline = t0.Add(time.Minute) }))

	now := t0.Add(2 * time.Minute)
	js, err := s.Claim(ctx, now, 30*time.Second, 10)
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, j := range js {
		got = append(got, j.ID)
		if j.State != store.Running || j.Attempt != 0 || j.Fence != 1 || !j.LeaseUntil.Equal(now.Add(30*time.Second)) || j.StateVersion != 2 {
			t.Errorf("claimed %s: %+v", j.IdempotencyKey, j)
		}
	}
	if want := []string{urgent.ID, early.ID, late.ID}; !slices.Equal(got, want) {
		t.Errorf("claimed %v, want priority then age: %v (not the future %s nor the expired %s)", got, want, future.ID, expired.ID)
	}
	if more, err := s.Claim(ctx, now, time.Minute, 10); err != nil || len(more) != 0 {
		t.Errorf("a second claim took %d jobs", len(more))
	}
}

// testAcceptConcurrentSameKey races acceptances of one key: exactly one
// creates the job, every other same request gets that job, and every
// different request gets ErrConflict, however the writers interleave.
func testAcceptConcurrentSameKey(t *testing.T, s store.Store) {
	ctx := context.Background()
	const writers = 16
	type outcome struct {
		job     store.Job
		created bool
		err     error
		same    bool
	}
	out := make([]outcome, writers)
	var wg sync.WaitGroup
	for w := range writers {
		wg.Go(func() {
			same := w%4 != 3
			n := newJob("acme", "race")
			if !same {
				n.RequestHash = "other"
			}
			j, created, err := s.Accept(ctx, n)
			out[w] = outcome{j, created, err, same}
		})
	}
	wg.Wait()
	var winner store.Job
	creators := 0
	for _, o := range out {
		if o.created {
			creators++
			winner = o.job
		}
	}
	if creators != 1 {
		t.Fatalf("%d acceptances created the job, want 1", creators)
	}
	for w, o := range out {
		switch {
		case o.same == (winner.RequestHash == "hash-race"):
			if o.err != nil || o.job.ID != winner.ID {
				t.Errorf("writer %d, same request as the winner: %s, %v; want job %s", w, o.job.ID, o.err, winner.ID)
			}
		default:
			if !errors.Is(o.err, store.ErrConflict) {
				t.Errorf("writer %d, different request: %v, want ErrConflict", w, o.err)
			}
		}
	}
	evs, err := s.Unpublished(ctx, 100)
	if err != nil || len(evs) != 1 || evs[0].JobID != winner.ID {
		t.Errorf("events after the race: %+v, %v; want one job.accepted", evs, err)
	}
}

// testConcurrentAcceptsApart sends acceptances that succeed, replay,
// conflict and fail (a job id already taken) all at once, as a backend
// that writes concurrent calls together would batch them: each gets its
// own outcome, and a failing one takes none of the others with it.
func testConcurrentAcceptsApart(t *testing.T, s store.Store) {
	ctx := context.Background()
	taken := accept(t, s, newJob("acme", "taken"))
	const rounds, perRound = 3, 24
	for r := range rounds {
		type outcome struct {
			kind    string
			n       store.NewJob
			job     store.Job
			created bool
			err     error
		}
		out := make([]outcome, perRound)
		var wg sync.WaitGroup
		for i := range perRound {
			kind := [...]string{"new", "new", "new", "replay", "conflict", "new", "new", "id-taken"}[i%8]
			n := newJob("acme", fmt.Sprint("r", r, "-", i))
			switch kind {
			case "replay":
				n = newJob("acme", "taken")
			case "conflict":
				n = newJob("acme", "taken", func(n *store.NewJob) { n.RequestHash = "other" })
			case "id-taken":
				n.ID = taken.ID
			}
			wg.Go(func() {
				j, created, err := s.Accept(ctx, n)
				out[i] = outcome{kind, n, j, created, err}
			})
		}
		wg.Wait()
		for i, o := range out {
			switch o.kind {
			case "new":
				if o.err != nil || !o.created || o.job.ID != o.n.ID {
					t.Errorf("round %d, call %d, a new job: %s created %v, %v", r, i, o.job.ID, o.created, o.err)
				}
			case "replay":
				if o.err != nil || o.created || o.job.ID != taken.ID {
					t.Errorf("round %d, call %d, a replay: %s created %v, %v; want job %s", r, i, o.job.ID, o.created, o.err, taken.ID)
				}
			case "conflict":
				if !errors.Is(o.err, store.ErrConflict) {
					t.Errorf("round %d, call %d, a conflict: %v, want ErrConflict", r, i, o.err)
				}
			case "id-taken":
				if o.err == nil || o.created {
					t.Errorf("round %d, call %d, an id already taken: created %v, %v; want an error", r, i, o.created, o.err)
				}
			}
		}
	}
	page, _, err := s.List(ctx, "acme", store.ListFilter{Limit: 1000})
	if want := 1 + rounds*perRound*5/8; err != nil || len(page) != want {
		t.Errorf("%d jobs after the rounds, %v; want %d", len(page), err, want)
	}
	evs, err := s.Unpublished(ctx, 1000)
	if want := 1 + rounds*perRound*5/8; err != nil || len(evs) != want {
		t.Errorf("%d events after the rounds, %v; want one per job, %d", len(evs), err, want)
	}
}

// testConcurrentCompletesApart completes claimed jobs all at once, some
// under a stale fence: each completion gets its own outcome.
func testConcurrentCompletesApart(t *testing.T, s store.Store) {
	ctx := context.Background()
	const jobs = 40
	for i := range jobs {
		accept(t, s, newJob("acme", fmt.Sprint("k", i)))
	}
	js, err := s.Claim(ctx, t0, time.Minute, jobs)
	if err != nil || len(js) != jobs {
		t.Fatalf("claim: %d jobs, %v", len(js), err)
	}
	errs := make([]error, jobs)
	var wg sync.WaitGroup
	for i, j := range js {
		fence := j.Fence
		if i%4 == 3 {
			fence-- // a stale worker
		}
		wg.Go(func() {
			errs[i] = s.Complete(ctx, store.Completion{JobID: j.ID, Fence: fence, State: store.Succeeded,
				Result:  json.RawMessage(fmt.Sprintf(`{"n":%d}`, i)),
				Attempt: store.Attempt{Attempt: j.Attempt, Outcome: "succeeded", Backend: fmt.Sprint("gpu", i)},
				Now:     t0.Add(time.Second)})
		})
	}
	wg.Wait()
	for i, j := range js {
		got, _ := s.Get(ctx, "acme", j.ID)
		res, _ := s.Result(ctx, "acme", j.ID)
		as, _ := s.Attempts(ctx, j.ID)
		if i%4 == 3 {
			if !errors.Is(errs[i], store.ErrLeaseLost) || got.State != store.Running || len(as) != 0 {
				t.Errorf("job %d, stale fence: %v, state %s, %d attempts; want ErrLeaseLost and no change", i, errs[i], got.State, len(as))
			}
			continue
		}
		if errs[i] != nil || got.State != store.Succeeded || string(res) != fmt.Sprintf(`{"n":%d}`, i) ||
			len(as) != 1 || as[0].Backend != fmt.Sprint("gpu", i) {
			t.Errorf("job %d: %v, state %s, result %s, attempts %+v", i, errs[i], got.State, res, as)
		}
	}
	evs, _ := s.Unpublished(ctx, 1000)
	succeeded := 0
	for _, e := range evs {
		if e.Type == "job.succeeded" {
			succeeded++
		}
	}
	if succeeded != jobs*3/4 {
		t.Errorf("%d job.succeeded events, want %d", succeeded, jobs*3/4)
	}
}

// testConcurrentRenewsApart: sent marks, heartbeats and stage checkpoints
// of many workers at once (which a store may write together in one
// statement) each land only under their own fence: a stale worker's
// changes nothing and gets ErrLeaseLost, the others' land.
func testConcurrentRenewsApart(t *testing.T, s store.Store) {
	ctx := context.Background()
	const jobs = 40
	for i := range jobs {
		accept(t, s, newJob("acme", fmt.Sprint("k", i)))
	}
	js, err := s.Claim(ctx, t0, time.Minute, jobs)
	if err != nil || len(js) != jobs {
		t.Fatalf("claim: %d jobs, %v", len(js), err)
	}
	stale := func(i int) bool { return i%4 == 3 }
	marks, beats, stages := make([]error, jobs), make([]error, jobs), make([]error, jobs)
	var wg sync.WaitGroup
	for i, j := range js {
		fence := j.Fence
		if stale(i) {
			fence--
		}
		wg.Go(func() { marks[i] = s.MarkSent(ctx, j.ID, fence, t0.Add(time.Second), 2*time.Minute, nil) })
		wg.Go(func() { beats[i] = s.Heartbeat(ctx, j.ID, fence, t0.Add(time.Second), 2*time.Minute) })
		wg.Go(func() {
			stages[i] = s.SaveStage(ctx, j.ID, fence, "inference", []byte(fmt.Sprintf(`{"n":%d}`, i)), t0.Add(time.Second))
		})
	}
	wg.Wait()
	for i, j := range js {
		got, _ := s.Get(ctx, "acme", j.ID)
		data, serr := s.Stage(ctx, j.ID, "inference")
		if stale(i) {
			if !errors.Is(marks[i], store.ErrLeaseLost) || !errors.Is(beats[i], store.ErrLeaseLost) ||
				!errors.Is(stages[i], store.ErrLeaseLost) || !got.LeaseUntil.Equal(j.LeaseUntil) || !errors.Is(serr, store.ErrNotFound) {
				t.Errorf("job %d, stale fence: mark %v, beat %v, stage %v, lease %v (was %v), stage read %v; want ErrLeaseLost and no change",
					i, marks[i], beats[i], stages[i], got.LeaseUntil, j.LeaseUntil, serr)
			}
			continue
		}
		if marks[i] != nil || beats[i] != nil || stages[i] != nil || !got.LeaseUntil.Equal(t0.Add(time.Second+2*time.Minute)) ||
			string(data) != fmt.Sprintf(`{"n":%d}`, i) {
			t.Errorf("job %d: mark %v, beat %v, stage %v, lease %v, stage %s", i, marks[i], beats[i], stages[i], got.LeaseUntil, data)
		}
	}
	// The marks counted: a lease lost now spends the attempt of each
	// marked job, and of no stale one's.
	if _, err := s.Reap(ctx, t0.Add(time.Hour), 100); err != nil {
		t.Fatal(err)
	}
	for i, j := range js {
		got, _ := s.Get(ctx, "acme", j.ID)
		want := 1
		if stale(i) {
			want = 0
		}
		if got.Attempt != want {
			t.Errorf("job %d after its lease was lost: attempt %d, want %d", i, got.Attempt, want)
		}
	}
}

// testClaimBatchEvents claims several jobs at once: each gets its own
// job.running event, distinct ids, in claim order after the acceptances.
func testClaimBatchEvents(t *testing.T, s store.Store) {
	ctx := context.Background()
	var ids []string
	for i := range 5 {
		ids = append(ids, accept(t, s, newJob("acme", fmt.Sprint("k", i), func(n *store.NewJob) {
			n.Now = t0.Add(time.Duration(i) * time.Second)
		})).ID)
	}
	js, err := s.Claim(ctx, t0.Add(time.Minute), time.Minute, 10)
	if err != nil || len(js) != 5 {
		t.Fatalf("claim: %d jobs, %v", len(js), err)
	}
	for i, j := range js {
		if j.ID != ids[i] {
			t.Errorf("claimed #%d %s, want %s", i, j.ID, ids[i])
		}
	}
	evs, err := s.Unpublished(ctx, 100)
	if err != nil || len(evs) != 10 {
		t.Fatalf("events: %d, %v; want 5 accepted and 5 running", len(evs), err)
	}
	seen := map[string]bool{}
	for i, e := range evs[5:] {
		if e.Type != "job.running" || e.JobID != ids[i] || e.State != store.Running || e.StateVersion != 2 ||
			!e.CreatedAt.Equal(t0.Add(time.Minute)) || seen[e.ID] || e.ID == "" {
			t.Errorf("running event #%d: %+v", i, e)
		}
		seen[e.ID] = true
	}
	// Nothing runnable: nothing claimed, nothing written.
	if more, err := s.Claim(ctx, t0.Add(time.Minute), time.Minute, 10); err != nil || len(more) != 0 {
		t.Errorf("second claim: %d jobs, %v", len(more), err)
	}
	if evs, _ := s.Unpublished(ctx, 100); len(evs) != 10 {
		t.Errorf("an empty claim wrote events: %d", len(evs))
	}
}

func testClaimConcurrent(t *testing.T, s store.Store) {
	ctx := context.Background()
	const jobs = 120
	for i := range jobs {
		accept(t, s, newJob("acme", fmt.Sprint("k", i)))
	}
	var mu sync.Mutex
	seen := map[string]int{}
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for range 8 {
		wg.Go(func() {
			for {
				js, err := s.Claim(ctx, t0, time.Minute, 7)
				if err != nil {
					errs <- err
					return
				}
				if len(js) == 0 {
					return
				}
				mu.Lock()
				for _, j := range js {
					seen[j.ID]++
				}
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	if len(seen) != jobs {
		t.Errorf("claimed %d distinct jobs, want %d", len(seen), jobs)
	}
	for id, n := range seen {
		if n != 1 {
			t.Errorf("job %s claimed %d times", id, n)
		}
	}
}

// testManyWriters runs more concurrent writers than either backend has
// connections: a store that needs a second connection inside a
// transaction deadlocks here.
func testManyWriters(t *testing.T, s store.Store) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var wg sync.WaitGroup
	errs := make(chan error, 64)
	for w := range 64 {
		wg.Go(func() {
			for i := range 3 {
				if _, _, err := s.Accept(ctx, newJob("acme", fmt.Sprint("w", w, "-", i))); err != nil {
					errs <- err
					return
				}
				js, err := s.Claim(ctx, t0, time.Minute, 1)
				if err != nil {
					errs <- err
					return
				}
				for _, j := range js {
					if err := s.Complete(ctx, store.Completion{JobID: j.ID, Fence: j.Fence, State: store.Succeeded, Now: t0}); err != nil {
						errs <- err
						return
					}
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	page, _, err := s.List(ctx, "acme", store.ListFilter{Limit: 1000})
	if err != nil || len(page) != 192 {
		t.Errorf("%d jobs after 64 writers accepted 3 each, %v", len(page), err)
	}
}

func testHeartbeat(t *testing.T, s store.Store) {
	ctx := context.Background()
	accept(t, s, newJob("acme", "k"))
	j := claimOne(t, s, t0)
	if err := s.Heartbeat(ctx, j.ID, j.Fence, t0.Add(30*time.Second), time.Minute); err != nil {
		t.Fatalf("heartbeat: %v", err)
	}
	got, _ := s.Get(ctx, "acme", j.ID)
	if !got.LeaseUntil.Equal(t0.Add(90 * time.Second)) {
		t.Errorf("lease until %v, want extended to %v", got.LeaseUntil, t0.Add(90*time.Second))
	}
	if err := s.Heartbeat(ctx, j.ID, j.Fence+1, t0.Add(40*time.Second), time.Minute); !errors.Is(err, store.ErrLeaseLost) {
		t.Errorf("heartbeat with another fence: %v", err)
	}
	if err := s.Heartbeat(ctx, j.ID, j.Fence, t0.Add(2*time.Minute), time.Minute); !errors.Is(err, store.ErrLeaseLost) {
		t.Errorf("heartbeat after the lease expired: %v", err)
	}
}

func testComplete(t *testing.T, s store.Store) {
	ctx := context.Background()
	accept(t, s, newJob("acme", "k"))
	j := claimOne(t, s, t0)
	if _, err := s.Result(ctx, "acme", j.ID); !errors.Is(err, store.ErrNotFound) {
		t.Errorf("result before completion: %v", err)
	}
	// A stale fence changes nothing.
	stale := store.Completion{JobID: j.ID, Fence: j.Fence - 1, State: store.Succeeded, Result: json.RawMessage(`"no"`), Now: t0}
	if err := s.Complete(ctx, stale); !errors.Is(err, store.ErrLeaseLost) {
		t.Errorf("complete with a stale fence: %v", err)
	}
	c := store.Completion{JobID: j.ID, Fence: j.Fence, State: store.Succeeded, Result: json.RawMessage(`{"ok":true}`),
		Attempt: store.Attempt{Attempt: 1, Backend: "gpu0", Outcome: "succeeded", PromptTokens: 10, CompletionTokens: 20,
			StartedAt: t0, EndedAt: t0.Add(time.Second)},
		EventID: uuid.Must(uuid.NewV7()).String(), Now: t0.Add(time.Second)}
	if err := s.Complete(ctx, c); err != nil {
		t.Fatal(err)
	}
	got, _ := s.Get(ctx, "acme", j.ID)
	if got.State != store.Succeeded || got.StateVersion != 3 || !got.LeaseUntil.IsZero() {
		t.Errorf("after completion: %+v", got)
	}
	if res, err := s.Result(ctx, "acme", j.ID); err != nil || string(res) != `{"ok":true}` {
		t.Errorf("result %s, %v", res, err)
	}
	as, err := s.Attempts(ctx, j.ID)
	if err != nil || len(as) != 1 || as[0].Backend != "gpu0" || as[0].CompletionTokens != 20 || as[0].Fence != j.Fence {
		t.Errorf("attempts %+v, %v", as, err)
	}
	// Completing twice is a lost lease: the job is no longer RUNNING.
	if err := s.Complete(ctx, c); !errors.Is(err, store.ErrLeaseLost) {
		t.Errorf("second completion: %v", err)
	}
}

func testFail(t *testing.T, s store.Store) {
	ctx := context.Background()
	accept(t, s, newJob("acme", "k", func(n *store.NewJob) { n.MaxAttempts = 2 }))
	j := claimOne(t, s, t0)
	retryAt := t0.Add(10 * time.Second)
	f := store.Failure{JobID: j.ID, Fence: j.Fence, RetryAt: retryAt, Now: t0.Add(time.Second),
		Attempt: store.Attempt{Attempt: 1, Outcome: store.OutcomeFailed, Spent: true, Sent: true, ErrorClass: "backend_5xx", Error: "503"}}
	if err := s.Fail(ctx, f); err != nil {
		t.Fatal(err)
	}
	got, _ := s.Get(ctx, "acme", j.ID)
	if got.State != store.RetryScheduled || !got.AvailableAt.Equal(retryAt) || got.ErrorClass != "backend_5xx" {
		t.Errorf("after a retryable failure: %+v", got)
	}
	if js, _ := s.Claim(ctx, t0.Add(5*time.Second), time.Minute, 1); len(js) != 0 {
		t.Error("claimed before its retry time")
	}
	j2 := claimOne(t, s, retryAt)
	if j2.Attempt != 1 || j2.Fence != 2 {
		t.Errorf("retry claim: attempt %d fence %d", j2.Attempt, j2.Fence)
	}
	// The last attempt: even with RetryAt the failure is terminal.
	f2 := store.Failure{JobID: j.ID, Fence: j2.Fence, RetryAt: retryAt.Add(time.Minute), Now: retryAt,
		Attempt: store.Attempt{Attempt: 2, Outcome: store.OutcomeFailed, Spent: true, Sent: true, ErrorClass: "backend_5xx"}}
	if err := s.Fail(ctx, f2); err != nil {
		t.Fatal(err)
	}
	if got, _ := s.Get(ctx, "acme", j.ID); got.State != store.FailedTerminal || got.Attempt != 2 {
		t.Errorf("attempts spent: %s after %d attempts, want FAILED_TERMINAL after 2", got.State, got.Attempt)
	}
	evs, _ := s.Unpublished(ctx, 100)
	if len(evs) == 0 || evs[len(evs)-1].Type != "job.dead_lettered" || evs[len(evs)-1].JobID != j.ID {
		t.Errorf("no dead-letter event: %+v", evs)
	}

	// A retry that would start after the deadline is terminal at once.
	accept(t, s, newJob("acme", "k2", func(n *store.NewJob) { n.Deadline = t0.Add(time.Minute) }))
	j3 := claimOne(t, s, t0.Add(time.Second))
	late := store.Failure{JobID: j3.ID, Fence: j3.Fence, RetryAt: t0.Add(2 * time.Minute), Now: t0.Add(2 * time.Second),
		Attempt: store.Attempt{Attempt: 1, Outcome: store.OutcomeFailed, Spent: true, Sent: true, ErrorClass: "backend_5xx"}}
	if err := s.Fail(ctx, late); err != nil {
		t.Fatal(err)
	}
	if got, _ := s.Get(ctx, "acme", j3.ID); got.State != store.FailedTerminal {
		t.Errorf("retry past the deadline: %s, want FAILED_TERMINAL", got.State)
	}
}

func testReap(t *testing.T, s store.Store) {
	ctx := context.Background()
	accept(t, s, newJob("acme", "a", func(n *store.NewJob) { n.MaxAttempts = 2; n.Now = t0.Add(-2 * time.Hour) }))
	accept(t, s, newJob("acme", "stale-deadline", func(n *store.NewJob) { n.Deadline = t0.Add(time.Second); n.Now = t0.Add(-time.Hour) }))
	j := claimOne(t, s, t0)
	if n, err := s.Reap(ctx, t0.Add(30*time.Second), 100); err != nil || n != 1 {
		// Only the runnable job past its deadline is due; the lease holds.
		t.Fatalf("reap before the lease expired: %d, %v", n, err)
	}
	// A claim that never marked its request sent loses its lease: the job
	// is retried and nothing is spent, however often.
	for i := range 3 {
		now := t0.Add(time.Duration(i*10) * time.Minute)
		if i > 0 {
			j = claimOne(t, s, now)
		}
		n, err := s.Reap(ctx, now.Add(2*time.Minute), 100)
		if err != nil || n != 1 {
			t.Fatalf("reap after the lease expired: %d, %v", n, err)
		}
		got, _ := s.Get(ctx, "acme", j.ID)
		if got.State != store.RetryScheduled || got.Fence != j.Fence+1 || got.Attempt != 0 || got.ErrorClass != "lease_expired" {
			t.Fatalf("reaped unsent claim %d: %+v", i, got)
		}
	}
	as, _ := s.Attempts(ctx, j.ID)
	if len(as) != 3 || as[0].Outcome != store.OutcomeLeaseExpired || as[0].Spent || as[0].Sent || as[0].Attempt != 1 {
		t.Errorf("the lost claims are not recorded as unspent: %+v", as)
	}
	// A claim that marked its request sent spends the attempt when its
	// lease is lost: the request may have reached a backend.
	now := t0.Add(30 * time.Minute)
	j = claimOne(t, s, now)
	if err := s.MarkSent(ctx, j.ID, j.Fence, now, time.Minute, nil); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Reap(ctx, now.Add(2*time.Minute), 100); err != nil {
		t.Fatal(err)
	}
	if got, _ := s.Get(ctx, "acme", j.ID); got.State != store.RetryScheduled || got.Attempt != 1 {
		t.Fatalf("reaped sent claim: %s attempt %d, want RETRY_SCHEDULED attempt 1", got.State, got.Attempt)
	}
	// The second lost sent claim spends the last attempt: terminal.
	now = now.Add(5 * time.Minute)
	j = claimOne(t, s, now)
	if j.Attempt != 1 {
		t.Fatalf("attempt %d after a reap, want 1 (a reap never resets it)", j.Attempt)
	}
	if err := s.MarkSent(ctx, j.ID, j.Fence, now, time.Minute, nil); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Reap(ctx, now.Add(2*time.Minute), 100); err != nil {
		t.Fatal(err)
	}
	got, _ := s.Get(ctx, "acme", j.ID)
	if got.State != store.FailedTerminal || got.Attempt != 2 || got.ErrorClass != "lease_expired" {
		t.Errorf("second lost sent lease with 2 attempts max: %+v", got)
	}
	as, _ = s.Attempts(ctx, j.ID)
	if last := as[len(as)-1]; !last.Spent || !last.Sent || last.Attempt != 2 {
		t.Errorf("the last lost claim: %+v, want spent and sent, attempt 2", last)
	}
	// MarkSent is the owner's alone.
	if err := s.MarkSent(ctx, j.ID, j.Fence, now, time.Minute, nil); !errors.Is(err, store.ErrLeaseLost) {
		t.Errorf("mark sent of a reaped claim: %v", err)
	}

	// A lost sent claim that had checkpointed its inference spends its
	// attempt, the last one, yet the job is retried: the next claim
	// finishes from the checkpoint.
	accept(t, s, newJob("acme", "checkpointed", func(n *store.NewJob) { n.MaxAttempts = 1; n.Now = now }))
	now = now.Add(time.Minute)
	c := claimOne(t, s, now)
	if err := s.MarkSent(ctx, c.ID, c.Fence, now, time.Minute, nil); err != nil {
		t.Fatal(err)
	}
	if err := s.SaveStage(ctx, c.ID, c.Fence, "inference", []byte(`"answer"`), now); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Reap(ctx, now.Add(2*time.Minute), 100); err != nil {
		t.Fatal(err)
	}
	if got, _ := s.Get(ctx, "acme", c.ID); got.State != store.RetryScheduled || got.Attempt != 1 {
		t.Errorf("a lost claim with a checkpoint: %s attempt %d, want RETRY_SCHEDULED with its attempt spent", got.State, got.Attempt)
	}

	// Part of the inference checkpointed (an embeddings job's first
	// batch) is no such exemption: the next claim would call a backend
	// again, so the lost last attempt ends the job.
	accept(t, s, newJob("acme", "partly", func(n *store.NewJob) { n.MaxAttempts = 1; n.Now = now }))
	now = now.Add(3 * time.Minute)
	p := claimOne(t, s, now)
	if err := s.SaveStage(ctx, p.ID, p.Fence, store.StageInference+"/batch/00000", []byte(`"first batch"`), now); err != nil {
		t.Fatal(err)
	}
	if err := s.MarkSent(ctx, p.ID, p.Fence, now, time.Minute, nil); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Reap(ctx, now.Add(2*time.Minute), 100); err != nil {
		t.Fatal(err)
	}
	if got, _ := s.Get(ctx, "acme", p.ID); got.State != store.FailedTerminal || got.Attempt != 1 {
		t.Errorf("a lost last claim with part of its inference checkpointed: %s attempt %d, want FAILED_TERMINAL", got.State, got.Attempt)
	}
}

// testWaitsSpendNothing ends claims that only waited (no backend, a
// quota, shutdown) on a job of one attempt: each hands the job back for a
// retry without spending it, until the deadline forbids a retry, which
// ends the job as deadline_exceeded; a failure that reached a backend then
// spends the one attempt.
func testWaitsSpendNothing(t *testing.T, s store.Store) {
	ctx := context.Background()
	j := accept(t, s, newJob("acme", "w", func(n *store.NewJob) { n.MaxAttempts = 1; n.Deadline = t0.Add(time.Hour) }))
	now := t0
	for i := range 5 {
		c := claimOne(t, s, now)
		f := store.Failure{JobID: j.ID, Fence: c.Fence, Now: now, Attempt: store.Attempt{Attempt: c.Attempt + 1,
			Outcome: store.OutcomeWait, ErrorClass: "no_capacity", Error: "waited"}}
		if i%2 == 1 {
			f.RetryAt = now.Add(time.Second) // else at once
		}
		if err := s.Fail(ctx, f); err != nil {
			t.Fatal(err)
		}
		got, _ := s.Get(ctx, "acme", j.ID)
		if got.State != store.RetryScheduled || got.Attempt != 0 {
			t.Fatalf("after wait %d: %s attempt %d, want RETRY_SCHEDULED with none spent", i, got.State, got.Attempt)
		}
		now = now.Add(time.Second)
	}
	as, _ := s.Attempts(ctx, j.ID)
	if len(as) != 5 || as[0].Spent || as[0].Outcome != store.OutcomeWait || as[0].Attempt != 1 {
		t.Errorf("waits in the history: %+v", as)
	}
	// A spent failure of the one attempt is terminal.
	c := claimOne(t, s, now)
	if err := s.Fail(ctx, store.Failure{JobID: j.ID, Fence: c.Fence, RetryAt: now.Add(time.Second), Now: now,
		Attempt: store.Attempt{Attempt: 1, Outcome: store.OutcomeFailed, Spent: true, Sent: true, ErrorClass: "backend_error"}}); err != nil {
		t.Fatal(err)
	}
	if got, _ := s.Get(ctx, "acme", j.ID); got.State != store.FailedTerminal || got.Attempt != 1 || got.ErrorClass != "backend_error" {
		t.Errorf("spent failure of the last attempt: %+v", got)
	}

	// A wait whose retry the deadline forbids ends the job as
	// deadline_exceeded, with nothing spent.
	j2 := accept(t, s, newJob("acme", "w2", func(n *store.NewJob) { n.Deadline = t0.Add(time.Minute) }))
	c2 := claimOne(t, s, t0.Add(time.Second))
	if c2.ID != j2.ID {
		t.Fatalf("claimed %s, want %s", c2.ID, j2.ID)
	}
	if err := s.Fail(ctx, store.Failure{JobID: j2.ID, Fence: c2.Fence, RetryAt: t0.Add(2 * time.Minute), Now: t0.Add(time.Second),
		Attempt: store.Attempt{Attempt: 1, Outcome: store.OutcomeWait, ErrorClass: "quota_wait"}}); err != nil {
		t.Fatal(err)
	}
	if got, _ := s.Get(ctx, "acme", j2.ID); got.State != store.FailedTerminal || got.Attempt != 0 || got.ErrorClass != "deadline_exceeded" {
		t.Errorf("wait past the deadline: %+v, want FAILED_TERMINAL deadline_exceeded with none spent", got)
	}
}

// testClaimModels claims only jobs for the models asked for, and any
// model when none is named.
func testClaimModels(t *testing.T, s store.Store) {
	ctx := context.Background()
	a := accept(t, s, newJob("acme", "a", func(n *store.NewJob) { n.Model = "llama" }))
	b := accept(t, s, newJob("bravo", "b", func(n *store.NewJob) { n.Model = "qwen"; n.Now = t0.Add(time.Millisecond) }))
	js, err := s.Claim(ctx, t0.Add(time.Second), time.Minute, 10, "qwen", "mistral")
	if err != nil || len(js) != 1 || js[0].ID != b.ID {
		t.Fatalf("claim for qwen: %+v, %v", js, err)
	}
	if js, err := s.Claim(ctx, t0.Add(time.Second), time.Minute, 10, "mistral"); err != nil || len(js) != 0 {
		t.Fatalf("claim for a model with no job: %+v, %v", js, err)
	}
	if js, err := s.Claim(ctx, t0.Add(time.Second), time.Minute, 10); err != nil || len(js) != 1 || js[0].ID != a.ID {
		t.Fatalf("claim for any model: %+v, %v", js, err)
	}
}

// testSaveStageOwned checkpoints only while the claim owns the job: not
// after its lease expired (by the caller's clock, before any reap), nor
// after a reap and a new claim.
func testSaveStageOwned(t *testing.T, s store.Store) {
	ctx := context.Background()
	accept(t, s, newJob("acme", "k"))
	j := claimOne(t, s, t0) // lease until t0+1m
	if err := s.SaveStage(ctx, j.ID, j.Fence, "inference", []byte(`"late"`), t0.Add(61*time.Second)); !errors.Is(err, store.ErrLeaseLost) {
		t.Errorf("checkpoint after the lease expired: %v, want ErrLeaseLost", err)
	}
	if _, err := s.Stage(ctx, j.ID, "inference"); !errors.Is(err, store.ErrNotFound) {
		t.Errorf("a checkpoint was written without ownership: %v", err)
	}
	if err := s.SaveStage(ctx, j.ID, j.Fence+1, "inference", []byte(`"other"`), t0); !errors.Is(err, store.ErrLeaseLost) {
		t.Errorf("checkpoint under another fence: %v, want ErrLeaseLost", err)
	}
	if err := s.SaveStage(ctx, "no-such-job", 1, "inference", []byte(`"x"`), t0); !errors.Is(err, store.ErrLeaseLost) {
		t.Errorf("checkpoint of a missing job: %v, want ErrLeaseLost", err)
	}
}

// testStaleStageBesideOwner: a stale claim's checkpoint and the owning
// claim's, of the same job and stage at the same moment (which a store may
// write together in one statement), each get their own answer: the stale
// one ErrLeaseLost, the owner's nil and its data kept, whichever the store
// took first. The stale call starts first, so that a store that answered
// a stage's calls by their order would tell the stale one it saved.
func testStaleStageBesideOwner(t *testing.T, s store.Store) {
	ctx := context.Background()
	const jobs, rounds = 16, 4
	for r := range rounds { // each round claims the jobs it accepted: the earlier ones stay leased
		for i := range jobs {
			accept(t, s, newJob("acme", fmt.Sprint("k", r, "-", i)))
		}
		js, err := s.Claim(ctx, t0, time.Minute, jobs)
		if err != nil || len(js) != jobs {
			t.Fatalf("round %d: claim %d jobs, %v", r, len(js), err)
		}
		stale, owner := make([]error, jobs), make([]error, jobs)
		var wg sync.WaitGroup
		for i, j := range js {
			wg.Go(func() {
				stale[i] = s.SaveStage(ctx, j.ID, j.Fence-1, "inference", []byte(`"stale"`), t0.Add(time.Second))
			})
			wg.Go(func() {
				owner[i] = s.SaveStage(ctx, j.ID, j.Fence, "inference", []byte(`"owner"`), t0.Add(time.Second))
			})
		}
		wg.Wait()
		for i, j := range js {
			data, err := s.Stage(ctx, j.ID, "inference")
			if !errors.Is(stale[i], store.ErrLeaseLost) || owner[i] != nil || err != nil || string(data) != `"owner"` {
				t.Errorf("round %d, job %d: stale claim's checkpoint %v (want ErrLeaseLost), owner's %v (want nil), stage %s, %v",
					r, i, stale[i], owner[i], data, err)
			}
		}
	}
}

func testStaleWorker(t *testing.T, s store.Store) {
	ctx := context.Background()
	accept(t, s, newJob("acme", "k"))
	old := claimOne(t, s, t0)
	if _, err := s.Reap(ctx, t0.Add(2*time.Minute), 10); err != nil {
		t.Fatal(err)
	}
	cur := claimOne(t, s, t0.Add(2*time.Minute))
	// The first worker wakes up with its answer: discarded.
	err := s.Complete(ctx, store.Completion{JobID: old.ID, Fence: old.Fence, State: store.Succeeded,
		Result: json.RawMessage(`"stale"`), Now: t0.Add(2 * time.Minute)})
	if !errors.Is(err, store.ErrLeaseLost) {
		t.Fatalf("stale completion: %v, want ErrLeaseLost", err)
	}
	if err := s.SaveStage(ctx, old.ID, old.Fence, "inference", []byte("stale"), t0.Add(2*time.Minute)); !errors.Is(err, store.ErrLeaseLost) {
		t.Errorf("stale checkpoint: %v", err)
	}
	if err := s.Complete(ctx, store.Completion{JobID: cur.ID, Fence: cur.Fence, State: store.Succeeded,
		Result: json.RawMessage(`"fresh"`), Now: t0.Add(150 * time.Second)}); err != nil {
		t.Fatal(err)
	}
	if res, _ := s.Result(ctx, "acme", cur.ID); string(res) != `"fresh"` {
		t.Errorf("result %s, want the current worker's", res)
	}
}

func testCancel(t *testing.T, s store.Store) {
	ctx := context.Background()
	j := accept(t, s, newJob("acme", "k"))
	got, err := s.Cancel(ctx, "acme", j.ID, "", t0)
	if err != nil || got.State != store.Cancelled {
		t.Fatalf("cancel: %+v %v", got, err)
	}
	if _, err := s.Cancel(ctx, "acme", j.ID, "", t0); !errors.Is(err, store.ErrFinal) {
		t.Errorf("cancel twice: %v, want ErrFinal", err)
	}
	if js, _ := s.Claim(ctx, t0, time.Minute, 10); len(js) != 0 {
		t.Error("a cancelled job was claimed")
	}
	// Cancelling a running job makes its worker's completion stale.
	accept(t, s, newJob("acme", "k2"))
	r := claimOne(t, s, t0)
	if _, err := s.Cancel(ctx, "acme", r.ID, "", t0); err != nil {
		t.Fatal(err)
	}
	if err := s.Complete(ctx, store.Completion{JobID: r.ID, Fence: r.Fence, State: store.Succeeded, Now: t0}); !errors.Is(err, store.ErrLeaseLost) {
		t.Errorf("completing a cancelled job: %v", err)
	}
}

func testStages(t *testing.T, s store.Store) {
	ctx := context.Background()
	accept(t, s, newJob("acme", "k"))
	j := claimOne(t, s, t0)
	if _, err := s.Stage(ctx, j.ID, "inference"); !errors.Is(err, store.ErrNotFound) {
		t.Errorf("missing stage: %v", err)
	}
	if err := s.SaveStage(ctx, j.ID, j.Fence, "inference", []byte(`{"text":"hi"}`), t0); err != nil {
		t.Fatal(err)
	}
	if err := s.SaveStage(ctx, j.ID, j.Fence, "inference", []byte(`{"text":"other"}`), t0); err != nil {
		t.Fatal(err)
	}
	// The next attempt finds the checkpoint and need not infer again.
	if err := s.Fail(ctx, store.Failure{JobID: j.ID, Fence: j.Fence, RetryAt: t0.Add(time.Second), Now: t0}); err != nil {
		t.Fatal(err)
	}
	j2 := claimOne(t, s, t0.Add(time.Second))
	data, err := s.Stage(ctx, j2.ID, "inference")
	if err != nil || string(data) != `{"text":"hi"}` {
		t.Errorf("stage after a retry: %s, %v; want the first checkpoint", data, err)
	}
}

func testOutbox(t *testing.T, s store.Store) {
	ctx := context.Background()
	j := accept(t, s, newJob("acme", "k"))
	accept(t, s, newJob("globex", "k"))
	c := claimOne(t, s, t0)
	_ = s.Complete(ctx, store.Completion{JobID: c.ID, Fence: c.Fence, State: store.Succeeded, Now: t0})
	evs, err := s.Unpublished(ctx, 100)
	if err != nil || len(evs) != 4 {
		t.Fatalf("unpublished: %d, %v", len(evs), err)
	}
	for i := 1; i < len(evs); i++ {
		if evs[i].Seq <= evs[i-1].Seq {
			t.Errorf("events out of order: %v then %v", evs[i-1].Seq, evs[i].Seq)
		}
	}
	// Not yet published: not in the feed.
	if feed, err := s.Events(ctx, "acme", "", 0, 100); err != nil || len(feed) != 0 {
		t.Errorf("feed before publishing: %+v, %v", feed, err)
	}
	if err := s.MarkPublished(ctx, []string{evs[0].ID, evs[1].ID}, t0); err != nil {
		t.Fatal(err)
	}
	if rest, _ := s.Unpublished(ctx, 100); len(rest) != 2 || rest[0].ID != evs[2].ID {
		t.Errorf("after marking two: %+v", rest)
	}
	first, _ := s.Events(ctx, "acme", "", 0, 100)
	if len(first) != 1 || first[0].ID != evs[0].ID || first[0].Cursor == 0 || first[0].PublishedAt.IsZero() {
		t.Fatalf("acme's feed after one publication: %+v", first)
	}
	// Marking again is harmless: the event keeps its place.
	if err := s.MarkPublished(ctx, []string{evs[0].ID}, t0.Add(time.Hour)); err != nil {
		t.Fatal(err)
	}
	if again, _ := s.Events(ctx, "acme", "", 0, 100); len(again) != 1 || again[0].Cursor != first[0].Cursor {
		t.Errorf("marked twice: %+v, want cursor %d kept", again, first[0].Cursor)
	}
	// The rest, published in an order other than insertion: the feed
	// follows publication.
	if err := s.MarkPublished(ctx, []string{evs[3].ID, evs[2].ID}, t0); err != nil {
		t.Fatal(err)
	}
	mine, err := s.Events(ctx, "acme", j.ID, 0, 100)
	if err != nil || len(mine) != 3 {
		t.Fatalf("job events: %d, %v", len(mine), err)
	}
	for i := 1; i < len(mine); i++ {
		if mine[i].Cursor <= mine[i-1].Cursor {
			t.Errorf("feed out of order: cursor %d then %d", mine[i-1].Cursor, mine[i].Cursor)
		}
	}
	if mine[1].ID != evs[3].ID || mine[2].ID != evs[2].ID {
		t.Errorf("feed order %s %s, want publication order %s %s", mine[1].ID, mine[2].ID, evs[3].ID, evs[2].ID)
	}
	types := map[string]int64{}
	for _, e := range mine {
		types[e.Type] = e.StateVersion
	}
	if types["job.accepted"] == 0 || types["job.running"] <= types["job.accepted"] || types["job.succeeded"] <= types["job.running"] {
		t.Errorf("event state versions: %v", types)
	}
	after, _ := s.Events(ctx, "acme", "", mine[0].Cursor, 100)
	if len(after) != 2 {
		t.Errorf("events after the cursor: %d, want 2", len(after))
	}
	// Counted as read, up to a bound; a tenant without events has none.
	for _, c := range []struct {
		tenant       string
		after        int64
		limit, count int
	}{{"acme", mine[0].Cursor, 100, 2}, {"acme", 0, 100, 3}, {"acme", 0, 2, 2}, {"nobody", 0, 100, 0}} {
		if n, err := s.CountEvents(ctx, c.tenant, c.after, c.limit); err != nil || n != c.count {
			t.Errorf("CountEvents(%s, after %d, at most %d) = %d, %v; want %d", c.tenant, c.after, c.limit, n, err, c.count)
		}
	}
	if other, _ := s.Events(ctx, "globex", "", 0, 100); len(other) != 1 || other[0].Cursor <= mine[0].Cursor {
		t.Errorf("globex's feed: %+v", other)
	}
	if head, err := s.FeedHead(ctx, "acme"); err != nil || head != mine[2].Cursor {
		t.Errorf("acme's feed head: %d, %v; want %d", head, err, mine[2].Cursor)
	}
	if head, err := s.FeedHead(ctx, "nobody"); err != nil || head != 0 {
		t.Errorf("an empty feed's head: %d, %v", head, err)
	}
}

// testFeedWithoutBroker: while the broker is away, unpublished events are
// placed in the feed (FeedUnpublished), readable by the event streams; they
// stay unpublished, first for the relay, and keep their places when it
// publishes them; the events after them take the places after. Their jobs
// outlive a prune, as unpublished events' do.
func testFeedWithoutBroker(t *testing.T, s store.Store) {
	ctx := context.Background()
	published := accept(t, s, newJob("acme", "before"))
	publishAll(t, s, t0)
	head, _ := s.FeedHead(ctx, "acme")
	a := accept(t, s, newJob("acme", "a"))
	if _, err := s.Cancel(ctx, "acme", a.ID, "", t0); err != nil { // final, its events unpublished
		t.Fatal(err)
	}
	b := accept(t, s, newJob("acme", "b"))
	if n, err := s.FeedUnpublished(ctx, 1); err != nil || n != 1 {
		t.Fatalf("placed %d events (%v), want 1: the limit", n, err)
	}
	if n, err := s.FeedUnpublished(ctx, 10); err != nil || n != 2 {
		t.Fatalf("placed %d events (%v), want the other two", n, err)
	}
	if n, err := s.FeedUnpublished(ctx, 10); err != nil || n != 0 {
		t.Fatalf("placed %d events again (%v)", n, err)
	}
	feed, err := s.Events(ctx, "acme", "", head, 10)
	if err != nil || len(feed) != 3 || feed[0].JobID != a.ID || feed[1].Type != "job.cancelled" || feed[2].JobID != b.ID ||
		feed[0].Cursor <= head || feed[1].Cursor <= feed[0].Cursor || feed[2].Cursor <= feed[1].Cursor {
		t.Fatalf("the feed after placing: %+v, %v; want a's two events then b's after %d", feed, err, head)
	}
	if !feed[0].PublishedAt.IsZero() {
		t.Errorf("a placed event reads published at %v", feed[0].PublishedAt)
	}
	if h, _ := s.FeedHead(ctx, "acme"); h != feed[2].Cursor {
		t.Errorf("the feed's head %d, want the last placed event's %d", h, feed[2].Cursor)
	}
	// A final job whose events the broker has not taken is kept.
	if n, err := s.PruneFinal(ctx, t0.Add(1000*time.Hour), 100); err != nil || n != 0 {
		t.Errorf("the prune took %d jobs (%v), want none: a's events are not published", n, err)
	}
	c := accept(t, s, newJob("acme", "c")) // the broker still away
	un, err := s.Unpublished(ctx, 10)
	if err != nil || len(un) != 4 || un[0].ID != feed[0].ID || un[2].ID != feed[2].ID || un[3].JobID != c.ID {
		t.Fatalf("unpublished: %+v, %v; want the placed three first, then c's", un, err)
	}
	if first, _ := s.Unpublished(ctx, 1); len(first) != 1 || first[0].ID != feed[0].ID {
		t.Errorf("one unpublished: %+v, want the first placed", first)
	}
	// The broker is back: the relay publishes c's first (any order), then
	// the placed ones; they keep their places, c's comes after them.
	if err := s.MarkPublished(ctx, []string{un[3].ID, un[0].ID, un[1].ID, un[2].ID}, t0); err != nil {
		t.Fatal(err)
	}
	if rest, _ := s.Unpublished(ctx, 10); len(rest) != 0 {
		t.Errorf("unpublished after the relay: %+v", rest)
	}
	all, _ := s.Events(ctx, "acme", "", head, 10)
	if len(all) != 4 || all[0].Cursor != feed[0].Cursor || all[2].Cursor != feed[2].Cursor || all[3].JobID != c.ID ||
		all[3].Cursor <= feed[2].Cursor || all[0].PublishedAt.IsZero() {
		t.Errorf("the feed once published: %+v; want the places kept and c's after", all)
	}
	if old, _ := s.Events(ctx, "acme", published.ID, 0, 10); len(old) != 1 || old[0].Cursor > head {
		t.Errorf("the event published before: %+v", old)
	}
}

func testInbox(t *testing.T, s store.Store) {
	ctx := context.Background()
	if dup, err := s.RecordInbox(ctx, "e1", "d1", t0); err != nil || dup {
		t.Fatalf("first delivery: dup %v, %v", dup, err)
	}
	if dup, err := s.RecordInbox(ctx, "e1", "d1", t0); err != nil || !dup {
		t.Errorf("redelivery: dup %v, %v", dup, err)
	}
	if _, err := s.RecordInbox(ctx, "e1", "other", t0); !errors.Is(err, store.ErrDigestMismatch) {
		t.Errorf("same id, other content: %v, want ErrDigestMismatch", err)
	}
}

func testPruneInbox(t *testing.T, s store.Store) {
	ctx := context.Background()
	for i, at := range []time.Time{t0, t0.Add(time.Hour), t0.Add(2 * time.Hour)} {
		if _, err := s.RecordInbox(ctx, fmt.Sprintf("e%d", i), "d", at); err != nil {
			t.Fatal(err)
		}
	}
	if n, err := s.PruneInbox(ctx, t0.Add(90*time.Minute), 100); err != nil || n != 2 {
		t.Fatalf("pruned %d, %v; want the 2 older records", n, err)
	}
	if dup, err := s.RecordInbox(ctx, "e2", "d", t0.Add(3*time.Hour)); err != nil || !dup {
		t.Errorf("the newest record was pruned too: dup %v, %v", dup, err)
	}
	if dup, err := s.RecordInbox(ctx, "e0", "d", t0.Add(3*time.Hour)); err != nil || dup {
		t.Errorf("a pruned record still counts: dup %v, %v", dup, err)
	}
}
