package scheduler

import (
	"math"
	"slices"
)

// flight is one admitted request as admission sees it: the KV tokens it
// holds now and the tokens it may still add before it finishes.
type flight struct {
	held      int // prompt + output so far
	remaining int // output tokens it may still produce
}

// load is what admission knows of one backend at one instant.
type load struct {
	routable   bool
	cooling    bool // the backend asked for a pause (429)
	stale      bool
	late       bool // past the staleness bound while a scrape is under way (lateview.go)
	degraded   bool
	preempting bool // the backend preempted since its previous scrape

	// lateness is how far into the late window the view is, in (0, 1]
	// when late (lateness in lateview.go): the share of lateMargin it costs.
	lateness float64

	capacity   int // KV tokens
	maxNumSeqs int
	// share is this replica's part of the backend's budget when several
	// replicas share it (replicas.go); 1 alone.
	share float64
	// blockSize is vLLM's KV block size: it allocates whole blocks, so
	// each sequence holds up to block_size-1 tokens more than it has.
	blockSize int

	// From the backend's last scrape.
	measuredUsed    int // KV tokens in use
	measuredRunning int
	measuredWaiting int

	// kvgate's own ledger. reserved is Σ held+remaining over the flights,
	// kept by the caller; flights and heldBeforeScrape are filled only
	// when exact is set, as they cost a pass over the flights.
	reserved int
	inflight int
	exact    bool
	// shared is the KV of prompt chunks the flights share (prefix.go),
	// counted once: part of reserved, not of any flight's held;
	// sharedBase the part no flight in flight brought, which pacing
	// takes as a base load.
	shared, sharedBase int
	// Pacing applies when paced is set (tickets come from a backlog) and
	// the backend publishes a step counter: engine steps since kvgate
	// last admitted to it, and the flights' mean output budget and mean
	// final size.
	paced           bool
	stepsSinceAdmit float64 // < 0: unknown
	meanOut         float64
	meanFinal       float64
	flights         []flight
	// newSinceScrape counts flights admitted after the last scrape, and
	// heldBeforeScrape the tokens now held by the others: the measured
	// usage already includes those, not these.
	newSinceScrape   int
	heldBeforeScrape int
	// unscheduled counts the flights sent since the scrape that vLLM may
	// not have scheduled yet (lateview.go): they may sit in its queue,
	// which the scrape does not show.
	unscheduled int
	// class says whether the batch share applies to the ticket, and the
	// batch flights there (classshare.go).
	class classLoad
	// holdNeed is the KV an older ticket that holds the backend for the
	// rest of a pass needs there (Scheduler.hold), 0 when none holds it:
	// a ticket may take room there only where it does not delay that one.
	holdNeed int
}

// verdict is an admission decision and, when it is no, why.
type verdict struct {
	ok       bool
	reason   string
	headroom float64 // fraction of capacity left under the target after admission
	// needExact asks the caller to retry with the exact ledger.
	needExact bool
	// gap is the pacing gap in steps the decision applied (0: none).
	gap float64
}

// Reasons a backend cannot take a ticket now.
const (
	reasonUnroutable = "backend_unroutable"
	reasonStale      = "metrics_stale"
	reasonNoCapacity = "capacity_unknown"
	reasonSeqs       = "max_num_seqs"
	reasonWaiting    = "backend_queue"
	reasonKV         = "kv_budget"
	reasonPacing     = "pacing"
	reasonPreempting = "preempting"
	reasonShare      = "replica_share"
	reasonCooldown   = "cooldown"
	reasonAlone      = "needs_backend_alone"
)

// refusesAll reports whether decide refuses for a reason of the backend's
// load alone, whatever the ticket (its size, class, prefix, pacing or a
// hold): while that load stands, every ticket is refused there. Within a
// pass it stands until the pass admits a ticket there, which a backend
// refusing all never does; so the pass stops checking a model once every
// backend serving it refuses all (pumpLocked). decide checks each of these
// before anything that could admit (TestRefusesAllWhateverTheTicket).
func refusesAll(reason string) bool {
	switch reason {
	case reasonUnroutable, reasonCooldown, reasonStale, reasonNoCapacity, reasonPreempting, reasonWaiting:
		return true
	}
	return false
}

