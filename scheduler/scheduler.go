package scheduler

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvgate/kvgate/gpu"
)

// Class is a ticket's priority class; lower runs first.
type Class int

// The classes: interactive requests hold a connection open; batch work is
// durable and fills what interactive traffic leaves.
const (
	Interactive Class = iota
	Batch
	numClasses
)

func (c Class) String() string {
	if c == Interactive {
		return "interactive"
	}
	return "batch"
}

// Policy sets the admission thresholds. Zero values take the defaults in
// brackets.
type Policy struct {
	// KVTarget is the share of a backend's KV capacity that admitted work
	// may be predicted to fill [0.95]. The prediction counts whole KV
	// blocks, as vLLM allocates them, so the target need only cover
	// what the prediction cannot see: prompt estimates and progress.
	KVTarget float64 `yaml:"kv_target"`
	// DegradedFactor scales KVTarget for a backend whose GPUs are degraded
	// (throttling, running hot) [0.7].
	DegradedFactor float64 `yaml:"degraded_factor"`
	// MaxBackendWaiting is how many requests may wait in vLLM's own queue
	// before kvgate stops sending more [2].
	MaxBackendWaiting int `yaml:"max_backend_waiting"`
	// MaxQueue caps the tickets waiting in kvgate, per class; beyond it,
	// 503 [4096].
	MaxQueue int `yaml:"max_queue"`
	// MaxQueueWait is how long a ticket may wait when it has no deadline
	// of its own [30s].
	MaxQueueWait time.Duration `yaml:"max_queue_wait"`
	// StarvationGuard is how long the oldest ticket of a model may be
	// passed over by smaller ones before it blocks them [2s].
	StarvationGuard time.Duration `yaml:"starvation_guard"`
	// ProgressFactor sets how wide admission brackets the decode progress
	// of a request that does not report it (non-streaming): from factor to
	// 2-factor times the estimate, since a request may wait in vLLM's
	// queue before its first step [0.95].
	ProgressFactor float64 `yaml:"progress_factor"`
}

func (p *Policy) defaults() {
	p.KVTarget = cmp.Or(p.KVTarget, 0.95)
	p.DegradedFactor = cmp.Or(p.DegradedFactor, 0.7)
	p.MaxBackendWaiting = cmp.Or(p.MaxBackendWaiting, 2)
	p.MaxQueue = cmp.Or(p.MaxQueue, 4096)
	p.MaxQueueWait = cmp.Or(p.MaxQueueWait, 30*time.Second)
	p.StarvationGuard = cmp.Or(p.StarvationGuard, 2*time.Second)
	p.ProgressFactor = cmp.Or(p.ProgressFactor, 0.95)
}

// Validate reports a policy that cannot work.
func (p Policy) Validate() error {
	switch {
	case p.KVTarget < 0 || p.KVTarget > 1:
		return fmt.Errorf("kv_target %g must be in (0, 1]", p.KVTarget)
	case p.DegradedFactor < 0 || p.DegradedFactor > 1:
		return fmt.Errorf("degraded_factor %g must be in (0, 1]", p.DegradedFactor)
	case p.ProgressFactor < 0 || p.ProgressFactor > 1 || (p.ProgressFactor != 0 && p.ProgressFactor < 0.5):
		return fmt.Errorf("progress_factor %g must be in [0.5, 1]", p.ProgressFactor)
	case p.MaxQueue < 0 || p.MaxBackendWaiting < 0 || p.MaxQueueWait < 0:
		return errors.New("max_queue, max_backend_waiting and max_queue_wait must not be negative")
	}
	return nil
}

