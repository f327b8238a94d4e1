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
// the backend serves, or arrived for one within BatchShareHold), batch
// tickets may hold at most BatchShare of the backend's KV budget and of
// its sequences, and never add to vLLM's own queue, where an interactive
// request would wait behind them: the rest stays free for interactive
// arrivals, which are admitted at once. With no interactive work about,
// batch work fills the whole backend (work-conserving); once interactive
// work returns, batch admissions stop until the batch flights have
// drained below the share.

// reasonClassShare is why a batch ticket waits while interactive work is
// about: the batch class holds its share of the backend.
const reasonClassShare = "batch_share"

// classLoad is what the batch share needs of one backend, for one ticket.
type classLoad struct {
	// capped is set for a batch ticket on a backend where interactive
	// work is about: the share applies.
	capped bool
	// reserved and inflight are the batch flights' Σ prompt + maxOut
	// and count; flights, sorted by remaining (sortFlights), their
	// projection, filled with the exact ledger.
	reserved int
	inflight int
	flights  []flight
}

// decideClassShare reports why a ticket adding prompt + maxOut KV tokens
// may not be admitted under the batch share, or "" when it may.
// budget is the backend's KV budget (target × capacity); needExact asks
// for the exact ledger, whose projection of the batch flights may admit
// what the sum of their reservations refuses. It is pure.
func decideClassShare(l *load, prompt, maxOut, budget int, p *Policy) (reason string, needExact bool) {
	c := &l.class
	if !c.capped || p.BatchShare >= 1 {
		return "", false
	}
	// Nothing batch goes into vLLM's queue (what it showed, or what
	// kvgate sent since that it may not have scheduled yet): vLLM serves
	// it first come, first served.
	if l.measuredWaiting+l.unscheduled > 0 {
		return reasonClassShare, false
	}
	// A share of one backend's sequences and KV; beside other replicas,
	// of this replica's part of them. A backend with no batch flight
	// takes one, however small the share (the whole-backend checks still
	// apply): a share rounded to nothing must not stop batch work.
	if c.inflight == 0 {
		return "", false
	}
	seqs := max(1, int(p.BatchShare*l.share*float64(l.maxNumSeqs)))
	if c.inflight+1 > seqs {
		return reasonClassShare, false
	}
	limit := int(p.BatchShare * l.share * float64(budget))
	slack := roundingSlack(c.inflight+1, l.blockSize)
	if c.reserved+prompt+maxOut+slack <= limit {
		return "", false
	}
	if !l.exact {
		return reasonClassShare, true
	}
	if slack+projectPeak(c.flights, flight{held: prompt, remaining: maxOut}) > limit {
		return reasonClassShare, false
	}
	return "", false
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
// it has had no work): while interactive work is about there, the batch
// tickets the batch share still lets in (its sequences, and its KV over
// the batch flights' mean reservation), at least one when no batch flight
// runs there; otherwise no bound. s.mu must be held.
func (s *Scheduler) classRoomLocked(sn *gpu.Snapshot, l *ledger, now time.Time) int {
	p := &s.policy
	if p.BatchShare >= 1 || !s.interactiveAbout(sn, now) {
		return math.MaxInt
	}
	seqs := sn.MaxNumSeqs
	if seqs <= 0 {
		seqs = defaultMaxNumSeqs
	}
	allowed := max(1, int(p.BatchShare*s.share*float64(seqs)))
	inflight := 0
	if l != nil && l.batchInflight > 0 {
		inflight = l.batchInflight
		if sn.CapacityTokens > 0 {
			mean := float64(l.batchReserved) / float64(inflight)
			budget := p.BatchShare * p.KVTarget * s.share * float64(sn.CapacityTokens)
			allowed = min(allowed, int(math.Floor(budget/max(mean, 1))))
		}
	}
	return max(allowed-inflight, 0, 1-inflight)
}
