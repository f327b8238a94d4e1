package gpu

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/kvgate/kvgate/bench/vllmsim"
)

// testProfile is the 8B H100 profile with a small cache, so that a few
// requests move the KV usage visibly.
func testProfile(t testing.TB) vllmsim.Profile {
	t.Helper()
	p, err := vllmsim.LookupProfile("h100-llama-3.1-8b")
	if err != nil {
		t.Fatal(err)
	}
	p.NumGPUBlocks = 2048
	p.MaxModelLen = 8192
	return p
}

// getPage fetches a server's /metrics page.
func getPage(t testing.TB, base string) []byte {
	t.Helper()
	resp, err := http.Get(base + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("GET /metrics: status %d: %s", resp.StatusCode, body)
	}
	return body
}

// completionUsage is the usage block of an OpenAI completion response.
type completionUsage struct {
	PromptTokens     int `json:"prompt_tokens"`
	CompletionTokens int `json:"completion_tokens"`
}

// complete runs one non-streaming completion of exactly maxTokens tokens.
func complete(ctx context.Context, base, prompt string, maxTokens int) (completionUsage, error) {
	body, _ := json.Marshal(map[string]any{"prompt": prompt, "max_tokens": maxTokens, "ignore_eos": true})
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, base+"/v1/completions", bytes.NewReader(body))
	if err != nil {
		return completionUsage{}, err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return completionUsage{}, err
	}
	defer resp.Body.Close()
	var out struct {
		Usage completionUsage `json:"usage"`
	}
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(resp.Body)
		return completionUsage{}, fmt.Errorf("POST /v1/completions: status %d: %s", resp.StatusCode, b)
	}
	if err := json.NewDecoder(resp.Body).Decode(&out); err != nil {
		return completionUsage{}, fmt.Errorf("POST /v1/completions: %w", err)
	}
	return out.Usage, nil
}

// oracle reads the engine state from a page with the full expfmt parser,
// independently of ParseEngineMetrics: the values a correct parse of a
// single-engine page must give.
type oracle struct {
	running, waiting, usage float64
	hasUsage                bool
	blockSize, blocks       string
	preempt, gen, prompt    float64
}

func readOracle(t testing.TB, page []byte) oracle {
	t.Helper()
	parser := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := parser.TextToMetricFamilies(bytes.NewReader(page))
	if err != nil {
		t.Fatalf("oracle parse: %v", err)
	}
	one := func(name string) (float64, bool) {
		f, ok := fams[name]
		if !ok {
			return 0, false
		}
		if n := len(f.GetMetric()); n != 1 {
			t.Fatalf("oracle: %s has %d series, want 1", name, n)
		}
		return value(f.GetMetric()[0]), true
	}
	var o oracle
	o.running, _ = one("vllm:num_requests_running")
	o.waiting, _ = one("vllm:num_requests_waiting")
	if o.usage, o.hasUsage = one("vllm:kv_cache_usage_perc"); !o.hasUsage {
		o.usage, o.hasUsage = one("vllm:gpu_cache_usage_perc")
	}
	o.preempt, _ = one("vllm:num_preemptions_total")
	o.gen, _ = one("vllm:generation_tokens_total")
	o.prompt, _ = one("vllm:prompt_tokens_total")
	if f, ok := fams["vllm:cache_config_info"]; ok && len(f.GetMetric()) == 1 {
		o.blockSize = label(f.GetMetric()[0], "block_size")
		o.blocks = label(f.GetMetric()[0], "num_gpu_blocks")
	}
	return o
}

