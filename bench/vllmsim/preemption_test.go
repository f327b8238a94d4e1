package vllmsim

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"testing"

	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

// scrapeCounter reads one unlabelled-by-extra-labels sample of /metrics,
// summed over its series.
func scrapeCounter(t *testing.T, baseURL, name string) float64 {
	t.Helper()
	resp, err := http.Get(baseURL + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	parser := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := parser.TextToMetricFamilies(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	fam, ok := fams[name]
	if !ok {
		t.Fatalf("/metrics has no %s", name)
	}
	var sum float64
	for _, m := range fam.GetMetric() {
		switch {
		case m.Counter != nil:
			sum += m.GetCounter().GetValue()
		case m.Gauge != nil:
			sum += m.GetGauge().GetValue()
		}
	}
	return sum
}

// TestPreemptionUnderKVPressure drives a simulated GPU with 2,048 KV blocks
// (32k tokens) over HTTP. Sixty-four concurrent 1k-in/1k-out requests want
// four times what it holds: vLLM preempts, and so must the simulator. Eight
// such requests fit, and must not.
func TestPreemptionUnderKVPressure(t *testing.T) {
	p, _ := LookupProfile("h100-llama-3.1-8b")
	p.NumGPUBlocks = 2048
	p.MaxModelLen = 4096
	for _, tc := range []struct {
		name        string
		concurrency int
		preempts    bool
	}{
		{"demand fits", 8, false},
		{"demand is four times the cache", 64, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			// Paced, so that the requests run together however slowly the
			// host starts them: unpaced, each could end before the next
			// arrives on a loaded machine, and none be preempted.
			_, srv := NewTestServer(t, Config{Profile: p, Seed: 3, Speedup: 50})
			var wg sync.WaitGroup
			errs := make(chan error, tc.concurrency)
			for i := range tc.concurrency {
				wg.Add(1)
				go func() {
					defer wg.Done()
					// Distinct ~1,000-token prompts: no prefix sharing.
					text := strings.Repeat(fmt.Sprintf(" req%03d abc", i), 250)
					body, _ := json.Marshal(map[string]any{"prompt": text, "max_tokens": 1000, "ignore_eos": true})
					resp, err := http.Post(srv.URL+"/v1/completions", "application/json", bytes.NewReader(body))
					if err != nil {
						errs <- err
						return
					}
					defer resp.Body.Close()
					var out struct {
						Usage usageInfo `json:"usage"`
					}
					if err := json.NewDecoder(resp.Body).Decode(&out); err != nil || resp.StatusCode != 200 {
						errs <- fmt.Errorf("status %d, decode %v", resp.StatusCode, err)
						return
					}
					if out.Usage.CompletionTokens != 1000 {
						errs <- fmt.Errorf("completion_tokens %d, want 1000", out.Usage.CompletionTokens)
					}
				}()
			}
			wg.Wait()
			close(errs)
			for err := range errs {
				t.Error(err)
			}
			preemptions := scrapeCounter(t, srv.URL, "vllm:num_preemptions_total")
			gen := scrapeCounter(t, srv.URL, "vllm:generation_tokens_total")
			t.Logf("%d requests: %v preemptions, %v generated tokens", tc.concurrency, preemptions, gen)
			if gen != float64(1000*tc.concurrency) {
				t.Errorf("generation_tokens_total = %v, want %d", gen, 1000*tc.concurrency)
			}
			if tc.preempts && preemptions == 0 {
				t.Error("no preemption although demand is four times the KV cache")
			}
			if !tc.preempts && preemptions != 0 {
				t.Errorf("%v preemptions although demand fits", preemptions)
			}
			if u := scrapeCounter(t, srv.URL, "vllm:kv_cache_usage_perc"); u != 0 {
				t.Errorf("kv_cache_usage_perc = %v after all requests finished, want 0", u)
			}
		})
	}
}