// decide reports whether a ticket needing prompt + maxOut tokens fits on a
// backend with load l under the policy p. It is pure: the table tests
// drive it directly. prompt is the KV the request adds: its prompt less
// the chunks flights on the backend already hold (prefix.go).
func decide(l *load, prompt, maxOut int, p *Policy) verdict {
	switch {
	case !l.routable:
		return verdict{reason: reasonUnroutable}
	case l.cooling:
		return verdict{reason: reasonCooldown}
	case l.stale:
		return verdict{reason: reasonStale}
	case l.capacity <= 0:
		return verdict{reason: reasonNoCapacity}
	case l.preempting:
		// Something overfills it (load kvgate does not see, or a wrong
		// prediction): sending more would only preempt more.
		return verdict{reason: reasonPreempting}
	}
	target := p.KVTarget
	if l.degraded {
		target *= p.DegradedFactor
	}
	if l.late {
		target -= lateMargin * min(1, max(0, l.lateness))
	}
	budget := int(target * float64(l.capacity))
	// Batch work leaves room for interactive work about (classshare.go).
	maxSeqs := l.maxNumSeqs
	if reason := batchShare(l, prompt+maxOut, &budget, &maxSeqs, p); reason != "" {
		return verdict{reason: reason}
	}

	// Sequences: what vLLM reported plus what kvgate sent since, or
	// kvgate's own count when that is larger.
	if max(l.inflight, l.measuredRunning+l.measuredWaiting+l.newSinceScrape)+1 > maxSeqs {
		return verdict{reason: reasonSeqs}
	}
	// Several replicas: each keeps its own flights within its share of
	// the budget and of the sequences, so that together they stay within
	// the whole whatever the others admitted since the last scrape.
	shareBudget := budget
	if l.share < 1 {
		shareBudget = int(l.share * float64(budget))
		seqs := int(l.share * float64(l.maxNumSeqs))
		// A replica with nothing in flight on the backend may send one
		// request its share cannot hold (a share rounded below one
		// sequence, or below one long request, must not hold work back
		// for ever; the whole-backend checks still apply): the bounded
		// slack, one such request per replica and backend.
		if l.inflight == 0 && (seqs < 1 || prompt+maxOut > shareBudget) {
			shareBudget, seqs = budget, 1
		}
		if l.inflight+1 > seqs {
			return verdict{reason: reasonShare}
		}
	}
	// vLLM's own queue: beside other replicas, each may add to it
	// unseen, and a request waiting there makes the progress estimate of
	// every non-streaming flight run ahead; so each keeps to its share.
	// The scrape shows the queue as it was; what kvgate sent since may
	// be in it too.
	if l.measuredWaiting+l.unscheduled > int(l.share*float64(p.MaxBackendWaiting)) {
		return verdict{reason: reasonWaiting}
	}

	// Load kvgate did not send shows only in the measurement. Without the
	// exact ledger, all the measured use counts as external: an upper bound.
	external := l.measuredUsed
	if l.exact {
		external = max(0, l.measuredUsed-l.heldBeforeScrape)
	}
	need := prompt + maxOut
	if alone := need + roundingSlack(1, l.blockSize); alone > budget {
		return decideAlone(l, external, alone)
	}

	gap := 0.0
	if l.paced && l.stepsSinceAdmit >= 0 {
		if gap = pacingGap(l, budget); l.stepsSinceAdmit < gap {
			return verdict{reason: reasonPacing}
		}
	}

	if l.holdNeed > 0 && !l.exact {
		// Whether t would delay the holder takes the flights one by one.
		return verdict{reason: reasonHold, needExact: true}
	}

	// Fast path: every flight at its largest at once still fits.
	slack := roundingSlack(l.inflight+1, l.blockSize)
	own := l.reserved + need + slack
	if worst := external + own; worst <= budget && own <= shareBudget && l.holdNeed == 0 {
		return verdict{ok: true, headroom: headroom(budget-worst, shareBudget-own, l.capacity), gap: gap}
	}
	if !l.exact {
		return verdict{reason: reasonKV, needExact: true}
	}
	own = slack + l.shared + projectPeak(l.flights, flight{held: prompt, remaining: maxOut})
	switch {
	case external+own > budget:
		return verdict{reason: reasonKV}
	case own > shareBudget:
		return verdict{reason: reasonShare}
	case l.holdNeed > 0 && delaysHolder(l.flights, flight{held: prompt, remaining: maxOut}, min(budget-external, shareBudget)-slack-l.shared, l.holdNeed):
		return verdict{reason: reasonHold}
	}
	return verdict{ok: true, headroom: headroom(budget-external-own, shareBudget-own, l.capacity), gap: gap}
}

// delaysHolder reports whether admitting cand would delay the older ticket
// that holds the backend, which needs need KV tokens there: whether, at
// the earliest engine step the holder fits beside the flights (each
// growing a token a step and freeing everything when it ends), cand would
// still run and leave too little room for it. base is the KV the flights
// may take (the budget less the load kvgate did not send, the rounding
// slack and the shared chunks); flights are sorted as projectPeak needs
// them. This is backfilling as batch schedulers do it (EASY): the oldest
// waiter keeps its place, and what it cannot use before it starts goes to
// those behind it. A holder that cannot fit even once every flight has
// ended is not delayed by anything here.
//
// Without it, a waiter for a backend kept that backend's whole room: in
// multi-turn, a turn resending 5,000 tokens of history left 1,000 to
// 3,000 free there until enough ended, while turns of 1,300 waited behind
// it (vLLM's KV at 0.89 where kvgate's target is 0.95).
func delaysHolder(flights []flight, cand flight, base, need int) bool {
	// occupancy at step k: Σ over the flights still running (remaining
	// > k) of held + k. Walk the flights in order of remaining, smallest
	// first, dropping each as it ends.
	held, n := 0, len(flights)
	for _, f := range flights {
		held += f.held
	}
	start, occ := -1, 0
	k := 0
	for i := len(flights) - 1; ; {
		for i >= 0 && flights[i].remaining <= k {
			held -= flights[i].held
			n--
			i--
		}
		if base-(held+n*k) >= need {
			start, occ = k, held+n*k
			break
		}
		if i < 0 {
			break
		}
		k = flights[i].remaining
	}
	if start < 0 {
		return false
	}
	return cand.remaining > start && base-occ-(cand.held+start) < need
}