func TestParseEngineMetricsSimulator(t *testing.T) {
	for _, legacy := range []bool{false, true} {
		t.Run(fmt.Sprintf("legacy=%v", legacy), func(t *testing.T) {
			p := testProfile(t)
			_, srv := vllmsim.NewTestServer(t, vllmsim.Config{Profile: p, Seed: 1, LegacyMetrics: legacy})

			page := getPage(t, srv.URL)
			// The simulator must really expose the naming under test.
			newName, oldName := []byte("vllm:kv_cache_usage_perc{"), []byte("vllm:gpu_cache_usage_perc{")
			if legacy != bytes.Contains(page, oldName) || legacy == bytes.Contains(page, newName) {
				t.Fatalf("simulator page with legacy=%v does not carry the expected usage gauge:\n%s", legacy, page)
			}
			if hasEngine := bytes.Contains(page, []byte(`engine="0"`)); hasEngine == legacy {
				t.Fatalf("simulator page with legacy=%v: engine label present = %v", legacy, hasEngine)
			}

			m, err := ParseEngineMetrics(bytes.NewReader(page))
			if err != nil {
				t.Fatal(err)
			}
			m.Steps, m.HasSteps = 0, false // not this test's subject
			want := EngineMetrics{
				HasKVUsage: true, BlockSize: p.BlockSize, NumGPUBlocks: p.NumGPUBlocks, Legacy: legacy,
				HasPrefix: true, // both namings publish the prefix-cache counters
			}
			if m != want {
				t.Errorf("idle simulator: got %+v, want %+v", m, want)
			}
			if got, w := m.CapacityTokens(), p.CapacityTokens(); got != w {
				t.Errorf("CapacityTokens() = %d, want %d", got, w)
			}

			// Sequential completions with distinct prompts (no prefix
			// sharing, no preemption): the counters must equal the sums of
			// the usage the responses report.
			var sumPrompt, sumGen int
			for i, n := range []int{1, 7, 64, 200} {
				u, err := complete(t.Context(), srv.URL, strings.Repeat(fmt.Sprintf("request %d asks something. ", i), 5+i*10), n)
				if err != nil {
					t.Fatal(err)
				}
				if u.CompletionTokens != n {
					t.Fatalf("completion %d: %d tokens, want %d", i, u.CompletionTokens, n)
				}
				sumPrompt += u.PromptTokens
				sumGen += u.CompletionTokens
			}
			// The gauges fall back to zero at the step after the last
			// request finishes; poll, bounded.
			var after EngineMetrics
			deadline := time.Now().Add(5 * time.Second)
			for {
				after, err = ParseEngineMetrics(bytes.NewReader(getPage(t, srv.URL)))
				if err != nil {
					t.Fatal(err)
				}
				done := after.Generation == float64(sumGen) && after.Prompt == float64(sumPrompt) && after.Running == 0
				if done || time.Now().After(deadline) {
					break
				}
				time.Sleep(5 * time.Millisecond)
			}
			if after.Generation != float64(sumGen) || after.Prompt != float64(sumPrompt) {
				t.Errorf("after completions: Generation %v, Prompt %v; want the responses' usage sums %d, %d",
					after.Generation, after.Prompt, sumGen, sumPrompt)
			}
			if after.Running != 0 || after.Waiting != 0 || after.KVUsage != 0 || after.Preemptions != 0 {
				t.Errorf("after completions: Running %v Waiting %v KVUsage %v Preemptions %v, want all 0",
					after.Running, after.Waiting, after.KVUsage, after.Preemptions)
			}
			// Distinct prompts: every prompt token queried, none a hit.
			if after.PrefixQueries != float64(sumPrompt) || after.PrefixHits != 0 {
				t.Errorf("after completions: prefix queries %v, hits %v; want %d and 0", after.PrefixQueries, after.PrefixHits, sumPrompt)
			}
			if after.Legacy != legacy || !after.HasKVUsage || after.CapacityTokens() != p.CapacityTokens() {
				t.Errorf("after completions: %+v", after)
			}
		})
	}
}

// TestParseEngineMetricsSimulatorUnderLoad reads a paced simulator while
// requests are in flight and checks every field against an independent
// full parse of the same page.
func TestParseEngineMetricsSimulatorUnderLoad(t *testing.T) {
	for _, legacy := range []bool{false, true} {
		t.Run(fmt.Sprintf("legacy=%v", legacy), func(t *testing.T) {
			p := testProfile(t)
			p.MaxNumSeqs = 4 // eight requests: four run, four wait
			_, srv := vllmsim.NewTestServer(t, vllmsim.Config{Profile: p, Seed: 2, Speedup: 1, LegacyMetrics: legacy})

			ctx, cancel := context.WithCancel(t.Context())
			var wg sync.WaitGroup
			t.Cleanup(wg.Wait) // runs after cancel below
			t.Cleanup(cancel)
			for i := range 8 {
				wg.Go(func() {
					// Cancelled at the end of the test; its error is expected.
					_, _ = complete(ctx, srv.URL, strings.Repeat(fmt.Sprintf("load %d ", i), 200), 4000)
				})
			}

			var m EngineMetrics
			var page []byte
			deadline := time.Now().Add(10 * time.Second)
			for {
				page = getPage(t, srv.URL)
				var err error
				if m, err = ParseEngineMetrics(bytes.NewReader(page)); err != nil {
					t.Fatal(err)
				}
				if (m.Running == 4 && m.Waiting == 4 && m.KVUsage > 0) || time.Now().After(deadline) {
					break
				}
				time.Sleep(5 * time.Millisecond)
			}
			if m.Running != 4 || m.Waiting != 4 || m.KVUsage <= 0 {
				t.Fatalf("simulator never showed 4 running, 4 waiting and some KV usage; last %+v", m)
			}
			o := readOracle(t, page)
			blockSize, blocks := fmt.Sprint(m.BlockSize), fmt.Sprint(m.NumGPUBlocks)
			if m.Running != o.running || m.Waiting != o.waiting || m.KVUsage != o.usage || m.HasKVUsage != o.hasUsage ||
				blockSize != o.blockSize || blocks != o.blocks || m.Preemptions != o.preempt ||
				m.Generation != o.gen || m.Prompt != o.prompt || m.Legacy != legacy {
				t.Errorf("ParseEngineMetrics = %+v, full parse of the same page = %+v", m, o)
			}
		})
	}
}

