package storetest

import (
	"context"
	"database/sql"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/kvgate/kvgate/store"
)

// testClaimFairAcrossTenants: a tenant's first job is not held behind
// another tenant's older backlog, and one batch serves tenants in turn.
func testClaimFairAcrossTenants(t *testing.T, s store.Store) {
	ctx := context.Background()
	for i := range 50 {
		accept(t, s, newJob("bulk", fmt.Sprintf("b%d", i)))
	}
	small := accept(t, s, newJob("small", "s0"))
	seen := false
	for range 2 {
		if j := claimOne(t, s, t0.Add(time.Second)); j.ID == small.ID {
			seen = true
		}
	}
	if !seen {
		t.Error("the small tenant's job was not among the first two claims behind a backlog of 50")
	}
	// Three tenants with work: a batch of 6 takes 2 from each.
	for i := range 5 {
		accept(t, s, newJob("third", fmt.Sprintf("t%d", i)))
		accept(t, s, newJob("small", fmt.Sprintf("s%d", i+1)))
	}
	js, err := s.Claim(ctx, t0.Add(2*time.Second), time.Minute, 6)
	if err != nil || len(js) != 6 {
		t.Fatalf("claim 6: %d, %v", len(js), err)
	}
	per := map[string]int{}
	for _, j := range js {
		per[j.Tenant]++
	}
	if per["bulk"] != 2 || per["small"] != 2 || per["third"] != 2 {
		t.Errorf("one batch of 6 over three backlogged tenants: %v, want 2 each", per)
	}
	// Within a tenant, its oldest first.
	js, _ = s.Claim(ctx, t0.Add(3*time.Second), time.Minute, 100)
	last := map[string]time.Time{}
	for _, j := range js {
		if j.CreatedAt.Before(last[j.Tenant]) {
			t.Errorf("tenant %s: job of %v claimed after one of %v", j.Tenant, j.CreatedAt, last[j.Tenant])
		}
		last[j.Tenant] = j.CreatedAt
	}
	if total := len(js) + 6 + 2; total != 50+1+10 {
		t.Errorf("claimed %d jobs in all, want 61", total)
	}
	// Nothing runnable left: the reaper's pass keeps the claim correct.
	if _, err := s.Reap(ctx, t0.Add(time.Hour), 100); err != nil {
		t.Fatal(err)
	}
	accept(t, s, newJob("late", "l0", func(n *store.NewJob) { n.Now, n.Deadline = t0.Add(time.Hour), t0.Add(48*time.Hour) }))
	if j := claimOne(t, s, t0.Add(2*time.Hour)); j.Tenant != "late" {
		t.Errorf("after the reaper's pass, claimed %s's job", j.Tenant)
	}
}

// testClaimFairNoStall: tenants whose work is not available yet, or that
// ran out, never stall a claim while another tenant has work, even with
// claims of one at the same instant.
func testClaimFairNoStall(t *testing.T, s store.Store) {
	ctx := context.Background()
	// Tenant "later" has only a retry scheduled far ahead.
	accept(t, s, newJob("later", "l0", func(n *store.NewJob) { n.Deadline = t0.Add(48 * time.Hour) }))
	j := claimOne(t, s, t0)
	if err := s.Fail(ctx, store.Failure{JobID: j.ID, Fence: j.Fence, RetryAt: t0.Add(24 * time.Hour), Now: t0,
		Attempt: store.Attempt{Attempt: 1, Outcome: "retry", ErrorClass: "rate_limited"}}); err != nil {
		t.Fatal(err)
	}
	for _, tenant := range []string{"a", "b", "c"} {
		for i := range 5 {
			accept(t, s, newJob(tenant, fmt.Sprintf("%s%d", tenant, i)))
		}
	}
	at := t0.Add(time.Second)
	per := map[string]int{}
	for i := range 15 {
		js, err := s.Claim(ctx, at, time.Minute, 1)
		if err != nil || len(js) != 1 {
			t.Fatalf("claim %d of 15 at one instant: %d jobs, %v", i+1, len(js), err)
		}
		per[js[0].Tenant]++
	}
	if per["a"] != 5 || per["b"] != 5 || per["c"] != 5 {
		t.Errorf("claims per tenant: %v", per)
	}
	if js, err := s.Claim(ctx, at, time.Minute, 1); err != nil || len(js) != 0 {
		t.Errorf("nothing available left, yet claimed %d (%v)", len(js), err)
	}
}

