package sqlstore

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"math/rand/v2"
	"time"

	"github.com/kvgate/kvgate/store"
)

// The limiter. Every acquisition under a limit first locks its tenant's
// window row (an upsert, which locks the row on PostgreSQL and takes the
// database's write lock on SQLite), so that reading the counts and taking
// from them cannot interleave with another acquisition of the same tenant
// on any replica: the counts are exact. Key scopes are locked after their
// tenant's, always in that order, so two acquisitions never deadlock.
// Releases do not take the lock: they only give back. An acquisition that
// nothing can refuse (no limit on its tenant or key) mostly takes no
// window at all (Acquire). Calls that arrive together commit together
// (quotabatch.go).

// lockWindow locks a scope's window, rolling it forward to start when the
// stored one is older (never backwards: a replica whose clock lags counts
// in the newer window), adds reqs requests and toks tokens to it, and
// returns the window's start and its counts before the addition. The
// caller rolls the transaction back when the addition does not fit: one
// round trip takes the lock, reads and takes.
func (s *Store) lockWindow(ctx context.Context, tx *sql.Tx, scope string, start time.Time, reqs, toks int64) (time.Time, int64, int64, error) {
	var ws, req, tok int64
	err := tx.QueryRowContext(ctx, s.rb(`INSERT INTO quota_windows (scope, window_start, requests, tokens) VALUES (?, ?, ?, ?)
		ON CONFLICT (scope) DO UPDATE SET
			requests = CASE WHEN excluded.window_start > quota_windows.window_start THEN 0 ELSE quota_windows.requests END
				+ excluded.requests,
			tokens = CASE WHEN excluded.window_start > quota_windows.window_start THEN 0 ELSE quota_windows.tokens END
				+ excluded.tokens,
			window_start = CASE WHEN excluded.window_start > quota_windows.window_start THEN excluded.window_start
				ELSE quota_windows.window_start END
		RETURNING window_start, requests, tokens`), scope, micros(start), reqs, toks).Scan(&ws, &req, &tok)
	return fromMicros(ws), req - reqs, tok - toks, err
}

// checkWindow refuses tokens more in a window that has no room for them.
func checkWindow(scope string, l store.Limits, req, tok, tokens int64, reset time.Duration) (store.Window, error) {
	w := store.Window{LimitRequests: l.RPM, LimitTokens: l.TPM, Reset: reset}
	if l.RPM > 0 {
		w.RemainingRequests = max(0, l.RPM-req-1)
	}
	if l.TPM > 0 {
		w.RemainingTokens = max(0, l.TPM-tok-tokens)
	}
	if (l.RPM > 0 && req+1 > l.RPM) || (l.TPM > 0 && tok+tokens > l.TPM) {
		// Refused, the request takes nothing: the window as it stands.
		w.RemainingRequests, w.RemainingTokens = max(0, l.RPM-req), max(0, l.TPM-tok)
		if l.RPM > 0 && req+1 > l.RPM {
			return w, &store.QuotaError{Limit: "requests", Scope: scope, Max: l.RPM, Used: req, Asked: 1, Reset: reset, Window: w}
		}
		return w, &store.QuotaError{Limit: "tokens", Scope: scope, Max: l.TPM, Used: tok, Asked: tokens, Reset: reset, Window: w}
	}
	return w, nil
}

// uncounted is window w, which counted a request of tokens and had room
// for it, without it: what a request refused after its windows let it
// through (by a key's window, a concurrency limit, a budget) reports in
// its x-ratelimit-remaining-* headers, since it takes nothing.
func uncounted(w store.Window, tokens int64) store.Window {
	if w.LimitRequests > 0 {
		w.RemainingRequests = min(w.LimitRequests, w.RemainingRequests+1)
	}
	if w.LimitTokens > 0 {
		w.RemainingTokens = min(w.LimitTokens, w.RemainingTokens+tokens)
	}
	return w
}

