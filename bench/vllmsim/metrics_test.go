package vllmsim

import (
	"bytes"
	"encoding/json"
	"math"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvgate/kvgate/bench/eventually"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

// scrape fetches GET /metrics and parses the Prometheus text exposition.
func scrape(t testing.TB, c simClient) map[string]*dto.MetricFamily {
	t.Helper()
	r := c.get(t, "/metrics")
	if r.status != 200 {
		t.Fatalf("/metrics status %d: %s", r.status, r.body)
	}
	if ct := r.header.Get("Content-Type"); !strings.HasPrefix(ct, "text/plain") {
		t.Errorf("/metrics Content-Type %q, want the text format", ct)
	}
	p := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := p.TextToMetricFamilies(bytes.NewReader(r.body))
	if err != nil {
		t.Fatalf("parsing /metrics: %v\n%s", err, r.body)
	}
	return fams
}

func labelMap(m *dto.Metric) map[string]string {
	out := make(map[string]string, len(m.GetLabel()))
	for _, l := range m.GetLabel() {
		out[l.GetName()] = l.GetValue()
	}
	return out
}

// findMetric returns the first series of family name whose labels include
// every pair of match.
func findMetric(fams map[string]*dto.MetricFamily, name string, match map[string]string) *dto.Metric {
	mf := fams[name]
	if mf == nil {
		return nil
	}
	for _, m := range mf.GetMetric() {
		labels := labelMap(m)
		ok := true
		for k, v := range match {
			if labels[k] != v {
				ok = false
				break
			}
		}
		if ok {
			return m
		}
	}
	return nil
}

// sampleValue returns the value of a gauge, counter or untyped series.
func sampleValue(fams map[string]*dto.MetricFamily, name string, match map[string]string) (float64, bool) {
	m := findMetric(fams, name, match)
	switch {
	case m == nil:
		return 0, false
	case m.Gauge != nil:
		return m.GetGauge().GetValue(), true
	case m.Counter != nil:
		return m.GetCounter().GetValue(), true
	case m.Untyped != nil:
		return m.GetUntyped().GetValue(), true
	}
	return 0, false
}

func histogramOf(t testing.TB, fams map[string]*dto.MetricFamily, name string) *dto.Histogram {
	t.Helper()
	m := findMetric(fams, name, nil)
	if m == nil || m.Histogram == nil {
		t.Fatalf("no histogram %s", name)
	}
	return m.GetHistogram()
}

// finiteBounds returns a histogram's bucket upper bounds without +Inf.
func finiteBounds(h *dto.Histogram) []float64 {
	var out []float64
	for _, b := range h.GetBucket() {
		if !math.IsInf(b.GetUpperBound(), +1) {
			out = append(out, b.GetUpperBound())
		}
	}
	return out
}

// vllmFamilies is reference vllm.md §1.2: every V1 family and its type.
var vllmFamilies = map[string]dto.MetricType{
	"vllm:num_requests_running":                  dto.MetricType_GAUGE,
	"vllm:num_requests_waiting":                  dto.MetricType_GAUGE,
	"vllm:kv_cache_usage_perc":                   dto.MetricType_GAUGE,
	"vllm:engine_sleep_state":                    dto.MetricType_GAUGE,
	"vllm:cache_config_info":                     dto.MetricType_GAUGE,
	"vllm:lora_requests_info":                    dto.MetricType_GAUGE,
	"vllm:num_preemptions_total":                 dto.MetricType_COUNTER,
	"vllm:prompt_tokens_total":                   dto.MetricType_COUNTER,
	"vllm:generation_tokens_total":               dto.MetricType_COUNTER,
	"vllm:request_success_total":                 dto.MetricType_COUNTER,
	"vllm:prefix_cache_queries_total":            dto.MetricType_COUNTER,
	"vllm:prefix_cache_hits_total":               dto.MetricType_COUNTER,
	"vllm:external_prefix_cache_queries_total":   dto.MetricType_COUNTER,
	"vllm:external_prefix_cache_hits_total":      dto.MetricType_COUNTER,
	"vllm:mm_cache_queries_total":                dto.MetricType_COUNTER,
	"vllm:mm_cache_hits_total":                   dto.MetricType_COUNTER,
	"vllm:corrupted_requests_total":              dto.MetricType_COUNTER,
	"vllm:spec_decode_num_draft_tokens_total":    dto.MetricType_COUNTER,
	"vllm:spec_decode_num_accepted_tokens_total": dto.MetricType_COUNTER,
	"vllm:time_to_first_token_seconds":           dto.MetricType_HISTOGRAM,
	"vllm:inter_token_latency_seconds":           dto.MetricType_HISTOGRAM,
	"vllm:request_time_per_output_token_seconds": dto.MetricType_HISTOGRAM,
	"vllm:e2e_request_latency_seconds":           dto.MetricType_HISTOGRAM,
	"vllm:request_queue_time_seconds":            dto.MetricType_HISTOGRAM,
	"vllm:request_inference_time_seconds":        dto.MetricType_HISTOGRAM,
	"vllm:request_prefill_time_seconds":          dto.MetricType_HISTOGRAM,
	"vllm:request_decode_time_seconds":           dto.MetricType_HISTOGRAM,
	"vllm:request_prompt_tokens":                 dto.MetricType_HISTOGRAM,
	"vllm:request_generation_tokens":             dto.MetricType_HISTOGRAM,
	"vllm:request_max_num_generation_tokens":     dto.MetricType_HISTOGRAM,
	"vllm:request_params_max_tokens":             dto.MetricType_HISTOGRAM,
	"vllm:request_params_n":                      dto.MetricType_HISTOGRAM,
	"vllm:iteration_tokens_total":                dto.MetricType_HISTOGRAM,
	"vllm:kv_block_lifetime_seconds":             dto.MetricType_HISTOGRAM,
	"vllm:kv_block_idle_before_evict_seconds":    dto.MetricType_HISTOGRAM,
	"vllm:kv_block_reuse_gap_seconds":            dto.MetricType_HISTOGRAM,
	"vllm:request_num_preemptions":               dto.MetricType_HISTOGRAM,
	"vllm:request_prefill_kv_computed_tokens":    dto.MetricType_HISTOGRAM,
	"vllm:engine_healthy":                        dto.MetricType_GAUGE,
	"vllm:admission_rejections_total":            dto.MetricType_COUNTER,
}

// coreFamilies must be present: what a gateway scrapes (reference §0.1).
var coreFamilies = []string{
	"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
	"vllm:cache_config_info", "vllm:num_preemptions_total", "vllm:prompt_tokens_total",
	"vllm:generation_tokens_total", "vllm:request_success_total", "vllm:prefix_cache_queries_total",
	"vllm:prefix_cache_hits_total", "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
	"vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
}

// Bucket boundaries of reference vllm.md §1.2, typed out from the table
// rather than taken from metrics.go.
var (
	refTTFTBuckets = []float64{0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80, 160, 640, 2560}
	refITLBuckets  = []float64{0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80}
	refE2EBuckets  = []float64{0.3, 0.5, 0.8, 1, 1.5, 2, 2.5, 5, 10, 15, 20, 30, 40, 50, 60, 120, 240, 480, 960, 1920, 7680}
)

// traffic is what a batch of requests reported in their usage.
type traffic struct {
	requests, prompt, completion, maxTokens, interTokens int
}

// sendTraffic sends chat and completion requests, streaming and not, all
// with ignore_eos, and adds up their usage.
func sendTraffic(t *testing.T, c simClient) traffic {
	t.Helper()
	var tr traffic
	add := func(u *usageJSON, maxTokens int) {
		t.Helper()
		if u == nil || u.CompletionTokens != maxTokens {
			t.Fatalf("usage %+v, want %d completion tokens", u, maxTokens)
		}
		tr.requests++
		tr.prompt += u.PromptTokens
		tr.completion += u.CompletionTokens
		tr.maxTokens += maxTokens
		tr.interTokens += u.CompletionTokens - 1
	}
	for i, n := range []int{5, 7} {
		var resp responseJSON
		c.post(t, "/v1/completions", map[string]any{"prompt": "metrics traffic number " + strconv.Itoa(i), "max_tokens": n, "ignore_eos": true}).ok(t, &resp)
		add(resp.Usage, n)
	}
	var chat responseJSON
	c.post(t, "/v1/chat/completions", map[string]any{"messages": chatMessages("count my tokens"), "max_tokens": 9, "ignore_eos": true}).ok(t, &chat)
	add(chat.Usage, 9)
	for _, s := range []struct {
		path string
		body map[string]any
		n    int
	}{
		{"/v1/completions", map[string]any{"prompt": "a streamed one"}, 4},
		{"/v1/chat/completions", map[string]any{"messages": chatMessages("a streamed chat")}, 3},
	} {
		s.body["max_tokens"], s.body["ignore_eos"], s.body["stream"] = s.n, true, true
		s.body["stream_options"] = map[string]any{"include_usage": true}
		r := c.post(t, s.path, s.body)
		r.ok(t, nil)
		events := parseSSE(t, r.body)
		var last responseJSON
		if err := json.Unmarshal([]byte(events[len(events)-2]), &last); err != nil {
			t.Fatal(err)
		}
		add(last.Usage, s.n)
	}
	return tr
}

// waitIdle polls /metrics until the engine reports nothing running or
// waiting and no KV blocks in use, and returns that scrape. The gauges move
// with engine steps, a moment after the last response is written.
func waitIdle(t *testing.T, c simClient, usageName string) map[string]*dto.MetricFamily {
	t.Helper()
	var fams map[string]*dto.MetricFamily
	if !eventually.Holds(5*time.Second, func() bool {
		fams = scrape(t, c)
		running, ok1 := sampleValue(fams, "vllm:num_requests_running", nil)
		waiting, ok2 := sampleValue(fams, "vllm:num_requests_waiting", nil)
		usage, ok3 := sampleValue(fams, usageName, nil)
		return ok1 && ok2 && ok3 && running == 0 && waiting == 0 && usage == 0
	}) {
		v, _ := sampleValue(fams, usageName, nil)
		t.Fatalf("engine never went idle: %s = %g", usageName, v)
	}
	return fams
}

func TestMetricsFamiliesTypesAndLabels(t *testing.T) {
	p := testProfile(t, 2048, 512)
	_, c := startSim(t, Config{Profile: p})
	sendTraffic(t, c)
	fams := waitIdle(t, c, "vllm:kv_cache_usage_perc")

	for _, name := range coreFamilies {
		if fams[name] == nil {
			t.Errorf("family %s missing", name)
		}
	}
	for name, mf := range fams {
		want, known := vllmFamilies[name]
		if !known {
			t.Errorf("family %s is not in reference vllm.md §1.2", name)
			continue
		}
		if mf.GetType() != want {
			t.Errorf("%s: type %v, want %v", name, mf.GetType(), want)
		}
		for _, m := range mf.GetMetric() {
			labels := labelMap(m)
			if name != "vllm:cache_config_info" && labels["model_name"] != p.Model {
				t.Errorf("%s%v: model_name %q, want %q", name, labels, labels["model_name"], p.Model)
			}
			if labels["engine"] != "0" {
				t.Errorf("%s%v: engine %q, want \"0\"", name, labels, labels["engine"])
			}
		}
	}
}

func TestMetricsHistogramBuckets(t *testing.T) {
	p := testProfile(t, 2048, 512)
	_, c := startSim(t, Config{Profile: p})
	sendTraffic(t, c)
	fams := scrape(t, c)
	for _, tc := range []struct {
		name string
		want []float64
	}{
		{"vllm:time_to_first_token_seconds", refTTFTBuckets},
		{"vllm:inter_token_latency_seconds", refITLBuckets},
		{"vllm:request_time_per_output_token_seconds", refITLBuckets},
		{"vllm:e2e_request_latency_seconds", refE2EBuckets},
		{"vllm:request_queue_time_seconds", refE2EBuckets},
		// 1-2-5 series up to max_model_len 2048.
		{"vllm:request_prompt_tokens", []float64{1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000}},
		{"vllm:request_generation_tokens", []float64{1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000}},
		{"vllm:request_params_max_tokens", []float64{1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000}},
	} {
		h := histogramOf(t, fams, tc.name)
		if got := finiteBounds(h); !slices.Equal(got, tc.want) {
			t.Errorf("%s buckets\n got %v\nwant %v", tc.name, got, tc.want)
		}
		bs := h.GetBucket()
		if len(bs) == 0 || !math.IsInf(bs[len(bs)-1].GetUpperBound(), +1) || bs[len(bs)-1].GetCumulativeCount() != h.GetSampleCount() {
			t.Errorf("%s: want a +Inf bucket holding all %d samples", tc.name, h.GetSampleCount())
		}
	}
}

func TestMetricsCacheConfigInfo(t *testing.T) {
	p := testProfile(t, 2048, 512)
	_, c := startSim(t, Config{Profile: p})
	fams := scrape(t, c)
	mf := fams["vllm:cache_config_info"]
	if mf == nil || len(mf.GetMetric()) != 1 {
		t.Fatalf("cache_config_info: %v, want one series", mf)
	}
	m := mf.GetMetric()[0]
	if v := m.GetGauge().GetValue(); v != 1 {
		t.Errorf("cache_config_info value %g, want 1", v)
	}
	labels := labelMap(m)
	for k, want := range map[string]string{
		"block_size":            strconv.Itoa(p.BlockSize),
		"num_gpu_blocks":        strconv.Itoa(p.NumGPUBlocks),
		"engine":                "0",
		"enable_prefix_caching": "True",
	} {
		if labels[k] != want {
			t.Errorf("cache_config_info %s=%q, want %q (labels %v)", k, labels[k], want, labels)
		}
	}
	if v, ok := sampleValue(fams, "vllm:kv_cache_usage_perc", nil); !ok || v != 0 {
		t.Errorf("kv_cache_usage_perc %g (present %v) on a fresh server, want 0", v, ok)
	}
}

func TestMetricsCountersMatchTraffic(t *testing.T) {
	p := testProfile(t, 2048, 512)
	_, c := startSim(t, Config{Profile: p})
	tr := sendTraffic(t, c)
	fams := waitIdle(t, c, "vllm:kv_cache_usage_perc")

	for _, tc := range []struct {
		name  string
		match map[string]string
		want  int
	}{
		{"vllm:prompt_tokens_total", nil, tr.prompt},
		{"vllm:generation_tokens_total", nil, tr.completion},
		{"vllm:request_success_total", map[string]string{"finished_reason": FinishLength}, tr.requests},
		{"vllm:request_success_total", map[string]string{"finished_reason": FinishStop}, 0},
		{"vllm:request_success_total", map[string]string{"finished_reason": FinishAbort}, 0},
		{"vllm:num_preemptions_total", nil, 0},
		{"vllm:num_requests_running", nil, 0},
		{"vllm:num_requests_waiting", nil, 0},
		{"vllm:kv_cache_usage_perc", nil, 0},
	} {
		v, ok := sampleValue(fams, tc.name, tc.match)
		if !ok || v != float64(tc.want) {
			t.Errorf("%s%v = %g (present %v), want %d", tc.name, tc.match, v, ok, tc.want)
		}
	}
	for _, tc := range []struct {
		name       string
		count, sum int // sum -1: positive; -2: not checked
	}{
		{"vllm:time_to_first_token_seconds", tr.requests, -1},
		{"vllm:e2e_request_latency_seconds", tr.requests, -1},
		{"vllm:request_queue_time_seconds", tr.requests, -2}, // sequential requests on an unpaced engine do not queue
		{"vllm:inter_token_latency_seconds", tr.interTokens, -1},
		{"vllm:request_time_per_output_token_seconds", tr.requests, -1},
		{"vllm:request_prompt_tokens", tr.requests, tr.prompt},
		{"vllm:request_generation_tokens", tr.requests, tr.completion},
		{"vllm:request_params_max_tokens", tr.requests, tr.maxTokens},
	} {
		h := histogramOf(t, fams, tc.name)
		if int(h.GetSampleCount()) != tc.count {
			t.Errorf("%s count %d, want %d", tc.name, h.GetSampleCount(), tc.count)
		}
		if tc.sum >= 0 && h.GetSampleSum() != float64(tc.sum) {
			t.Errorf("%s sum %g, want %d", tc.name, h.GetSampleSum(), tc.sum)
		}
		if tc.sum == -1 && !(h.GetSampleSum() > 0) {
			t.Errorf("%s sum %g, want a positive simulated time", tc.name, h.GetSampleSum())
		}
	}
}

func TestMetricsLegacyNames(t *testing.T) {
	p := testProfile(t, 2048, 512)
	_, c := startSim(t, Config{Profile: p, LegacyMetrics: true})
	sendTraffic(t, c)
	fams := waitIdle(t, c, "vllm:gpu_cache_usage_perc")

	for name, typ := range map[string]dto.MetricType{
		"vllm:gpu_cache_usage_perc":           dto.MetricType_GAUGE,
		"vllm:gpu_prefix_cache_queries_total": dto.MetricType_COUNTER,
		"vllm:gpu_prefix_cache_hits_total":    dto.MetricType_COUNTER,
		"vllm:time_per_output_token_seconds":  dto.MetricType_HISTOGRAM,
		"vllm:num_requests_running":           dto.MetricType_GAUGE,
		"vllm:prompt_tokens_total":            dto.MetricType_COUNTER,
		"vllm:cache_config_info":              dto.MetricType_GAUGE,
	} {
		mf := fams[name]
		if mf == nil {
			t.Errorf("legacy family %s missing", name)
			continue
		}
		if mf.GetType() != typ {
			t.Errorf("%s: type %v, want %v", name, mf.GetType(), typ)
		}
	}
	if h := histogramOf(t, fams, "vllm:time_per_output_token_seconds"); !slices.Equal(finiteBounds(h), refITLBuckets) {
		t.Errorf("time_per_output_token_seconds buckets %v, want %v", finiteBounds(h), refITLBuckets)
	}
	for _, name := range []string{
		"vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:inter_token_latency_seconds",
	} {
		if fams[name] != nil {
			t.Errorf("new family %s present with legacy metrics", name)
		}
	}
	for name, mf := range fams {
		for _, m := range mf.GetMetric() {
			labels := labelMap(m)
			if _, ok := labels["engine"]; ok {
				t.Errorf("%s%v has an engine label with legacy metrics", name, labels)
			}
			if name != "vllm:cache_config_info" && labels["model_name"] != p.Model {
				t.Errorf("%s%v: model_name %q, want %q", name, labels, labels["model_name"], p.Model)
			}
		}
	}
	var v map[string]string
	c.get(t, "/version").ok(t, &v)
	if v["version"] != LegacyVersion {
		t.Errorf("/version %v with legacy metrics, want %s", v, LegacyVersion)
	}
}

func TestMetricsPrefixCacheHits(t *testing.T) {
	p := testProfile(t, 2048, 512)
	_, c := startSim(t, Config{Profile: p})
	var sb strings.Builder
	for i := range 60 {
		sb.WriteString("the shared system prompt line ")
		sb.WriteString(strconv.Itoa(i))
		sb.WriteString(". ")
	}
	long := sb.String()
	n := c.tokenCount(t, map[string]any{"prompt": long})
	if n < 10*p.BlockSize {
		t.Fatalf("prompt is only %d tokens", n)
	}
	send := func(prompt string) {
		t.Helper()
		var resp responseJSON
		c.post(t, "/v1/completions", map[string]any{"prompt": prompt, "max_tokens": 4, "ignore_eos": true}).ok(t, &resp)
	}
	counters := func() (queries, hits float64) {
		t.Helper()
		fams := scrape(t, c)
		queries, ok1 := sampleValue(fams, "vllm:prefix_cache_queries_total", nil)
		hits, ok2 := sampleValue(fams, "vllm:prefix_cache_hits_total", nil)
		if !ok1 || !ok2 {
			t.Fatal("prefix cache counters missing")
		}
		return queries, hits
	}

	send(long)
	q, h := counters()
	if q != float64(n) || h != 0 {
		t.Errorf("after the first request: queries %g hits %g, want %d and 0", q, h, n)
	}
	send(long)
	q, h = counters()
	// Every full block of the prompt hits except that the last prompt token
	// is always recomputed.
	wantHits := (n - 1) / p.BlockSize * p.BlockSize
	if q != float64(2*n) || h != float64(wantHits) || h <= 0 {
		t.Errorf("after the repeat: queries %g hits %g, want %d and %d", q, h, 2*n, wantHits)
	}
	send("a different opening " + long)
	_, h2 := counters()
	if h2 != h {
		t.Errorf("a prompt with a different first block hit the cache: hits %g -> %g", h, h2)
	}
}

// vLLM labels its metrics with the served model name (loggers.py:
// model_name = served_model_name), which is what a gateway matches on.
func TestMetricsModelNameIsServedName(t *testing.T) {
	p := testProfile(t, 2048, 512)
	_, c := startSim(t, Config{Profile: p, ServedModelName: "served-llama"})
	var resp responseJSON
	c.post(t, "/v1/completions", map[string]any{"model": "served-llama", "prompt": "label me", "max_tokens": 2}).ok(t, &resp)
	for name, mf := range scrape(t, c) {
		if name == "vllm:cache_config_info" {
			continue
		}
		for _, m := range mf.GetMetric() {
			if got := labelMap(m)["model_name"]; got != "served-llama" {
				t.Errorf("%s: model_name %q, want the served name served-llama", name, got)
			}
		}
	}
}

func TestMetricsEmbeddingModel(t *testing.T) {
	p := embeddingProfile(t)
	_, c := startSim(t, Config{Profile: p})
	var v embeddingResp
	c.post(t, "/v1/embeddings", map[string]any{"input": []string{"one two three", "four five"}}).ok(t, &v)
	fams := waitIdle(t, c, "vllm:kv_cache_usage_perc")
	for _, tc := range []struct {
		name  string
		match map[string]string
		want  int
	}{
		{"vllm:prompt_tokens_total", nil, v.Usage.PromptTokens},
		{"vllm:generation_tokens_total", nil, 0},
		{"vllm:request_success_total", map[string]string{"finished_reason": FinishStop}, 2},
	} {
		if got, ok := sampleValue(fams, tc.name, tc.match); !ok || got != float64(tc.want) {
			t.Errorf("%s%v = %g (present %v), want %d", tc.name, tc.match, got, ok, tc.want)
		}
	}
	info := findMetric(fams, "vllm:cache_config_info", nil)
	if info == nil {
		t.Fatal("no cache_config_info")
	}
	if l := labelMap(info); l["enable_prefix_caching"] != "False" || l["num_gpu_blocks"] != strconv.Itoa(p.NumGPUBlocks) {
		t.Errorf("cache_config_info %v, want prefix caching off and %d blocks", l, p.NumGPUBlocks)
	}
	if h := histogramOf(t, fams, "vllm:e2e_request_latency_seconds"); h.GetSampleCount() != 2 {
		t.Errorf("e2e count %d, want 2", h.GetSampleCount())
	}
	for name, mf := range fams {
		for _, m := range mf.GetMetric() {
			if l := labelMap(m); name != "vllm:cache_config_info" && l["model_name"] != p.Model {
				t.Errorf("%s: model_name %q, want %q", name, l["model_name"], p.Model)
			}
		}
	}
}
