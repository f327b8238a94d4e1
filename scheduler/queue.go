package scheduler

import (
	"context"
	"errors"
	"math"
	"slices"
	"time"

	"github.com/kvgate/kvgate/gpu"
)

// Acquire waits until t is admitted to a backend and returns the grant,
// which the caller must Release. It returns *TooLargeError at once for a
// ticket no backend could hold, ErrNoBackend for a model nobody serves or
// may serve, an *UnroutableError (errors.Is ErrNoRoutableBackend) at once
// when no backend of the model but those t excludes is routable, and also
// when the last one stops being routable while t waits; *RejectedError
// when the queue is full or the deadline passes, and ctx's error when the
// caller gives up (its ticket leaves the queue).
func (s *Scheduler) Acquire(ctx context.Context, t *Ticket) (*Grant, error) {
	now := s.now()
	t.enqueued = now
	deadline := t.Deadline
	if deadline.IsZero() {
		deadline = now.Add(s.policy.MaxQueueWait)
	}
	if g, queued, err := s.enter(t, now); !queued {
		return g, err
	}

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
	case t.err != nil && errors.As(t.err, new(*TooLargeError)): // its prompt, counted again, outgrew every backend
		s.m.outcome(t.Class, outcomeTooLarge)
		return nil, t.err
	case t.err != nil: // its model's last routable backend went
		s.m.outcome(t.Class, outcomeNoRoutable)
		s.noteUnroutable(t.err)
		return nil, t.err
	}
	s.m.outcome(t.Class, outcomeTimeout)
	return nil, &RejectedError{Reason: "queue_timeout", RetryAfter: retry}
}

// enter is Acquire's first step, under s.mu (deferred: a panic in
// admission must not leave the scheduler locked): t is refused (err), or
// admitted at once (g), or queued.
func (s *Scheduler) enter(t *Ticket, now time.Time) (g *Grant, queued bool, err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	// Read under s.mu: a later change of routability then comes with a
	// pump that sees this ticket queued (failUnroutableLocked).
	snaps := s.src.Snapshots()
	if s.closed {
		s.m.outcome(t.Class, outcomeShutdown)
		return nil, false, &RejectedError{Reason: "shutting_down", RetryAfter: time.Second}
	}
	if err := s.checkFits(t, snaps, now); err != nil {
		switch {
		case errors.Is(err, ErrNoBackend):
			s.m.outcome(t.Class, outcomeNoBackend)
		case errors.Is(err, ErrNoRoutableBackend):
			s.m.outcome(t.Class, outcomeNoRoutable)
			s.noteUnroutable(err)
		default:
			s.m.outcome(t.Class, outcomeTooLarge)
		}
		return nil, false, err
	}
	if t.Class == Interactive {
		s.lastInteractive[t.Model] = now // the batch share applies (classshare.go)
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
			if t.Booked != nil {
				t.Booked()
			}
			s.m.outcome(t.Class, outcomeAdmitted)
			s.m.waited(t.Class, 0)
			return g, false, nil
		}
	}
	// Per class: a batch backlog never fills interactive traffic's queue.
	if len(s.queues[t.Class]) >= s.policy.MaxQueue {
		s.m.outcome(t.Class, outcomeQueueFull)
		return nil, false, &RejectedError{Reason: "queue_full", RetryAfter: s.retryAfterLocked()}
	}
	if s.queued == 0 {
		// The routing t was checked against is what later changes are
		// compared with (failUnroutableLocked); with nothing queued, no
		// pump kept that baseline up to date.
		s.routingChangedLocked(snaps)
	}
	s.enqueueLocked(t)
	if t.Booked != nil {
		t.Booked()
	}
	return nil, true, nil
}

// checkFits fails a ticket that needs more than any backend serving its
// model could ever give it (its whole KV capacity: a ticket above the
// kv_target share of it waits to run alone, decideAlone), whose model nobody serves or may serve, or
// whose model no backend it may use can take now (reach). Too large comes
// first: it is for good, whatever the backends' state.
func (s *Scheduler) checkFits(t *Ticket, snaps []*gpu.Snapshot, now time.Time) error {
	if err := tooLarge(t, snaps); err != nil {
		return err
	}
	return reach(snaps, t.Model, t.Exclude, now)
}

