package scheduler

import (
	"cmp"
	"log/slog"
	"math"
	"slices"
	"sync"
	"time"

	"github.com/kvgate/kvgate/gpu"
)

// snapshotSource is where the scheduler reads backend state; *gpu.Pool
// satisfies it.
type snapshotSource interface {
	Snapshots() []*gpu.Snapshot
}

// Scheduler admits tickets to backends. Its methods are safe for
// concurrent use; Run keeps time-driven work going.
type Scheduler struct {
	src    snapshotSource
	policy Policy
	now    func() time.Time
	log    *slog.Logger
	m      *metrics

	mu       sync.Mutex
	queues   [numClasses][]*Ticket  // each in fair order (fair.go)
	fair     [numClasses]fairClocks // by model (fair.go)
	queued   int
	byModel  map[string]*[numClasses]int // queued tickets per model and class
	ledgers  map[string]*ledger
	prefixes map[string]*prefixIndex // per backend (prefix.go)
	hold     map[string]int          // backends kept for older tickets during a pump, with the KV each needs there (prefix.go)
	// starved are the backends serving several models kept for a ticket
	// of one of them that waited the starvation guard (starveLocked), as
	// the last pump found them: the next pump, until it finds them again,
	// and Acquire's fast path keep to them. starving is what the pump
	// under way finds.
	starved, starving map[string]starve
	recent            map[string]float64 // each backend's recent work, for placing new prefixes (prefix.go)
	cands             []candidate        // tryAdmit's backends that can admit, kept to spare an allocation a call
	closed            bool
	share             float64 // of each backend's budget: 1 alone, less beside other replicas
	admitted          float64 // EWMA of admissions per second, for Retry-After
	lastAdm           time.Time
	routing           []routeSig        // backends' routability at the last queue check (models.go)
	observe           func(AdmitRecord) // admittrace.go; nil: none
	// lastInteractive is when an interactive ticket last arrived, per
	// model: the batch share applies for BatchShareHold after it
	// (classshare.go).
	lastInteractive map[string]time.Time
	// tenantAdm counts admissions per class and tenant, for reports only
	// (tenantstats.go).
	tenantAdm map[tenantClass]*tenantAdmissions

	unroutable unroutableLog // has its own lock
}

// Options configure a Scheduler.
type Options struct {
	Policy Policy
	Logger *slog.Logger
	// Now is the clock; time.Now by default. Tests inject one.
	Now func() time.Time
}

// New returns a scheduler reading backend state from src.
func New(src snapshotSource, opts Options) (*Scheduler, error) {
	opts.Policy.defaults()
	if err := opts.Policy.Validate(); err != nil {
		return nil, err
	}
	if opts.Now == nil {
		opts.Now = time.Now
	}
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.DiscardHandler)
	}
	s := &Scheduler{
		src: src, policy: opts.Policy, now: opts.Now,
		log:      opts.Logger.With("component", "scheduler"),
		byModel:  map[string]*[numClasses]int{},
		ledgers:  map[string]*ledger{},
		prefixes: map[string]*prefixIndex{},
		recent:   map[string]float64{},
		share:    1,

		lastInteractive: map[string]time.Time{},
	}
	s.m = newMetrics(s)
	s.m.share.Set(1)
	return s, nil
}

// SetShare sets the part of every backend's KV budget and sequences this
// replica may fill, in [0, 1]: 1 when it is alone, 1/n beside n-1 others
// (replicas.go). Requests already admitted keep running; a smaller share
// only holds new ones back until enough finish.
func (s *Scheduler) SetShare(share float64) {
	share = min(max(share, 0), 1)
	s.mu.Lock()
	grew := share > s.share
	s.share = share
	if grew && s.queued > 0 {
		s.pumpLocked(s.src.Snapshots(), s.now())
	}
	s.mu.Unlock()
	s.m.share.Set(share)
}

// Share returns the part of every backend's budget this replica may fill.
func (s *Scheduler) Share() float64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.share
}

// Policy returns the effective policy.
func (s *Scheduler) Policy() Policy { return s.policy }

