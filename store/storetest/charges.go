package storetest

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/kvgate/kvgate/store"
)

// ledger is the part of a UsageDay that charges change.
type ledger struct {
	requests, attempts, prompt, completion, reserved, uncertain, uncertainTokens, cost, reservedCost, uncertainCost int64
}

func ledgerOf(u store.UsageDay) ledger {
	return ledger{u.Requests, u.Attempts, u.PromptTokens, u.CompletionTokens, u.ReservedTokens, u.Uncertain, u.UncertainTokens,
		u.Cost, u.ReservedCost, u.UncertainCost}
}

// testAttemptCharges: a job attempt's Charge (an attempt that held no
// permit) lands in its tenant's ledger exactly once. The attempt's end
// charges how its request ended, in the end's own transaction, on the
// day of the end; an end that its claim no longer owns charges nothing.
// A claim taken from its owner after it marked its request sent with a
// reservation (a reap, a cancel) charges the reservation as an uncertain
// request, once; one marked without a reservation (its usage went
// through a permit), or never marked, charges nothing. Many ends at once
// (a store may write them in one statement) charge each tenant the sum
// of its own.
func testAttemptCharges(t *testing.T, s store.Store) {
	ctx := context.Background()
	day2 := t0.Add(24 * time.Hour)
	reserved := func(tokens, cost int64) *store.Charge { return &store.Charge{Tokens: tokens, Cost: cost} }
	ended := func(r *store.Charge, o store.Outcome, prompt, completion, cost int64) *store.Charge {
		c := *r
		c.Outcome, c.Attempts, c.PromptTokens, c.CompletionTokens, c.UsageCost = o, 1, prompt, completion, cost
		if o == store.NotSent {
			c.Attempts = 0
		}
		return &c
	}
	// run claims a job of tenant's, marks it sent with r (unless unsent),
	// and returns it.
	run := func(tenant, key string, now time.Time, r *store.Charge, mark bool) store.Job {
		t.Helper()
		accept(t, s, newJob(tenant, key, func(n *store.NewJob) {
			n.Now, n.Deadline, n.Model = now.Add(-time.Second), now.Add(48*time.Hour), key // claimed by its model alone
		}))
		js, err := s.Claim(ctx, now, time.Minute, 1, key)
		if err != nil || len(js) != 1 || js[0].IdempotencyKey != key {
			t.Fatalf("claim %s: %+v, %v", key, js, err)
		}
		if mark {
			if err := s.MarkSent(ctx, js[0].ID, js[0].Fence, now, time.Minute, r); err != nil {
				t.Fatalf("mark %s sent: %v", key, err)
			}
		}
		return js[0]
	}
	complete := func(j store.Job, fence int64, c *store.Charge, now time.Time) error {
		return s.Complete(ctx, store.Completion{JobID: j.ID, Fence: fence, State: store.Succeeded, Result: []byte(`{}`),
			Attempt: store.Attempt{Attempt: j.Attempt + 1, Outcome: store.OutcomeSucceeded, Charge: c}, Now: now})
	}
	check := func(step, tenant string, day time.Time, want ledger) {
		t.Helper()
		if got := ledgerOf(usageOn(t, s, tenant, day)); got != want {
			t.Errorf("%s: %s's ledger %+v, want %+v", step, tenant, got, want)
		}
	}

	// The ends: reported, uncertain, never sent; the last one claimed on
	// one day and ended on the next.
	r := reserved(100, 50)
	j := run("acme", "reported", t0, r, true)
	if err := complete(j, j.Fence, ended(r, store.Reported, 10, 5, 7), t0); err != nil {
		t.Fatal(err)
	}
	check("a reported end", "acme", t0, ledger{requests: 1, attempts: 1, prompt: 10, completion: 5, cost: 7})
	retried := run("acme", "uncertain", t0, r, true)
	if err := s.Fail(ctx, store.Failure{JobID: retried.ID, Fence: retried.Fence, RetryAt: t0.Add(time.Hour), Now: t0,
		Attempt: store.Attempt{Attempt: 1, Outcome: store.OutcomeFailed, Spent: true, Sent: true, Charge: ended(r, store.Uncertain, 0, 0, 0)}}); err != nil {
		t.Fatal(err)
	}
	check("an uncertain end", "acme", t0, ledger{requests: 2, attempts: 2, prompt: 10, completion: 5, cost: 7,
		uncertain: 1, uncertainTokens: 100, uncertainCost: 50})
	waited := run("acme", "never-sent", t0, nil, false)
	if err := s.Fail(ctx, store.Failure{JobID: waited.ID, Fence: waited.Fence, Now: t0,
		Attempt: store.Attempt{Attempt: 1, Outcome: store.OutcomeWait, Charge: ended(r, store.NotSent, 0, 0, 0)}}); err != nil {
		t.Fatal(err)
	}
	check("an end never sent", "acme", t0, ledger{requests: 2, attempts: 2, prompt: 10, completion: 5, cost: 7,
		uncertain: 1, uncertainTokens: 100, uncertainCost: 50})
	midnight := t0.Truncate(24 * time.Hour).Add(24 * time.Hour)
	j = run("acme", "late", midnight.Add(-30*time.Second), r, true)
	if err := complete(j, j.Fence, ended(r, store.Reported, 3, 4, 2), midnight.Add(10*time.Second)); err != nil {
		t.Fatal(err)
	}
	check("an end the next day", "acme", midnight, ledger{requests: 1, attempts: 1, prompt: 3, completion: 4, cost: 2})

	// A stale end charges nothing; the reap that took its job charges the
	// reservation, once.
	stale := run("reaped", "reaped-sent", t0, reserved(40, 20), true)
	unmarked := run("reaped", "reaped-permit", t0, nil, true)
	unsent := run("reaped", "reaped-unsent", t0, nil, false)
	if err := complete(stale, stale.Fence-1, ended(r, store.Reported, 1, 1, 1), t0); !errors.Is(err, store.ErrLeaseLost) {
		t.Fatalf("an end under a stale fence: %v", err)
	}
	check("an end under a stale fence", "reaped", t0, ledger{})
	for i := range 2 {
		if _, err := s.Reap(ctx, t0.Add(2*time.Minute), 100); err != nil {
			t.Fatal(err)
		}
		check(fmt.Sprint("reap ", i+1), "reaped", t0, ledger{requests: 1, attempts: 1, uncertain: 1, uncertainTokens: 40, uncertainCost: 20})
	}
	for _, j := range []store.Job{stale, unmarked, unsent} {
		if err := complete(j, j.Fence, ended(r, store.Reported, 1, 1, 1), t0.Add(2*time.Minute)); !errors.Is(err, store.ErrLeaseLost) {
			t.Fatalf("the end of a reaped claim: %v", err)
		}
	}
	check("the ends of reaped claims", "reaped", t0, ledger{requests: 1, attempts: 1, uncertain: 1, uncertainTokens: 40, uncertainCost: 20})
	// A cancel charges only a claim it takes: not a job waiting for its
	// retry, whatever its last claim's mark held.
	for _, j := range []store.Job{stale, unmarked, unsent, retried, waited} {
		if _, err := s.Cancel(ctx, j.Tenant, j.ID, "", t0.Add(3*time.Minute)); err != nil {
			t.Fatal(err)
		}
	}
	check("cancels of jobs not running", "reaped", t0, ledger{requests: 1, attempts: 1, uncertain: 1, uncertainTokens: 40, uncertainCost: 20})
	check("cancels of jobs not running", "acme", t0, ledger{requests: 2, attempts: 2, prompt: 10, completion: 5, cost: 7,
		uncertain: 1, uncertainTokens: 100, uncertainCost: 50})

	// A cancel takes a running job from its claim: the reservation of a
	// claim that marked its request sent is charged, once.
	sent := run("cancelled", "cancelled-sent", t0, reserved(30, 9), true)
	waiting := run("cancelled", "cancelled-unsent", t0, nil, false)
	for _, j := range []store.Job{sent, waiting} {
		if _, err := s.Cancel(ctx, "cancelled", j.ID, "", t0); err != nil {
			t.Fatal(err)
		}
		if err := complete(j, j.Fence, ended(r, store.Reported, 1, 1, 1), t0); !errors.Is(err, store.ErrLeaseLost) {
			t.Fatalf("the end of a cancelled claim: %v", err)
		}
	}
	check("a cancel", "cancelled", t0, ledger{requests: 1, attempts: 1, uncertain: 1, uncertainTokens: 30, uncertainCost: 9})

	// An attempt of several requests (an embeddings job's batches): its
	// charge carries the earlier ones, each a reported request, and its
	// sent mark holds all their reservations, which a reap charges as one
	// uncertain request.
	earlier := store.Spent{Requests: 2, Tokens: 60, Cost: 30, PromptTokens: 20, UsageCost: 4}
	several := func(c *store.Charge) *store.Charge {
		c.Earlier = earlier
		return c
	}
	j = run("several-ended", "several-reported", t0, several(reserved(100, 50)), true)
	if err := complete(j, j.Fence, several(ended(r, store.Reported, 10, 0, 2)), t0); err != nil {
		t.Fatal(err)
	}
	check("the reported end of several requests", "several-ended", t0, ledger{requests: 3, attempts: 3, prompt: 30, cost: 6})
	unc := run("several-ended", "several-uncertain", t0, several(reserved(100, 50)), true)
	if err := s.Fail(ctx, store.Failure{JobID: unc.ID, Fence: unc.Fence, RetryAt: t0.Add(time.Hour), Now: t0,
		Attempt: store.Attempt{Attempt: 1, Outcome: store.OutcomeFailed, Spent: true, Sent: true, Charge: several(ended(r, store.Uncertain, 0, 0, 0))}}); err != nil {
		t.Fatal(err)
	}
	check("the uncertain end of several requests", "several-ended", t0, ledger{requests: 6, attempts: 6, prompt: 50, cost: 10,
		uncertain: 1, uncertainTokens: 100, uncertainCost: 50})
	// The last request went through a permit, or was never sent: the
	// earlier ones are still the attempt's to charge.
	uns := run("several-ended", "several-unsent", t0, several(&store.Charge{}), true)
	if err := s.Fail(ctx, store.Failure{JobID: uns.ID, Fence: uns.Fence, RetryAt: t0.Add(time.Hour), Now: t0,
		Attempt: store.Attempt{Attempt: 1, Outcome: store.OutcomeWait, Sent: true, Charge: several(&store.Charge{})}}); err != nil {
		t.Fatal(err)
	}
	check("an end of several requests, the last not the attempt's", "several-ended", t0, ledger{requests: 8, attempts: 8, prompt: 70, cost: 14,
		uncertain: 1, uncertainTokens: 100, uncertainCost: 50})
	for _, j := range []store.Job{unc, uns} {
		if _, err := s.Cancel(ctx, j.Tenant, j.ID, "", t0); err != nil {
			t.Fatal(err)
		}
	}
	j = run("several-reaped", "several-reaped", t0, several(reserved(100, 50)), true)
	if _, err := s.Reap(ctx, t0.Add(2*time.Minute), 100); err != nil {
		t.Fatal(err)
	}
	if err := complete(j, j.Fence, several(ended(r, store.Reported, 10, 0, 2)), t0.Add(2*time.Minute)); !errors.Is(err, store.ErrLeaseLost) {
		t.Fatalf("the end of a reaped claim: %v", err)
	}
	check("a reap of several requests", "several-reaped", t0, ledger{requests: 1, attempts: 1, uncertain: 1, uncertainTokens: 160, uncertainCost: 80})

	// A replica of an earlier release marks a claim sent without writing
	// a reservation (its usage goes through a permit): the reservation an
	// earlier claim's mark left behind is not charged by the reap.
	if db, ok := s.(interface{ DB() *sql.DB }); ok {
		j := run("mixed", "mixed-versions", t0, r, true)
		if err := s.Fail(ctx, store.Failure{JobID: j.ID, Fence: j.Fence, RetryAt: t0.Add(time.Second), Now: t0,
			Attempt: store.Attempt{Attempt: 1, Outcome: store.OutcomeFailed, Spent: true, Sent: true, Charge: ended(r, store.Uncertain, 0, 0, 0)}}); err != nil {
			t.Fatal(err)
		}
		again, err := s.Claim(ctx, t0.Add(time.Second), time.Minute, 1, "mixed-versions")
		if err != nil || len(again) != 1 {
			t.Fatalf("claim again: %+v, %v", again, err)
		}
		// The earlier release's MarkSent statement.
		if _, err := db.DB().ExecContext(ctx, "UPDATE jobs SET sent_fence = fence WHERE id = '"+again[0].ID+"'"); err != nil {
			t.Fatal(err)
		}
		if _, err := s.Reap(ctx, t0.Add(2*time.Minute), 100); err != nil {
			t.Fatal(err)
		}
		check("a reap of an earlier release's mark", "mixed", t0, ledger{requests: 1, attempts: 1, uncertain: 1, uncertainTokens: 100, uncertainCost: 50})
		if _, err := s.Cancel(ctx, "mixed", again[0].ID, "", t0.Add(3*time.Minute)); err != nil {
			t.Fatal(err)
		}
	}

	// Many ends at once, of two tenants, a quarter of them stale.
	const n = 40
	var js []store.Job
	for i := range n {
		accept(t, s, newJob(fmt.Sprint("many-", i%2), fmt.Sprint("k", i), func(j *store.NewJob) { j.Now, j.Deadline = day2, day2.Add(time.Hour) }))
	}
	js, err := s.Claim(ctx, day2, time.Minute, n)
	if err != nil || len(js) != n {
		t.Fatalf("claim: %d, %v", len(js), err)
	}
	want := map[string]ledger{}
	var wg sync.WaitGroup
	errs := make([]error, n)
	for i, j := range js {
		c := ended(reserved(int64(i), 1), store.Reported, int64(i), 2, 3)
		fence := j.Fence
		if i%4 == 3 {
			fence--
		} else {
			w := want[j.Tenant]
			w.requests, w.attempts, w.prompt, w.completion, w.cost = w.requests+1, w.attempts+1, w.prompt+int64(i), w.completion+2, w.cost+3
			want[j.Tenant] = w
		}
		wg.Go(func() { errs[i] = complete(j, fence, c, day2) })
	}
	wg.Wait()
	for i, err := range errs {
		if stale := i%4 == 3; stale != errors.Is(err, store.ErrLeaseLost) || (!stale && err != nil) {
			t.Errorf("end %d (stale %v): %v", i, stale, err)
		}
	}
	for _, tenant := range []string{"many-0", "many-1"} {
		check("many ends at once", tenant, day2, want[tenant])
	}
}