// Ticket is a request waiting for capacity.
type Ticket struct {
	Tenant string
	// Weight is the tenant's share within its class, relative to other
	// tenants' (see fair.go); 0 means 1.
	Weight       float64
	Class        Class
	Model        string
	PromptTokens int
	MaxTokens    int // output tokens to reserve
	// Deadline bounds the wait; zero means the policy's MaxQueueWait.
	Deadline time.Time
	// Exclude lists backends not to use, such as one that just failed.
	Exclude []string
	// PromptEstimate, when set, re-counts the prompt: PromptTokens is an
	// estimate that improves as backends report usage, and a ticket that
	// waits, or a request that runs, should not keep a cold guess.
	PromptEstimate func() int

	enqueued time.Time
	vstart   float64 // fair-queueing tags
	vfinish  float64
	done     chan struct{}
	grant    *Grant
	state    ticketState
}

type ticketState uint8

const (
	ticketNew ticketState = iota
	ticketQueued
	ticketGranted
	ticketGone // cancelled or expired
)

// Need is the ticket's reservation in KV tokens.
func (t *Ticket) Need() int { return t.PromptTokens + t.MaxTokens }

// RejectedError is returned when kvgate cannot take a ticket now: its queue
// is full, or the ticket's wait ran out. RetryAfter is a hint for the
// client.
type RejectedError struct {
	Reason     string // "queue_full", "queue_timeout", "shutting_down"
	RetryAfter time.Duration
}

func (e *RejectedError) Error() string {
	return fmt.Sprintf("no capacity: %s (retry after %s)", e.Reason, e.RetryAfter)
}

// TooLargeError is returned for a ticket that no backend serving its model
// could ever hold: waiting would be forever.
type TooLargeError struct {
	Need, Capacity int // tokens; Capacity is the largest budget on offer
}

func (e *TooLargeError) Error() string {
	return fmt.Sprintf("request needs %d KV tokens (prompt plus max_tokens), more than any backend can hold (%d)", e.Need, e.Capacity)
}

// ErrNoBackend is returned for a model that no backend serves.
var ErrNoBackend = errors.New("no backend serves the model")

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
	queues   [numClasses][]*Ticket // each in fair order (fair.go)
	fair     [numClasses]fairClock
	queued   int
	byModel  map[string]*[numClasses]int // queued tickets per model and class
	ledgers  map[string]*ledger
	closed   bool
	share    float64 // of each backend's budget: 1 alone, less beside other replicas
	admitted float64 // EWMA of admissions per second, for Retry-After
	lastAdm  time.Time
}

// ledger is kvgate's record of what it has admitted to one backend.
type ledger struct {
	grants   []*Grant // in admission order
	reserved int      // Σ prompt + maxOut
	sumOut   int      // Σ maxOut
	// lastAdmitStep is the backend's engine step count at kvgate's last
	// admission to it, for pacing; < 0 when unknown.
	lastAdmitStep float64
	// released are recent releases: the backend's last scrape may still
	// show their KV, which is kvgate's own and not foreign load.
	released []release
}

type release struct {
	at     time.Time
	tokens int
}

// maxReleases bounds the releases a ledger remembers between two scrapes of
// its backend, should scrapes stop.
const maxReleases = 4096