// passLoads are the loads of one pass's backends (loadOf), each
// assembled once in the pass and kept until the pass admits a ticket to
// that backend (tryAdmit drops both of its loads then); the plain form
// is dropped too when the exact one is assembled, which may re-estimate
// the ledger's prompts. Nothing else changes a ledger under the pass's
// lock, and now is the pass's. A saturated fleet's pass checks tens of
// tickets a release against every backend: assembling a plain load, a
// walk over the grants since the backend's last scrape, was a quarter of
// those checks' time. shut holds the backends that refused a ticket for
// a reason of their load alone (refusesAll): they refuse every other
// ticket for the rest of the pass.
type passLoads struct {
	plain, exact map[string]*load
	shut         map[string]bool
}

func newPassLoads() *passLoads {
	return &passLoads{plain: map[string]*load{}, exact: map[string]*load{}, shut: map[string]bool{}}
}

// shutFor reports whether every backend serving model refuses all for the
// rest of the pass (false when none serves it).
func (p *passLoads) shutFor(model string, snaps []*gpu.Snapshot) bool {
	serving := false
	for _, sn := range snaps {
		if _, ok := sn.Serves(model); ok {
			if !p.shut[sn.Name] {
				return false
			}
			serving = true
		}
	}
	return serving
}

// load is loadOf through p (nil: no pass, assembled each time). The
// caller may set the per-ticket fields (paced, class.capped, holdNeed)
// of what it gets: a kept load is shared by the pass's checks, which all
// set them before they decide.
func (s *Scheduler) load(p *passLoads, sn *gpu.Snapshot, l *ledger, now time.Time, exact bool) *load {
	if p == nil {
		ld := s.loadOf(sn, l, now, exact)
		return &ld
	}
	kept := p.plain
	if exact {
		kept = p.exact
	}
	if ld := kept[sn.Name]; ld != nil {
		return ld
	}
	ld := s.loadOf(sn, l, now, exact)
	kept[sn.Name] = &ld
	if exact {
		delete(p.plain, sn.Name)
	}
	return &ld
}

