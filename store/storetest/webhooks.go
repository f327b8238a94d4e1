package storetest

import (
	"context"
	"encoding/json"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/kvgate/kvgate/store"
)

// Conformance cases of store.Webhooks: deliveries made by the outbox in
// the event's transaction, the fenced state machine, and concurrent
// claimers.
var webhookTests = []struct {
	name string
	fn   func(*testing.T, store.Store)
}{
	{"WebhookFanout", testWebhookFanout},
	{"WebhookFencing", testWebhookFencing},
	{"WebhookRedeliverAndDefer", testWebhookRedeliver},
	{"WebhookClaimConcurrent", testWebhookClaimConcurrent},
	{"WebhookEndpoints", testWebhookEndpoints},
	{"ForeignBytesStored", testForeignBytesStored},
}

func endpoint(t *testing.T, s store.Store, tenant string, events ...string) store.WebhookEndpoint {
	t.Helper()
	e := store.WebhookEndpoint{ID: "we_" + uuid.Must(uuid.NewV7()).String(), Tenant: tenant, URL: "http://127.0.0.1:1/hook",
		Events: events, Secret: "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", CreatedAt: t0}
	if err := s.CreateEndpoint(context.Background(), e); err != nil {
		t.Fatalf("create endpoint: %v", err)
	}
	return e
}

func succeed(t *testing.T, s store.Store, j store.Job, now time.Time) {
	t.Helper()
	if err := s.Complete(context.Background(), store.Completion{JobID: j.ID, Fence: j.Fence, State: store.Succeeded, Result: json.RawMessage(`{"v":1}`),
		Attempt: store.Attempt{JobID: j.ID, Attempt: j.Attempt + 1, Fence: j.Fence, Outcome: store.OutcomeSucceeded, StartedAt: now, EndedAt: now},
		EventID: uuid.Must(uuid.NewV7()).String(), Now: now}); err != nil {
		t.Fatalf("complete %s: %v", j.ID, err)
	}
}

func deliveriesOf(t *testing.T, s store.Store, f store.DeliveryFilter) []store.Delivery {
	t.Helper()
	ds, _, err := s.Deliveries(context.Background(), f)
	if err != nil {
		t.Fatalf("deliveries: %v", err)
	}
	return ds
}

