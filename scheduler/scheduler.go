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
	// may be predicted to fill [0.9].
	KVTarget float64 `yaml:"kv_target"`
	// DegradedFactor scales KVTarget for a backend whose GPUs are degraded
	// (throttling, running hot) [0.7].
	DegradedFactor float64 `yaml:"degraded_factor"`
	// MaxBackendWaiting is how many requests may wait in vLLM's own queue
	// before kvgate stops sending more [2].
	MaxBackendWaiting int `yaml:"max_backend_waiting"`
	// MaxQueue caps the tickets waiting in kvgate; beyond it, 503 [4096].
	MaxQueue int `yaml:"max_queue"`
	// MaxQueueWait is how long a ticket may wait when it has no deadline
	// of its own [30s].
	MaxQueueWait time.Duration `yaml:"max_queue_wait"`
	// StarvationGuard is how long the oldest ticket of a model may be
	// passed over by smaller ones before it blocks them [2s].
	StarvationGuard time.Duration `yaml:"starvation_guard"`
	// ProgressFactor discounts the decode progress estimated from time
	// for requests that do not report it (non-streaming) [0.8].
	ProgressFactor float64 `yaml:"progress_factor"`
}

func (p *Policy) defaults() {
	p.KVTarget = cmp.Or(p.KVTarget, 0.9)
	p.DegradedFactor = cmp.Or(p.DegradedFactor, 0.7)
	p.MaxBackendWaiting = cmp.Or(p.MaxBackendWaiting, 2)
	p.MaxQueue = cmp.Or(p.MaxQueue, 4096)
	p.MaxQueueWait = cmp.Or(p.MaxQueueWait, 30*time.Second)
	p.StarvationGuard = cmp.Or(p.StarvationGuard, 2*time.Second)
	p.ProgressFactor = cmp.Or(p.ProgressFactor, 0.8)
}

// Validate reports a policy that cannot work.
func (p Policy) Validate() error {
	switch {
	case p.KVTarget < 0 || p.KVTarget > 1:
		return fmt.Errorf("kv_target %g must be in (0, 1]", p.KVTarget)
	case p.DegradedFactor < 0 || p.DegradedFactor > 1:
		return fmt.Errorf("degraded_factor %g must be in (0, 1]", p.DegradedFactor)
	case p.ProgressFactor < 0 || p.ProgressFactor > 1:
		return fmt.Errorf("progress_factor %g must be in (0, 1]", p.ProgressFactor)
	case p.MaxQueue < 0 || p.MaxBackendWaiting < 0 || p.MaxQueueWait < 0:
		return errors.New("max_queue, max_backend_waiting and max_queue_wait must not be negative")
	}
	return nil
}

// Ticket is a request waiting for capacity.
type Ticket struct {
	Tenant       string
	Class        Class
	Model        string
	PromptTokens int
	MaxTokens    int // output tokens to reserve
	// Deadline bounds the wait; zero means the policy's MaxQueueWait.
	Deadline time.Time
	// Exclude lists backends not to use, such as one that just failed.
	Exclude []string

	enqueued time.Time
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
	queues   [numClasses][]*Ticket
	queued   int
	byModel  map[string]*[numClasses]int // queued tickets per model and class
	ledgers  map[string]*ledger
	closed   bool
	admitted float64 // EWMA of admissions per second, for Retry-After
	lastAdm  time.Time
}

// ledger is kvgate's record of what it has admitted to one backend.
type ledger struct {
	grants   []*Grant // in admission order
	reserved int      // Σ prompt + maxOut
}

