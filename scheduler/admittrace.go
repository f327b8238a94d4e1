package scheduler

import (
	"time"

	"github.com/kvgate/kvgate/gpu"
)

// AdmitRecord describes one admission, for per-request traces in
// benchmarks: how long the ticket waited in kvgate and why, where it went
// and where its prefix was expected.
type AdmitRecord struct {
	Tenant             string
	Enqueued, Admitted time.Time
	Backend            string
	// Hit is the share of the prompt the chosen backend was expected to
	// have cached; BestPrefix the backend with the highest expectation
	// (hit + held share) at admission and BestHit that share.
	Hit, BestHit float64
	BestPrefix   string
	// Refusals counts, by reason, the refusals the ticket met on any
	// backend while it waited; WaitedOn is the last backend it waited
	// for because it held its prefix ("" if none).
	Refusals map[string]int
	WaitedOn string
	// Group names the prompt's prefix: the hash of its chunk at
	// groupDepth (or its last), so that a trace tells which prompts share
	// a system prompt or a conversation (0: no chunks).
	Group uint64
	// Reserved and Shared are the chosen backend's ledger just before
	// the admission (KV tokens kvgate reserves there, and the part of it
	// that is prompt chunks shared once); Measured is its KV use at its
	// last scrape, in tokens.
	Reserved, Shared, Measured int
}

// groupDepth is the chunk whose hash names a prompt's group in a trace:
// past a chat template's header (identical across prompts), within a
// system prompt of a few hundred tokens.
const groupDepth = 47

// SetAdmitObserver calls f, under the scheduler's lock, for every
// admission from then on (nil: none). It costs a map per waiting ticket
// and is meant for benchmarks and debugging.
func (s *Scheduler) SetAdmitObserver(f func(AdmitRecord)) {
	s.mu.Lock()
	s.observe = f
	s.mu.Unlock()
}

// noteRefusal counts a refusal of t for its admission record.
func (s *Scheduler) noteRefusal(t *Ticket, reason string) {
	if s.observe == nil {
		return
	}
	if t.refusals == nil {
		t.refusals = map[string]int{}
	}
	t.refusals[reason]++
	if t.waitsOn != "" {
		t.waitedOn = t.waitsOn
	}
}

// observeAdmit reports t's admission to backend with expected hit share.
func (s *Scheduler) observeAdmit(t *Ticket, snaps []*gpu.Snapshot, backend string, hit float64, now time.Time) {
	if s.observe == nil {
		return
	}
	r := AdmitRecord{Tenant: t.Tenant, Enqueued: t.enqueued, Admitted: now, Backend: backend, Hit: hit,
		Refusals: t.refusals, WaitedOn: t.waitedOn, BestHit: -1}
	for _, sn := range snaps {
		if _, ok := sn.Serves(t.Model); !ok {
			continue
		}
		pinned := s.ledgers[sn.Name].pinnedLeading(t.Prefix)
		if v := s.expectedHit(sn, t, pinned) + t.heldShare(pinned); v > r.BestHit {
			r.BestHit, r.BestPrefix = v, sn.Name
		}
	}
	if t.Prefix != nil && len(t.Prefix.Hashes) > 0 {
		r.Group = t.Prefix.Hashes[min(groupDepth, len(t.Prefix.Hashes)-1)]
	}
	if l := s.ledgers[backend]; l != nil {
		r.Reserved, r.Shared = l.reserved, l.shared
	}
	for _, sn := range snaps {
		if sn.Name == backend {
			r.Measured = int(sn.Metrics.KVUsage * float64(sn.CapacityTokens))
		}
	}
	s.observe(r)
}