// tighter returns the window with less room left.
func tighter(a, b store.Window) store.Window {
	if b.LimitRequests > 0 && (a.LimitRequests == 0 || b.RemainingRequests < a.RemainingRequests) {
		a.LimitRequests, a.RemainingRequests = b.LimitRequests, b.RemainingRequests
	}
	if b.LimitTokens > 0 && (a.LimitTokens == 0 || b.RemainingTokens < a.RemainingTokens) {
		a.LimitTokens, a.RemainingTokens = b.LimitTokens, b.RemainingTokens
	}
	return a
}

// ledgerChange is what a call adds to a tenant's usage_days row for one
// day (each field its column's delta). Every write to the ledger goes
// through it: acquiredChange, recordedChange, releasedChange and the sweep
// say what changes, and for job attempts charged with their own writes
// (store.Charge) chargedChange and takenChange; charge or chargePermit
// (one call), and plainCalls and finishBatch (a batch's, summed) write it.
type ledgerChange struct {
	requests, attempts, prompt, completion, reserved, uncertain, uncertainTokens, cost, reservedCost, uncertainCost int64
}

// add is the sum of two changes.
func (d ledgerChange) add(e ledgerChange) ledgerChange {
	return ledgerChange{d.requests + e.requests, d.attempts + e.attempts, d.prompt + e.prompt, d.completion + e.completion,
		d.reserved + e.reserved, d.uncertain + e.uncertain, d.uncertainTokens + e.uncertainTokens, d.cost + e.cost,
		d.reservedCost + e.reservedCost, d.uncertainCost + e.uncertainCost}
}

// columns are d's fields in ledgerUpsert's order.
func (d ledgerChange) columns() [10]int64 {
	return [10]int64{d.requests, d.attempts, d.prompt, d.completion, d.reserved, d.uncertain, d.uncertainTokens,
		d.cost, d.reservedCost, d.uncertainCost}
}

// ledgerUpsert adds a ledgerChange to its row, which it creates at the
// day's first charge.
const ledgerUpsert = `INSERT INTO usage_days (tenant, day, requests, attempts, prompt_tokens, completion_tokens,
		reserved_tokens, uncertain, uncertain_tokens, cost, reserved_cost, uncertain_cost) %s
		ON CONFLICT (tenant, day) DO UPDATE SET requests = usage_days.requests + excluded.requests,
			attempts = usage_days.attempts + excluded.attempts, prompt_tokens = usage_days.prompt_tokens + excluded.prompt_tokens,
			completion_tokens = usage_days.completion_tokens + excluded.completion_tokens,
			reserved_tokens = usage_days.reserved_tokens + excluded.reserved_tokens, uncertain = usage_days.uncertain + excluded.uncertain,
			uncertain_tokens = usage_days.uncertain_tokens + excluded.uncertain_tokens, cost = usage_days.cost + excluded.cost,
			reserved_cost = usage_days.reserved_cost + excluded.reserved_cost, uncertain_cost = usage_days.uncertain_cost + excluded.uncertain_cost`

var chargeOne = fmt.Sprintf(ledgerUpsert, "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)")

// ledgerUpdate adds a ledgerChange to a row that is there: the row of a
// permit, which its acquisition created. Cheaper than the upsert.
const ledgerUpdate = `UPDATE usage_days SET requests = requests + ?, attempts = attempts + ?, prompt_tokens = prompt_tokens + ?,
	completion_tokens = completion_tokens + ?, reserved_tokens = reserved_tokens + ?, uncertain = uncertain + ?,
	uncertain_tokens = uncertain_tokens + ?, cost = cost + ?, reserved_cost = reserved_cost + ?,
	uncertain_cost = uncertain_cost + ? WHERE tenant = ? AND day = ?`

// charge adds d to tenant's ledger row of day, creating the row.
func (s *Store) charge(ctx context.Context, tx *sql.Tx, tenant string, day int, d ledgerChange) error {
	_, err := tx.ExecContext(ctx, s.rb(chargeOne), tenant, day, d.requests, d.attempts, d.prompt, d.completion, d.reserved,
		d.uncertain, d.uncertainTokens, d.cost, d.reservedCost, d.uncertainCost)
	return err
}