// testWebhookFanout: a job's final event makes one delivery per
// subscribed endpoint of its tenant, disabled ones included (their
// deliveries wait, claimed by nobody, until they are enabled again); other
// events and other tenants' endpoints get none.
func testWebhookFanout(t *testing.T, s store.Store) {
	ctx := context.Background()
	both := endpoint(t, s, "acme", "job.succeeded", "job.failed")
	onlyFailed := endpoint(t, s, "acme", "job.failed")
	off := endpoint(t, s, "acme", "job.succeeded")
	yes := true
	if _, err := s.UpdateEndpoint(ctx, "acme", off.ID, store.EndpointPatch{Disabled: &yes, Reason: "test", Now: t0}); err != nil {
		t.Fatal(err)
	}
	other := endpoint(t, s, "globex", "job.succeeded")
	j := accept(t, s, newJob("acme", "k1"))
	if ds := deliveriesOf(t, s, store.DeliveryFilter{}); len(ds) != 0 {
		t.Fatalf("job.accepted made deliveries: %+v", ds)
	}
	succeed(t, s, claimOne(t, s, t0), t0)
	ds := deliveriesOf(t, s, store.DeliveryFilter{Tenant: "acme", EndpointID: both.ID})
	if len(ds) != 1 || ds[0].EndpointID != both.ID || ds[0].Type != "job.succeeded" || ds[0].JobID != j.ID ||
		ds[0].State != store.DeliveryPending || ds[0].JobState != store.Succeeded || ds[0].StateVersion != 3 {
		t.Fatalf("deliveries after success: %+v", ds)
	}
	held := deliveriesOf(t, s, store.DeliveryFilter{Tenant: "acme", EndpointID: off.ID})
	if len(held) != 1 || held[0].JobID != j.ID || held[0].State != store.DeliveryPending {
		t.Fatalf("the disabled endpoint's deliveries: %+v, want the success's, pending", held)
	}
	// A dead letter is delivered as job.failed.
	j2 := accept(t, s, newJob("acme", "k2", func(n *store.NewJob) { n.MaxAttempts = 1 }))
	c := claimOne(t, s, t0)
	if err := s.Fail(ctx, store.Failure{JobID: j2.ID, Fence: c.Fence, Attempt: store.Attempt{JobID: j2.ID, Attempt: 1, Fence: c.Fence,
		Outcome: store.OutcomeFailed, Spent: true, Sent: true, EndedAt: t0}, EventID: uuid.Must(uuid.NewV7()).String(), Now: t0}); err != nil {
		t.Fatal(err)
	}
	failed := 0
	for _, d := range deliveriesOf(t, s, store.DeliveryFilter{Tenant: "acme"}) {
		if d.JobID == j2.ID {
			failed++
			if d.Type != "job.failed" || (d.EndpointID != both.ID && d.EndpointID != onlyFailed.ID) {
				t.Errorf("dead letter's delivery %+v", d)
			}
		}
	}
	if failed != 2 {
		t.Errorf("%d deliveries of the dead letter, want 2", failed)
	}
	// By job: the dead letter's two, none of the other job's, none for
	// another tenant.
	if ds := deliveriesOf(t, s, store.DeliveryFilter{Tenant: "acme", JobID: j2.ID}); len(ds) != 2 || ds[0].JobID != j2.ID || ds[1].JobID != j2.ID ||
		ds[0].Seq >= ds[1].Seq {
		t.Errorf("deliveries of job %s: %+v, want its 2 in order", j2.ID, ds)
	}
	if ds := deliveriesOf(t, s, store.DeliveryFilter{Tenant: "globex", JobID: j2.ID}); len(ds) != 0 {
		t.Errorf("another tenant lists acme's job's deliveries: %+v", ds)
	}
	if ds := deliveriesOf(t, s, store.DeliveryFilter{EndpointID: other.ID}); len(ds) != 0 {
		t.Errorf("another tenant's endpoint got %+v", ds)
	}
	if n, err := s.PendingDeliveries(ctx); err != nil || n != 4 {
		t.Errorf("pending: %d, %v; want 4", n, err)
	}
	// A cancel's event (written apart from the ends of attempts) fans out
	// too, to each subscribed endpoint in the endpoints' order; a claim's
	// and an acceptance's events made none above.
	c1, c2 := endpoint(t, s, "acme", "job.cancelled"), endpoint(t, s, "acme", "job.cancelled", "job.succeeded")
	j3 := accept(t, s, newJob("acme", "k3"))
	if _, err := s.Cancel(ctx, "acme", j3.ID, uuid.Must(uuid.NewV7()).String(), t0); err != nil {
		t.Fatal(err)
	}
	ds = deliveriesOf(t, s, store.DeliveryFilter{Tenant: "acme", JobID: j3.ID})
	if len(ds) != 2 || ds[0].Type != "job.cancelled" || ds[1].Type != "job.cancelled" || ds[0].JobState != store.Cancelled ||
		min(c1.ID, c2.ID) != ds[0].EndpointID || max(c1.ID, c2.ID) != ds[1].EndpointID {
		t.Errorf("deliveries of the cancel: %+v", ds)
	}
	// Claims pass the disabled endpoint's delivery by until it is enabled.
	claimed := func() map[string]bool {
		cs, err := s.ClaimDeliveries(ctx, t0.Add(time.Minute), time.Minute, 100)
		if err != nil {
			t.Fatal(err)
		}
		ids := map[string]bool{}
		for _, d := range cs {
			ids[d.ID] = true
		}
		return ids
	}
	if got := claimed(); len(got) != 5 || got[held[0].ID] {
		t.Errorf("claimed %d deliveries (the disabled endpoint's among them: %v), want the 5 of enabled endpoints", len(got), got[held[0].ID])
	}
	no := false
	if _, err := s.UpdateEndpoint(ctx, "acme", off.ID, store.EndpointPatch{Disabled: &no, Now: t0}); err != nil {
		t.Fatal(err)
	}
	if got := claimed(); len(got) != 1 || !got[held[0].ID] {
		t.Errorf("once enabled again, claimed %v, want its held delivery", got)
	}
}

