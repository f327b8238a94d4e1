package scheduler

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
