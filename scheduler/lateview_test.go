package scheduler

import (
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus/testutil"
)

// TestProgressSourceGauge: /metrics says, per backend, which source
// admission follows non-streaming progress by.
func TestProgressSourceGauge(t *testing.T) {
	steps := backendSnap("steps", 1000)
	steps.Metrics.HasSteps = true
	rate := backendSnap("rate", 1000)
	rate.DecodeRate = 49
	none := backendSnap("none", 1000)
	s := newTestScheduler(t, Policy{}, steps, rate, none)
	want := `
# HELP kvgate_scheduler_backend_progress_source 1 for the source admission follows a backend's non-streaming requests by: steps (vllm:iteration_tokens_total), decode_rate (generation_tokens_total over running, bounded), none (assumes no progress); 0 for the others.
# TYPE kvgate_scheduler_backend_progress_source gauge
kvgate_scheduler_backend_progress_source{backend="none",source="decode_rate"} 0
kvgate_scheduler_backend_progress_source{backend="none",source="none"} 1
kvgate_scheduler_backend_progress_source{backend="none",source="steps"} 0
kvgate_scheduler_backend_progress_source{backend="rate",source="decode_rate"} 1
kvgate_scheduler_backend_progress_source{backend="rate",source="none"} 0
kvgate_scheduler_backend_progress_source{backend="rate",source="steps"} 0
kvgate_scheduler_backend_progress_source{backend="steps",source="decode_rate"} 0
kvgate_scheduler_backend_progress_source{backend="steps",source="none"} 0
kvgate_scheduler_backend_progress_source{backend="steps",source="steps"} 1
`
	if err := testutil.CollectAndCompare(stateCollector{s}, strings.NewReader(want), "kvgate_scheduler_backend_progress_source"); err != nil {
		t.Error(err)
	}
}