// testWebhookFencing: a claim leases; an expired lease is claimed again
// under the same id and a new fence, and the first claim's late record
// is refused.
func testWebhookFencing(t *testing.T, s store.Store) {
	ctx := context.Background()
	endpoint(t, s, "acme", "job.succeeded")
	accept(t, s, newJob("acme", "k1"))
	succeed(t, s, claimOne(t, s, t0), t0)
	first, err := s.ClaimDeliveries(ctx, t0, time.Minute, 10)
	if err != nil || len(first) != 1 || first[0].State != store.DeliverySending {
		t.Fatalf("claim: %+v, %v", first, err)
	}
	if again, err := s.ClaimDeliveries(ctx, t0.Add(30*time.Second), time.Minute, 10); err != nil || len(again) != 0 {
		t.Fatalf("claimed a leased delivery: %+v, %v", again, err)
	}
	later := t0.Add(2 * time.Minute)
	second, err := s.ClaimDeliveries(ctx, later, time.Minute, 10)
	if err != nil || len(second) != 1 || second[0].ID != first[0].ID || second[0].Fence != first[0].Fence+1 {
		t.Fatalf("reclaim after the lease: %+v, %v", second, err)
	}
	stale := store.DeliveryResult{ID: first[0].ID, Fence: first[0].Fence, State: store.DeliveryDelivered, Now: later,
		Attempt: store.DeliveryAttempt{Status: 200, StartedAt: t0}}
	errs, err := s.FinishDeliveries(ctx, []store.DeliveryResult{stale})
	if err != nil || !errors.Is(errs[0], store.ErrLeaseLost) {
		t.Fatalf("stale finish: %v, %v; want ErrLeaseLost", errs, err)
	}
	retry := store.DeliveryResult{ID: second[0].ID, Fence: second[0].Fence, State: store.DeliveryRetryScheduled, RetryAt: later.Add(5 * time.Second),
		Now: later, Attempt: store.DeliveryAttempt{Status: 503, Error: "503", Body: "busy", StartedAt: later, Latency: time.Millisecond}}
	if errs, err := s.FinishDeliveries(ctx, []store.DeliveryResult{retry}); err != nil || errs[0] != nil {
		t.Fatalf("finish: %v, %v", errs, err)
	}
	d, err := s.Delivery(ctx, "acme", first[0].ID)
	if err != nil || d.State != store.DeliveryRetryScheduled || d.Attempts != 1 || d.LastStatus != 503 || !d.DueAt.Equal(later.Add(5*time.Second)) {
		t.Fatalf("after a 503: %+v, %v", d, err)
	}
	if _, err := s.Delivery(ctx, "globex", d.ID); !errors.Is(err, store.ErrNotFound) {
		t.Errorf("another tenant's delivery: %v", err)
	}
	// Finishing twice under one fence: the second is refused.
	if errs, _ := s.FinishDeliveries(ctx, []store.DeliveryResult{retry}); !errors.Is(errs[0], store.ErrLeaseLost) {
		t.Errorf("second finish under one fence: %v", errs)
	}
	third, err := s.ClaimDeliveries(ctx, later.Add(5*time.Second), time.Minute, 10)
	if err != nil || len(third) != 1 || third[0].Attempts != 1 {
		t.Fatalf("claim the retry: %+v, %v", third, err)
	}
	done := store.DeliveryResult{ID: d.ID, Fence: third[0].Fence, State: store.DeliveryDelivered, Now: later.Add(6 * time.Second),
		Attempt: store.DeliveryAttempt{Status: 204, StartedAt: later.Add(5 * time.Second)}}
	if errs, err := s.FinishDeliveries(ctx, []store.DeliveryResult{done}); err != nil || errs[0] != nil {
		t.Fatalf("deliver: %v, %v", errs, err)
	}
	as, err := s.DeliveryAttempts(ctx, d.ID)
	if err != nil || len(as) != 2 || as[0].Status != 503 || as[0].Body != "busy" || as[1].Status != 204 || as[1].Fence != third[0].Fence {
		t.Fatalf("attempts: %+v, %v", as, err)
	}
	if n, _ := s.PendingDeliveries(ctx); n != 0 {
		t.Errorf("pending after delivery: %d", n)
	}
}

