package scheduler

import (
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"time"

	"github.com/kvgate/kvgate/gpu"
)

// Which models kvgate can route work for now, and what a ticket for one it
// cannot is told.

// outcomeNoRoutable is the admission outcome of a ticket refused, or
// failed while queued, because no backend of its model could take work.
const outcomeNoRoutable = "no_routable_backend"

// CheckModel says whether work for model can be routed now, without
// queueing anything: nil when a routable backend serves it, ErrNoBackend
// when no backend serves it or may, and an *UnroutableError (errors.Is
// ErrNoRoutableBackend) when those that do or may cannot take work now.
// Acquire makes the same check; CheckModel lets a caller refuse before it
// spends anything on the request, such as a tenant's quota. Refusals are
// logged, at most once per model every unroutableLogEvery.
func (s *Scheduler) CheckModel(model string) error {
	err := reach(s.src.Snapshots(), model, nil, s.now())
	s.noteUnroutable(err)
	return err
}

// reach decides whether a ticket for model, kept off the backends in
// exclude, can be routed: see CheckModel.
func reach(snaps []*gpu.Snapshot, model string, exclude []string, now time.Time) error {
	var (
		why   []string
		retry time.Duration
	)
	for _, sn := range snaps {
		if !sn.MayServe(model) {
			continue
		}
		excluded := slices.Contains(exclude, sn.Name)
		if sn.Routable() && !excluded {
			return nil
		}
		reason, after := unroutableReason(sn, excluded, now)
		why = append(why, sn.Name+": "+reason)
		if retry == 0 || after < retry {
			retry = after
		}
	}
	if why == nil {
		return ErrNoBackend
	}
	return &UnroutableError{Model: model, Backends: why, RetryAfter: min(max(retry, time.Second), time.Minute)}
}

// unroutableReason says why a backend that serves or may serve a model
// cannot take a ticket for it, and when it may be back.
func unroutableReason(sn *gpu.Snapshot, excluded bool, now time.Time) (string, time.Duration) {
	health := ""
	if sn.HealthErr != "" {
		health = ": " + sn.HealthErr
	}
	switch {
	case sn.Ejected && now.Before(sn.EjectedUntil):
		return fmt.Sprintf("ejected until %s%s", sn.EjectedUntil.Format(time.TimeOnly), health), sn.EjectedUntil.Sub(now)
	case sn.Ejected:
		// Its ejection is over; the next healthy probe ends it.
		return "ejected until a probe succeeds" + health, 2 * time.Second
	case sn.GPUHealth == gpu.Failed:
		return fmt.Sprintf("GPU failed %v", sn.GPUReasons), 30 * time.Second
	case len(sn.Models) == 0:
		if health == "" && sn.ScrapeErr != "" {
			health = ": " + sn.ScrapeErr
		}
		// Discovery is retried every probe interval.
		return "not reached yet" + health, 2 * time.Second
	case excluded:
		return "failed this request", time.Second
	}
	return "not routable", time.Second
}

// unroutableLogEvery bounds the log lines about one model's refusals.
const unroutableLogEvery = 30 * time.Second

// unroutableLog counts refusals for want of a routable backend, per model,
// and logs them at most once every unroutableLogEvery: a fleet without a
// backend for a model refuses every request for it, and one line per
// request would bury everything else. Safe for concurrent use.
type unroutableLog struct {
	mu   sync.Mutex
	last map[string]*unroutableSeen
}

type unroutableSeen struct {
	logged  time.Time
	refused int // since logged
}

// noteUnroutable counts err, when it is an *UnroutableError, and logs it
// if its model's last line is old enough.
func (s *Scheduler) noteUnroutable(err error) {
	var e *UnroutableError
	if !errors.As(err, &e) {
		return
	}
	now := s.now()
	l := &s.unroutable
	l.mu.Lock()
	if l.last == nil {
		l.last = map[string]*unroutableSeen{}
	}
	seen := l.last[e.Model]
	if seen != nil && now.Sub(seen.logged) < unroutableLogEvery {
		seen.refused++
		l.mu.Unlock()
		return
	}
	refused := 1
	if seen != nil {
		refused += seen.refused
	}
	if len(l.last) >= 1024 {
		// Model names come from clients: forget the quiet ones.
		for m, x := range l.last {
			if now.Sub(x.logged) >= unroutableLogEvery {
				delete(l.last, m)
			}
		}
	}
	l.last[e.Model] = &unroutableSeen{logged: now}
	l.mu.Unlock()
	s.log.Warn("no routable backend", slog.String("model", e.Model), slog.Any("backends", e.Backends),
		slog.Int("refused", refused), slog.Duration("retry_after", e.RetryAfter))
}

// routeSig is what routability depends on in one backend's snapshot.
type routeSig struct {
	routable, discovered bool
	models               []gpu.Model
	configured           []string
}

// routingChangedLocked reports whether the backends' routability differs
// from the last call's, and remembers the new one.
func (s *Scheduler) routingChangedLocked(snaps []*gpu.Snapshot) bool {
	sigs := make([]routeSig, len(snaps))
	for i, sn := range snaps {
		sigs[i] = routeSig{sn.Routable(), sn.Discovered, sn.Models, sn.Configured}
	}
	if slices.EqualFunc(sigs, s.routing, func(a, b routeSig) bool {
		return a.routable == b.routable && a.discovered == b.discovered &&
			slices.Equal(a.models, b.models) && slices.Equal(a.configured, b.configured)
	}) {
		return false
	}
	s.routing = sigs
	return true
}

// failUnroutableLocked fails, with ErrNoRoutableBackend (or ErrNoBackend),
// the queued tickets whose model has lost its last routable backend (or
// whose remaining ones the ticket excludes): they would otherwise wait out
// their deadline for nothing. A ticket is checked on entry, in Acquire,
// against snapshots read under s.mu, so the queue need only be looked
// over again when routability changes.
func (s *Scheduler) failUnroutableLocked(snaps []*gpu.Snapshot, now time.Time) {
	if !s.routingChangedLocked(snaps) {
		return
	}
	routable := map[string][]string{} // model → routable backends serving it
	for _, sn := range snaps {
		if sn.Routable() {
			for _, m := range sn.Models {
				routable[m.ID] = append(routable[m.ID], sn.Name)
			}
		}
	}
	for c := range s.queues {
		q := s.queues[c]
		kept := q[:0]
		var failed []*Ticket
		for _, t := range q {
			if slices.ContainsFunc(routable[t.Model], func(b string) bool { return !slices.Contains(t.Exclude, b) }) {
				kept = append(kept, t)
				continue
			}
			t.err = reach(snaps, t.Model, t.Exclude, now)
			if t.err == nil { // cannot be, but a ticket must not fail without a reason
				kept = append(kept, t)
				continue
			}
			t.state = ticketGone
			s.dequeuedLocked(t)
			close(t.done)
			failed = append(failed, t)
		}
		clear(q[len(kept):])
		s.queues[c] = kept
		for _, t := range failed {
			s.fair[c].of(t.Model).removed(t, kept)
		}
	}
}
