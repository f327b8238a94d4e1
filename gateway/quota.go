package gateway

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvgate/kvgate/store"
)

// Quotas. An interactive request of a tenant that the store knows takes a
// permit before the scheduler admits it: one request from the tenant's
// (and its key's) current minute window, its token reservation (prompt
// plus output budget) against TPM and the day's and month's budgets, and
// a concurrency permit, atomically across replicas (store.Acquisition).
// The permit is given back when the response ends, reconciled with the
// usage the backend reported; a request sent whose usage never came back
// (a timeout, a cut stream, a client that left) stays charged as uncertain
// usage. A job's submission reserves room under the tenant's pending-job
// limits until the job is stored; when the job runs, its request takes a
// permit of its tenant's (no key's) like an interactive one, before the
// scheduler grants it a backend: a quota that refuses it makes the job
// wait for the quota's reset (scheduler.ClassQuota), and its usage lands in
// the tenant's ledger. A job attempt that nothing can refuse takes no
// permit: its usage is charged by the attempt's own writes instead
// (carriedCharge). Tenants that the store does not know (static keys,
// development mode) are not limited, and their usage is recorded too.
//
// When the store does not answer, the request is refused with 503 (fail
// closed), or, with Tenants.FailOpen, admitted without a permit and
// without usage recorded.
//
// A permit that nothing can refuse (store.Acquisition.Unrefusable: no
// limit on the tenant or the key that a request counts against) is
// written behind the request: the request goes on while the permit
// commits, and its release, once the response has ended, is queued
// behind the acquisition instead of waited for. Such a request does not
// wait for the store at all, which is most of what a gateway without
// limits adds to a request. The acquisition waits behindDelay for the
// request to end first: a request that does is recorded with one ledger
// write and no permit (store.Tenants.RecordUsage). The usage is the same
// once the writes commit (a batch, milliseconds): this replica's usage
// endpoint and its drain wait for the writes of the requests that ended
// before them, and another replica reads them a batch later. Two things
// change at the edges. A crash loses the writes not yet committed: a
// request that began or ended in the last few milliseconds before it may
// leave no trace in the ledger (not even uncertain usage). A write-behind
// write that fails makes the replica acquire for every request first
// again (and so fail closed) until an acquisition succeeds; the request
// that met the failure is served, and its acquisition is tried once more
// at its release, or counted as admitted without a permit
// (kvgate_gateway_quota_fail_open_total).

// Tenants configures store-backed keys, quotas and usage. Zero values take
// the defaults in brackets.
type Tenants struct {
	// Store holds the tenants, keys, limiter state and usage ledger; nil
	// disables them all.
	Store store.Tenants
	// FailOpen admits requests when the limiter state cannot be reached,
	// unlimited and unrecorded [false: 503].
	FailOpen bool
	// CacheTTL is how long a key lookup and a tenant's limits are reused
	// in process: how long a revocation or a new limit may take to reach
	// every replica [5s], at most MaxCacheTTL.
	CacheTTL time.Duration
	// PermitLease is how long a permit counts if its replica never
	// releases it [RequestTimeout + 1m].
	PermitLease time.Duration
	// Now is the clock of the quota windows and the caches [time.Now].
	Now func() time.Time
}

// errQuotaUnavailable: the limiter state could not be reached, and the
// gateway fails closed.
var errQuotaUnavailable = errors.New("quota store unavailable")

// errTenantDeleted refuses the requests and job attempts of a deleted
// tenant: keys cached before its delete, jobs accepted meanwhile. Read as
// a tenant the store does not know, they would have no limits.
var errTenantDeleted = errors.New("tenant deleted")

// tenantCache keeps tenants' limits for CacheTTL.
type tenantCache struct {
	mu sync.Mutex
	m  map[string]tenantEntry
}

type tenantEntry struct {
	t       store.Tenant
	found   bool
	deleted bool
	until   time.Time
}

// quotaMetrics count the quotas' refusals and fail-open admissions.
type quotaMetrics struct {
	rejected *prometheus.CounterVec
	failOpen prometheus.Counter
}

// MaxCacheTTL bounds Tenants.CacheTTL: a revoked key keeps working on
// other replicas for as long as it, so a mistyped hour is refused.
const MaxCacheTTL = 10 * time.Minute