// Grant is an admitted ticket: the backend to call and the reservation to
// release when the call ends.
type Grant struct {
	Backend string
	URL     string
	Waited  time.Duration // time spent queued

	s          *Scheduler
	l          *ledger
	estimate   func() int // re-counts prompt; nil when exact
	prompt     int
	maxOut     int
	admittedAt time.Time
	// admittedStep is the backend's engine step count at admission, when
	// the backend publishes one (else -1).
	admittedStep float64
	generated    atomic.Int64 // -1 until reported
	released     bool         // guarded by s.mu
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
		log:     opts.Logger.With("component", "scheduler"),
		byModel: map[string]*[numClasses]int{},
		ledgers: map[string]*ledger{},
		share:   1,
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

// Acquire waits until t is admitted to a backend and returns the grant,
// which the caller must Release. It returns *TooLargeError at once for a
// ticket no backend could hold, ErrNoBackend for a model nobody serves,
// *RejectedError when the queue is full or the deadline passes, and ctx's
// error when the caller gives up (its ticket leaves the queue).
func (s *Scheduler) Acquire(ctx context.Context, t *Ticket) (*Grant, error) {
	now := s.now()
	t.enqueued = now
	deadline := t.Deadline
	if deadline.IsZero() {
		deadline = now.Add(s.policy.MaxQueueWait)
	}
	snaps := s.src.Snapshots()

	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		s.m.outcome(t.Class, outcomeShutdown)
		return nil, &RejectedError{Reason: "shutting_down", RetryAfter: time.Second}
	}
	if err := s.checkFits(t, snaps); err != nil {
		s.mu.Unlock()
		if errors.Is(err, ErrNoBackend) {
			s.m.outcome(t.Class, outcomeNoBackend)
		} else {
			s.m.outcome(t.Class, outcomeTooLarge)
		}
		return nil, err
	}
	counts := s.byModel[t.Model]
	ahead := 0
	if counts != nil {
		for c := Class(0); c <= t.Class; c++ {
			ahead += counts[c]
		}
	}
	if ahead == 0 {
		if g := s.tryAdmit(t, snaps, now, false, nil); g != nil {
			s.mu.Unlock()
			s.m.outcome(t.Class, outcomeAdmitted)
			s.m.waited(t.Class, 0)
			return g, nil
		}
	}
	// Per class: a batch backlog never fills interactive traffic's queue.
	if len(s.queues[t.Class]) >= s.policy.MaxQueue {
		retry := s.retryAfterLocked()
		s.mu.Unlock()
		s.m.outcome(t.Class, outcomeQueueFull)
		return nil, &RejectedError{Reason: "queue_full", RetryAfter: retry}
	}
	s.enqueueLocked(t)
	s.mu.Unlock()

	timer := time.NewTimer(deadline.Sub(now))
	defer timer.Stop()
	select {
	case <-t.done:
	case <-ctx.Done():
	case <-timer.C:
	}
	s.mu.Lock()
	if t.state == ticketGranted {
		s.mu.Unlock()
		if ctx.Err() != nil {
			// Granted as the caller left: hand the capacity back.
			t.grant.Release()
			s.m.outcome(t.Class, outcomeCancelled)
			return nil, ctx.Err()
		}
		s.m.outcome(t.Class, outcomeQueuedAdmitted)
		s.m.waited(t.Class, t.grant.Waited)
		return t.grant, nil
	}
	closed := s.closed
	s.removeLocked(t)
	retry := s.retryAfterLocked()
	s.mu.Unlock()
	switch {
	case ctx.Err() != nil:
		s.m.outcome(t.Class, outcomeCancelled)
		return nil, ctx.Err()
	case closed:
		s.m.outcome(t.Class, outcomeShutdown)
		return nil, &RejectedError{Reason: "shutting_down", RetryAfter: time.Second}
	}
	s.m.outcome(t.Class, outcomeTimeout)
	return nil, &RejectedError{Reason: "queue_timeout", RetryAfter: retry}
}

// checkFits fails a ticket that needs more than any backend serving its
// model could ever give it, or whose model nobody serves.
func (s *Scheduler) checkFits(t *Ticket, snaps []*gpu.Snapshot) error {
	serving, known, largest := false, false, 0
	for _, sn := range snaps {
		if _, ok := sn.Serves(t.Model); !ok {
			continue
		}
		serving = true
		if sn.CapacityTokens > 0 {
			known = true
			largest = max(largest, int(s.policy.KVTarget*float64(sn.CapacityTokens)))
		}
	}
	switch {
	case !serving:
		return ErrNoBackend
	case known && t.Need() > largest:
		return &TooLargeError{Need: t.Need(), Capacity: largest}
	}
	return nil
}

func (s *Scheduler) enqueueLocked(t *Ticket) {
	t.done = make(chan struct{})
	t.state = ticketQueued
	s.fair[t.Class].tag(t)
	s.queues[t.Class] = insertFair(s.queues[t.Class], t)
	s.queued++
	c := s.byModel[t.Model]
	if c == nil {
		c = new([numClasses]int)
		s.byModel[t.Model] = c
	}
	c[t.Class]++
}