// chargePermit adds d to the ledger row of a stored permit's day.
func (s *Store) chargePermit(ctx context.Context, tx *sql.Tx, tenant string, day int, d ledgerChange) error {
	_, err := tx.ExecContext(ctx, s.rb(ledgerUpdate), d.requests, d.attempts, d.prompt, d.completion, d.reserved,
		d.uncertain, d.uncertainTokens, d.cost, d.reservedCost, d.uncertainCost, tenant, day)
	return err
}

// acquiredChange: an admitted acquisition counts a request and holds its
// reservation.
func acquiredChange(a store.Acquisition) ledgerChange {
	return ledgerChange{requests: 1, reserved: a.Tokens, reservedCost: a.Cost}
}

// recordedChange: a request recorded when it ended (RecordUsage), as its
// acquisition and release would have left the ledger; false for one
// never sent, which leaves nothing.
func recordedChange(r store.Release) (ledgerChange, bool) {
	d := earlierChange(r)
	switch r.Outcome {
	case store.NotSent:
		return d, r.Attempts != 0
	case store.Reported:
		d.requests, d.prompt, d.completion, d.cost = 1, r.PromptTokens, r.CompletionTokens, r.Cost
	case store.Uncertain:
		d.requests = 1
		d = d.add(ledgerChange{uncertain: 1, uncertainTokens: r.Permit.Tokens, uncertainCost: r.Permit.Cost})
	}
	return d, true
}

// chargedChange: a job attempt's Charge at its end (store.Charge), as
// RecordUsage would have charged its requests, the attempt's earlier ones
// each a reported request; false when nothing was sent.
func chargedChange(c store.Charge) (ledgerChange, bool) {
	d, ok := recordedChange(store.Release{Permit: store.Permit{Tokens: c.Tokens, Cost: c.Cost}, Outcome: c.Outcome,
		Attempts: c.Attempts, PromptTokens: c.PromptTokens, CompletionTokens: c.CompletionTokens, Cost: c.UsageCost})
	e := c.Earlier
	if e.Requests == 0 {
		return d, ok
	}
	n := int64(e.Requests)
	return d.add(ledgerChange{requests: n, attempts: n, prompt: e.PromptTokens, completion: e.CompletionTokens, cost: e.UsageCost}), true
}

// takenChange: the reservation of a job attempt taken from its claim (a
// reap, a cancel) after its request was sent, charged as one uncertain
// request.
func takenChange(tokens, cost int64) ledgerChange {
	d, _ := chargedChange(store.Charge{Tokens: tokens, Cost: cost, Outcome: store.Uncertain, Attempts: 1})
	return d
}

// releasedChange: a permit's release gives back its reservation and
// charges what was used. A swept permit's reservation is uncertain usage
// already (sweptChange): it is taken back from there.
func releasedChange(r store.Release, swept bool) ledgerChange {
	p := r.Permit
	d := earlierChange(r)
	held, heldCost, heldCount := &d.reserved, &d.reservedCost, int64(0) // where the reservation sits
	if swept {
		held, heldCost, heldCount = &d.uncertainTokens, &d.uncertainCost, 1
	}
	switch r.Outcome {
	case store.NotSent:
		d.requests = -1
		*held -= p.Tokens
		*heldCost -= p.Cost
		d.uncertain -= heldCount
	case store.Reported:
		d.prompt, d.completion, d.cost = r.PromptTokens, r.CompletionTokens, r.Cost
		*held -= p.Tokens
		*heldCost -= p.Cost
		d.uncertain -= heldCount
	case store.Uncertain:
		if !swept {
			d = d.add(sweptChange(p.Tokens, p.Cost)) // the reservation, uncertain now
		}
	}
	return d
}

// earlierChange is the part of a request's end that its last attempt's
// outcome does not change: its attempts, and the reservation charged as
// an uncertain request for each earlier attempt cut with no answer.
func earlierChange(r store.Release) ledgerChange {
	n := int64(r.EarlierUncertain)
	return ledgerChange{attempts: int64(r.Attempts), uncertain: n, uncertainTokens: n * r.Permit.Tokens, uncertainCost: n * r.Permit.Cost}
}