// CheckCacheTTL refuses a Tenants.CacheTTL out of bounds.
func CheckCacheTTL(d time.Duration) error {
	if d < 0 || d > MaxCacheTTL {
		return fmt.Errorf("cache_ttl %s: a revoked key works on other replicas for as long; write 0 (5s) to %s", d, MaxCacheTTL)
	}
	return nil
}

func (s *Server) initTenants(reg prometheus.Registerer) error {
	t := &s.cfg.Tenants
	if t.Store == nil {
		return nil
	}
	if err := CheckCacheTTL(t.CacheTTL); err != nil {
		return err
	}
	s.quota = &quotaMetrics{
		rejected: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvgate_gateway_quota_rejections_total", Help: "Requests and job submissions refused by a tenant quota, by limit.",
		}, []string{"limit"}),
		failOpen: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvgate_gateway_quota_fail_open_total", Help: "Requests admitted unlimited because the quota store did not answer.",
		}),
	}
	for _, c := range []prometheus.Collector{s.quota.rejected, s.quota.failOpen} {
		if err := reg.Register(c); err != nil {
			return err
		}
	}
	t.CacheTTL = cmp.Or(t.CacheTTL, 5*time.Second)
	t.PermitLease = cmp.Or(t.PermitLease, s.cfg.RequestTimeout+time.Minute)
	if t.Now == nil {
		t.Now = time.Now
	}
	s.permitsBehind = &permitsBehind{releasing: map[*permit]struct{}{}, delay: behindDelay}
	s.keys = &keyCache{ttl: t.CacheTTL, now: t.Now, m: map[string]keyEntry{}, miss: map[string]keyEntry{}}
	s.limits = &tenantCache{m: map[string]tenantEntry{}}
	return nil
}

// tenant returns a tenant's record, cached; found is false for a tenant
// the store does not know; errTenantDeleted for one deleted.
func (s *Server) tenant(ctx context.Context, name string) (store.Tenant, bool, error) {
	now := s.cfg.Tenants.Now()
	s.limits.mu.Lock()
	e, ok := s.limits.m[name]
	s.limits.mu.Unlock()
	if ok && now.Before(e.until) {
		if e.deleted {
			return store.Tenant{}, false, errTenantDeleted
		}
		return e.t, e.found, nil
	}
	t, err := s.cfg.Tenants.Store.GetTenant(ctx, name)
	switch {
	case errors.Is(err, store.ErrTenantDeleted):
		e = tenantEntry{deleted: true, until: now.Add(s.cfg.Tenants.CacheTTL)}
	case errors.Is(err, store.ErrNotFound):
		e = tenantEntry{until: now.Add(s.cfg.Tenants.CacheTTL)}
	case err != nil:
		return store.Tenant{}, false, err
	default:
		e = tenantEntry{t: t, found: true, until: now.Add(s.cfg.Tenants.CacheTTL)}
	}
	s.limits.mu.Lock()
	if len(s.limits.m) >= keyCacheMax {
		clear(s.limits.m)
	}
	s.limits.m[name] = e
	s.limits.mu.Unlock()
	if e.deleted {
		return store.Tenant{}, false, errTenantDeleted
	}
	return e.t, e.found, nil
}

// forgetTenant drops a cached tenant after a change through this replica.
func (s *Server) forgetTenant(name string) {
	s.limits.mu.Lock()
	delete(s.limits.m, name)
	s.limits.mu.Unlock()
}

// permit is an admitted request's hold on its tenant's quotas; nil when
// the tenant is not limited.
type permit struct {
	s     *Server
	p     store.Permit
	price Price // of the request's model: its release charges the usage's price
	// A permit written behind its request (see above): acquired closes
	// once its acquisition returned, p and err then hold what it
	// returned; settled closes once its release committed too. Both are
	// nil for a permit acquired before the request went on.
	a        store.Acquisition
	err      error
	acquired chan struct{}
	settled  chan struct{}
	start    *time.Timer // starts the acquisition after permitsBehind.delay; nil: started at once
}