// removeLocked takes a queued ticket out (cancelled or expired).
func (s *Scheduler) removeLocked(t *Ticket) {
	if t.state != ticketQueued {
		return
	}
	t.state = ticketGone
	s.dequeuedLocked(t)
	s.queues[t.Class] = slices.DeleteFunc(s.queues[t.Class], func(x *Ticket) bool { return x == t })
	s.fair[t.Class].removed(t, s.queues[t.Class])
}

func (s *Scheduler) dequeuedLocked(t *Ticket) {
	s.queued--
	if c := s.byModel[t.Model]; c != nil {
		c[t.Class]--
	}
}

// retryAfterLocked estimates when capacity for a new ticket may exist: the
// queue ahead divided by the recent admission rate, between 1 s and 60 s.
func (s *Scheduler) retryAfterLocked() time.Duration {
	rate := math.Max(s.admitted, 1)
	sec := math.Ceil(float64(s.queued) / rate)
	return time.Duration(min(max(sec, 1), 60)) * time.Second
}

// tryAdmit grants t on the backend with the most headroom that can take
// it, or returns nil. paced says t comes from a backlog. exact, when not
// nil, keeps each backend's exact load across the tickets of one pass (the
// costly part of a decision); an admission drops its backend's.
func (s *Scheduler) tryAdmit(t *Ticket, snaps []*gpu.Snapshot, now time.Time, paced bool, exact map[string]*load) *Grant {
	var best *gpu.Snapshot
	bestHead := math.Inf(-1)
	for _, sn := range snaps {
		if slices.Contains(t.Exclude, sn.Name) {
			continue
		}
		if _, ok := sn.Serves(t.Model); !ok {
			continue
		}
		l := s.ledgers[sn.Name]
		ld := s.loadOf(sn, l, now, false)
		ld.paced = paced
		v := decide(&ld, t.PromptTokens, t.MaxTokens, &s.policy)
		if v.needExact {
			ex := exact[sn.Name]
			if ex == nil {
				e := s.loadOf(sn, l, now, true)
				ex = &e
				if exact != nil {
					exact[sn.Name] = ex
				}
			}
			ex.paced = paced
			v = decide(ex, t.PromptTokens, t.MaxTokens, &s.policy)
		}
		if !v.ok {
			s.m.blocked(sn.Name, v.reason)
			continue
		}
		if v.headroom > bestHead {
			best, bestHead = sn, v.headroom
		}
	}
	if best == nil {
		return nil
	}
	delete(exact, best.Name)
	l := s.ledgers[best.Name]
	if l == nil {
		l = &ledger{lastAdmitStep: -1}
		s.ledgers[best.Name] = l
	}
	g := &Grant{
		Backend: best.Name, URL: best.URL, Waited: now.Sub(t.enqueued),
		s: s, l: l, estimate: t.PromptEstimate, prompt: t.PromptTokens, maxOut: t.MaxTokens, admittedAt: now,
	}
	g.generated.Store(-1)
	g.admittedStep = -1
	if st, ok := best.StepsAt(now); ok {
		g.admittedStep = st
	}
	l.lastAdmitStep = g.admittedStep
	l.grants = append(l.grants, g)
	l.reserved += t.Need()
	l.sumOut += t.MaxTokens
	// Admissions per second, smoothed over about a second.
	if dt := now.Sub(s.lastAdm).Seconds(); dt > 0 {
		alpha := 1 - math.Exp(-dt)
		s.admitted = (1-alpha)*s.admitted + alpha/dt
	}
	s.lastAdm = now
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
		stale:           sn.Stale(now),
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
	for i := len(l.grants) - 1; i >= 0 && l.grants[i].admittedAt.After(sn.ScrapedAt); i-- {
		ld.newSinceScrape++
	}
	stepsNow, hasSteps := sn.StepsAt(now)
	if !hasSteps {
		stepsNow = -1
	} else if l.lastAdmitStep >= 0 {
		ld.stepsSinceAdmit = max(0, stepsNow-l.lastAdmitStep)
	}
	if n := len(l.grants); n > 0 {
		ld.meanOut, ld.meanFinal = float64(l.sumOut)/float64(n), float64(l.reserved)/float64(n)
	}
	if !exact {
		return ld
	}
	ld.flights = make([]flight, len(l.grants))
	for i, g := range l.grants {
		if g.estimate != nil {
			if p := g.estimate(); p != g.prompt {
				l.reserved += p - g.prompt
				g.prompt = p
			}
		}
		lo, hi := g.progress(now, stepsNow, sn.DecodeRate, s.policy.ProgressFactor)
		ld.flights[i] = flight{held: g.prompt + hi, remaining: g.maxOut - lo}
		if i < len(l.grants)-ld.newSinceScrape {
			// The low end: what the measurement surely includes, so that
			// the load kvgate did not send is not underestimated.
			ld.heldBeforeScrape += g.prompt + lo
		}
	}
	sortFlights(ld.flights)
	ld.reserved = l.reserved // prompts may have been re-estimated
	// Releases before the scrape are out of the measurement; after it,
	// still in it, as kvgate's own.
	i, _ := slices.BinarySearchFunc(l.released, sn.ScrapedAt, func(r release, t time.Time) int {
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

// progress brackets the output a grant has produced: lo and hi tokens.
// A stream reports it exactly. Otherwise, with the backend's engine step
// counter, a sequence has made at most one token per step since its
// admission (hi), and at least ProgressFactor of that less the prefill
// step (lo), since it may have waited in vLLM's queue. Without a step
// counter the estimate is the time since admission times the per-sequence
// decode rate, bracketed twice as wide on both sides. Admission projects a
// flight from the high end (what it may hold now) to the low end (how long
// it may still grow), which is safe both ways.
func (g *Grant) progress(now time.Time, stepsNow, decodeRate, factor float64) (lo, hi int) {
	if n := g.generated.Load(); n >= 0 {
		n := min(int(n), g.maxOut)
		return n, min(n+1, g.maxOut) // a token may be in the making
	}
	var loF, hiF float64
	if stepsNow >= 0 && g.admittedStep >= 0 {
		steps := max(0, stepsNow-g.admittedStep)
		loF, hiF = factor*(steps-1), steps+1
	} else {
		est := decodeRate * now.Sub(g.admittedAt).Seconds()
		wide := 2 * (1 - factor)
		loF, hiF = (1-wide)*est, (1+wide)*est+1
	}
	const eps = 1e-9 // so that 0.9×100 is 90, not 89
	lo = max(0, min(int(loF+eps), g.maxOut-1))
	hi = max(lo, min(int(math.Ceil(hiF-eps)), g.maxOut))
	return lo, hi
}

// Progress reports how many output tokens the request has produced so
// far, as a streaming response counts them. It makes admission exact.
func (g *Grant) Progress(generated int) { g.generated.Store(int64(generated)) }

// Release returns the grant's reservation and lets waiting tickets in.
// It is idempotent.
func (g *Grant) Release() {
	s := g.s
	s.mu.Lock()
	if g.released {
		s.mu.Unlock()
		return
	}
	g.released = true
	l := g.l
	l.grants = slices.DeleteFunc(l.grants, func(x *Grant) bool { return x == g })
	l.reserved -= g.prompt + g.maxOut
	l.sumOut -= g.maxOut
	now := s.now()
	// What the backend's last scrape surely showed of it: its prompt and
	// the output a stream reported, not its whole budget, which would
	// hide other load.
	held := g.prompt
	if n := g.generated.Load(); n >= 0 {
		held += min(int(n), g.maxOut)
	}
	// In time order; loadOf drops those the next scrape no longer shows.
	if len(l.released) >= maxReleases {
		l.released = append(l.released[:0], l.released[len(l.released)/2:]...)
	}
	l.released = append(l.released, release{at: now, tokens: held})
	if s.queued > 0 {
		s.pumpLocked(s.src.Snapshots(), now)
	}
	s.mu.Unlock()
}

// Wake re-evaluates the queue, after backend state changed. Cheap when the
// queue is empty.
func (s *Scheduler) Wake() {
	s.mu.Lock()
	if s.queued > 0 {
		s.pumpLocked(s.src.Snapshots(), s.now())
	}
	s.mu.Unlock()
}

// maxScanMisses bounds the work of one pump over a long queue: after this
// many tickets in a row fit nowhere, the rest wait for the next event.
const maxScanMisses = 32

// pumpLocked admits queued tickets in priority order, each class in its
// weighted fair order, while they fit. A
// ticket that does not fit is passed over by later ones of its model until
// it has waited StarvationGuard; then it blocks them.
func (s *Scheduler) pumpLocked(snaps []*gpu.Snapshot, now time.Time) {
	if s.queued == 0 || s.closed {
		return
	}
	var blocked map[string]bool
	exact := map[string]*load{}
	misses := 0
	for c := range s.queues {
		q := s.queues[c]
		kept := q[:0]
		for i, t := range q {
			if misses >= maxScanMisses {
				kept = append(kept, q[i:]...)
				break
			}
			if blocked[t.Model] {
				kept = append(kept, t)
				continue
			}
			if t.PromptEstimate != nil {
				t.PromptTokens = t.PromptEstimate()
			}
			if g := s.tryAdmit(t, snaps, now, true, exact); g != nil {
				t.grant, t.state = g, ticketGranted
				s.dequeuedLocked(t)
				s.fair[c].admitted(t, s.queued)
				close(t.done)
				misses = 0
				continue
			}
			misses++
			kept = append(kept, t)
			if now.Sub(t.enqueued) >= s.policy.StarvationGuard {
				if blocked == nil {
					blocked = map[string]bool{}
				}
				blocked[t.Model] = true
			}
		}
		clear(q[len(kept):])
		s.queues[c] = kept
	}
}

// tick is how often Run re-evaluates the queue: estimated decode progress
// and metric staleness change with time alone.
const tick = 50 * time.Millisecond

// Run re-evaluates the queue on a timer until ctx is done, then rejects
// whatever still waits. It returns ctx's error.
func (s *Scheduler) Run(ctx context.Context) error {
	t := time.NewTicker(tick)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			s.mu.Lock()
			s.closed = true
			for c := range s.queues {
				for _, tk := range s.queues[c] {
					tk.state = ticketGone // its Acquire rejects it
					s.dequeuedLocked(tk)
					close(tk.done)
				}
				s.queues[c] = nil
			}
			s.mu.Unlock()
			return ctx.Err()
		case <-t.C:
			s.Wake()
		}
	}
}

// BackendLoad is what kvgate has admitted to one backend, for reports.
type BackendLoad struct {
	Backend  string
	Inflight int
	Reserved int // KV tokens, prompt plus max output of each in-flight request
}

// Loads returns the ledger of every backend that has had work.
func (s *Scheduler) Loads() []BackendLoad {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]BackendLoad, 0, len(s.ledgers))
	for name, l := range s.ledgers {
		out = append(out, BackendLoad{Backend: name, Inflight: len(l.grants), Reserved: l.reserved})
	}
	slices.SortFunc(out, func(a, b BackendLoad) int { return cmp.Compare(a.Backend, b.Backend) })
	return out
}

// Queued returns the number of tickets waiting, by class.
func (s *Scheduler) Queued() [numClasses]int {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out [numClasses]int
	for c := range s.queues {
		out[c] = len(s.queues[c])
	}
	return out
}
