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

// Conformance cases of store.Outcomes: policies, pinning, the stages of
// validation, review, replay, audit, dead letters and retention.
var outcomeTests = []struct {
	name string
	fn   func(*testing.T, store.Store)
}{
	{"PolicyVersions", testPolicyVersions},
	{"PolicyConcurrentPuts", testPolicyConcurrentPuts},
	{"AcceptPinsPolicy", testAcceptPinsPolicy},
	{"ValidationStages", testValidationStages},
	{"ReviewDecisions", testReviewDecisions},
	{"ReplayResumes", testReplayResumes},
	{"DeadLetters", testDeadLetters},
	{"PruneFinal", testPruneFinal},
	{"PruneKeepsFeedAndOutbox", testPruneKeepsFeedAndOutbox},
}

const invoiceV1 = `{"name":"invoice","rules":[{"rule":"json"}]}`
const invoiceV2 = `{"name":"invoice","rules":[{"rule":"json"},{"rule":"enum","pointer":"/currency","values":["EUR"]}]}`

func putPolicy(t *testing.T, s store.Store, tenant, name, doc string) store.Policy {
	t.Helper()
	p, err := s.PutPolicy(context.Background(), store.Policy{Tenant: tenant, Name: name, Document: json.RawMessage(doc),
		CreatedBy: "key-1", CreatedAt: t0})
	if err != nil {
		t.Fatalf("put policy %s: %v", name, err)
	}
	return p
}

func withPolicy(name string, version int) func(*store.NewJob) {
	return func(n *store.NewJob) {
		n.Outcome = &store.NewOutcome{Policy: name, Version: version, Source: "the source"}
	}
}

func testPolicyVersions(t *testing.T, s store.Store) {
	ctx := context.Background()
	if _, err := s.GetPolicy(ctx, "acme", "invoice", 0); !errors.Is(err, store.ErrPolicyNotFound) {
		t.Errorf("no policy yet: %v", err)
	}
	p1 := putPolicy(t, s, "acme", "invoice", invoiceV1)
	p2 := putPolicy(t, s, "acme", "invoice", invoiceV2)
	other := putPolicy(t, s, "globex", "invoice", invoiceV2)
	putPolicy(t, s, "acme", "contract", invoiceV1)
	if p1.Version != 1 || p2.Version != 2 || other.Version != 1 {
		t.Errorf("versions %d, %d, another tenant's %d; want 1, 2, 1", p1.Version, p2.Version, other.Version)
	}
	latest, err := s.GetPolicy(ctx, "acme", "invoice", 0)
	if err != nil || latest.Version != 2 || string(latest.Document) != invoiceV2 || latest.CreatedBy != "key-1" || !latest.CreatedAt.Equal(t0) {
		t.Errorf("latest: %+v, %v", latest, err)
	}
	old, err := s.GetPolicy(ctx, "acme", "invoice", 1)
	if err != nil || old.Version != 1 || string(old.Document) != invoiceV1 {
		t.Errorf("version 1 stays readable: %+v, %v", old, err)
	}
	if _, err := s.GetPolicy(ctx, "acme", "invoice", 3); !errors.Is(err, store.ErrPolicyNotFound) {
		t.Errorf("version 3: %v", err)
	}
	vs, err := s.PolicyVersions(ctx, "acme", "invoice")
	if err != nil || len(vs) != 2 || vs[0].Version != 1 || vs[1].Version != 2 {
		t.Errorf("versions: %+v, %v", vs, err)
	}
	if _, err := s.PolicyVersions(ctx, "initech", "invoice"); !errors.Is(err, store.ErrPolicyNotFound) {
		t.Errorf("another tenant's versions: %v", err)
	}
	ps, err := s.Policies(ctx, "acme")
	if err != nil || len(ps) != 2 || ps[0].Name != "contract" || ps[1].Name != "invoice" || ps[1].Version != 2 {
		t.Errorf("policies: %+v, %v", ps, err)
	}
}