// dpPage is a data-parallel vLLM page: two engines, each line of
// cache_config_info carrying the server's total blocks (vLLM's front end
// sums the engines' as they start, and writes the sum on every line).
const dpPage = `# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 5.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
vllm:num_requests_waiting{engine="1",model_name="m"} 2.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.1
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="0",num_gpu_blocks="4000"} 1.0
vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="1",num_gpu_blocks="4000"} 1.0
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="m"} 4.0
vllm:num_preemptions_total{engine="1",model_name="m"} 6.0
# HELP vllm:num_preemptions_created Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_created gauge
vllm:num_preemptions_created{engine="0",model_name="m"} 1.7e9
vllm:num_preemptions_created{engine="1",model_name="m"} 1.7e9
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="m"} 100.0
vllm:prompt_tokens_total{engine="1",model_name="m"} 200.0
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="m"} 1000.0
vllm:generation_tokens_total{engine="1",model_name="m"} 2000.0
`

// gauges is the minimal page: the two gauges ParseEngineMetrics requires.
const gauges = `# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 2
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 1
`

// unrelatedFamilies returns n histogram families (and a counter each) that
// ParseEngineMetrics must skip, in the shape vLLM and its HTTP middleware
// print them.
func unrelatedFamilies(n int) string {
	var b strings.Builder
	buckets := []string{"0.001", "0.005", "0.01", "0.02", "0.04", "0.06", "0.08", "0.1", "0.25", "0.5",
		"0.75", "1.0", "2.5", "5.0", "7.5", "10.0", "20.0", "40.0", "80.0", "+Inf"}
	for i := range n {
		name := fmt.Sprintf("vllm:extra_latency_%03d_seconds", i)
		fmt.Fprintf(&b, "# HELP %s Histogram number %d, not read by the gateway.\n# TYPE %s histogram\n", name, i, name)
		for _, engine := range []string{"0", "1"} {
			for j, le := range buckets {
				fmt.Fprintf(&b, "%s_bucket{engine=%q,le=%q,model_name=\"m\"} %d.0\n", name, engine, le, j*i)
			}
			fmt.Fprintf(&b, "%s_count{engine=%q,model_name=\"m\"} %d.0\n", name, engine, 19*i)
			fmt.Fprintf(&b, "%s_sum{engine=%q,model_name=\"m\"} %d.25\n", name, engine, 7*i)
		}
		fmt.Fprintf(&b, "# HELP http_extra_%03d_total Requests.\n# TYPE http_extra_%03d_total counter\n", i, i)
		fmt.Fprintf(&b, "http_extra_%03d_total{handler=\"/v1/completions\",method=\"POST\",status=\"2xx\"} %d.0\n", i, i)
	}
	return b.String()
}