// permitsBehind tracks the permits written behind their requests.
type permitsBehind struct {
	n         atomic.Int64 // written behind and not settled
	mu        sync.Mutex
	releasing map[*permit]struct{} // their requests ended, their releases not committed
	// failed: a write-behind acquisition failed; every acquisition is
	// waited for until one succeeds.
	failed atomic.Bool
	// settling, when set (tests), is called as a settle begins to wait;
	// under mu.
	settling func()
	// delay is how long a permit's acquisition waits for its request to
	// end first [behindDelay]: a request that ends within it is recorded
	// with one write (store.Tenants.RecordUsage) instead of an
	// acquisition and a release.
	delay time.Duration
}

// behindDelay is permitsBehind's delay: about the time a permit's
// acquisition would linger in its batch anyway (sqlstore's behindLinger),
// so that what a crash may lose stays the same few milliseconds, and long
// enough for a short request (an embedding, a few tokens) to end first.
const behindDelay = 2 * time.Millisecond

// maxBehind bounds the permits written behind and not yet settled: past
// it (a store slower than the requests), requests wait for their
// acquisitions again, as they would without write-behind.
const maxBehind = 4096

// writeBehind starts a's acquisition and returns its permit at once; nil
// when maxBehind permits are pending already.
func (s *Server) writeBehind(a store.Acquisition, price Price) *permit {
	b := s.permitsBehind
	if b.n.Add(1) > maxBehind {
		b.n.Add(-1)
		return nil
	}
	a.Behind = true
	p := &permit{s: s, price: price, a: a, acquired: make(chan struct{}), settled: make(chan struct{})}
	acquire := func() {
		defer close(p.acquired)
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if p.p, p.err = s.cfg.Tenants.Store.Acquire(ctx, a); p.err != nil {
			b.failed.Store(true)
			s.log.Warn("quota store unreachable: a permit written behind its request failed; acquiring first from now on", "tenant", a.Tenant, "err", p.err)
		}
	}
	if b.delay <= 0 {
		go acquire()
	} else {
		p.start = time.AfterFunc(b.delay, acquire)
	}
	return p
}

// SettleUsage waits for the permits written behind requests and job
// attempts that ended before it was called to commit their releases, or
// for ctx to end: a shutdown's last step before it closes the store.
func (s *Server) SettleUsage(ctx context.Context) { s.permitsBehind.settle(ctx) }

// settle waits for the permits of the requests that ended before it was
// called to commit their releases, or for ctx to end: a read of the
// usage through this replica then sees every request that ended before
// it. Requests still running are not waited for.
func (b *permitsBehind) settle(ctx context.Context) {
	if b == nil {
		return
	}
	b.mu.Lock()
	waits := make([]chan struct{}, 0, len(b.releasing))
	for p := range b.releasing {
		waits = append(waits, p.settled)
	}
	hook := b.settling
	b.mu.Unlock()
	if hook != nil {
		hook()
	}
	for _, w := range waits {
		select {
		case <-w:
		case <-ctx.Done():
			return
		}
	}
}

// acquireQuota admits a request reserving prompt and maxOut tokens at
// price for the caller: a permit (nil without a tenant store, or admitted
// fail-open), a *store.QuotaError, or errQuotaUnavailable.
func (s *Server) acquireQuota(ctx context.Context, prompt, maxOut int, price Price) (*permit, error) {
	pr := principalOf(ctx)
	return s.acquireQuotaFor(ctx, pr.tenant, pr.keyID, pr.keyLimits, prompt, maxOut, price)
}