// headroom is the smaller of the room left under the whole budget and
// under this replica's share, as a fraction of capacity.
func headroom(whole, share, capacity int) float64 {
	return float64(min(whole, share)) / float64(capacity)
}

// pacingGap is how many engine steps apart admissions from a backlog
// should be. Requests admitted together grow together and peak together,
// so a synchronized cohort can only fill the budget with the sum of its
// final sizes, while requests spread evenly over their lifetimes hold
// about half their output on average and fill it with many more. A cohort
// that finishes together frees room together; refilled at once, it stays a
// cohort forever. Refilling at about the rate an evenly spread population
// replaces itself (mean output / concurrency steps apart; a little faster,
// since the projection still guards the budget) spreads the phases out
// within one lifetime. Without a backlog nothing is paced: a request that
// finds the queue empty goes at once.
func pacingGap(l *load, budget int) float64 {
	occupancy := l.meanFinal - l.meanOut/2 // mean KV of a request over its life
	if occupancy <= 0 || l.meanOut <= 0 || !pacingWins(l, occupancy) {
		return 0
	}
	concurrency := float64(max(budget-l.sharedBase, 1)) / occupancy
	return 0.8 * l.meanOut / concurrency
}

// minPacingGain is the least KV that spreading admissions must win for
// pacing to apply, as a share of a request's mean occupancy. A cohort
// peaks with its whole output grown, an evenly spread population holds
// half of it on average: the win is (mean output / 2) / occupancy. Where
// outputs are short beside the prompts (prefill-bound traffic: long
// system prompts, resent histories), it is a few percent, and pacing
// would only hold back a burst that vLLM prefills together, each request
// a gap of long prefill steps after the one before: TTFT for nothing.
const minPacingGain = 0.1

// pacingWins reports whether spreading wins minPacingGain. The KV a
// request frees when it ends counts its shared chunks too: those pinned
// by requests still in flight after their bringer ended (a conversation's
// history, resent by its next turn before the last one was released) are
// freed with the last holder, and pacing's base load (sharedBase) leaves
// them out of meanFinal.
func pacingWins(l *load, occupancy float64) bool {
	if l.inflight > 0 {
		occupancy += float64(l.sharedBase) / float64(l.inflight)
	}
	return l.meanOut/2 >= minPacingGain*occupancy
}

// roundingSlack bounds the KV tokens that block rounding adds to n
// sequences. Each wastes between 0 and bs-1 tokens of its last block, as
// its length happens to fall: summed over n sequences that concentrates
// around n(bs-1)/2, with a spread of about bs·sqrt(n/12). Half a block per
// sequence plus three spreads (and a block for small n) holds with room to
// spare, where n(bs-1) would reserve twice the waste there is.
func roundingSlack(n, bs int) int {
	if bs <= 1 || n <= 0 {
		return 0
	}
	spread := float64(bs) * math.Sqrt(float64(n)/12)
	return min(n*(bs-1), n*(bs-1)/2+int(math.Ceil(3*spread))+bs)
}

// projectPeak returns the most KV tokens the flights (plus extra) will hold
// at once if each grows by one token per engine step and frees everything
// when done. At step t a flight with remaining r holds held+t while r >= t;
// the peak falls just before some flight finishes, at t = r_j:
//
//	peak = max_j Σ_{i: r_i >= r_j} (held_i + r_j)
//
// which one pass over the flights in order of remaining computes. flights
// must be sorted by remaining, largest first (sortFlights); extra is
// merged in without copying them.
func projectPeak(flights []flight, extra flight) int {
	peak, held, n := 0, 0, 0
	add := func(f flight) {
		held += f.held
		n++
		if occ := held + n*f.remaining; occ > peak {
			peak = occ
		}
	}
	merged := false
	for _, f := range flights {
		if !merged && extra.remaining >= f.remaining {
			add(extra)
			merged = true
		}
		add(f)
	}
	if !merged {
		add(extra)
	}
	return peak
}

// sortFlights orders flights as projectPeak needs them.
func sortFlights(flights []flight) {
	slices.SortFunc(flights, func(a, b flight) int { return b.remaining - a.remaining })
}