// sweptChange: an expired permit's reservation becomes uncertain usage.
func sweptChange(tokens, cost int64) ledgerChange {
	return ledgerChange{reserved: -tokens, uncertain: 1, uncertainTokens: tokens, reservedCost: -cost, uncertainCost: cost}
}

// Acquire implements store.Store. Concurrent acquisitions and releases
// commit together (quotabatch.go).
func (s *Store) Acquire(ctx context.Context, a store.Acquisition) (store.Permit, error) {
	// Nothing can refuse an unlimited acquisition, so nothing needs
	// serialising: it takes no window (its permit's WindowStart stays
	// zero, and its release gives none back), but one in 64 takes the
	// tenant's window after all, to sweep the tenant's expired permits
	// under the lock that keeps two sweeps apart.
	c := &quotaCall{acquire: &a, windowless: a.Unrefusable() && rand.IntN(64) != 0}
	if err := s.quotaDo(ctx, c); err != nil {
		return store.Permit{}, err // if its batch runs after all, undoAcquire undoes it
	}
	if c.err != nil && s.lostTouch(c.err) {
		go s.undoAcquire(c)
	}
	return c.permit, c.err
}

// undoAcquire gives back, as never sent, the permit that an acquisition
// may have written although its caller was told it failed: its batch
// committed after the caller stopped waiting (quotaWait), or its commit
// failed in a way that leaves the outcome unknown (a statement cancelled
// or a connection lost in flight). Without it such a permit would hold
// its tenant's concurrency and reservation until its lease ran out, and
// a store that stalled past quotaWait would, once it came back, find the
// tenants it refused meanwhile (503) at their concurrency limits. A
// permit known to be written is released as written; one that may not
// be (the store lost touch with the database: lostTouch) is released by
// its id alone, without the window it may have counted (a release of a
// permit that is not there changes nothing). A release that fails leaves
// the permit to its lease, as before.
func (s *Store) undoAcquire(c *quotaCall) {
	if c.acquire == nil || (c.err != nil && !s.lostTouch(c.err)) {
		// A refusal wrote nothing, nor did a call the database turned
		// down (a permit id taken: releasing it would release the
		// permit of the call that took it).
		return
	}
	p := c.permit
	if c.err != nil {
		p = c.acquire.Permit()
	}
	ctx, cancel := context.WithTimeout(context.Background(), s.quotaWait)
	defer cancel()
	_ = s.Release(ctx, store.Release{Permit: p, Outcome: store.NotSent, Now: c.acquire.Now, Behind: true})
}

// acquireIn is one acquisition in tx, windowless (see Acquire) or under
// its tenant's window lock. A refusal returns its *store.QuotaError after
// writing to the windows: the caller rolls back.
func (s *Store) acquireIn(ctx context.Context, tx *sql.Tx, a store.Acquisition, windowless bool) (store.Permit, error) {
	start := a.Now.Truncate(time.Minute)
	p := a.Permit()
	keyScoped := a.KeyLimited()
	err := func() error {
		if windowless {
			return s.recordPermit(ctx, tx, a, p)
		}
		ws, req, tok, err := s.lockWindow(ctx, tx, "t:"+a.Tenant, start, 1, a.Tokens)
		if err != nil {
			return err
		}
		p.WindowStart = ws
		reset := max(0, ws.Add(time.Minute).Sub(a.Now))
		if p.Window, err = checkWindow("tenant", a.Limits, req, tok, a.Tokens, reset); err != nil {
			return err
		}
		if keyScoped {
			kws, kreq, ktok, err := s.lockWindow(ctx, tx, "k:"+a.KeyID, start, 1, a.Tokens)
			if err != nil {
				return err
			}
			p.KeyWindow = true
			kw, err := checkWindow("key", a.KeyLimits, kreq, ktok, a.Tokens, max(0, kws.Add(time.Minute).Sub(a.Now)))
			if err != nil {
				// The tenant's window, too, as it stands without the
				// refused request, where it has less room than the key's.
				var qe *store.QuotaError
				if errors.As(err, &qe) {
					qe.Window = tighter(qe.Window, uncounted(p.Window, a.Tokens))
				}
				return err
			}
			p.Window = tighter(p.Window, kw)
		}
		refused := uncounted(p.Window, a.Tokens) // what a refusal from here reports
		// Expired permits matter at once to concurrency and budgets;
		// elsewhere only to the ledger, swept now and then.
		l := a.Limits
		if l.MaxConcurrency > 0 || l.DailyTokens > 0 || l.MonthlyTokens > 0 || l.DailySpend > 0 || l.MonthlySpend > 0 ||
			a.KeyLimits.MaxConcurrency > 0 || a.Unrefusable() || rand.IntN(64) == 0 {
			if err := s.sweepPermits(ctx, tx, a.Tenant, a.Now); err != nil {
				return err
			}
		}
		if err := s.checkConcurrency(ctx, tx, "tenant", `tenant = ?`, a.Tenant, a.Limits.MaxConcurrency, refused); err != nil {
			return err
		}
		if keyScoped {
			// The index of keys' permits (quota_permits_key) is partial:
			// neither database infers its predicate from key_id = ?.
			if err := s.checkConcurrency(ctx, tx, "key", `key_id = ? AND key_id <> ''`, a.KeyID, a.KeyLimits.MaxConcurrency, refused); err != nil {
				return err
			}
		}
		if err := s.checkBudgets(ctx, tx, a, refused); err != nil {
			return err
		}
		// Room everywhere: the windows took theirs already.
		return s.recordPermit(ctx, tx, a, p)
	}()
	if err != nil {
		return store.Permit{}, err
	}
	return p, nil
}

