package scheduler

import (
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
	routable bool
	stale    bool
	degraded bool

	capacity   int // KV tokens
	maxNumSeqs int

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
	flights  []flight
	// newSinceScrape counts flights admitted after the last scrape, and
	// heldBeforeScrape the tokens now held by the others: the measured
	// usage already includes those, not these.
	newSinceScrape   int
	heldBeforeScrape int
}

// verdict is an admission decision and, when it is no, why.
type verdict struct {
	ok       bool
	reason   string
	headroom float64 // fraction of capacity left under the target after admission
	// needExact asks the caller to retry with the exact ledger.
	needExact bool
}

// Reasons a backend cannot take a ticket now.
const (
	reasonUnroutable = "backend_unroutable"
	reasonStale      = "metrics_stale"
	reasonNoCapacity = "capacity_unknown"
	reasonSeqs       = "max_num_seqs"
	reasonWaiting    = "backend_queue"
	reasonKV         = "kv_budget"
)

// decide reports whether a ticket needing prompt + maxOut tokens fits on a
// backend with load l under the policy p. It is pure: the table tests
// drive it directly.
func decide(l *load, prompt, maxOut int, p *Policy) verdict {
	switch {
	case !l.routable:
		return verdict{reason: reasonUnroutable}
	case l.stale:
		return verdict{reason: reasonStale}
	case l.capacity <= 0:
		return verdict{reason: reasonNoCapacity}
	}
	target := p.KVTarget
	if l.degraded {
		target *= p.DegradedFactor
	}
	budget := int(target * float64(l.capacity))

	// Sequences: what vLLM reported plus what kvgate sent since, or
	// kvgate's own count when that is larger.
	if max(l.inflight, l.measuredRunning+l.measuredWaiting+l.newSinceScrape)+1 > l.maxNumSeqs {
		return verdict{reason: reasonSeqs}
	}
	if l.measuredWaiting > p.MaxBackendWaiting {
		return verdict{reason: reasonWaiting}
	}

	// Load kvgate did not send shows only in the measurement. Without the
	// exact ledger, all the measured use counts as external: an upper bound.
	external := l.measuredUsed
	if l.exact {
		external = max(0, l.measuredUsed-l.heldBeforeScrape)
	}
	need := prompt + maxOut

	// Fast path: every flight at its largest at once still fits.
	if worst := external + l.reserved + need; worst <= budget {
		return verdict{ok: true, headroom: float64(budget-worst) / float64(l.capacity)}
	}
	if !l.exact {
		return verdict{reason: reasonKV, needExact: true}
	}
	peak := external + projectPeak(l.flights, flight{held: prompt, remaining: maxOut})
	if peak > budget {
		return verdict{reason: reasonKV}
	}
	return verdict{ok: true, headroom: float64(budget-peak) / float64(l.capacity)}
}

// projectPeak returns the most KV tokens the flights (plus extra) will hold
// at once if each grows by one token per engine step and frees everything
// when done. At step t a flight with remaining r holds held+t while r >= t;
// the peak falls just before some flight finishes, at t = r_j:
//
//	peak = max_j Σ_{i: r_i >= r_j} (held_i + r_j)
//
// which one pass over the flights sorted by remaining computes.
func projectPeak(flights []flight, extra flight) int {
	all := make([]flight, 0, len(flights)+1)
	all = append(all, flights...)
	all = append(all, extra)
	slices.SortFunc(all, func(a, b flight) int { return b.remaining - a.remaining })
	peak, held, n := 0, 0, 0
	for _, f := range all {
		held += f.held
		n++
		if occ := held + n*f.remaining; occ > peak {
			peak = occ
		}
	}
	return peak
}