func (s *Scheduler) tryAdmit(t *Ticket, snaps []*gpu.Snapshot, now time.Time, paced bool, pass *passLoads) *Grant {
	var (
		best     *gpu.Snapshot
		bestHit  float64
		bestHeld float64
		bestHead float64
		bestGap  float64
		bestPin  int
		// bestComputed is how many of bestPin's chunks the backend has
		// computed: the rest it allocates again for this request.
		bestComputed int
		bestScore    = math.Inf(-1)
		bestBusy     busyBest // the best hit+held on a backend only busy for now
		// warmest is the most hit+held of t's prompt on any backend that
		// serves it and is only busy or can admit it; below spillHit the
		// prefix is new to the fleet, and placed by recent work, not by
		// score (placeScore).
		warmest float64
		cands   = s.cands[:0] // reused across calls (s.mu)
	)
	// A prompt re-estimated since it was hashed rescales its chunks.
	t.Prefix.fit(t.PromptTokens)
	for _, sn := range snaps {
		if slices.Contains(t.Exclude, sn.Name) {
			continue
		}
		if _, ok := sn.Serves(t.Model); !ok {
			continue
		}
		l := s.ledgers[sn.Name]
		// Only the chunks requests in flight there hold are shared at
		// once; the rest of the prompt takes new KV (prefix.go). A
		// backend that caches no prefixes shares none.
		pf := t.Prefix
		if sn.Metrics.NoPrefixCaching {
			pf = nil
		}
		pinned := l.pinnedLeading(pf)
		computed := pinned
		if pinned > 0 {
			computed = l.computedLeading(pf, pinned, s.prefilled(sn, now))
		}
		prompt := t.PromptTokens - pf.tokens(computed)
		capped := t.Class == Batch && s.interactiveAbout(sn, now)
		// An older ticket may wait for this backend's next room
		// (Scheduler.hold): decide lets t take room only where it does not
		// delay that one (delaysHolder).
		holdNeed := s.hold[sn.Name]
		if st, ok := s.starvedFor(sn.Name, t.Class); ok && holdNeed == 0 && st.t != t {
			holdNeed = st.need
		}
		ld := s.load(pass, sn, l, now, false)
		ld.paced, ld.class.capped, ld.holdNeed = paced, capped, holdNeed
		v := decide(ld, prompt, t.MaxTokens, &s.policy)
		if v.needExact {
			ex := s.load(pass, sn, l, now, true)
			ex.paced, ex.class.capped, ex.holdNeed = paced, capped, holdNeed
			v = decide(ex, prompt, t.MaxTokens, &s.policy)
		}
		if !v.ok {
			if pass != nil && refusesAll(v.reason) {
				pass.shut[sn.Name] = true
			}
			s.m.blocked(sn.Name, v.reason)
			s.noteRefusal(t, v.reason)
			if busy(v.reason) && t.Prefix != nil {
				s.noteBusy(sn, t, pinned, v.reason, prompt+t.MaxTokens, &bestBusy)
			}
			continue
		}
		hit, held := s.expectedHit(sn, t, pinned), t.heldShare(pinned)
		warmest = max(warmest, hit+held)
		cands = append(cands, candidate{sn: sn, hit: hit, held: held, headroom: v.headroom, gap: v.gap, pinned: pinned, computed: computed})
	}
	defer func() { s.cands = cands[:0] }()
	warmest = max(warmest, bestBusy.value)
	newPrefix := t.Prefix != nil && warmest < spillHit
	var shares map[string]float64
	if newPrefix {
		shares = s.recentShares()
	}
	for _, c := range cands {
		score := routeScore(c.hit, c.held, c.headroom, s.policy.KVTarget)
		if newPrefix {
			score = placeScore(shares[c.sn.Name], c.headroom, s.policy.KVTarget)
		}
		if score > bestScore {
			best, bestScore, bestHit, bestHeld, bestHead, bestGap, bestPin, bestComputed = c.sn, score, c.hit, c.held, c.headroom, c.gap, c.pinned, c.computed
		}
	}
	// Waiting for the backend that holds the prefix, rather than for
	// room anywhere: no backend can take it, or only one that would
	// have to copy the prefix with little room left after it.
	t.waitsOn, t.waitsNeed, t.waitsPassed = "", 0, false
	lost := bestBusy.value - bestHit - bestHeld
	if bestBusy.value >= spillHit && (best == nil || !spills(t.Prefix != nil, lost, lost*float64(t.PromptTokens), bestHead, bestBusy.transient, now.Sub(t.enqueued) >= s.policy.StarvationGuard/2)) {
		t.waitsOn, t.waitsNeed, t.waitsPassed = bestBusy.where, bestBusy.need, best != nil
	}
	if best == nil || t.waitsOn != "" {
		if t.waitsOn != "" {
			s.noteRefusal(t, "waits_on_prefix")
		}
		return nil
	}
	s.observeAdmit(t, snaps, best.Name, bestHit, now)
	s.noteWork(best.Name, float64(t.PromptTokens)*(1-bestHit)+float64(t.MaxTokens))
	if pass != nil {
		delete(pass.plain, best.Name)
		delete(pass.exact, best.Name)
	}
	l := s.ledgers[best.Name]
	if l == nil {
		l = &ledger{lastAdmitStep: -1, lastPassStep: -1}
		s.ledgers[best.Name] = l
	}
	g := &Grant{
		Backend: best.Name, URL: best.URL, Waited: now.Sub(t.enqueued),
		s: s, l: l, estimate: t.PromptEstimate, prompt: t.PromptTokens, maxOut: t.MaxTokens, admittedAt: now,
		class: t.Class,
	}
	if t.Prefix != nil && !best.Metrics.NoPrefixCaching {
		// Chunks pinned there but not computed yet are allocated again
		// for this request: its own, not shared.
		g.prefix, g.sharedPart = t.Prefix, t.Prefix.tokens(len(t.Prefix.Hashes)-(bestPin-bestComputed))
		var resized int
		g.created, resized = l.pin(t.Prefix, g)
		l.created += g.created
		l.reserved += resized
		// The prompt tokens the backend should find cached skip their KV
		// allocation; the rest turn its cache over.
		cached := bestHit * float64(t.PromptTokens)
		s.prefixSent(best.Name, t.Prefix.Hashes, float64(t.PromptTokens)-max(cached, float64(t.Prefix.tokens(bestPin))), best.CapacityTokens, l.isPinned)
		s.prefixes[best.Name].predicted(cached, float64(t.PromptTokens))
	}
	g.generated.Store(-1)
	g.admittedStep = -1
	g.admittedGen = best.Metrics.Generation
	if st, ok := best.StepsAt(now); ok {
		g.admittedStep = st
	}
	l.lastAdmitStep = pacingMark(l.lastAdmitStep, g.admittedStep, bestGap, l.lastPassStep)
	l.grants = append(l.grants, g)
	l.reserved += g.own() + g.maxOut + g.created
	l.sumOut += t.MaxTokens
	if g.class == Batch {
		l.batchInflight++
	}
	// Admissions per second, smoothed over about a second.
	if dt := now.Sub(s.lastAdm).Seconds(); dt > 0 {
		alpha := 1 - math.Exp(-dt)
		s.admitted = (1-alpha)*s.admitted + alpha/dt
	}
	s.lastAdm = now
	s.noteAdmission(t, now) // a report's count, not a decision's input (tenantstats.go)
	return g
}

