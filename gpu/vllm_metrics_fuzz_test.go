package gpu

import (
	"bytes"
	"errors"
	"math"
	"slices"
	"strings"
	"testing"

	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/kvgate/kvgate/bench/vllmsim"
)

// FuzzParseEngineMetrics feeds arbitrary /metrics pages to
// ParseEngineMetrics. A page it accepts must describe a possible engine:
// finite, non-negative counts, a usage between 0 and 1 and a capacity that
// did not overflow, since admission trusts these numbers (a NaN usage
// would read as an empty cache). A page it refuses gives the zero value.
// Where the full Prometheus parser accepts the whole page, the line
// filter must not change the answer: the same families written out
// canonically parse to the same metrics.
func FuzzParseEngineMetrics(f *testing.F) {
	_, srv := vllmsim.NewTestServer(f, vllmsim.Config{Profile: testProfile(f), Seed: 9})
	f.Add(getPage(f, srv.URL)) // a real page, from the simulator
	for _, page := range []string{
		dpPage, gauges, prefixFamilies + dpPage, unrelatedFamilies(1) + gauges,
		"vllm:num_requests_running 6\nvllm:num_requests_waiting 7\nvllm:kv_cache_usage_perc 0.75\n",
		gauges + "vllm:gpu_cache_usage_perc{engine=\"0\"} 0.25\nvllm:cache_config_info{block_size=\"32\",num_gpu_blocks=\"500\"} 1\n",
		gauges + "# TYPE vllm:num_preemptions counter\nvllm:num_preemptions_total{engine=\"0\"} 5\n# EOF\n",
		gauges + "# TYPE vllm:iteration_tokens_total histogram\nvllm:iteration_tokens_total_bucket{le=\"+Inf\"} 5\nvllm:iteration_tokens_total_count 5\nvllm:iteration_tokens_total_sum 50\n",
		// Values a broken exporter might print.
		"vllm:num_requests_running NaN\nvllm:num_requests_waiting 0\n",
		"vllm:num_requests_running -3\nvllm:num_requests_waiting +Inf\n",
		gauges + "vllm:kv_cache_usage_perc{engine=\"0\"} NaN\n",
		gauges + "vllm:kv_cache_usage_perc{engine=\"0\"} 75\n",
		gauges + "vllm:cache_config_info{block_size=\"9223372036854775807\",num_gpu_blocks=\"2\"} 1\n",
		gauges + "vllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"-5\"} 1\n",
		gauges + "vllm:num_preemptions_total 1e308\nvllm:num_preemptions_total{engine=\"1\"} 1e308\n",
	} {
		f.Add([]byte(page))
	}
	f.Fuzz(func(t *testing.T, page []byte) {
		m, err := ParseEngineMetrics(bytes.NewReader(page))
		if err != nil {
			if !sameMetrics(m, EngineMetrics{}) {
				t.Fatalf("error %v with metrics %+v, want the zero value", err, m)
			}
		} else {
			checkPlausible(t, m)
		}
		// Parsing is a pure function of the page, whatever the pooled
		// buffers last held.
		_, _ = ParseEngineMetrics(strings.NewReader(dpPage + unrelatedFamilies(2)))
		again, err2 := ParseEngineMetrics(bytes.NewReader(page))
		if (err == nil) != (err2 == nil) || !sameMetrics(m, again) {
			t.Fatalf("second parse of the same page: %+v, %v; first %+v, %v", again, err2, m, err)
		}

		full := expfmt.NewTextParser(model.UTF8Validation)
		fams, ferr := full.TextToMetricFamilies(bytes.NewReader(page))
		if ferr != nil {
			return // the filter may accept what the full parser refuses elsewhere on the page
		}
		var canon bytes.Buffer
		names := make([]string, 0, len(fams))
		for name := range fams {
			if wanted([]byte(name)) {
				names = append(names, name)
			}
		}
		slices.Sort(names)
		for _, name := range names {
			if _, err := expfmt.MetricFamilyToText(&canon, fams[name]); err != nil {
				t.Fatalf("write %s: %v", name, err)
			}
		}
		want, werr := ParseEngineMetrics(&canon)
		if (err == nil) != (werr == nil) || errors.Is(err, ErrNoEngineMetrics) != errors.Is(werr, ErrNoEngineMetrics) || !sameMetrics(m, want) {
			t.Fatalf("page parses to %+v, %v\nits wanted families alone to %+v, %v\ncanonical page:\n%s", m, err, want, werr, canon.Bytes())
		}
	})
}

// checkPlausible fails t unless m could describe a real engine.
func checkPlausible(t *testing.T, m EngineMetrics) {
	t.Helper()
	for name, v := range map[string]float64{
		"Running": m.Running, "Waiting": m.Waiting, "KVUsage": m.KVUsage, "Preemptions": m.Preemptions,
		"Generation": m.Generation, "Prompt": m.Prompt, "Steps": m.Steps,
	} {
		if math.IsNaN(v) || math.IsInf(v, 0) || v < 0 {
			t.Fatalf("%s = %v accepted: %+v", name, v, m)
		}
	}
	if m.KVUsage > 1 {
		t.Fatalf("KVUsage = %v above 1 accepted: %+v", m.KVUsage, m)
	}
	if m.BlockSize < 0 || m.NumGPUBlocks < 0 || (m.BlockSize == 0) != (m.NumGPUBlocks == 0) {
		t.Fatalf("block size %d, %d blocks accepted", m.BlockSize, m.NumGPUBlocks)
	}
	if c := m.CapacityTokens(); c < 0 || c > maxCapacityTokens || (m.BlockSize > 0 && c/m.BlockSize != m.NumGPUBlocks) {
		t.Fatalf("capacity %d tokens from block size %d and %d blocks", c, m.BlockSize, m.NumGPUBlocks)
	}
}

// sameMetrics is == with NaN equal to itself, so that a NaN that got
// through is reported by checkPlausible rather than as a difference.
func sameMetrics(a, b EngineMetrics) bool {
	nan := func(x, y float64) bool { return x == y || (math.IsNaN(x) && math.IsNaN(y)) }
	return nan(a.Running, b.Running) && nan(a.Waiting, b.Waiting) && nan(a.KVUsage, b.KVUsage) &&
		nan(a.Preemptions, b.Preemptions) && nan(a.Generation, b.Generation) && nan(a.Prompt, b.Prompt) &&
		nan(a.Steps, b.Steps) && a.HasKVUsage == b.HasKVUsage && a.BlockSize == b.BlockSize &&
		a.NumGPUBlocks == b.NumGPUBlocks && a.HasSteps == b.HasSteps && a.Legacy == b.Legacy
}