// prefixFamilies are families whose names start with a wanted one's, a
// histogram whose name ends in _total like a counter's, and a broken family
// nobody wants: none may be mistaken for a wanted family or fail the parse.
const prefixFamilies = `# HELP vllm:num_requests_running_something A different family.
# TYPE vllm:num_requests_running_something histogram
vllm:num_requests_running_something_bucket{le="1.0"} 7
vllm:num_requests_running_something_bucket{le="+Inf"} 9
vllm:num_requests_running_something_count 9
vllm:num_requests_running_something_sum 99
# TYPE vllm:num_requests_waiting_by_reason gauge
vllm:num_requests_waiting_by_reason{reason="capacity"} 40
# TYPE vllm:kv_cache_usage_perc_peak gauge
vllm:kv_cache_usage_perc_peak 0.99
# TYPE vllm:generation_tokens_totalx counter
vllm:generation_tokens_totalx 12345
# TYPE vllm:prompt_tokens_total_per_request histogram
vllm:prompt_tokens_total_per_request_bucket{le="+Inf"} 3
vllm:prompt_tokens_total_per_request_count 3
vllm:prompt_tokens_total_per_request_sum 300
# TYPE vllm:iteration_tokens_total histogram
vllm:iteration_tokens_total_bucket{le="1.0"} 2
vllm:iteration_tokens_total_bucket{le="+Inf"} 5
vllm:iteration_tokens_total_count 5
vllm:iteration_tokens_total_sum 500
# TYPE other_broken_family gauge
other_broken_family{ this is not exposition text at all
`

