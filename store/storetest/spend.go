package storetest

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/kvgate/kvgate/store"
)

// testSpendBudgets: a tenant's daily and monthly spending budgets
// (micro-units) refuse a reservation whose price they cannot hold, with
// reported, reserved and uncertain money counted; a release reconciles a
// reservation's price with the usage's; a refund gives it back; a permit
// swept past its lease moves its price to uncertain money; the ledger
// reports the money beside the tokens.
func testSpendBudgets(t *testing.T, s store.Store) {
	ctx := context.Background()
	createTenant(t, s, "spender", store.Limits{})
	l := store.Limits{DailySpend: 1_000_000, MonthlySpend: 1_500_000} // 1.00 a day, 1.50 a month
	priced := func(tokens, cost int64, now time.Time) store.Acquisition {
		a := acquisition("spender", tokens, l, now)
		a.Cost = cost
		return a
	}
	day1 := time.Date(2026, 11, 1, 9, 0, 0, 0, time.UTC)
	p, err := s.Acquire(ctx, priced(100, 900_000, day1))
	if err != nil {
		t.Fatal(err)
	}
	_, err = s.Acquire(ctx, priced(10, 200_000, day1))
	var q *store.QuotaError
	if !errors.As(err, &q) || q.Limit != "daily_spend" || !q.Budget() || !q.Spend() || q.Used != 900_000 || q.Asked != 200_000 || q.Reset != 15*time.Hour {
		t.Fatalf("over the day's spend: %v", err)
	}
	// Reconciled: the request cost 0.30, not the 0.90 reserved.
	if err := s.Release(ctx, store.Release{Permit: p, Outcome: store.Reported, Attempts: 1, PromptTokens: 20, CompletionTokens: 10,
		Cost: 300_000, Now: day1}); err != nil {
		t.Fatal(err)
	}
	u := usageOn(t, s, "spender", day1)
	if u.Cost != 300_000 || u.ReservedCost != 0 || u.ChargedCost() != 300_000 {
		t.Errorf("after the release: %+v", u)
	}
	p2, err := s.Acquire(ctx, priced(10, 600_000, day1))
	if err != nil {
		t.Fatalf("within the day after reconciling: %v", err)
	}
	// Refunded: never sent.
	if err := s.Release(ctx, store.Release{Permit: p2, Outcome: store.NotSent, Now: day1}); err != nil {
		t.Fatal(err)
	}
	if u := usageOn(t, s, "spender", day1); u.ChargedCost() != 300_000 {
		t.Errorf("after a refund: %+v", u)
	}
	// Uncertain: its price stays charged.
	p3, err := s.Acquire(ctx, priced(10, 100_000, day1))
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Release(ctx, store.Release{Permit: p3, Outcome: store.Uncertain, Attempts: 1, Now: day1}); err != nil {
		t.Fatal(err)
	}
	if u := usageOn(t, s, "spender", day1); u.UncertainCost != 100_000 || u.ChargedCost() != 400_000 {
		t.Errorf("after an uncertain release: %+v", u)
	}
	// Swept: a permit whose replica died keeps its price as uncertain.
	if _, err := s.Acquire(ctx, priced(10, 100_000, day1)); err != nil {
		t.Fatal(err)
	}
	later := day1.Add(2 * time.Minute) // past the minute's lease
	if _, err := s.Acquire(ctx, priced(1, 1, later)); err != nil {
		t.Fatal(err)
	}
	if u := usageOn(t, s, "spender", day1); u.UncertainCost != 200_000 || u.ReservedCost != 1 {
		t.Errorf("after a sweep: %+v", u)
	}
	// The month: 0.50 spent on day 1; day 2 may spend 1.00 less what
	// the month has left.
	day2 := day1.Add(24 * time.Hour)
	if _, err := s.Acquire(ctx, priced(10, 999_999, day2)); err != nil {
		t.Fatalf("a new day: %v", err)
	}
	if _, err := s.Acquire(ctx, priced(1, 1, day2)); quotaLimit(err) != "monthly_spend" {
		t.Fatalf("over the month's spend: %v", err)
	}
	// A request without a price passes while the budget is not spent,
	// and not once it is.
	if _, err := s.Acquire(ctx, priced(1, 0, day2)); quotaLimit(err) != "monthly_spend" {
		t.Fatalf("an unpriced request on a spent month: %v", err)
	}
	if _, err := s.Acquire(ctx, priced(1, 0, time.Date(2026, 12, 1, 0, 0, 0, 0, time.UTC))); err != nil {
		t.Fatalf("a new month: %v", err)
	}
	// Limits round-trip through the tenant record.
	if _, err := s.UpdateTenant(ctx, "spender", day1, func(tn *store.Tenant) error {
		tn.Limits = l
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	if got, err := s.GetTenant(ctx, "spender"); err != nil || got.Limits.DailySpend != 1_000_000 || got.Limits.MonthlySpend != 1_500_000 {
		t.Errorf("tenant limits: %+v, %v", got.Limits, err)
	}
}