// testWebhookRedeliver: a FAILED delivery is redelivered under its id
// with a fresh schedule; the breaker's deferral spends no attempt; a 410
// disables the endpoint, and redeliveries to it wait until it is enabled.
func testWebhookRedeliver(t *testing.T, s store.Store) {
	ctx := context.Background()
	e := endpoint(t, s, "acme", "job.succeeded")
	accept(t, s, newJob("acme", "k1"))
	succeed(t, s, claimOne(t, s, t0), t0)
	ds, _ := s.ClaimDeliveries(ctx, t0, time.Minute, 10)
	if len(ds) != 1 {
		t.Fatalf("claim: %+v", ds)
	}
	if _, err := s.Redeliver(ctx, "acme", ds[0].ID, "op", t0); !errors.Is(err, store.ErrWrongState) {
		t.Errorf("redeliver in flight: %v, want ErrWrongState", err)
	}
	// Deferred: back to PENDING, nothing spent.
	if errs, err := s.FinishDeliveries(ctx, []store.DeliveryResult{{ID: ds[0].ID, Fence: ds[0].Fence, Deferred: true,
		RetryAt: t0.Add(time.Second), Now: t0}}); err != nil || errs[0] != nil {
		t.Fatal(errs, err)
	}
	if n, err := s.DeferEndpoint(ctx, e.ID, t0.Add(time.Minute)); err != nil || n != 1 {
		t.Errorf("defer endpoint: %d, %v", n, err)
	}
	if got, _ := s.ClaimDeliveries(ctx, t0.Add(30*time.Second), time.Minute, 10); len(got) != 0 {
		t.Errorf("claimed while the endpoint is deferred: %+v", got)
	}
	ds, _ = s.ClaimDeliveries(ctx, t0.Add(time.Minute), time.Minute, 10)
	if len(ds) != 1 || ds[0].Attempts != 0 {
		t.Fatalf("claim after deferral: %+v", ds)
	}
	gone := store.DeliveryResult{ID: ds[0].ID, Fence: ds[0].Fence, State: store.DeliveryFailed, DisableEndpoint: "410 Gone", Now: t0.Add(time.Minute),
		Attempt: store.DeliveryAttempt{Status: 410, Error: "410 Gone", StartedAt: t0.Add(time.Minute)}}
	if errs, err := s.FinishDeliveries(ctx, []store.DeliveryResult{gone}); err != nil || errs[0] != nil {
		t.Fatal(errs, err)
	}
	if got, err := s.Endpoint(ctx, "acme", e.ID); err != nil || !got.Disabled || got.DisabledReason != "410 Gone" {
		t.Errorf("endpoint after a 410: %+v, %v", got, err)
	}
	if failed := deliveriesOf(t, s, store.DeliveryFilter{Tenant: "acme", State: store.DeliveryFailed}); len(failed) != 1 {
		t.Errorf("failed deliveries: %+v", failed)
	}
	// To the disabled endpoint it would fail at once: refused until the
	// endpoint is enabled again.
	if _, err := s.Redeliver(ctx, "acme", ds[0].ID, "op-key", t0.Add(2*time.Minute)); !errors.Is(err, store.ErrEndpointDisabled) {
		t.Errorf("redeliver to a disabled endpoint: %v, want ErrEndpointDisabled", err)
	}
	no := false
	if _, err := s.UpdateEndpoint(ctx, "acme", e.ID, store.EndpointPatch{Disabled: &no, Now: t0.Add(2 * time.Minute)}); err != nil {
		t.Fatal(err)
	}
	d, err := s.Redeliver(ctx, "acme", ds[0].ID, "op-key", t0.Add(2*time.Minute))
	if err != nil || d.ID != ds[0].ID || d.State != store.DeliveryPending || d.Base != 1 || d.Attempts != 1 {
		t.Fatalf("redeliver: %+v, %v", d, err)
	}
	if _, err := s.Redeliver(ctx, "globex", ds[0].ID, "x", t0); !errors.Is(err, store.ErrNotFound) {
		t.Errorf("another tenant's redelivery: %v", err)
	}
}

