package gateway

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"strconv"
	"time"

	"github.com/kvgate/kvgate/store"
)

// Costs. Config.Prices gives a model a price per million prompt and per
// million completion tokens, in the configuration's currency. A request
// of a priced model reserves, at admission, the price of its reservation
// (prompt plus output budget) beside its tokens, and its release charges
// the price of the usage reported: the ledger (GET /v1/usage,
// /v1/admin/usage) carries money beside tokens, reported, reserved and
// uncertain, as it does tokens. A tenant's daily_spend and monthly_spend
// are budgets in that currency, checked at admission beside the token
// budgets (store.Acquisition.Cost; insufficient_quota when spent). Money
// is kept in micro-units (one millionth of the currency), so that sums
// are exact. A model without a price costs nothing; a request of one
// still passes a spending budget only while the budget is not spent.

// Price is a model's price, in the configuration's currency per million
// tokens.
type Price struct {
	Prompt     float64 `json:"prompt" yaml:"prompt"`
	Completion float64 `json:"completion" yaml:"completion"`
}

// checkPrices refuses negative or non-finite prices.
func checkPrices(m map[string]Price) error {
	for model, p := range m {
		for _, v := range []float64{p.Prompt, p.Completion} {
			if v < 0 || math.IsNaN(v) || math.IsInf(v, 0) {
				return fmt.Errorf("price of model %q: %v is not a price (0 or more per million tokens)", model, v)
			}
		}
	}
	return nil
}

// priceOf is the price of a call to model, asked for as asked (an alias,
// or the model itself): the model's price, else the alias's. An alias
// named after its own model (a served model with fallbacks) has no price
// of its own: the name's price is the model's, and a fallback is priced
// as itself.
func (s *Server) priceOf(model, asked string) Price {
	if p, ok := s.cfg.Prices[model]; ok {
		return p
	}
	if slices.Contains(s.cfg.Models[asked], asked) {
		return Price{}
	}
	return s.cfg.Prices[asked]
}

// micros is the price of tokens in micro-units: a price per million tokens
// is the price per token in micro-units.
func (p Price) micros(prompt, completion int) int64 {
	v := float64(prompt)*p.Prompt + float64(completion)*p.Completion
	if v >= math.MaxInt64/2 {
		return math.MaxInt64 / 2
	}
	return int64(math.Round(v))
}

// fromMicros is an amount of micro-units in the currency.
func fromMicros(v int64) float64 { return float64(v) / 1e6 }

// toMicros is an amount of the currency in micro-units.
func toMicros(v float64) int64 { return int64(math.Round(v * 1e6)) }

// money writes micro-units as an amount of the currency.
func money(v int64) string { return strconv.FormatFloat(fromMicros(v), 'f', -1, 64) }

// currency is Config.Currency, "USD" by default.
func (s *Server) currency() string {
	if s.cfg.Currency != "" {
		return s.cfg.Currency
	}
	return "USD"
}

// checkJobSpend refuses a job whose tenant's spending budget, for the day
// or the month, cannot hold the price of its estimate (a job of a model
// without a price: a budget already spent). It reads the ledger without a
// lock: the job's run is admitted against the budgets again, atomically
// (see Prepare), and this only keeps a tenant from queueing work its
// budget will refuse. A tenant the store does not know has no budget.
func (s *Server) checkJobSpend(ctx context.Context, tenant string, cost int64) error {
	if s.cfg.Tenants.Store == nil {
		return nil
	}
	t, found, err := s.tenant(ctx, tenant)
	if errors.Is(err, errTenantDeleted) {
		return err
	}
	if err != nil {
		if s.cfg.Tenants.FailOpen {
			return nil
		}
		return errQuotaUnavailable
	}
	l := t.Limits
	if !found || (l.DailySpend <= 0 && l.MonthlySpend <= 0) {
		return nil
	}
	now := s.cfg.Tenants.Now().UTC()
	monthStart := time.Date(now.Year(), now.Month(), 1, 0, 0, 0, 0, time.UTC)
	days, err := s.cfg.Tenants.Store.Usage(ctx, tenant, monthStart, now)
	if err != nil {
		if s.cfg.Tenants.FailOpen {
			return nil
		}
		return errQuotaUnavailable
	}
	var today, month int64
	for _, d := range days {
		month += d.ChargedCost()
		if store.DayOf(d.Day) == store.DayOf(now) {
			today = d.ChargedCost()
		}
	}
	for _, b := range []struct {
		limit, used int64
		name        string
		reset       time.Time
	}{
		{l.DailySpend, today, "daily_spend", time.Date(now.Year(), now.Month(), now.Day()+1, 0, 0, 0, 0, time.UTC)},
		{l.MonthlySpend, month, "monthly_spend", monthStart.AddDate(0, 1, 0)},
	} {
		if b.limit > 0 && (b.used+cost > b.limit || (cost == 0 && b.used >= b.limit)) {
			s.quota.rejected.WithLabelValues(b.name).Inc()
			return &store.QuotaError{Limit: b.name, Scope: "tenant", Max: b.limit, Used: b.used, Asked: cost, Reset: b.reset.Sub(now)}
		}
	}
	return nil
}