// loadOf assembles what admission knows of one backend. The exact form
// walks the ledger to project each flight's progress.
func (s *Scheduler) loadOf(sn *gpu.Snapshot, l *ledger, now time.Time, exact bool) load {
	m := sn.Metrics
	ld := load{
		preempting:      sn.PreemptionRate > 0,
		routable:        sn.Routable(),
		cooling:         sn.Cooling(now),
		stale:           sn.Stale(now) && !lateView(sn, now),
		late:            lateView(sn, now),
		lateness:        lateness(sn, now),
		degraded:        sn.GPUHealth == gpu.Degraded,
		capacity:        sn.CapacityTokens,
		maxNumSeqs:      sn.MaxNumSeqs,
		share:           s.share,
		measuredUsed:    int(m.KVUsage * float64(sn.CapacityTokens)),
		measuredRunning: int(m.Running),
		measuredWaiting: int(m.Waiting),
		blockSize:       m.BlockSize,
		exact:           exact,
		stepsSinceAdmit: -1,
	}
	if l == nil {
		return ld
	}
	ld.reserved, ld.inflight = l.reserved, len(l.grants)
	ld.class.inflight = l.batchInflight
	stepsNow, hasSteps := sn.StepsAt(now)
	if !hasSteps {
		stepsNow = -1
	} else if l.lastAdmitStep >= 0 {
		ld.stepsSinceAdmit = max(0, stepsNow-l.lastAdmitStep)
	}
	for i := len(l.grants) - 1; i >= 0 && l.grants[i].admittedAt.After(sn.ScrapedAt); i-- {
		ld.newSinceScrape++
		if g := l.grants[i]; !scheduledSince(g, stepsNow) {
			ld.unscheduled++
		}
	}
	if n := len(l.grants); n > 0 {
		// Pacing sees a request's own KV: shared chunks whose bringers
		// ended are a base load (sharedBase), not any request's.
		ld.sharedBase = max(0, l.shared-l.created)
		ld.meanOut, ld.meanFinal = float64(l.sumOut)/float64(n), float64(l.reserved-ld.sharedBase)/float64(n)
	}
	if !exact {
		return ld
	}
	ld.flights = make([]flight, len(l.grants))
	sharedSince := 0 // shared tokens pinned by grants admitted since the scrape
	for i, g := range l.grants {
		if g.estimate != nil {
			if p := g.estimate(); p != g.prompt {
				l.reserved += p - g.prompt
				g.prompt = p
			}
		}
		lo, hi := g.progress(now, stepsNow, sn.DecodeRate, m.Generation, s.policy.ProgressFactor)
		ld.flights[i] = flight{held: max(0, g.own()+hi), remaining: g.maxOut - lo}
		if i < len(l.grants)-ld.newSinceScrape {
			// The low end: what the measurement surely includes, so that
			// the load kvgate did not send is not underestimated.
			ld.heldBeforeScrape += max(0, g.own()+lo)
		} else {
			sharedSince += g.created
		}
	}
	// Shared chunks count once, held until their last holder ends; those
	// pinned before the scrape are in the measurement.
	ld.shared = l.shared
	ld.heldBeforeScrape += max(0, l.shared-sharedSince)
	sortFlights(ld.flights)
	ld.reserved = l.reserved // prompts may have been re-estimated
	// Releases before the page came may be out of the measurement (the
	// backend wrote it at some moment of the fetch); after it, still in
	// it, as kvgate's own. Erring so, the load kvgate did not send is
	// never understated.
	i, _ := slices.BinarySearchFunc(l.released, cmp.Or(sn.ScrapeDone, sn.ScrapedAt), func(r release, t time.Time) int {
		if r.at.After(t) {
			return 1
		}
		return -1
	})
	l.released = l.released[i:]
	for _, r := range l.released {
		ld.heldBeforeScrape += r.tokens
	}
	return ld
}
