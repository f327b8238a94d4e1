package postgres_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/kvgate/kvgate/store"
	"github.com/kvgate/kvgate/store/postgres"
	"github.com/kvgate/kvgate/store/sqlstore"
)

// twoStores opens two stores over one fresh database, as two replicas.
func twoStores(t *testing.T) (*sqlstore.Store, *sqlstore.Store) {
	t.Helper()
	ctx := context.Background()
	url := freshDatabase(t)
	var ss [2]*sqlstore.Store
	for i := range ss {
		s, err := postgres.Open(ctx, url)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { s.Close() })
		ss[i] = s
	}
	if _, err := postgres.Migrate(ctx, ss[0]); err != nil {
		t.Fatal(err)
	}
	return ss[0], ss[1]
}

func claimTenants(t *testing.T, s store.Store, now time.Time, limit int) map[string]int {
	t.Helper()
	js, err := s.Claim(context.Background(), now, time.Hour, limit, "m")
	if err != nil || len(js) != limit {
		t.Fatalf("claim %d: %d jobs, %v", limit, len(js), err)
	}
	per := map[string]int{}
	for _, j := range js {
		per[j.Tenant]++
	}
	return per
}

// oldBacklog accepts 20 jobs of tenant old through a, and has b claim
// one of them, which reads b's copy of the listing; it returns the
// instant of both.
func oldBacklog(t *testing.T, a, b store.Store) time.Time {
	t.Helper()
	now := time.Now()
	for i := range 20 {
		acceptAt(t, a, "old", fmt.Sprint("o", i), now)
	}
	if per := claimTenants(t, b, now, 1); per["old"] != 1 {
		t.Fatalf("the first claim: %v", per)
	}
	return now
}

// TestFairListNewTenantOfAnotherStore: a store claiming from its copy of
// the listing considers a tenant first listed by another store's
// acceptance (a replica's) by its second claim after it, at the same
// instant (no refresh by age): the first claim's count of tenants never
// served differs from the copy's.
func TestFairListNewTenantOfAnotherStore(t *testing.T) {
	a, b := twoStores(t)
	now := oldBacklog(t, a, b)
	acceptAt(t, a, "new", "n0", now)
	first := claimTenants(t, b, now, 1)
	second := claimTenants(t, b, now, 1)
	if first["new"]+second["new"] != 1 {
		t.Errorf("b's two claims after another store listed tenant new behind old's backlog: %v, %v; want new's job in one", first, second)
	}
}

// TestFairListNewTenantOfItsOwn: a tenant first listed by the store's
// own acceptance is considered by its very next claim, at the same
// instant (no refresh by age, no count seen yet).
func TestFairListNewTenantOfItsOwn(t *testing.T) {
	s := migratedFresh(t)
	now := oldBacklog(t, s, s)
	acceptAt(t, s, "new", "n0", now)
	if per := claimTenants(t, s, now, 1); per["new"] != 1 {
		t.Errorf("the claim after the store listed tenant new behind old's backlog: %v, want new's job", per)
	}
}

// TestFairListWeightOfAnotherStore: a weight set through another store
// shapes a store's shares once its copy is fairListAge (a second) old by
// the claims' clock, and one set through the store itself at once.
func TestFairListWeightOfAnotherStore(t *testing.T) {
	a, b := twoStores(t)
	ctx := context.Background()
	now := time.Now()
	for i := range 40 {
		acceptAt(t, a, "heavy", fmt.Sprint("h", i), now)
		acceptAt(t, a, "plain", fmt.Sprint("p", i), now)
	}
	if per := claimTenants(t, b, now, 8); per["heavy"] != 4 || per["plain"] != 4 {
		t.Fatalf("equal weights, a batch of 8: %v", per)
	}
	if err := a.CreateTenant(ctx, store.Tenant{Name: "heavy", Weight: 3, CreatedAt: now}); err != nil {
		t.Fatal(err)
	}
	if per := claimTenants(t, b, now.Add(100*time.Millisecond), 8); per["heavy"] != 4 {
		t.Errorf("weight 3 set through another store, the copy 100ms old: %v, want 4 and 4 still", per)
	}
	if per := claimTenants(t, b, now.Add(time.Second), 8); per["heavy"] != 6 || per["plain"] != 2 {
		t.Errorf("weight 3 set through another store, the copy a second old: %v, want 6 and 2", per)
	}
	if _, err := b.UpdateTenant(ctx, "heavy", now, func(tn *store.Tenant) error {
		tn.Weight = 1
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	if per := claimTenants(t, b, now.Add(time.Second), 8); per["heavy"] != 4 {
		t.Errorf("weight 1 set through the store itself: %v, want 4 and 4", per)
	}
}