// tooLarge is checkFits's first check: a *TooLargeError when t needs more
// than the whole KV capacity of every backend serving its model.
func tooLarge(t *Ticket, snaps []*gpu.Snapshot) error {
	known, largest := false, 0
	for _, sn := range snaps {
		if _, ok := sn.Serves(t.Model); !ok {
			continue
		}
		if sn.CapacityTokens > 0 {
			known = true
			largest = max(largest, sn.CapacityTokens-roundingSlack(1, sn.Metrics.BlockSize))
		}
	}
	if known && t.Need() > largest {
		return &TooLargeError{Need: t.Need(), Capacity: largest}
	}
	return nil
}

func (s *Scheduler) enqueueLocked(t *Ticket) {
	t.done = make(chan struct{})
	t.state = ticketQueued
	s.fair[t.Class].of(t.Model).tag(t)
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
	s.fair[t.Class].of(t.Model).removed(t, s.queues[t.Class])
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
// Wake re-evaluates the queue, after backend state changed. Cheap when the
// queue is empty.
func (s *Scheduler) Wake() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.queued > 0 {
		s.pumpLocked(s.src.Snapshots(), s.now())
	}
}

// maxScanMisses bounds the work of one pump over a long queue: after this
// many tickets of a model in a row fit nowhere, the model's others wait
// for the next event (those of other models, served by other backends,
// are still checked).
const maxScanMisses = 32

// maxPrefixWaits bounds the tickets one pump passes over because they
// wait for the backend that holds their prefix (prefix.go).
const maxPrefixWaits = 512

// pumpLocked admits queued tickets in priority order, each class in its
// weighted fair order, while they fit. A
// ticket that does not fit is passed over by later ones of its model until
// it has waited StarvationGuard; then it blocks them. A model whose every
// backend refuses for its load alone (refusesAll) is blocked for the rest
// of the pass too: its other tickets would be refused there as well.
func (s *Scheduler) pumpLocked(snaps []*gpu.Snapshot, now time.Time) {
	if s.queued == 0 || s.closed {
		clear(s.starved)
		return
	}
	defer func() { // what this pass found replaces what the last one did
		s.starved, s.starving = s.starving, s.starved
		clear(s.starving)
	}()
	s.failUnroutableLocked(snaps, now)
	var blocked map[string]bool
	loads := newPassLoads()
	// Misses by model since the pass's last admission; once every model
	// with tickets queued has had maxScanMisses or is blocked, the pass
	// ends. An admission does not unblock a model.
	var misses map[string]int
	models, spent := 0, 0
	for _, n := range s.byModel {
		if slices.ContainsFunc(n[:], func(k int) bool { return k > 0 }) {
			models++
		}
	}
	miss := func(model string) {
		if misses == nil {
			misses = map[string]int{}
		}
		if misses[model]++; misses[model] == maxScanMisses {
			spent++
		}
	}
	block := func(model string) {
		if blocked == nil {
			blocked = map[string]bool{}
		}
		if !blocked[model] {
			blocked[model] = true
			if misses[model] < maxScanMisses {
				spent++
			}
		}
	}
	prefixWaits := 0
	defer s.releaseHolds()
	for c := range s.queues {
		q := s.queues[c]
		kept := q[:0]
		var outgrown []*Ticket
		for i, t := range q {
			if spent >= models {
				kept = append(kept, q[i:]...)
				break
			}
			if misses[t.Model] >= maxScanMisses {
				kept = append(kept, t)
				continue
			}
			if blocked[t.Model] {
				kept = append(kept, t)
				continue
			}
			if t.PromptEstimate != nil {
				if n := t.PromptEstimate(); n != t.PromptTokens {
					t.PromptTokens = n
					// Counted again, a prompt can outgrow every backend:
					// it fails now, as it would have at Acquire, rather
					// than waiting out its deadline (and, past the
					// starvation guard, blocking its model meanwhile).
					if err := tooLarge(t, snaps); err != nil {
						t.state, t.err = ticketGone, err
						s.dequeuedLocked(t)
						close(t.done)
						outgrown = append(outgrown, t)
						continue
					}
				}
			}
			if g := s.tryAdmit(t, snaps, now, true, loads); g != nil {
				t.grant, t.state = g, ticketGranted
				s.dequeuedLocked(t)
				s.fair[c].of(t.Model).admitted(t, s.queued)
				close(t.done)
				clear(misses)
				spent = len(blocked)
				continue
			}
			kept = append(kept, t)
			if loads.shutFor(t.Model, snaps) {
				block(t.Model)
				continue
			}
			// A ticket waiting for the backend that holds its prefix
			// keeps that backend's next room for itself once it has
			// waited the starvation guard, not the whole model's
			// (prefix.go). When it passed over a backend that could
			// take it, its refusal says nothing of the room for the
			// next one: it costs a scan, not a miss (bounded apart).
			// When none could, it is a miss like any other.
			if t.waitsOn != "" && prefixWaits < maxPrefixWaits {
				if now.Sub(t.enqueued) >= s.policy.StarvationGuard {
					s.holdLocked(t.waitsOn, t.waitsNeed)
				}
				if t.waitsPassed {
					prefixWaits++
				} else {
					miss(t.Model)
				}
				continue
			}
			miss(t.Model)
			if now.Sub(t.enqueued) >= s.policy.StarvationGuard {
				block(t.Model)
				s.starveLocked(t, snaps)
			}
		}
		clear(q[len(kept):])
		s.queues[c] = kept
		for _, t := range outgrown {
			s.fair[c].of(t.Model).removed(t, kept)
		}
	}
	markPass(s.ledgers, snaps, now)
}