// testWebhookClaimConcurrent: claimers racing never share a delivery.
func testWebhookClaimConcurrent(t *testing.T, s store.Store) {
	ctx := context.Background()
	endpoint(t, s, "acme", "job.succeeded")
	const n = 40
	for i := range n {
		accept(t, s, newJob("acme", "k"+string(rune('A'+i))))
	}
	js, err := s.Claim(ctx, t0, time.Minute, n)
	if err != nil || len(js) != n {
		t.Fatalf("claim jobs: %d, %v", len(js), err)
	}
	for _, j := range js {
		succeed(t, s, j, t0)
	}
	var mu sync.Mutex
	seen := map[string]int{}
	var wg sync.WaitGroup
	for range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				ds, err := s.ClaimDeliveries(ctx, t0, time.Minute, 3)
				if err != nil {
					t.Error(err)
					return
				}
				if len(ds) == 0 {
					return
				}
				mu.Lock()
				for _, d := range ds {
					seen[d.ID]++
				}
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	if len(seen) != n {
		t.Errorf("%d deliveries claimed, want %d", len(seen), n)
	}
	for id, c := range seen {
		if c != 1 {
			t.Errorf("delivery %s claimed %d times", id, c)
		}
	}
}

// testWebhookEndpoints: the endpoint CRUD, tenant-scoped, and rotation.
func testWebhookEndpoints(t *testing.T, s store.Store) {
	ctx := context.Background()
	e := endpoint(t, s, "acme", "job.succeeded")
	if _, err := s.Endpoint(ctx, "globex", e.ID); !errors.Is(err, store.ErrNotFound) {
		t.Errorf("another tenant's endpoint: %v", err)
	}
	u := "https://example.invalid/x"
	got, err := s.UpdateEndpoint(ctx, "acme", e.ID, store.EndpointPatch{URL: &u, Events: []string{"job.failed", "job.superseded"}, Now: t0})
	if err != nil || got.URL != u || len(got.Events) != 2 || got.Events[1] != "job.superseded" {
		t.Fatalf("update: %+v, %v", got, err)
	}
	if err := s.CreateEndpoint(ctx, e); !errors.Is(err, store.ErrExists) {
		t.Errorf("create an endpoint of a taken id: %v, want ErrExists", err)
	}
	r, err := s.RotateSecret(ctx, "acme", e.ID, "whsec_new", "rot-1", t0.Add(24*time.Hour), t0)
	if err != nil || r.Secret != "whsec_new" || r.PrevSecret != e.Secret {
		t.Fatalf("rotate: %+v, %v", r, err)
	}
	// The same rotation again (its key): nothing changes, and it returns
	// the secret the first made; the previous one keeps its overlap.
	again, err := s.RotateSecret(ctx, "acme", e.ID, "whsec_other", "rot-1", t0.Add(48*time.Hour), t0.Add(time.Minute))
	if err != nil || again.Secret != "whsec_new" || again.PrevSecret != e.Secret || !again.PrevUntil.Equal(t0.Add(24*time.Hour)) {
		t.Fatalf("the same rotation again: %+v, %v; want the first one's secret, nothing rotated", again, err)
	}
	if _, err := s.RotateSecret(ctx, "globex", e.ID, "whsec_x", "rot-2", t0.Add(24*time.Hour), t0); !errors.Is(err, store.ErrNotFound) {
		t.Errorf("rotate another tenant's endpoint: %v, want ErrNotFound", err)
	}
	if ss := r.Secrets(t0.Add(time.Hour)); len(ss) != 2 {
		t.Errorf("secrets within the overlap: %v", ss)
	}
	if ss := r.Secrets(t0.Add(25 * time.Hour)); len(ss) != 1 || ss[0] != "whsec_new" {
		t.Errorf("secrets after the overlap: %v", ss)
	}
	d, err := s.SendTest(ctx, "acme", e.ID, uuid.Must(uuid.NewV7()).String(), t0)
	if err != nil || d.Type != store.WebhookTest || d.State != store.DeliveryPending {
		t.Fatalf("test delivery: %+v, %v", d, err)
	}
	if list, err := s.Endpoints(ctx, "acme"); err != nil || len(list) != 1 {
		t.Errorf("list: %+v, %v", list, err)
	}
	if err := s.DeleteEndpoint(ctx, "acme", e.ID); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Delivery(ctx, "acme", d.ID); !errors.Is(err, store.ErrNotFound) {
		t.Errorf("delivery of a deleted endpoint: %v", err)
	}
	if err := s.DeleteEndpoint(ctx, "acme", e.ID); !errors.Is(err, store.ErrNotFound) {
		t.Errorf("delete twice: %v", err)
	}
	// A deleted endpoint's id is not made again (an Idempotency-Key's
	// request sent after the delete).
	if err := s.CreateEndpoint(ctx, e); !errors.Is(err, store.ErrEndpointDeleted) || !errors.Is(err, store.ErrExists) {
		t.Errorf("create a deleted endpoint's id: %v, want ErrEndpointDeleted", err)
	}
	if _, err := s.Endpoint(ctx, "acme", e.ID); !errors.Is(err, store.ErrNotFound) {
		t.Errorf("the refused creation made the endpoint: %v", err)
	}
}