// acquireQuotaFor admits a request for a tenant, and for its key when
// keyID is set ("" for a durable job, which runs under its tenant's quotas
// only); it returns what acquireQuota does.
func (s *Server) acquireQuotaFor(ctx context.Context, tenant, keyID string, keyLimits store.Limits, prompt, maxOut int, price Price) (*permit, error) {
	if s.cfg.Tenants.Store == nil {
		return nil, nil
	}
	// A tenant the store does not know (a static key's, development
	// mode's) has no limits, and its usage lands in the ledger all the same.
	t, _, err := s.tenant(ctx, tenant)
	var p store.Permit
	if err == nil {
		a := s.acquisition(tenant, t.Limits, prompt, maxOut, price)
		a.PermitID, a.KeyID, a.KeyLimits = uuid.Must(uuid.NewV7()).String(), keyID, keyLimits
		if a.Unrefusable() && !s.permitsBehind.failed.Load() {
			if p := s.writeBehind(a, price); p != nil {
				return p, nil
			}
		}
		if p, err = s.cfg.Tenants.Store.Acquire(ctx, a); err == nil {
			s.permitsBehind.failed.Store(false)
		}
	}
	var qe *store.QuotaError
	switch {
	case err == nil:
		return &permit{s: s, p: p, price: price}, nil
	case errors.Is(err, errTenantDeleted):
		return nil, err
	case errors.As(err, &qe):
		s.quota.rejected.WithLabelValues(qe.Limit).Inc()
		return nil, qe
	case ctx.Err() != nil:
		return nil, ctx.Err()
	case s.cfg.Tenants.FailOpen:
		s.log.Warn("quota store unreachable: admitting without a permit", "tenant", tenant, "err", err)
		s.quota.failOpen.Inc()
		return nil, nil
	}
	s.log.Warn("quota store unreachable: refusing", "tenant", tenant, "err", err)
	return nil, errQuotaUnavailable
}

// acquisition asks for a tenant's request reserving prompt and maxOut
// tokens at price, under its limits l, now; without a permit id or a key.
func (s *Server) acquisition(tenant string, l store.Limits, prompt, maxOut int, price Price) store.Acquisition {
	return store.Acquisition{Tenant: tenant, Tokens: int64(prompt + maxOut), Cost: price.micros(prompt, maxOut), Limits: l,
		Now: s.cfg.Tenants.Now(), Lease: s.cfg.Tenants.PermitLease}
}

// writtenBehind says whether the permit is written behind its request.
func (p *permit) writtenBehind() bool { return p != nil && p.acquired != nil }

// keep renews a permit's lease every third of it until stop is called: a
// job's permit is held while the job waits for a backend, a request's
// while it waits and runs, either of which may take longer than the lease,
// and a permit swept once its lease ran out would no longer count against
// its tenant's concurrency. A permit written behind its request limits
// nothing: not renewed.
func (p *permit) keep() (stop func()) {
	if p == nil || p.writtenBehind() || p.p.ID == "" || p.s.cfg.Tenants.PermitLease <= 0 {
		return func() {}
	}
	lease := p.s.cfg.Tenants.PermitLease
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		t := time.NewTicker(lease / 3)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
			}
			err := p.s.cfg.Tenants.Store.RenewPermit(ctx, p.p.ID, p.s.cfg.Tenants.Now().Add(lease))
			if errors.Is(err, store.ErrNotFound) {
				return // released, or swept already: nothing to keep
			}
			if err != nil && ctx.Err() == nil {
				p.s.log.Warn("renewing a quota permit", "tenant", p.p.Tenant, "permit", p.p.ID, "err", err)
			}
		}
	}()
	return func() { cancel(); <-done }
}

// headers sets OpenAI's x-ratelimit-* headers for the permit's window
// (none for a permit written behind: nothing limits it).
func (p *permit) headers(h http.Header) {
	if p != nil && !p.writtenBehind() {
		rateLimitHeaders(h, p.p.Window)
	}
}

func rateLimitHeaders(h http.Header, w store.Window) {
	reset := w.Reset.Round(time.Millisecond).String()
	if w.LimitRequests > 0 {
		h.Set("x-ratelimit-limit-requests", strconv.FormatInt(w.LimitRequests, 10))
		h.Set("x-ratelimit-remaining-requests", strconv.FormatInt(w.RemainingRequests, 10))
		h.Set("x-ratelimit-reset-requests", reset)
	}
	if w.LimitTokens > 0 {
		h.Set("x-ratelimit-limit-tokens", strconv.FormatInt(w.LimitTokens, 10))
		h.Set("x-ratelimit-remaining-tokens", strconv.FormatInt(w.RemainingTokens, 10))
		h.Set("x-ratelimit-reset-tokens", reset)
	}
}