func TestParseEngineMetricsPages(t *testing.T) {
	for _, tc := range []struct {
		name    string
		page    string
		want    EngineMetrics
		wantErr error // errors.Is target; nil means success
		anyErr  bool  // some error, not a sentinel
	}{
		{
			name: "two data-parallel engines",
			page: dpPage,
			want: EngineMetrics{
				Running: 8, Waiting: 3, HasKVUsage: true,
				// Two engines of 2,000 blocks each: the mean usage, and
				// the total once (8,000 would be twice the server).
				KVUsage:   0.3,
				BlockSize: 16, NumGPUBlocks: 4000,
				Preemptions: 10, Prompt: 300, Generation: 3000,
			},
		},
		{
			name: "legacy names without the engine label",
			page: `# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 1
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="m"} 0
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="m"} 0.25
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="32",num_gpu_blocks="500"} 1
`,
			want: EngineMetrics{Running: 1, HasKVUsage: true, KVUsage: 0.25, BlockSize: 32, NumGPUBlocks: 500, Legacy: true},
		},
		{
			name: "current name wins over the legacy one",
			page: gauges + `vllm:kv_cache_usage_perc{engine="0"} 0.4
vllm:gpu_cache_usage_perc{engine="0"} 0.9
`,
			want: EngineMetrics{Running: 2, Waiting: 1, HasKVUsage: true, KVUsage: 0.4},
		},
		{
			name: "cache_config_info with extra labels in any order",
			page: gauges + `# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{swap_space_bytes="4294967296",num_gpu_blocks="27494",enable_prefix_caching="True",model_name="m",engine="0",num_gpu_blocks_override="None",gpu_memory_utilization="0.9",block_size="16",cache_dtype="auto",calculate_kv_scales="False"} 1.0
`,
			want: EngineMetrics{Running: 2, Waiting: 1, BlockSize: 16, NumGPUBlocks: 27494},
		},
		{
			name: "prefix caching off",
			page: gauges + `vllm:cache_config_info{block_size="16",num_gpu_blocks="1000",enable_prefix_caching="False",engine="0"} 1.0
`,
			want: EngineMetrics{Running: 2, Waiting: 1, BlockSize: 16, NumGPUBlocks: 1000, NoPrefixCaching: true},
		},
		{
			name: "cache_config_info before engine init",
			page: gauges + `vllm:cache_config_info{block_size="16",num_gpu_blocks="None",engine="0"} 1.0
`,
			want: EngineMetrics{Running: 2, Waiting: 1},
		},
		{
			name: "usage without cache_config_info is a plain mean",
			page: gauges + `vllm:kv_cache_usage_perc{engine="0"} 0.2
vllm:kv_cache_usage_perc{engine="1"} 0.6
`,
			want: EngineMetrics{Running: 2, Waiting: 1, HasKVUsage: true, KVUsage: 0.4},
		},
		{
			name: "counters with the _total suffix",
			page: gauges + `# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0"} 3
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0"} 30
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0"} 300
`,
			want: EngineMetrics{Running: 2, Waiting: 1, Preemptions: 3, Generation: 30, Prompt: 300},
		},
		{
			name: "counters without the _total suffix",
			page: gauges + `# TYPE vllm:num_preemptions counter
vllm:num_preemptions{engine="0"} 4
# TYPE vllm:generation_tokens counter
vllm:generation_tokens{engine="0"} 40
# TYPE vllm:prompt_tokens counter
vllm:prompt_tokens{engine="0"} 400
`,
			want: EngineMetrics{Running: 2, Waiting: 1, Preemptions: 4, Generation: 40, Prompt: 400},
		},
		{
			name: "OpenMetrics counters: family without _total, samples with it",
			page: gauges + `# TYPE vllm:num_preemptions counter
vllm:num_preemptions_total{engine="0"} 5
vllm:num_preemptions_created{engine="0"} 1.7e9
# TYPE vllm:generation_tokens counter
vllm:generation_tokens_total{engine="0"} 50
# TYPE vllm:prompt_tokens counter
vllm:prompt_tokens_total{engine="0"} 500
# EOF
`,
			want: EngineMetrics{Running: 2, Waiting: 1, Preemptions: 5, Generation: 50, Prompt: 500},
		},
		{
			name: "untyped samples without comments",
			page: `vllm:num_requests_running 6
vllm:num_requests_waiting 7
vllm:kv_cache_usage_perc 0.75
`,
			want: EngineMetrics{Running: 6, Waiting: 7, HasKVUsage: true, KVUsage: 0.75},
		},
		{
			name: "many unrelated families and prefixes of wanted names",
			page: unrelatedFamilies(50) + prefixFamilies + dpPage + unrelatedFamilies(5),
			want: EngineMetrics{
				Running: 8, Waiting: 3, HasKVUsage: true, KVUsage: 0.3, BlockSize: 16, NumGPUBlocks: 4000,
				Preemptions: 10, Prompt: 300, Generation: 3000,
			},
		},
		{
			name:    "empty page",
			page:    "",
			wantErr: ErrNoEngineMetrics,
		},
		{
			name:    "no engine gauges",
			page:    unrelatedFamilies(3) + prefixFamilies,
			wantErr: ErrNoEngineMetrics,
		},
		{
			name: "running without waiting",
			page: `# TYPE vllm:num_requests_running gauge
vllm:num_requests_running 1
vllm:kv_cache_usage_perc 0.5
`,
			wantErr: ErrNoEngineMetrics,
		},
		{
			name:   "malformed value in a wanted family",
			page:   "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{engine=\"0\"} lots\n" + gauges[strings.Index(gauges, "# TYPE vllm:num_requests_waiting"):],
			anyErr: true,
		},
		{
			name:   "malformed labels in a wanted family",
			page:   gauges + "vllm:kv_cache_usage_perc{engine=\"0\" 0.5\n",
			anyErr: true,
		},
		{
			name:   "wanted family typed twice",
			page:   gauges + "# TYPE vllm:num_requests_running gauge\n",
			anyErr: true,
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := ParseEngineMetrics(strings.NewReader(tc.page))
			switch {
			case tc.anyErr:
				if err == nil || errors.Is(err, ErrNoEngineMetrics) {
					t.Fatalf("err = %v, want a parse error; got %+v", err, got)
				}
				return
			case tc.wantErr != nil:
				if !errors.Is(err, tc.wantErr) {
					t.Fatalf("err = %v, want %v", err, tc.wantErr)
				}
				if got != (EngineMetrics{}) {
					t.Errorf("metrics with an error = %+v, want zero", got)
				}
				return
			case err != nil:
				t.Fatal(err)
			}
			if math.Abs(got.KVUsage-tc.want.KVUsage) > 1e-12 {
				t.Errorf("KVUsage = %v, want %v", got.KVUsage, tc.want.KVUsage)
			}
			got.KVUsage = tc.want.KVUsage
			got.Steps, got.HasSteps = 0, false // the step counter is not this test's subject
			if got != tc.want {
				t.Errorf("got  %+v\nwant %+v", got, tc.want)
			}
		})
	}
}

// TestParseEngineMetricsWhitespace feeds pages that the Prometheus text
// format allows (tokens separated by any run of blanks or tabs, leading
// blanks before a line) and that the full expfmt parser accepts.
func TestParseEngineMetricsWhitespace(t *testing.T) {
	for _, tc := range []struct{ name, page string }{
		{"tab between name and value", "vllm:num_requests_running\t2\nvllm:num_requests_waiting\t1\n"},
		{"tab after TYPE name", "# TYPE vllm:num_requests_running\tgauge\nvllm:num_requests_running 2\n# TYPE vllm:num_requests_waiting\tgauge\nvllm:num_requests_waiting 1\n"},
		{"leading blanks", "  vllm:num_requests_running 2\n\tvllm:num_requests_waiting 1\n"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			parser := expfmt.NewTextParser(model.UTF8Validation)
			if _, err := parser.TextToMetricFamilies(strings.NewReader(tc.page)); err != nil {
				t.Fatalf("expfmt rejects the page, so the case is moot: %v", err)
			}
			got, err := ParseEngineMetrics(strings.NewReader(tc.page))
			if err != nil {
				t.Fatal(err)
			}
			if got.Running != 2 || got.Waiting != 1 {
				t.Errorf("got %+v, want Running 2, Waiting 1", got)
			}
		})
	}
}

