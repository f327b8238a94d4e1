package scheduler

import (
	"math"
	"time"

	"github.com/kvgate/kvgate/gpu"
)

// The batch class's share of a backend.
//
// Batch work fills what interactive traffic leaves, and interactive
// tickets go first in kvgate's queue; but a batch line admitted while the
// fleet had room holds its sequence and KV for seconds of decode, and an
// interactive request that arrives then waits for one to end. So while
// interactive work is about on a backend (waiting in kvgate for a model
// the backend serves, or arrived for one within BatchShareHold), a batch
// ticket is admitted only if everything on the backend, interactive work
// included, stays within BatchShare of its KV budget and of its sequences
// (the same projection and measured load as every decision, against the
// smaller budget), and never into vLLM's own queue, where an interactive
// request would wait behind it. The rest of the budget stays free for
// interactive arrivals, which are admitted at once; interactive work in
// flight takes its room from the batch class, not from that reserve, so
// the reserve holds when interactive requests last longer beside a batch
// (slower steps) or prompts were underestimated. With no interactive work
// about, batch work fills whole backends (work-conserving); once
// interactive work returns, batch admissions stop until the backend is
// back under the share.

// reasonClassShare is why a batch ticket waits while interactive work is
// about: the backend is at the batch share.
const reasonClassShare = "batch_share"

// classLoad is what the batch share needs of one backend, for one ticket.
type classLoad struct {
	// capped is set for a batch ticket on a backend where interactive
	// work is about: the share applies.
	capped bool
	// inflight counts the batch flights on the backend.
	inflight int
}

// batchShare applies the batch share to a ticket needing need KV tokens
// on a backend with load l: it lowers budget (the KV budget, target ×
// capacity) and maxSeqs (the backend's max_num_seqs) to the share the
// ticket may fill, or returns why the ticket may not be admitted at all
// (reasonClassShare), or "" and leaves them as they are when the share
// does not apply. It is pure.
func batchShare(l *load, need int, budget, maxSeqs *int, p *Policy) string {
	if !l.class.capped || p.BatchShare >= 1 {
		return ""
	}
	// Nothing batch goes into vLLM's queue (what it showed, or what
	// kvgate sent since that it may not have scheduled yet): vLLM serves
	// it first come, first served.
	if queueHoldsBatch(l) {
		return reasonClassShare
	}
	// A backend with no batch flight takes one, however full (the
	// whole-backend checks still apply): interactive work, or a share
	// rounded to nothing, must not stop batch work for good.
	if l.class.inflight == 0 {
		return ""
	}
	b := int(p.BatchShare * float64(*budget))
	if need+roundingSlack(1, l.blockSize) > b {
		return reasonClassShare // it waits for the batch flights to end
	}
	*budget, *maxSeqs = b, max(1, int(p.BatchShare*float64(*maxSeqs)))
	return ""
}

// queueHoldsBatch reports whether vLLM's queue on the backend with load
// l may hold work (what it showed, or what kvgate sent since that it may
// not have scheduled yet), where the share sends no batch work. Room
// follows it (classRoomLocked).
func queueHoldsBatch(l *load) bool {
	return l.measuredWaiting+l.unscheduled > 0
}

// interactiveAbout reports whether interactive work is about on backend
// sn: an interactive ticket waits in kvgate for a model it serves, or one
// arrived for such a model within hold of now. s.mu must be held.
func (s *Scheduler) interactiveAbout(sn *gpu.Snapshot, now time.Time) bool {
	for _, m := range sn.Models {
		if c := s.byModel[m.ID]; c != nil && c[Interactive] > 0 {
			return true
		}
		if at, ok := s.lastInteractive[m.ID]; ok && now.Sub(at) < s.policy.BatchShareHold {
			return true
		}
	}
	return false
}

// classRoomLocked bounds Room on backend sn, whose ledger is l (nil when
// it has had no work): while interactive work is about there, the
// tickets the batch share still lets in (its part of the sequences, and of
// the KV budget over the mean reservation in flight), less what is in
// flight, at least one when no batch flight runs there, and none while
// vLLM's queue there may hold work (queueHoldsBatch: decide would refuse
// every batch ticket, which would only wait in kvgate's memory);
// otherwise no bound. s.mu must be held.
func (s *Scheduler) classRoomLocked(sn *gpu.Snapshot, l *ledger, now time.Time) int {
	p := &s.policy
	if p.BatchShare >= 1 || !s.interactiveAbout(sn, now) {
		return math.MaxInt
	}
	if ld := s.loadOf(sn, l, now, false); queueHoldsBatch(&ld) {
		return 0
	}
	seqs := sn.MaxNumSeqs
	if seqs <= 0 {
		seqs = defaultMaxNumSeqs
	}
	allowed := int(p.BatchShare * s.share * float64(seqs))
	if l == nil || len(l.grants) == 0 {
		return max(allowed, 1)
	}
	inflight := len(l.grants)
	if sn.CapacityTokens > 0 {
		mean := float64(l.reserved) / float64(inflight)
		budget := p.BatchShare * p.KVTarget * s.share * float64(sn.CapacityTokens)
		allowed = min(allowed, int(math.Floor(budget/max(mean, 1))))
	}
	return max(allowed-inflight, 0, 1-l.batchInflight)
}
