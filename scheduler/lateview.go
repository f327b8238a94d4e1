package scheduler

import (
	"time"

	"github.com/kvgate/kvgate/gpu"
)

// lateMargin is the most of a backend's capacity that a late view costs:
// while a scrape is overdue, admission goes on from what it knows (what it
// sent, the streams' reported progress, the step rate extrapolated no
// further than the staleness bound) with the KV target lowered by up to
// this much, rather than stopping. The margin grows with the view's age
// (lateness), from nothing at the staleness bound, where a view is still
// fresh and costs nothing, to all of it at twice the bound, past which
// the backend is stale: what kvgate cannot see (load it did not send, the
// progress of requests it does not stream) drifts with the time since the
// scrape, not all at once when the bound is crossed.
const lateMargin = 0.1

// lateness is how far into its late window a backend's view is at now:
// 0 while fresh, rising to 1 at twice the staleness bound; 0 too when the
// view is not late but stale (lateView).
func lateness(sn *gpu.Snapshot, now time.Time) float64 {
	if !lateView(sn, now) || sn.StaleAfter <= 0 {
		return 0
	}
	over := now.Sub(sn.ScrapedAt) - sn.StaleAfter
	return min(1, max(0, over.Seconds()/sn.StaleAfter.Seconds()))
}

// lateView reports whether a backend's metrics are past the staleness
// bound only because a scrape is late: the last one succeeded, none has
// failed since, and it is no older than twice the bound (a scrape times
// out at the bound, and a failed one marks the snapshot). A backend whose
// scrapes fail, or that was never scraped, stays stale: saturated.
func lateView(sn *gpu.Snapshot, now time.Time) bool {
	if sn.ScrapedAt.IsZero() || sn.ScrapeErr != "" {
		return false
	}
	age := now.Sub(sn.ScrapedAt)
	return age > sn.StaleAfter && age <= 2*sn.StaleAfter
}

// maxPacingCredit bounds, in pacing gaps, the steps a backlog may have
// to its credit: how many admissions one pass may make at once to a
// backend after a pass came late.
const maxPacingCredit = 4

// pacingMark is where the pacing clock of a backend stands after an
// admission at step now that applied the gap (0: none applied, the clock
// restarts at now); prevPass is the step at the end of the previous pass
// over the backlog (< 0: unknown). Pacing spaces admissions gap steps
// apart on the backend's step clock, not one per pass: when passes come
// late (a busy host, a late scrape), the steps between the previous pass
// and this one, in which no pass could admit, are credit, up to
// maxPacingCredit gaps, rather than lost fleet throughput. Steps in which
// passes ran and found no room are no credit: admitting them at once when
// room appears would make a cohort of what pacing spreads.
func pacingMark(last, now, gap, prevPass float64) float64 {
	if gap <= 0 || last < 0 || now < 0 {
		return now
	}
	if prevPass < 0 || prevPass > now {
		prevPass = now
	}
	return max(last+gap, prevPass, now-maxPacingCredit*gap)
}

// markPass records, at the end of a pass over the backlog, each backend's
// step count: the next pass's admissions take credit only for the steps
// after it.
func markPass(ledgers map[string]*ledger, snaps []*gpu.Snapshot, now time.Time) {
	for _, sn := range snaps {
		if l := ledgers[sn.Name]; l != nil {
			if st, ok := sn.StepsAt(now); ok {
				l.lastPassStep = st
			}
		}
	}
}

// decideAlone decides on a request larger than the KV budget (kv_target
// of the capacity) but not than the capacity: vLLM would run it, so it
// waits until kvgate has nothing else in flight on the backend and the
// load it did not send leaves room for it (alone: the need with its
// rounding), and then goes. external is the measured load that is not
// kvgate's.
func decideAlone(l *load, external, alone int) verdict {
	switch {
	case alone > l.capacity:
		return verdict{reason: reasonKV} // checkFits refuses it beforehand
	case l.inflight > 0:
		return verdict{reason: reasonAlone}
	case external+alone > l.capacity:
		// Without the exact ledger, recent releases of kvgate's own
		// count as external.
		return verdict{reason: reasonAlone, needExact: !l.exact}
	}
	return verdict{ok: true, headroom: float64(l.capacity-external-alone) / float64(l.capacity)}
}

// scheduledSteps is how many engine steps after its admission a request is
// taken to have left vLLM's waiting queue: vLLM's scheduler takes waiting
// requests in at every step while sequences and KV allow (which the other
// guards keep), and the prefill of one prompt can take a chunked step
// more.
const scheduledSteps = 2

// scheduledSince reports whether the backend has stepped enough since g
// was admitted to have taken it in (stepsNow is its extrapolated step
// count, < 0 when it publishes none: then a request sent since the last
// scrape may still be waiting, as far as kvgate can tell).
func scheduledSince(g *Grant, stepsNow float64) bool {
	return stepsNow >= 0 && g.admittedStep >= 0 && stepsNow-g.admittedStep >= scheduledSteps
}