// sweepPermits expires a tenant's permits whose lease ended (their
// replica died or lost touch): they stop counting against concurrency and
// their reservations become uncertain usage. Swept permits a day past
// their lease are forgotten.
func (s *Store) sweepPermits(ctx context.Context, tx *sql.Tx, tenant string, now time.Time) error {
	// A permit whose release holds it is ending anyway: skipped, not
	// waited for (quotabatch.go's lock order).
	rows, err := tx.QueryContext(ctx, s.rb(`UPDATE quota_permits SET swept = 1 WHERE id IN (
		SELECT id FROM quota_permits WHERE tenant = ? AND swept = 0 AND expires_at <= ? `+s.d.LockRunnable+`)
		RETURNING day, tokens, cost`), tenant, micros(now))
	if err != nil {
		return err
	}
	type expired struct{ day, tokens, cost int64 }
	var ex []expired
	for rows.Next() {
		var e expired
		if err := rows.Scan(&e.day, &e.tokens, &e.cost); err != nil {
			rows.Close()
			return err
		}
		ex = append(ex, e)
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return err
	}
	if len(ex) == 0 {
		return nil
	}
	for _, e := range ex {
		if err := s.chargePermit(ctx, tx, tenant, int(e.day), sweptChange(e.tokens, e.cost)); err != nil {
			return err
		}
	}
	_, err = tx.ExecContext(ctx, s.rb(`DELETE FROM quota_permits WHERE id IN (
		SELECT id FROM quota_permits WHERE tenant = ? AND swept = 1 AND expires_at <= ? `+s.d.LockRunnable+`)`),
		tenant, micros(now.Add(-24*time.Hour)))
	return err
}

func (s *Store) checkConcurrency(ctx context.Context, tx *sql.Tx, scope, where, arg string, limit int64, w store.Window) error {
	if limit <= 0 {
		return nil
	}
	var n int64
	if err := tx.QueryRowContext(ctx, s.rb(`SELECT COUNT(*) FROM quota_permits WHERE `+where+` AND swept = 0`), arg).Scan(&n); err != nil {
		return err
	}
	if n >= limit {
		return &store.QuotaError{Limit: "concurrency", Scope: scope, Max: limit, Used: n, Asked: 1, Window: w}
	}
	return nil
}