// testForeignBytesStored: a webhook receiver's answer and a backend's
// error are other programs' bytes, and may hold a NUL or invalid UTF-8
// (a Latin-1 error page, a body cut inside a character). Their writes
// land all the same, beside another caller's in the same batch, with
// each such byte kept as U+FFFD: a store that refused them would record
// neither outcome, and send or run again what had ended.
func testForeignBytesStored(t *testing.T, s store.Store) {
	ctx := context.Background()
	const foreign = "caf\xe9 \x00 \xe3\x81" // Latin-1, a NUL, a character cut short
	endpoint(t, s, "acme", "job.succeeded")
	for _, k := range []string{"k1", "k2"} {
		accept(t, s, newJob("acme", k))
		succeed(t, s, claimOne(t, s, t0), t0)
	}
	ds, err := s.ClaimDeliveries(ctx, t0, time.Minute, 10)
	if err != nil || len(ds) != 2 {
		t.Fatalf("claim: %+v, %v", ds, err)
	}
	rs := []store.DeliveryResult{
		{ID: ds[0].ID, Fence: ds[0].Fence, State: store.DeliveryRetryScheduled, RetryAt: t0.Add(time.Minute), Now: t0,
			Attempt: store.DeliveryAttempt{Status: 500, Error: "500 " + foreign, Body: foreign, StartedAt: t0}},
		{ID: ds[1].ID, Fence: ds[1].Fence, State: store.DeliveryDelivered, Now: t0,
			Attempt: store.DeliveryAttempt{Status: 200, Body: "ok", StartedAt: t0}},
	}
	errs, err := s.FinishDeliveries(ctx, rs)
	if err != nil || errs[0] != nil || errs[1] != nil {
		t.Fatalf("finish: %v, %v", errs, err)
	}
	if rs[0].Attempt.Body != foreign {
		t.Errorf("the caller's result was changed: %q", rs[0].Attempt.Body)
	}
	want := "caf\uFFFD \uFFFD \uFFFD"
	as, err := s.DeliveryAttempts(ctx, ds[0].ID)
	if err != nil || len(as) != 1 || as[0].Body != want || as[0].Error != "500 "+want {
		t.Errorf("the receiver's answer: %+v, %v; want its body and error as %q", as, err, want)
	}
	if d, err := s.Delivery(ctx, "acme", ds[1].ID); err != nil || d.State != store.DeliveryDelivered {
		t.Errorf("the other delivery of the batch: %+v, %v", d, err)
	}

	// A backend's error, ending an attempt.
	accept(t, s, newJob("acme", "k3"))
	j := claimOne(t, s, t0)
	if err := s.Fail(ctx, store.Failure{JobID: j.ID, Fence: j.Fence, RetryAt: t0.Add(time.Minute), EventID: uuid.Must(uuid.NewV7()).String(), Now: t0,
		Attempt: store.Attempt{JobID: j.ID, Attempt: 1, Fence: j.Fence, Outcome: store.OutcomeFailed, Spent: true, Sent: true,
			ErrorClass: "backend_error", Error: "backend said: " + foreign, StartedAt: t0, EndedAt: t0}}); err != nil {
		t.Fatalf("fail with the backend's bytes: %v", err)
	}
	got, err := s.Get(ctx, "acme", j.ID)
	if err != nil || got.State != store.RetryScheduled || got.LastError != "backend said: "+want {
		t.Errorf("job after its failure: %s %q, %v", got.State, got.LastError, err)
	}
	if as, err := s.Attempts(ctx, j.ID); err != nil || len(as) != 1 || as[0].Error != "backend said: "+want {
		t.Errorf("attempt record: %+v, %v", as, err)
	}
}