// Grant is an admitted ticket: the backend to call and the reservation to
// release when the call ends.
type Grant struct {
	Backend string
	URL     string
	Waited  time.Duration // time spent queued

	s          *Scheduler
	l          *ledger
	prompt     int
	maxOut     int
	admittedAt time.Time
	generated  atomic.Int64 // -1 until reported
	released   bool         // guarded by s.mu
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
	}
	s.m = newMetrics(s)
	return s, nil
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
		return nil, &RejectedError{Reason: "shutting_down", RetryAfter: time.Second}
	}
	if err := s.checkFits(t, snaps); err != nil {
		s.mu.Unlock()
		s.m.outcome(t.Class, outcomeTooLarge)
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
		if g := s.tryAdmit(t, snaps, now); g != nil {
			s.mu.Unlock()
			s.m.outcome(t.Class, outcomeAdmitted)
			s.m.waited(t.Class, 0)
			return g, nil
		}
	}
	if s.queued >= s.policy.MaxQueue {
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
	s.queues[t.Class] = append(s.queues[t.Class], t)
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
// it, or returns nil.
func (s *Scheduler) tryAdmit(t *Ticket, snaps []*gpu.Snapshot, now time.Time) *Grant {
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
		v := decide(&ld, t.PromptTokens, t.MaxTokens, &s.policy)
		if v.needExact {
			ld = s.loadOf(sn, l, now, true)
			v = decide(&ld, t.PromptTokens, t.MaxTokens, &s.policy)
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
	l := s.ledgers[best.Name]
	if l == nil {
		l = &ledger{}
		s.ledgers[best.Name] = l
	}
	g := &Grant{
		Backend: best.Name, URL: best.URL, Waited: now.Sub(t.enqueued),
		s: s, l: l, prompt: t.PromptTokens, maxOut: t.MaxTokens, admittedAt: now,
	}
	g.generated.Store(-1)
	l.grants = append(l.grants, g)
	l.reserved += t.Need()
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
		routable:        sn.Routable(),
		stale:           sn.Stale(now),
		degraded:        sn.GPUHealth == gpu.Degraded,
		capacity:        sn.CapacityTokens,
		maxNumSeqs:      sn.MaxNumSeqs,
		measuredUsed:    int(m.KVUsage * float64(sn.CapacityTokens)),
		measuredRunning: int(m.Running),
		measuredWaiting: int(m.Waiting),
		exact:           exact,
	}
	if l == nil {
		return ld
	}
	ld.reserved, ld.inflight = l.reserved, len(l.grants)
	for i := len(l.grants) - 1; i >= 0 && l.grants[i].admittedAt.After(sn.ScrapedAt); i-- {
		ld.newSinceScrape++
	}
	if !exact {
		return ld
	}
	ld.flights = make([]flight, len(l.grants))
	for i, g := range l.grants {
		gen := g.progress(now, sn.DecodeRate, s.policy.ProgressFactor)
		ld.flights[i] = flight{held: g.prompt + gen, remaining: g.maxOut - gen}
		if i < len(l.grants)-ld.newSinceScrape {
			ld.heldBeforeScrape += g.prompt + gen
		}
	}
	return ld
}

// progress is the output a grant has produced: as reported by a stream, or
// estimated from the time since admission and the backend's per-sequence
// decode rate, discounted and short of the last token.
func (g *Grant) progress(now time.Time, decodeRate, factor float64) int {
	if n := g.generated.Load(); n >= 0 {
		return min(int(n), g.maxOut)
	}
	est := int(factor * decodeRate * now.Sub(g.admittedAt).Seconds())
	return max(0, min(est, g.maxOut-1))
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
	s.pumpLocked(s.src.Snapshots(), s.now())
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

// pumpLocked admits queued tickets in priority order while they fit. A
// ticket that does not fit is passed over by later ones of its model until
// it has waited StarvationGuard; then it blocks them.
func (s *Scheduler) pumpLocked(snaps []*gpu.Snapshot, now time.Time) {
	if s.queued == 0 || s.closed {
		return
	}
	var blocked map[string]bool
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
			if g := s.tryAdmit(t, snaps, now); g != nil {
				t.grant, t.state = g, ticketGranted
				s.dequeuedLocked(t)
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