// checkBudgets refuses a reservation the day's or the month's token budget
// cannot hold: reported, reserved and uncertain tokens all count.
func (s *Store) checkBudgets(ctx context.Context, tx *sql.Tx, a store.Acquisition, w store.Window) error {
	day := store.DayOf(a.Now)
	now := a.Now.UTC()
	for _, b := range []struct {
		limit    int64
		name     string
		from, to int
		reset    time.Time
	}{
		{a.Limits.DailyTokens, "daily_tokens", day, day, time.Date(now.Year(), now.Month(), now.Day()+1, 0, 0, 0, 0, time.UTC)},
		{a.Limits.MonthlyTokens, "monthly_tokens", day/100*100 + 1, day/100*100 + 31, time.Date(now.Year(), now.Month()+1, 1, 0, 0, 0, 0, time.UTC)},
	} {
		if b.limit <= 0 {
			continue
		}
		var used int64
		if err := tx.QueryRowContext(ctx, s.rb(`SELECT CAST(COALESCE(SUM(prompt_tokens + completion_tokens + reserved_tokens + uncertain_tokens), 0) AS BIGINT)
			FROM usage_days WHERE tenant = ? AND day >= ? AND day <= ?`), a.Tenant, b.from, b.to).Scan(&used); err != nil {
			return err
		}
		if used+a.Tokens > b.limit {
			return &store.QuotaError{Limit: b.name, Scope: "tenant", Max: b.limit, Used: used, Asked: a.Tokens,
				Reset: b.reset.Sub(a.Now), Window: w}
		}
	}
	return s.checkSpend(ctx, tx, a, w)
}

// checkSpend refuses a reservation whose price the day's or the month's
// spending budget cannot hold: reported, reserved and uncertain money all
// count. A request without a price (its model has none) costs nothing,
// and passes while the budget is not overspent.
func (s *Store) checkSpend(ctx context.Context, tx *sql.Tx, a store.Acquisition, w store.Window) error {
	day := store.DayOf(a.Now)
	now := a.Now.UTC()
	for _, b := range []struct {
		limit    int64
		name     string
		from, to int
		reset    time.Time
	}{
		{a.Limits.DailySpend, "daily_spend", day, day, time.Date(now.Year(), now.Month(), now.Day()+1, 0, 0, 0, 0, time.UTC)},
		{a.Limits.MonthlySpend, "monthly_spend", day/100*100 + 1, day/100*100 + 31, time.Date(now.Year(), now.Month()+1, 1, 0, 0, 0, 0, time.UTC)},
	} {
		if b.limit <= 0 {
			continue
		}
		var used int64
		if err := tx.QueryRowContext(ctx, s.rb(`SELECT CAST(COALESCE(SUM(cost + reserved_cost + uncertain_cost), 0) AS BIGINT)
			FROM usage_days WHERE tenant = ? AND day >= ? AND day <= ?`), a.Tenant, b.from, b.to).Scan(&used); err != nil {
			return err
		}
		if used+a.Cost > b.limit || (a.Cost == 0 && used >= b.limit) {
			return &store.QuotaError{Limit: b.name, Scope: "tenant", Max: b.limit, Used: used, Asked: a.Cost,
				Reset: b.reset.Sub(a.Now), Window: w}
		}
	}
	return nil
}

// RenewPermit implements store.Store.
func (s *Store) RenewPermit(ctx context.Context, id string, expires time.Time) error {
	res, err := s.db.ExecContext(ctx, s.rb(`UPDATE quota_permits SET expires_at = ? WHERE id = ? AND swept = 0`), micros(expires), id)
	if err := affected(res, err); errors.Is(err, store.ErrLeaseLost) {
		return store.ErrNotFound
	} else if err != nil {
		return s.err("renew permit", err)
	}
	return nil
}

// Release implements store.Store. Concurrent acquisitions and releases
// commit together (quotabatch.go).
func (s *Store) Release(ctx context.Context, r store.Release) error {
	c := &quotaCall{release: &r}
	if err := s.quotaDo(ctx, c); err != nil {
		return err
	}
	return c.err
}

// RecordUsage implements store.Store. It commits with the acquisitions
// and releases that arrive with it (quotabatch.go).
func (s *Store) RecordUsage(ctx context.Context, r store.Release) error {
	// As an unlimited acquisition: one in 64 takes the tenant's window,
	// to sweep its expired permits (a tenant whose requests all end
	// quickly may never acquire one).
	c := &quotaCall{release: &r, record: true, windowless: rand.IntN(64) != 0}
	if err := s.quotaDo(ctx, c); err != nil {
		return err
	}
	return c.err
}

