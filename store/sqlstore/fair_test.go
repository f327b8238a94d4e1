package sqlstore

import (
	"context"
	"slices"
	"testing"
	"time"
)

// TestChoicesInFlightTakeTurns: a claim moves the cursor as it chooses,
// so claims in flight together consider the tenants after each other's
// rather than the same ones; the cursor wraps round, and tenants never
// served come first without moving it.
func TestChoicesInFlightTakeTurns(t *testing.T) {
	now := time.Unix(1_000, 0)
	var s Store
	s.fair.at = now // a fresh copy: choose reads nothing
	for _, n := range []string{"a", "b", "c", "d", "e", "f", "g"} {
		s.fair.tenants = append(s.fair.tenants, fairTenant{name: n, served: micros(now), weight: 1})
	}
	choose := func() []string {
		t.Helper()
		c, err := s.choose(context.Background(), nil, now, 24) // fairTenants(24) = 3
		if err != nil {
			t.Fatal(err)
		}
		return c.tenants
	}
	// Three claims chosen before any has taken its jobs.
	for i, want := range [][]string{{"a", "b", "c"}, {"d", "e", "f"}, {"g", "a", "b"}} {
		if got := choose(); !slices.Equal(got, want) {
			t.Fatalf("claim %d considered %v, want %v", i+1, got, want)
		}
	}
	// A new tenant comes first, and the turn goes on after b.
	s.fair.tenants = slices.Insert(s.fair.tenants, 0, fairTenant{name: "0new", weight: 1})
	s.fair.fresh = 1
	if got, want := choose(), []string{"0new", "c", "d"}; !slices.Equal(got, want) {
		t.Fatalf("with a new tenant the claim considered %v, want %v", got, want)
	}
	if s.fair.cursor != "d" {
		t.Errorf("cursor %q after a choice ending at d", s.fair.cursor)
	}
}