// testClaimFairWeights: a batch over backlogged tenants follows their
// weights (from the tenants table; 1 for a tenant not there).
func testClaimFairWeights(t *testing.T, s store.Store) {
	ctx := context.Background()
	if err := s.CreateTenant(ctx, store.Tenant{Name: "heavy", Weight: 3, CreatedAt: t0}); err != nil {
		t.Fatal(err)
	}
	for i := range 20 {
		accept(t, s, newJob("heavy", fmt.Sprintf("h%d", i)))
		accept(t, s, newJob("plain", fmt.Sprintf("p%d", i)))
	}
	js, err := s.Claim(ctx, t0.Add(time.Second), time.Minute, 8)
	if err != nil || len(js) != 8 {
		t.Fatalf("claim 8: %d, %v", len(js), err)
	}
	per := map[string]int{}
	for _, j := range js {
		per[j.Tenant]++
	}
	if per["heavy"] != 6 || per["plain"] != 2 {
		t.Errorf("a batch of 8 over weights 3 and 1: %v, want 6 and 2", per)
	}
}

// testClaimFairRelist: a tenant with runnable jobs that job_tenants lost
// (removed by hand, or by an earlier release's prune racing an
// acceptance) is listed again by the reaper.
func testClaimFairRelist(t *testing.T, s store.Store) {
	ctx := context.Background()
	db, ok := s.(interface{ DB() *sql.DB })
	if !ok {
		t.Skip("not a SQL store")
	}
	accept(t, s, newJob("a", "a0"))
	accept(t, s, newJob("b", "b0"))
	if _, err := db.DB().ExecContext(ctx, `DELETE FROM job_tenants`); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Reap(ctx, t0, 100); err != nil {
		t.Fatal(err)
	}
	var n int
	if err := db.DB().QueryRowContext(ctx, `SELECT count(*) FROM job_tenants`).Scan(&n); err != nil || n != 2 {
		t.Errorf("tenants listed after the reaper's pass: %d, %v; want 2", n, err)
	}
}

// testClaimFairPrune: the reaper drops from job_tenants a tenant with
// nothing runnable once it was last served over a minute ago, and no
// other; the tenant's next job lists it again, and the next claim takes
// that job in its turn.
func testClaimFairPrune(t *testing.T, s store.Store) {
	ctx := context.Background()
	db, ok := s.(interface{ DB() *sql.DB })
	if !ok {
		t.Skip("not a SQL store")
	}
	listed := func(tenant string) bool {
		t.Helper()
		var n int
		if err := db.DB().QueryRowContext(ctx, `SELECT count(*) FROM job_tenants WHERE tenant = '`+tenant+`'`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n == 1
	}
	reap := func(at time.Time) {
		t.Helper()
		if _, err := s.Reap(ctx, at, 100); err != nil {
			t.Fatal(err)
		}
	}
	accept(t, s, newJob("gone", "g0"))
	served := t0.Add(time.Second)
	// A lease longer than the test, so that the reaper leaves the job.
	if js, err := s.Claim(ctx, served, 2*time.Hour, 1); err != nil || len(js) != 1 || js[0].Tenant != "gone" {
		t.Fatalf("claim gone's job: %v, %v", js, err)
	}
	accept(t, s, newJob("kept", "k0"))
	reap(served.Add(50 * time.Second))
	if !listed("gone") || !listed("kept") {
		t.Fatalf("after a reaper's pass 50s after gone was served: gone listed %v, kept %v; want both", listed("gone"), listed("kept"))
	}
	reap(served.Add(2 * time.Minute))
	if listed("gone") || !listed("kept") {
		t.Fatalf("after a reaper's pass 2m after gone was served: gone listed %v, kept %v; want kept alone", listed("gone"), listed("kept"))
	}
	g1 := accept(t, s, newJob("gone", "g1", func(n *store.NewJob) { n.Now = served.Add(2 * time.Minute) }))
	if !listed("gone") {
		t.Fatal("gone's new job did not list it again")
	}
	js, err := s.Claim(ctx, served.Add(2*time.Minute), time.Minute, 2)
	if err != nil || len(js) != 2 {
		t.Fatalf("claim 2: %d jobs, %v", len(js), err)
	}
	if !slices.ContainsFunc(js, func(j store.Job) bool { return j.ID == g1.ID }) {
		t.Errorf("claim of 2 over kept and gone took %v, want gone's new job %s among them", js, g1.ID)
	}
}