// recordIn is one RecordUsage in tx: the ledger row as recordPermit and
// then releaseIn would leave it, in one upsert (nothing at all for a
// request never sent); windowless, or first the tenant's window and the
// sweep of its expired permits.
func (s *Store) recordIn(ctx context.Context, tx *sql.Tx, r store.Release, windowless bool) error {
	p := r.Permit
	if !windowless {
		if _, _, _, err := s.lockWindow(ctx, tx, "t:"+p.Tenant, r.Now.Truncate(time.Minute), 0, 0); err != nil {
			return err
		}
		if err := s.sweepPermits(ctx, tx, p.Tenant, r.Now); err != nil {
			return err
		}
	}
	d, ok := recordedChange(r)
	if !ok {
		return nil
	}
	return s.charge(ctx, tx, p.Tenant, p.Day, d)
}

// releaseIn is one release in tx.
func (s *Store) releaseIn(ctx context.Context, tx *sql.Tx, r store.Release) error {
	p := r.Permit
	actual := r.PromptTokens + r.CompletionTokens
	var window [2]int64 // requests and tokens given back to the window
	switch r.Outcome {
	case store.NotSent:
		window = [2]int64{-1, -p.Tokens}
	case store.Reported:
		window = [2]int64{0, actual - p.Tokens}
	}
	// The attempts cut with no answer keep a reservation each in the
	// window, as in the ledger (earlierChange).
	window[1] += int64(r.EarlierUncertain) * p.Tokens
	// The windows first, as in Acquire (the tenant's, then the key's;
	// then the permits, then the ledger), so the two never deadlock.
	// Only while the permit is there (not released before), and only
	// in the window that counted it: a later one never saw it.
	for _, sc := range []string{"t:" + p.Tenant, "k:" + p.KeyID} {
		if p.WindowStart.IsZero() || (sc[0] == 'k' && !p.KeyWindow) { // no window counted it, or not the key's
			continue
		}
		ws := micros(p.WindowStart)
		if _, err := tx.ExecContext(ctx, s.rb(`UPDATE quota_windows SET
			requests = CASE WHEN window_start <> ? THEN requests WHEN requests + ? < 0 THEN 0 ELSE requests + ? END,
			tokens = CASE WHEN window_start <> ? THEN tokens WHEN tokens + ? < 0 THEN 0 ELSE tokens + ? END
			WHERE scope = ? AND EXISTS (SELECT 1 FROM quota_permits WHERE id = ?)`),
			ws, window[0], window[0], ws, window[1], window[1], sc, p.ID); err != nil {
			return err
		}
	}
	var swept int
	err := tx.QueryRowContext(ctx, s.rb(`DELETE FROM quota_permits WHERE id = ? RETURNING swept`), p.ID).Scan(&swept)
	if errors.Is(err, sql.ErrNoRows) {
		return nil // released before
	}
	if err != nil {
		return err
	}
	return s.chargePermit(ctx, tx, p.Tenant, p.Day, releasedChange(r, swept == 1))
}

// pendingCount counts a tenant's pending jobs (READY, RUNNING or
// RETRY_SCHEDULED) and their token estimates: the runnable ones through
// jobs_runnable_tenant and the running ones through jobs_running, each
// condition written as its index's predicate so that both databases use
// the two partial indexes (migration 18 dropped the index of all three
// states).
const pendingCount = `SELECT COUNT(*), CAST(COALESCE(SUM(token_estimate), 0) AS BIGINT) FROM (
		SELECT token_estimate FROM jobs WHERE tenant = ? AND state IN ('READY', 'RETRY_SCHEDULED')
		UNION ALL
		SELECT token_estimate FROM jobs WHERE tenant = ? AND state = 'RUNNING') pending`

