package vllmsim

import "github.com/prometheus/client_golang/prometheus"

// Quirks make the simulator's /metrics page behave as some servers and
// emulators do, unlike vLLM, so that kvgate's fallbacks can be tested over
// HTTP.
type Quirks struct {
	// NoStepCounter leaves out vllm:iteration_tokens_total, as older vLLM
	// releases and some emulators do: kvgate then follows non-streaming
	// requests by the decode rate.
	NoStepCounter bool
	// OutputAtFinish adds a request's output to
	// vllm:generation_tokens_total when it finishes rather than at each
	// step, as some emulators do: over one short scrape interval the
	// counter then jumps by whole requests.
	OutputAtFinish bool
}

// nopObserver stands for a histogram the page leaves out.
type nopObserver struct{}

func (nopObserver) Observe(float64) {}

var _ prometheus.Observer = nopObserver{}

// applyQuirks unregisters what q leaves out; newEngineMetrics calls it.
func (m *engineMetrics) applyQuirks(q Quirks) {
	m.quirks = q
	if q.NoStepCounter {
		if c, ok := m.iterTokens.(prometheus.Collector); ok {
			m.reg.Unregister(c)
		}
		m.iterTokens = nopObserver{}
	}
}