// release gives the permit back with how its request ended: o and u as
// outcome says, attempts those that reached a backend or may have, and cut
// how many of them before the last were cut with no answer (each charged
// the reservation as uncertain usage). It runs after the client may have
// left, so it does not take the request's context.
//
// A permit written behind its request is released behind it too: after
// its acquisition, in a goroutine of its own, and settle waits for it.
func (p *permit) release(ctx context.Context, o store.Outcome, attempts, cut int, u *usage) {
	if p == nil {
		return
	}
	now := p.s.cfg.Tenants.Now()
	if !p.writtenBehind() {
		p.releaseNow(ctx, o, attempts, cut, u, now)
		return
	}
	ctx = context.WithoutCancel(ctx)
	b := p.s.permitsBehind
	b.mu.Lock()
	b.releasing[p] = struct{}{}
	b.mu.Unlock()
	go func() {
		defer func() {
			b.mu.Lock()
			delete(b.releasing, p)
			b.mu.Unlock()
			b.n.Add(-1)
			close(p.settled)
		}()
		if p.start != nil && p.start.Stop() {
			// The acquisition never began: the request's usage in one
			// write, and no permit.
			r := p.ended(p.a.Permit(), o, attempts, cut, u, now)
			rctx, cancel := context.WithTimeout(ctx, 10*time.Second)
			defer cancel()
			if err := p.s.cfg.Tenants.Store.RecordUsage(rctx, r); err != nil {
				b.failed.Store(true)
				p.s.log.Warn("quota store unreachable: a request's usage went unrecorded; acquiring first from now on", "tenant", p.a.Tenant, "err", err)
				p.s.quota.failOpen.Inc()
			}
			return
		}
		<-p.acquired
		if p.err != nil {
			// Once more, now that the request has ended: its usage is
			// recorded if the store answers again. Under an id of its
			// own: the store undoes the first acquisition if it was
			// written after all, by its id.
			p.a.PermitID = uuid.Must(uuid.NewV7()).String()
			actx, cancel := context.WithTimeout(ctx, 10*time.Second)
			p.p, p.err = p.s.cfg.Tenants.Store.Acquire(actx, p.a)
			cancel()
			if p.err != nil {
				p.s.log.Warn("quota store unreachable: a request served without a permit", "tenant", p.a.Tenant, "err", p.err)
				p.s.quota.failOpen.Inc()
				return
			}
		}
		p.releaseNow(ctx, o, attempts, cut, u, now)
	}()
}

// ended is how the request of permit pp ended, at now.
func (p *permit) ended(pp store.Permit, o store.Outcome, attempts, cut int, u *usage, now time.Time) store.Release {
	r := ending(o, attempts, u, p.price)
	r.EarlierUncertain = cut
	r.Permit, r.Now, r.Behind = pp, now, p.writtenBehind()
	return r
}

// ending is how a request ended, priced: the part of a permit's release
// that a carried charge records too.
func ending(o store.Outcome, attempts int, u *usage, price Price) store.Release {
	r := store.Release{Outcome: o, Attempts: attempts}
	if u != nil {
		r.PromptTokens, r.CompletionTokens = int64(u.PromptTokens), int64(u.CompletionTokens)
		r.Cost = price.micros(u.PromptTokens, u.CompletionTokens)
	}
	return r
}

// carriedCharge is a job attempt's charge that the runner carries with
// the attempt's own writes (store.Charge), its reservation filled in, when
// nothing can refuse the attempt (store.Acquisition.Unrefusable): no
// permit, and no write of the gateway's own. Nil when the attempt needs a
// permit, or when the tenant's limits cannot be read (acquireQuotaFor
// then decides, failing open or closed).
//
// Beside a permit written behind, the attempt's usage is in the ledger
// from its end only (a permit's reservation shows from its acquisition),
// and a crash cannot lose it: a sent attempt whose end is never recorded
// is charged its reservation as uncertain usage by the reap (or cancel)
// that takes its job, in that statement's transaction.
func (s *Server) carriedCharge(ctx context.Context, tenant string, prompt, maxOut int, price Price) *store.Charge {
	if s.cfg.Tenants.Store == nil {
		return nil
	}
	t, _, err := s.tenant(ctx, tenant)
	if err != nil {
		return nil
	}
	a := s.acquisition(tenant, t.Limits, prompt, maxOut, price)
	if !a.Unrefusable() {
		return nil
	}
	return &store.Charge{Tokens: a.Tokens, Cost: a.Cost}
}