// ReserveJob implements store.Store. It is serialised with the tenant's
// other reservations (and acquisitions) by the tenant's window row; a
// reservation counts until EndJobReservation, and the job it stands for
// counts from its acceptance: between the two, the job counts twice, never
// zero times.
func (s *Store) ReserveJob(ctx context.Context, id, tenant string, tokens int64, l store.Limits, now time.Time, lease time.Duration) error {
	return s.reservePending(ctx, "reserve job", id, tenant, 1, tokens, l, now, lease)
}

// reservePending holds room for jobs jobs of tokens in all under the
// tenant's pending-job limits, in one transaction serialised with the
// tenant's other reservations by its window row: the check and the
// reservation are one, so that callers at the same moment never pass a
// limit together. A reservation of the same id is replaced (it does not
// count against itself). ReserveJob and ReserveBatch share it.
func (s *Store) reservePending(ctx context.Context, op, id, tenant string, jobs, tokens int64, l store.Limits, now time.Time, lease time.Duration) error {
	return s.tx(ctx, op, func(tx *sql.Tx) error {
		if _, _, _, err := s.lockWindow(ctx, tx, "t:"+tenant, now.Truncate(time.Minute), 0, 0); err != nil {
			return err
		}
		if _, err := tx.ExecContext(ctx, s.rb(`DELETE FROM job_reservations WHERE (tenant = ? AND expires_at <= ?) OR id = ?`), tenant, micros(now), id); err != nil {
			return err
		}
		// The reservations first, then the jobs, each statement seeing
		// what had committed when it began: a reservation ends only after
		// its job committed, so a submission that ends between the two
		// reads is counted twice (by its reservation, then its job),
		// never zero times, as the other order could.
		var pjobs, ptoks, rjobs, rtoks int64
		if err := tx.QueryRowContext(ctx, s.rb(`SELECT CAST(COALESCE(SUM(jobs), 0) AS BIGINT), CAST(COALESCE(SUM(tokens), 0) AS BIGINT) FROM job_reservations
			WHERE tenant = ?`), tenant).Scan(&rjobs, &rtoks); err != nil {
			return err
		}
		if err := tx.QueryRowContext(ctx, s.rb(pendingCount), tenant, tenant).Scan(&pjobs, &ptoks); err != nil {
			return err
		}
		pjobs, ptoks = pjobs+rjobs, ptoks+rtoks
		switch {
		case l.MaxPendingJobs > 0 && pjobs+jobs > l.MaxPendingJobs:
			return &store.QuotaError{Limit: "pending_jobs", Scope: "tenant", Max: l.MaxPendingJobs, Used: pjobs, Asked: jobs}
		case l.MaxPendingTokens > 0 && ptoks+tokens > l.MaxPendingTokens:
			return &store.QuotaError{Limit: "pending_tokens", Scope: "tenant", Max: l.MaxPendingTokens, Used: ptoks, Asked: tokens}
		}
		_, err := tx.ExecContext(ctx, s.rb(`INSERT INTO job_reservations (id, tenant, jobs, tokens, expires_at) VALUES (?, ?, ?, ?, ?)`),
			id, tenant, jobs, tokens, micros(now.Add(lease)))
		return err
	})
}

// EndJobReservation implements store.Store.
func (s *Store) EndJobReservation(ctx context.Context, id string) error {
	_, err := s.db.ExecContext(ctx, s.rb(`DELETE FROM job_reservations WHERE id = ?`), id)
	return s.err("end job reservation", err)
}

// recordPermit charges an admitted acquisition's reservation to the
// ledger and stores its permit.
func (s *Store) recordPermit(ctx context.Context, tx *sql.Tx, a store.Acquisition, p store.Permit) error {
	if err := s.charge(ctx, tx, a.Tenant, p.Day, acquiredChange(a)); err != nil {
		return err
	}
	_, err := tx.ExecContext(ctx, s.rb(`INSERT INTO quota_permits (id, tenant, key_id, day, window_start, tokens, cost, expires_at, swept)
		VALUES (?, ?, ?, ?, ?, ?, ?, ?, 0)`), p.ID, a.Tenant, a.KeyID, p.Day, micros(p.WindowStart), a.Tokens, a.Cost, micros(a.Now.Add(a.Lease)))
	return err
}