// starveLocked keeps for t, which waited the starvation guard, the
// backends of its model that serve other models too. Blocking its model
// keeps the room of a backend serving it alone; on a backend serving
// several, tickets of the others would take every room that appears, and
// t would wait out its deadline. Kept, such a backend takes only what
// does not delay t (delaysHolder), until a pump admits t or t leaves;
// where several starve, the oldest of the first class keeps it.
func (s *Scheduler) starveLocked(t *Ticket, snaps []*gpu.Snapshot) {
	need := max(t.PromptTokens+t.MaxTokens, 1)
	for _, sn := range snaps {
		if len(sn.Models) < 2 || !sn.Routable() || slices.Contains(t.Exclude, sn.Name) {
			continue
		}
		if _, ok := sn.Serves(t.Model); !ok {
			continue
		}
		if s.starving == nil {
			s.starving = map[string]starve{}
		}
		if cur, ok := s.starving[sn.Name]; !ok || t.Class < cur.t.Class || t.Class == cur.t.Class && t.enqueued.Before(cur.t.enqueued) {
			s.starving[sn.Name] = starve{t: t, need: need}
		}
	}
}

// starvedFor returns the oldest starving ticket that keeps backend for a
// ticket of class c: of those the last pump found and this one has so
// far, still queued, and of a class that goes before c or with it (a
// starving batch ticket, which the batch share may be what holds back,
// keeps nothing from interactive traffic).
func (s *Scheduler) starvedFor(backend string, c Class) (starve, bool) {
	a, okA := s.starved[backend]
	b, okB := s.starving[backend]
	okA = okA && a.t.state == ticketQueued && a.t.Class <= c
	okB = okB && b.t.state == ticketQueued && b.t.Class <= c
	switch {
	case okA && okB && (b.t.Class < a.t.Class || b.t.Class == a.t.Class && b.t.enqueued.Before(a.t.enqueued)):
		return b, true
	case okA:
		return a, true
	}
	return b, okB
}

// starve is a backend kept for a starving ticket, t, which needs need KV
// tokens there.
type starve struct {
	t    *Ticket
	need int
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