// chargeEnded records in ch how its attempt's request ended.
func chargeEnded(ch *store.Charge, o store.Outcome, attempts int, u *usage, price Price) {
	r := ending(o, attempts, u, price)
	ch.Outcome, ch.Attempts = r.Outcome, r.Attempts
	ch.PromptTokens, ch.CompletionTokens, ch.UsageCost = r.PromptTokens, r.CompletionTokens, r.Cost
}

// releaseNow gives the acquired permit back, as release says, at now.
func (p *permit) releaseNow(ctx context.Context, o store.Outcome, attempts, cut int, u *usage, now time.Time) {
	r := p.ended(p.p, o, attempts, cut, u, now)
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	if err := p.s.cfg.Tenants.Store.Release(ctx, r); err != nil {
		// The permit's lease ends it; its tokens stay charged as uncertain.
		p.s.log.Warn("quota release failed", "tenant", p.p.Tenant, "permit", p.p.ID, "err", err)
	}
}

// outcome says how a proxied request ended for its permit: attempts is how
// many attempts reached a backend (or may have), res the last of them's
// result (nil if none did), reserved the usage to charge for a success
// without a report. With attempts 1 and an earlier attempt's res, it says
// whether that attempt's usage is unknown (store.Uncertain).
func outcome(attempts int, res *result, reserved usage) (store.Outcome, *usage) {
	var up *upstreamError
	switch {
	case attempts == 0 || res == nil:
		return store.NotSent, nil
	case res.usage != nil:
		// The backend reported what it used (a stream's usage comes
		// after its last token), whatever cut the exchange after that.
		return store.Reported, res.usage
	case res.err == nil:
		return store.Reported, &reserved // served without a report: charge what was reserved
	case !res.wrote && errors.As(res.err, &up):
		return store.Reported, &usage{} // the backend refused it
	}
	return store.Uncertain, nil // sent, and how much it used is unknown
}

// reserveJob holds room under the caller's pending-job limits for a job of
// tokens; the returned func ends the reservation once the job is stored.
func (s *Server) reserveJob(ctx context.Context, tokens int) (func(), error) {
	noop := func() {}
	if s.cfg.Tenants.Store == nil {
		return noop, nil
	}
	name := tenantOf(ctx)
	t, found, err := s.tenant(ctx, name)
	if err == nil && (!found || (t.Limits.MaxPendingJobs <= 0 && t.Limits.MaxPendingTokens <= 0)) {
		return noop, nil
	}
	id := uuid.Must(uuid.NewV7()).String()
	if err == nil {
		now := s.cfg.Tenants.Now()
		err = s.cfg.Tenants.Store.ReserveJob(ctx, id, name, int64(tokens), t.Limits, now, time.Minute)
	}
	var qe *store.QuotaError
	switch {
	case errors.Is(err, errTenantDeleted):
		return nil, err
	case err == nil:
		return func() {
			ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
			defer cancel()
			if err := s.cfg.Tenants.Store.EndJobReservation(ctx, id); err != nil {
				s.log.Warn("end job reservation", "tenant", name, "err", err) // its lease ends it
			}
		}, nil
	case errors.As(err, &qe):
		s.quota.rejected.WithLabelValues(qe.Limit).Inc()
		return nil, qe
	case ctx.Err() != nil:
		return nil, ctx.Err()
	case s.cfg.Tenants.FailOpen:
		s.log.Warn("quota store unreachable: accepting the job unchecked", "tenant", name, "err", err)
		s.quota.failOpen.Inc()
		return noop, nil
	}
	return nil, errQuotaUnavailable
}

// weight returns a tenant's share in the scheduler's fair queueing: its
// configured weight, or 1 without a tenant store, for a tenant the store
// does not know, or when the store does not answer.
func (s *Server) weight(ctx context.Context, tenant string) float64 {
	if s.limits == nil {
		return 1
	}
	t, found, err := s.tenant(ctx, tenant)
	if err != nil || !found || t.Weight < 1 {
		return 1
	}
	return float64(t.Weight)
}
