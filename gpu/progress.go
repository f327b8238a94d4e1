package gpu

import "time"

// Progress sources: how admission follows a non-streaming request's output
// on a backend, which it cannot see.
const (
	// ProgressSteps follows vLLM's step counter (the sample count of
	// vllm:iteration_tokens_total): each running sequence gains one token
	// a step.
	ProgressSteps = "steps"
	// ProgressDecodeRate falls back on the per-sequence decode rate, from
	// vllm:generation_tokens_total and vllm:num_requests_running.
	ProgressDecodeRate = "decode_rate"
	// ProgressNone: neither is known yet; admission then assumes no
	// progress, which is safe.
	ProgressNone = "none"
)

// ProgressSources lists the sources, for a gauge labelled by each.
var ProgressSources = []string{ProgressSteps, ProgressDecodeRate, ProgressNone}

// ProgressSource says which source admission uses for the backend.
func (s *Snapshot) ProgressSource() string {
	switch {
	case s.Metrics.HasSteps && !s.ScrapedAt.IsZero():
		return ProgressSteps
	case s.DecodeRate > 0:
		return ProgressDecodeRate
	}
	return ProgressNone
}

// DefaultMaxDecodeRate bounds a sequence's decode rate, in output tokens
// per second, for a server that publishes no step counter: a decode step
// reads every weight once, so even a 1B model on the fastest GPU takes
// milliseconds a step. 500 tokens/s per sequence is above any real server.
const DefaultMaxDecodeRate = 500

// rateWindow is how many samples the decode rate spans at most, taken
// at least sampleEvery apart, and minRateSpan the least time it spans: a
// server may count output in bursts (at a request's end rather than at
// each step, as some emulators do), and a rate over one short scrape
// interval then reads many times the truth.
const (
	rateWindow  = 64
	sampleEvery = 100 * time.Millisecond
	minRateSpan = time.Second
)

// rateSample is the counters at one scrape.
type rateSample struct {
	at         time.Time
	generation float64 // vllm:generation_tokens_total
	seqSeconds float64 // ∫ num_requests_running dt since the window began
}

// rateSamples keeps a backend's samples for the decode rate.
type rateSamples struct {
	buf  [rateWindow]rateSample
	n    int // samples held
	next int // where the next goes
	cur  rateSample
	// running is num_requests_running at cur.
	running float64
}

// add records a scrape. A counter that went backwards (a restart) or a
// clock that did starts the window again.
func (r *rateSamples) add(at time.Time, generation, running float64) {
	if r.n > 0 && (generation < r.cur.generation || !at.After(r.cur.at)) {
		r.n, r.next = 0, 0
	}
	if r.n == 0 {
		r.cur = rateSample{at: at, generation: generation}
		r.running = running
		r.put(r.cur)
		return
	}
	dt := at.Sub(r.cur.at).Seconds()
	r.cur = rateSample{at: at, generation: generation, seqSeconds: r.cur.seqSeconds + (r.running+running)/2*dt}
	r.running = running
	if last := r.buf[(r.next+rateWindow-1)%rateWindow]; at.Sub(last.at) >= sampleEvery {
		r.put(r.cur)
	}
}

func (r *rateSamples) put(s rateSample) {
	r.buf[r.next] = s
	r.next = (r.next + 1) % rateWindow
	r.n = min(r.n+1, rateWindow)
}

// rate returns the decode rate from the oldest sample to the latest
// scrape, or 0 while that spans less than minRateSpan or nothing ran.
func (r *rateSamples) rate(stepRate, maxRate float64) float64 {
	if r.n == 0 {
		return 0
	}
	first := r.buf[(r.next+rateWindow-r.n)%rateWindow]
	if r.cur.at.Sub(first.at) < minRateSpan {
		return 0
	}
	return boundDecodeRate(r.cur.generation-first.generation, r.cur.seqSeconds-first.seqSeconds, stepRate, maxRate)
}

// boundDecodeRate is the per-sequence decode rate from the output tokens
// a backend produced over a window and the sequence-seconds it ran (the
// integral of num_requests_running), bounded by what is physically
// possible: no more than one token a step when the step rate is known,
// and no more than maxRate. It is 0 (unknown) when nothing ran.
func boundDecodeRate(tokens, seqSeconds, stepRate, maxRate float64) float64 {
	if !(tokens > 0) || !(seqSeconds > 0) {
		return 0
	}
	r := tokens / seqSeconds
	if stepRate > 0 {
		r = min(r, stepRate)
	}
	if maxRate > 0 {
		r = min(r, maxRate)
	}
	return r
}