// TestParseEngineMetricsSkipsUnwantedCheaply checks the point of the line
// filter without timing anything: two hundred unrelated histogram families
// add no allocations over the engine families alone.
func TestParseEngineMetricsSkipsUnwantedCheaply(t *testing.T) {
	small := []byte(prefixFamilies + dpPage) // prefixFamilies holds vllm:iteration_tokens_total, which is read
	large := []byte(unrelatedFamilies(100) + prefixFamilies + dpPage + unrelatedFamilies(100))
	parse := func(page []byte) func() {
		return func() {
			if _, err := ParseEngineMetrics(bytes.NewReader(page)); err != nil {
				t.Fatal(err)
			}
		}
	}
	a := testing.AllocsPerRun(20, parse(small))
	b := testing.AllocsPerRun(20, parse(large))
	t.Logf("allocations per parse: %v for %d bytes, %v for %d bytes", a, len(small), b, len(large))
	// A little slack for buffer growth; a full parse of the large page
	// allocates tens of thousands of times.
	if b > a+10 {
		t.Errorf("a page with 200 unrelated families costs %v allocations, the engine families alone %v", b, a)
	}
}

// benchmarkPage is the simulator's page after some traffic, with about two
// hundred unrelated histogram families appended, as a busy vLLM with its
// HTTP middleware metrics might serve.
func benchmarkPage(b *testing.B) []byte {
	b.Helper()
	p := testProfile(b)
	_, srv := vllmsim.NewTestServer(b, vllmsim.Config{Profile: p, Seed: 4})
	for i := range 8 {
		if _, err := complete(context.Background(), srv.URL, strings.Repeat(fmt.Sprintf("bench %d ", i), 50), 32); err != nil {
			b.Fatal(err)
		}
	}
	page := getPage(b, srv.URL)
	return append(page, unrelatedFamilies(200)...)
}

func BenchmarkParseEngineMetrics(b *testing.B) {
	page := benchmarkPage(b)
	if _, err := ParseEngineMetrics(bytes.NewReader(page)); err != nil {
		b.Fatal(err)
	}
	b.SetBytes(int64(len(page)))
	b.ReportAllocs()
	for b.Loop() {
		if _, err := ParseEngineMetrics(bytes.NewReader(page)); err != nil {
			b.Fatal(err)
		}
	}
}

// TestParseEngineMetricsSteps reads the engine step counter from the
// sample count of vllm:iteration_tokens_total, a histogram whose lines are
// named _bucket, _count and _sum; with data-parallel engines, the fewest
// steps any of them took.
func TestParseEngineMetricsSteps(t *testing.T) {
	page := `# HELP vllm:iteration_tokens_total Histogram of number of tokens per engine_step.
# TYPE vllm:iteration_tokens_total histogram
vllm:iteration_tokens_total_bucket{engine="0",le="1.0"} 3
vllm:iteration_tokens_total_bucket{engine="0",le="+Inf"} 40
vllm:iteration_tokens_total_sum{engine="0"} 812
vllm:iteration_tokens_total_count{engine="0"} 40
vllm:iteration_tokens_total_bucket{engine="1",le="1.0"} 1
vllm:iteration_tokens_total_bucket{engine="1",le="+Inf"} 2
vllm:iteration_tokens_total_sum{engine="1"} 9
vllm:iteration_tokens_total_count{engine="1"} 2
vllm:num_requests_running{engine="0"} 1
vllm:num_requests_waiting{engine="0"} 0
`
	m, err := ParseEngineMetrics(strings.NewReader(page))
	if err != nil {
		t.Fatal(err)
	}
	if !m.HasSteps || m.Steps != 2 {
		t.Errorf("steps %v (has %v), want 2, the fewest any engine took (a request gains its own engine's steps)", m.Steps, m.HasSteps)
	}
}