func testPolicyConcurrentPuts(t *testing.T, s store.Store) {
	var wg sync.WaitGroup
	versions := make([]int, 6)
	errs := make([]error, 6)
	for i := range versions {
		wg.Go(func() {
			p, err := s.PutPolicy(context.Background(), store.Policy{Tenant: "acme", Name: "p", Document: json.RawMessage(invoiceV1), CreatedAt: t0})
			versions[i], errs[i] = p.Version, err
		})
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	slices.Sort(versions)
	if !slices.Equal(versions, []int{1, 2, 3, 4, 5, 6}) {
		t.Errorf("six concurrent puts got versions %v", versions)
	}
}

func testAcceptPinsPolicy(t *testing.T, s store.Store) {
	ctx := context.Background()
	putPolicy(t, s, "acme", "invoice", invoiceV1)
	putPolicy(t, s, "acme", "invoice", invoiceV2)
	latest := accept(t, s, newJob("acme", "latest", withPolicy("invoice", 0)))
	pinned := accept(t, s, newJob("acme", "pinned", withPolicy("invoice", 1)))
	plain := accept(t, s, newJob("acme", "plain"))
	putPolicy(t, s, "acme", "invoice", invoiceV1) // v3 comes after: the jobs keep theirs
	for _, tc := range []struct {
		id      string
		version int
		doc     string
	}{{latest.ID, 2, invoiceV2}, {pinned.ID, 1, invoiceV1}} {
		o, err := s.JobOutcome(ctx, tc.id)
		if err != nil || o.Policy != "invoice" || o.Version != tc.version || string(o.Document) != tc.doc || o.Source != "the source" || o.Tenant != "acme" {
			t.Errorf("outcome of %s: %+v, %v; want version %d", tc.id, o, err, tc.version)
		}
	}
	if _, err := s.JobOutcome(ctx, plain.ID); !errors.Is(err, store.ErrNotFound) {
		t.Errorf("a job without a policy: %v", err)
	}
	// An unknown policy, another tenant's policy or version: no job.
	for _, n := range []store.NewJob{
		newJob("acme", "unknown", withPolicy("nope", 0)),
		newJob("acme", "v9", withPolicy("invoice", 9)),
		newJob("globex", "theirs", withPolicy("invoice", 0)),
	} {
		if _, _, err := s.Accept(ctx, n); !errors.Is(err, store.ErrPolicyNotFound) {
			t.Errorf("accept %s: %v, want ErrPolicyNotFound", n.IdempotencyKey, err)
		}
		if _, err := s.GetByKey(ctx, n.Tenant, n.IdempotencyKey); !errors.Is(err, store.ErrNotFound) {
			t.Errorf("%s was refused, yet a job exists: %v", n.IdempotencyKey, err)
		}
	}
	// The same key again: the same job, its pin unchanged.
	again, created, err := s.Accept(ctx, newJob("acme", "pinned", withPolicy("invoice", 1)))
	if err != nil || created || again.ID != pinned.ID {
		t.Errorf("replayed submission: %s created %v, %v", again.ID, created, err)
	}
}

// finishReview runs a job through inference and a failing validation to
// REVIEW_REQUIRED, as the runner does.
func finishReview(t *testing.T, s store.Store, now time.Time) store.Job {
	t.Helper()
	ctx := context.Background()
	c := claimOne(t, s, now)
	if err := s.SaveStage(ctx, c.ID, c.Fence, store.StageInference, []byte(`{"choices":[]}`), now); err != nil {
		t.Fatal(err)
	}
	v, _ := json.Marshal(store.Validation{Policy: "invoice", Version: 1, Reasons: json.RawMessage(`[{"rule":"json","code":"invalid_json","pointer":""}]`)})
	if err := s.SaveStage(ctx, c.ID, c.Fence, store.StageValidation, v, now); err != nil {
		t.Fatal(err)
	}
	if err := s.Complete(ctx, store.Completion{JobID: c.ID, Fence: c.Fence, State: store.ReviewRequired, Result: json.RawMessage(`{"answer":"bad"}`),
		Attempt: store.Attempt{JobID: c.ID, Attempt: c.Attempt + 1, Fence: c.Fence, Outcome: store.OutcomeSucceeded, StartedAt: now, EndedAt: now}, Now: now}); err != nil {
		t.Fatal(err)
	}
	j, err := s.Get(ctx, c.Tenant, c.ID)
	if err != nil || j.State != store.ReviewRequired {
		t.Fatalf("after a failing validation: %s, %v", j.State, err)
	}
	return j
}

func testValidationStages(t *testing.T, s store.Store) {
	ctx := context.Background()
	putPolicy(t, s, "acme", "invoice", invoiceV1)
	accept(t, s, newJob("acme", "k", withPolicy("invoice", 0)))
	j := finishReview(t, s, t0)
	for stage, want := range map[string]string{store.StageInference: `{"choices":[]}`} {
		if data, err := s.Stage(ctx, j.ID, stage); err != nil || string(data) != want {
			t.Errorf("stage %s: %s, %v", stage, data, err)
		}
	}
	jobs, vals, next, err := s.Reviews(ctx, "acme", "", 10)
	if err != nil || len(jobs) != 1 || jobs[0].ID != j.ID || next != "" || len(vals) != 1 || vals[0].Passed || vals[0].Version != 1 ||
		string(vals[0].Reasons) == "" || jobs[0].Body != nil {
		t.Errorf("reviews: %+v %+v %q %v", jobs, vals, next, err)
	}
	if jobs, _, _, _ := s.Reviews(ctx, "globex", "", 10); len(jobs) != 0 {
		t.Errorf("another tenant sees acme's reviews: %+v", jobs)
	}
	if one, v, err := s.Review(ctx, "acme", j.ID); err != nil || one.ID != j.ID || string(v.Reasons) != string(vals[0].Reasons) || v.Version != 1 {
		t.Errorf("the one review: %+v %+v %v", one, v, err)
	}
	if _, _, err := s.Review(ctx, "globex", j.ID); !errors.Is(err, store.ErrNotFound) {
		t.Errorf("another tenant's review: %v, want ErrNotFound", err)
	}
	other := accept(t, s, newJob("acme", "not-in-review"))
	if _, _, err := s.Review(ctx, "acme", other.ID); !errors.Is(err, store.ErrNotFound) {
		t.Errorf("the review of a job not waiting for one: %v, want ErrNotFound", err)
	}
	// Not a success, and withheld: the result is stored but the job is
	// not SUCCEEDED.
	c, err := s.CountOutcomes(ctx)
	if err != nil || c.ReviewRequired != 1 || len(c.DeadLetters) != 0 {
		t.Errorf("counts: %+v, %v", c, err)
	}
}

func testReviewDecisions(t *testing.T, s store.Store) {
	ctx := context.Background()
	putPolicy(t, s, "acme", "invoice", invoiceV1)
	accept(t, s, newJob("acme", "a", withPolicy("invoice", 0)))
	a := finishReview(t, s, t0)
	accept(t, s, newJob("acme", "b", withPolicy("invoice", 0)))
	b := finishReview(t, s, t0)
	plain := accept(t, s, newJob("acme", "plain"))

	now := t0.Add(time.Minute)
	review := func(id string, approve bool, result string) (store.Job, error) {
		r := store.Review{Tenant: "acme", JobID: id, Approve: approve, Reason: "the IBAN is invented", Now: now,
			EventID: uuid.Must(uuid.NewV7()).String(), Audit: store.AuditRecord{Actor: "op-key", Detail: json.RawMessage(`{"note":"checked"}`)}}
		if result != "" {
			r.Result = json.RawMessage(result)
		}
		return s.Decide(ctx, r)
	}
	if _, err := review(a.ID, true, `{"answer":"fixed"}`); err != nil {
		t.Fatal(err)
	}
	got, err := s.Get(ctx, "acme", a.ID)
	if err != nil || got.State != store.Succeeded || got.StateVersion <= a.StateVersion {
		t.Fatalf("approved: %+v, %v", got, err)
	}
	if res, err := s.Result(ctx, "acme", a.ID); err != nil || string(res) != `{"answer":"fixed"}` {
		t.Errorf("the corrected result: %s, %v", res, err)
	}
	rej, err := review(b.ID, false, "")
	if err != nil || rej.State != store.FailedTerminal || rej.ErrorClass != store.ClassRejected || rej.LastError != "the IBAN is invented" {
		t.Errorf("rejected: %+v, %v", rej, err)
	}
	// A decided job, a job never under review, another tenant's job.
	if _, err := review(a.ID, false, ""); !errors.Is(err, store.ErrWrongState) {
		t.Errorf("deciding twice: %v", err)
	}
	if _, err := review(plain.ID, true, ""); !errors.Is(err, store.ErrWrongState) {
		t.Errorf("reviewing a READY job: %v", err)
	}
	if _, err := s.Decide(ctx, store.Review{Tenant: "globex", JobID: b.ID, Approve: true, Now: now}); !errors.Is(err, store.ErrNotFound) {
		t.Errorf("another tenant's job: %v", err)
	}
	for id, want := range map[string]struct {
		action     string
		prev, next store.State
	}{a.ID: {store.AuditApprove, store.ReviewRequired, store.Succeeded}, b.ID: {store.AuditReject, store.ReviewRequired, store.FailedTerminal}} {
		recs, err := s.Audit(ctx, "acme", id)
		if err != nil || len(recs) != 1 {
			t.Fatalf("audit of %s: %+v, %v", id, recs, err)
		}
		r := recs[0]
		if r.Action != want.action || r.Actor != "op-key" || r.Policy != "invoice" || r.Version != 1 || r.Previous != want.prev ||
			r.State != want.next || !r.At.Equal(now) || string(r.Detail) != `{"note":"checked"}` {
			t.Errorf("audit record of %s: %+v", id, r)
		}
		if recs, _ := s.Audit(ctx, "globex", id); len(recs) != 0 {
			t.Errorf("another tenant reads acme's audit: %+v", recs)
		}
	}
	c, err := s.CountOutcomes(ctx)
	if err != nil || c.ReviewRequired != 0 || c.DeadLetters[store.ClassRejected] != 1 {
		t.Errorf("counts after the decisions: %+v, %v", c, err)
	}
	// The decisions' events are in the outbox, in order.
	evs, err := s.Unpublished(ctx, 100)
	if err != nil {
		t.Fatal(err)
	}
	var types []string
	for _, e := range evs {
		if e.JobID == a.ID || e.JobID == b.ID {
			types = append(types, e.Type)
		}
	}
	if !slices.Contains(types, "job.succeeded") || !slices.Contains(types, "job.dead_lettered") {
		t.Errorf("events of the decided jobs: %v", types)
	}
}

func testReplayResumes(t *testing.T, s store.Store) {
	ctx := context.Background()
	putPolicy(t, s, "acme", "invoice", invoiceV1)
	accept(t, s, newJob("acme", "r", withPolicy("invoice", 0)))
	j := finishReview(t, s, t0)
	putPolicy(t, s, "acme", "invoice", invoiceV2)

	now := t0.Add(time.Hour)
	replay := func(id string, fromInference bool, version int) (store.Job, error) {
		return s.Replay(ctx, store.Replay{Tenant: "acme", JobID: id, FromInference: fromInference, Version: version, MaxAttempts: 4,
			Deadline: now.Add(time.Hour), Now: now, Audit: store.AuditRecord{Actor: "op"}})
	}
	r, err := replay(j.ID, false, 0)
	if err != nil || r.State != store.Ready || r.Attempt != 0 || r.MaxAttempts != 4 || !r.Deadline.Equal(now.Add(time.Hour)) ||
		r.StateVersion <= j.StateVersion || r.ErrorClass != "" || r.ReplayFence != j.Fence || r.Fence != j.Fence {
		t.Fatalf("replayed: %+v, %v", r, err)
	}
	// The inference stays, the validation goes; the job is pinned to the
	// policy's latest version now.
	if _, err := s.Stage(ctx, j.ID, store.StageInference); err != nil {
		t.Errorf("the inference checkpoint is gone: %v", err)
	}
	if _, err := s.Stage(ctx, j.ID, store.StageValidation); !errors.Is(err, store.ErrNotFound) {
		t.Errorf("the validation checkpoint stayed: %v", err)
	}
	if o, err := s.JobOutcome(ctx, j.ID); err != nil || o.Version != 2 {
		t.Errorf("re-pinned: %+v, %v", o, err)
	}
	if _, err := s.Result(ctx, "acme", j.ID); !errors.Is(err, store.ErrNotFound) {
		t.Errorf("the result under review survived the replay: %v", err)
	}
	// Only failed or reviewed jobs replay.
	if _, err := replay(j.ID, false, 0); !errors.Is(err, store.ErrWrongState) {
		t.Errorf("replaying a READY job: %v", err)
	}
	// It runs again: claimable, with its attempts numbered afresh and the
	// old history kept.
	c := claimOne(t, s, now)
	if c.ID != j.ID || c.Fence <= j.Fence || c.ReplayFence != j.Fence {
		t.Errorf("claimed %s fence %d (replayed at %d) after the replay; want %s with a fence above %d, replayed at it", c.ID, c.Fence, c.ReplayFence, j.ID, j.Fence)
	}
	if err := s.Fail(ctx, store.Failure{JobID: c.ID, Fence: c.Fence, Now: now, Attempt: store.Attempt{JobID: c.ID, Attempt: 1, Fence: c.Fence,
		Outcome: store.OutcomeFailed, Spent: true, ErrorClass: "invalid", StartedAt: now, EndedAt: now}}); err != nil {
		t.Fatal(err)
	}
	as, err := s.Attempts(ctx, j.ID)
	if err != nil || len(as) != 2 {
		t.Errorf("attempts after the replay: %+v, %v", as, err)
	}
	// From inference, pinned to version 1: every checkpoint goes.
	r2, err := replay(j.ID, true, 1)
	if err != nil || r2.StateVersion <= r.StateVersion {
		t.Fatalf("second replay: %+v, %v", r2, err)
	}
	if _, err := s.Stage(ctx, j.ID, store.StageInference); !errors.Is(err, store.ErrNotFound) {
		t.Errorf("from inference, the inference checkpoint stayed: %v", err)
	}
	if o, _ := s.JobOutcome(ctx, j.ID); o.Version != 1 {
		t.Errorf("pinned to version 1: %+v", o)
	}
	if _, err := replay(j.ID, true, 7); !errors.Is(err, store.ErrWrongState) {
		t.Errorf("a READY job with an unknown version: %v", err)
	}
	recs, err := s.Audit(ctx, "acme", j.ID)
	if err != nil || len(recs) != 2 || recs[0].Action != store.AuditReplay || recs[0].Version != 2 || recs[1].Version != 1 ||
		recs[0].Previous != store.ReviewRequired || recs[1].Previous != store.FailedTerminal || recs[1].State != store.Ready {
		t.Errorf("replay audit: %+v, %v", recs, err)
	}
	if _, err := s.Replay(ctx, store.Replay{Tenant: "globex", JobID: j.ID, Now: now}); !errors.Is(err, store.ErrNotFound) {
		t.Errorf("another tenant's replay: %v", err)
	}
}

func testDeadLetters(t *testing.T, s store.Store) {
	ctx := context.Background()
	fail := func(tenant, key, class string, at time.Time) store.Job {
		accept(t, s, newJob(tenant, key, func(n *store.NewJob) { n.Now = at; n.Deadline = at.Add(time.Hour) }))
		c := claimOne(t, s, at)
		if err := s.Fail(ctx, store.Failure{JobID: c.ID, Fence: c.Fence, Now: at, Attempt: store.Attempt{JobID: c.ID, Attempt: 1, Fence: c.Fence,
			Backend: "b1", Outcome: store.OutcomeFailed, Spent: true, ErrorClass: class, Error: "boom", StartedAt: at, EndedAt: at}}); err != nil {
			t.Fatal(err)
		}
		return c
	}
	var acme []store.Job
	for i := range 5 {
		class := "invalid"
		if i%2 == 1 {
			class = "backend"
		}
		acme = append(acme, fail("acme", fmt.Sprint("d", i), class, t0.Add(time.Duration(i)*time.Minute)))
	}
	fail("globex", "g", "invalid", t0)
	accept(t, s, newJob("acme", "alive"))

	page1, next, err := s.DeadLetters(ctx, store.DeadLetterFilter{Tenant: "acme", Limit: 2})
	if err != nil || len(page1) != 2 || next == "" || page1[0].Job.ID != acme[4].ID || page1[1].Job.ID != acme[3].ID {
		t.Fatalf("page 1: %+v %q %v", page1, next, err)
	}
	d := page1[0]
	if d.Job.Body != nil || d.Job.Metadata != nil || d.Job.ErrorClass != "invalid" || len(d.Attempts) != 1 || d.Attempts[0].Backend != "b1" {
		t.Errorf("a dead letter carries references, its class and attempts: %+v", d)
	}
	var all []string
	for f := (store.DeadLetterFilter{Tenant: "acme", Limit: 2}); ; {
		page, next, err := s.DeadLetters(ctx, f)
		if err != nil {
			t.Fatal(err)
		}
		for _, d := range page {
			all = append(all, d.Job.ID)
		}
		if next == "" {
			break
		}
		f.After = next
	}
	if len(all) != 5 {
		t.Errorf("paging found %d dead letters of acme's, want 5", len(all))
	}
	byClass, _, _ := s.DeadLetters(ctx, store.DeadLetterFilter{Tenant: "acme", Class: "backend"})
	if len(byClass) != 2 {
		t.Errorf("class backend: %d, want 2", len(byClass))
	}
	window, _, _ := s.DeadLetters(ctx, store.DeadLetterFilter{Tenant: "acme", Since: t0.Add(time.Minute), Until: t0.Add(3 * time.Minute)})
	if len(window) != 2 || window[0].Job.ID != acme[2].ID || window[1].Job.ID != acme[1].ID {
		t.Errorf("since/until: %+v", window)
	}
	everyone, _, _ := s.DeadLetters(ctx, store.DeadLetterFilter{})
	if len(everyone) != 6 {
		t.Errorf("across tenants: %d, want 6", len(everyone))
	}
	c, err := s.CountOutcomes(ctx)
	if err != nil || c.DeadLetters["invalid"] != 4 || c.DeadLetters["backend"] != 2 {
		t.Errorf("counts: %+v, %v", c, err)
	}
}

func testPruneFinal(t *testing.T, s store.Store) {
	ctx := context.Background()
	putPolicy(t, s, "acme", "invoice", invoiceV1)
	var old []store.Job
	for i := range 5 {
		accept(t, s, newJob("acme", fmt.Sprint("old", i), withPolicy("invoice", 0)))
		j := finishReview(t, s, t0)
		if i == 0 {
			if _, err := s.Decide(ctx, store.Review{Tenant: "acme", JobID: j.ID, Approve: false, Now: t0}); err != nil {
				t.Fatal(err)
			}
		}
		old = append(old, j)
	}
	accept(t, s, newJob("acme", "recent", withPolicy("invoice", 0), func(n *store.NewJob) { n.Deadline = t0.Add(72 * time.Hour) }))
	recent := finishReview(t, s, t0.Add(48*time.Hour))
	alive := accept(t, s, newJob("acme", "alive"))

	publishAll(t, s, t0.Add(48*time.Hour))
	cutoff := t0.Add(24 * time.Hour)
	n1, err := s.PruneFinal(ctx, cutoff, 3)
	if err != nil || n1 != 3 {
		t.Fatalf("first batch: %d, %v; want 3", n1, err)
	}
	n2, err := s.PruneFinal(ctx, cutoff, 3)
	if err != nil || n2 != 2 {
		t.Fatalf("second batch: %d, %v; want 2", n2, err)
	}
	if n, err := s.PruneFinal(ctx, cutoff, 3); err != nil || n != 0 {
		t.Errorf("nothing left: %d, %v", n, err)
	}
	for _, j := range old {
		if _, err := s.Get(ctx, "acme", j.ID); !errors.Is(err, store.ErrNotFound) {
			t.Errorf("pruned job %s: %v", j.ID, err)
		}
		if as, _ := s.Attempts(ctx, j.ID); len(as) != 0 {
			t.Errorf("pruned job %s kept attempts", j.ID)
		}
		if recs, _ := s.Audit(ctx, "acme", j.ID); len(recs) != 0 {
			t.Errorf("pruned job %s kept audit records", j.ID)
		}
	}
	for _, j := range []store.Job{alive, recent} {
		if _, err := s.Get(ctx, "acme", j.ID); err != nil {
			t.Errorf("%s was pruned: %v", j.ID, err)
		}
		if got, err := s.GetByKey(ctx, "acme", j.IdempotencyKey); err != nil || got.ID != j.ID {
			t.Errorf("%s by its key %q: %s, %v", j.ID, j.IdempotencyKey, got.ID, err)
		}
	}
	// A pruned job's keys go with it: the tenant's listing holds the
	// jobs kept, and its idempotency key accepts a new job.
	listed, _, err := s.List(ctx, "acme", store.ListFilter{})
	if err != nil || len(listed) != 2 || listed[0].ID != alive.ID || listed[1].ID != recent.ID {
		t.Errorf("listing after the prune: %d jobs, %v; want alive, recent", len(listed), err)
	}
	if _, err := s.GetByKey(ctx, "acme", "old0"); !errors.Is(err, store.ErrNotFound) {
		t.Errorf("pruned job by its key: %v", err)
	}
	again := newJob("acme", "old0")
	if j, created, err := s.Accept(ctx, again); err != nil || !created || j.ID != again.ID {
		t.Errorf("a pruned job's key accepted again: %s, created %v, %v; want %s created", j.ID, created, err, again.ID)
	}
}

// publishAll marks every unpublished event published, as the relay does.
func publishAll(t *testing.T, s store.Store, at time.Time) {
	t.Helper()
	for {
		evs, err := s.Unpublished(context.Background(), 100)
		if err != nil {
			t.Fatal(err)
		}
		if len(evs) == 0 {
			return
		}
		ids := make([]string, len(evs))
		for i, e := range evs {
			ids[i] = e.ID
		}
		if err := s.MarkPublished(context.Background(), ids, at); err != nil {
			t.Fatal(err)
		}
	}
}

// testPruneKeepsFeedAndOutbox: the prune of old ended jobs keeps, however
// old, a job with an event not yet published (its end must still reach
// the broker) and the job whose event holds the feed's last place, so
// that the next event published is placed after every place a reader
// has seen: a reader following the feed from its last place misses
// nothing, the pruned places never given again.
func testPruneKeepsFeedAndOutbox(t *testing.T, s store.Store) {
	ctx := context.Background()
	end := func(key string) store.Job {
		accept(t, s, newJob("acme", key))
		j := claimOne(t, s, t0)
		succeed(t, s, j, t0)
		return j
	}
	pruned := end("pruned")
	last := end("last") // its final event takes the feed's last place
	publishAll(t, s, t0)
	unpublished := end("unpublished")
	head, err := s.FeedHead(ctx, "acme")
	if err != nil || head == 0 {
		t.Fatalf("feed head %d, %v", head, err)
	}

	if n, err := s.PruneFinal(ctx, t0.Add(time.Hour), 100); err != nil || n != 1 {
		t.Fatalf("pruned %d, %v; want 1", n, err)
	}
	if _, err := s.Get(ctx, "acme", pruned.ID); !errors.Is(err, store.ErrNotFound) {
		t.Errorf("the old job was not pruned: %v", err)
	}
	for _, j := range []store.Job{last, unpublished} {
		if _, err := s.Get(ctx, "acme", j.ID); err != nil {
			t.Errorf("job %s was pruned: %v", j.IdempotencyKey, err)
		}
	}
	// The unpublished events are published now, after the prune: their
	// places follow the last one a reader could have seen.
	publishAll(t, s, t0.Add(2*time.Hour))
	evs, err := s.Events(ctx, "acme", "", head, 100)
	if err != nil || len(evs) == 0 {
		t.Fatalf("events after place %d: %d, %v", head, len(evs), err)
	}
	for _, e := range evs {
		if e.JobID != unpublished.ID {
			t.Errorf("event %s of job %s placed after the head: only the unpublished job's are new", e.ID, e.JobID)
		}
	}
}
