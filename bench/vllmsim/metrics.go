package vllmsim

import (
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Histogram buckets as vLLM V1 declares them (vllm/v1/metrics/loggers.py).
var (
	ttftBuckets = []float64{0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80, 160, 640, 2560}
	itlBuckets  = []float64{0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80}
	e2eBuckets  = []float64{0.3, 0.5, 0.8, 1, 1.5, 2, 2.5, 5, 10, 15, 20, 30, 40, 50, 60, 120, 240, 480, 960, 1920, 7680}
	iterBuckets = []float64{1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384}
)

// buckets125 is vLLM's 1-2-5 series up to limit, for token-count histograms.
func buckets125(limit int) []float64 {
	var b []float64
	for exp := 1; ; exp *= 10 {
		for _, m := range []int{1, 2, 5} {
			v := m * exp
			if v > limit {
				return b
			}
			b = append(b, float64(v))
		}
	}
}

// engineMetrics are the vllm:* families of one engine, in their own
// registry, updated by the step loop with simulated times.
type engineMetrics struct {
	reg *prometheus.Registry

	running, waiting, usage prometheus.Gauge

	preemptions, promptTokens, genTokens prometheus.Counter
	prefixQueries, prefixHits            prometheus.Counter
	success                              map[string]prometheus.Counter

	ttft, itl, tpot, e2e, queue, inference, prefill, decode prometheus.Observer
	promptLen, genLen, maxTokens, iterTokens                prometheus.Observer

	embedding bool
	quirks    Quirks // quirks.go
}

func newEngineMetrics(p Profile, model string, legacy bool, q Quirks) *engineMetrics {
	reg := prometheus.NewRegistry()
	labels := prometheus.Labels{"model_name": model, "engine": "0"}
	if legacy {
		// Older releases had no data-parallel engine label.
		delete(labels, "engine")
	}
	names := map[string]string{
		"usage":        "vllm:kv_cache_usage_perc",
		"prefix_q":     "vllm:prefix_cache_queries_total",
		"prefix_h":     "vllm:prefix_cache_hits_total",
		"itl":          "vllm:inter_token_latency_seconds",
		"usage_help":   "KV-cache usage. 1 means 100 percent usage.",
		"itl_helpText": "Histogram of inter-token latency in seconds.",
	}
	if legacy {
		names["usage"] = "vllm:gpu_cache_usage_perc"
		names["prefix_q"] = "vllm:gpu_prefix_cache_queries_total"
		names["prefix_h"] = "vllm:gpu_prefix_cache_hits_total"
		names["itl"] = "vllm:time_per_output_token_seconds"
		names["usage_help"] = "GPU KV-cache usage. 1 means 100 percent usage."
		names["itl_helpText"] = "Histogram of time per output token in seconds."
	}
	gauge := func(name, help string) prometheus.Gauge {
		g := prometheus.NewGauge(prometheus.GaugeOpts{Name: name, Help: help, ConstLabels: labels})
		reg.MustRegister(g)
		return g
	}
	counter := func(name, help string) prometheus.Counter {
		c := prometheus.NewCounter(prometheus.CounterOpts{Name: name, Help: help, ConstLabels: labels})
		reg.MustRegister(c)
		return c
	}
	hist := func(name, help string, buckets []float64) prometheus.Observer {
		h := prometheus.NewHistogram(prometheus.HistogramOpts{Name: name, Help: help, Buckets: buckets, ConstLabels: labels})
		reg.MustRegister(h)
		return h
	}

	m := &engineMetrics{reg: reg, embedding: p.Embedding}
	m.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
	m.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
	m.usage = gauge(names["usage"], names["usage_help"])

	cacheLabels := prometheus.Labels{
		"block_size":              strconv.Itoa(p.BlockSize),
		"num_gpu_blocks":          strconv.Itoa(p.NumGPUBlocks),
		"num_gpu_blocks_override": "None",
		"gpu_memory_utilization":  "0.9",
		"cache_dtype":             "auto",
		"enable_prefix_caching":   pyBool(p.PrefixCaching && !p.Embedding),
		"swap_space_bytes":        "4294967296",
		"engine":                  "0",
	}
	if legacy {
		delete(cacheLabels, "engine")
	}
	info := prometheus.NewGauge(prometheus.GaugeOpts{
		Name: "vllm:cache_config_info", Help: "Information of the LLMEngine CacheConfig", ConstLabels: cacheLabels,
	})
	info.Set(1)
	reg.MustRegister(info)

	m.preemptions = counter("vllm:num_preemptions_total", "Cumulative number of preemption from the engine.")
	m.promptTokens = counter("vllm:prompt_tokens_total", "Number of prefill tokens processed.")
	m.genTokens = counter("vllm:generation_tokens_total", "Number of generation tokens processed.")
	m.prefixQueries = counter(names["prefix_q"], "Prefix cache queries, in terms of number of queried tokens.")
	m.prefixHits = counter(names["prefix_h"], "Prefix cache hits, in terms of number of cached tokens.")

	success := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "vllm:request_success_total", Help: "Count of successfully processed requests.", ConstLabels: labels,
	}, []string{"finished_reason"})
	reg.MustRegister(success)
	m.success = map[string]prometheus.Counter{}
	for _, r := range []string{FinishStop, FinishLength, FinishAbort} {
		m.success[r] = success.WithLabelValues(r)
	}

	tokenBuckets := buckets125(p.MaxModelLen)
	m.ttft = hist("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", ttftBuckets)
	m.itl = hist(names["itl"], names["itl_helpText"], itlBuckets)
	m.tpot = hist("vllm:request_time_per_output_token_seconds", "Histogram of time_per_output_token_seconds per request.", itlBuckets)
	m.e2e = hist("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", e2eBuckets)
	m.queue = hist("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", e2eBuckets)
	m.inference = hist("vllm:request_inference_time_seconds", "Histogram of time spent in RUNNING phase for request.", e2eBuckets)
	m.prefill = hist("vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.", e2eBuckets)
	m.decode = hist("vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.", e2eBuckets)
	m.promptLen = hist("vllm:request_prompt_tokens", "Number of prefill tokens processed.", tokenBuckets)
	m.genLen = hist("vllm:request_generation_tokens", "Number of generation tokens processed.", tokenBuckets)
	m.maxTokens = hist("vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.", tokenBuckets)
	m.iterTokens = hist("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.", iterBuckets)
	m.applyQuirks(q)
	return m
}

func pyBool(b bool) string {
	if b {
		return "True"
	}
	return "False"
}

func (m *engineMetrics) setQueues(running, waiting int, usage float64) {
	m.running.Set(float64(running))
	m.waiting.Set(float64(waiting))
	m.usage.Set(usage)
}

func (m *engineMetrics) prefixQueried(queried, hit int) {
	m.prefixQueries.Add(float64(queried))
	m.prefixHits.Add(float64(hit))
}

func (m *engineMetrics) preempted()                 { m.preemptions.Inc() }
func (m *engineMetrics) iteration(tokens int)       { m.iterTokens.Observe(float64(tokens)) }
func (m *engineMetrics) interToken(d time.Duration) { m.itl.Observe(d.Seconds()) }

func (m *engineMetrics) generated(n int) {
	if n > 0 && !m.quirks.OutputAtFinish {
		m.genTokens.Add(float64(n))
	}
}

func (m *engineMetrics) firstToken(ttft time.Duration, promptLen int) {
	m.ttft.Observe(ttft.Seconds())
	m.promptTokens.Add(float64(promptLen))
}

// finished records a request's end-of-life histograms, in simulated time.
func (m *engineMetrics) finished(r *Request, reason string, now time.Duration) {
	m.success[reason].Inc()
	if reason == FinishAbort {
		return
	}
	gen := r.generated()
	if m.quirks.OutputAtFinish && !m.embedding {
		m.genTokens.Add(float64(gen))
	}
	if m.embedding {
		m.promptTokens.Add(float64(len(r.prompt)))
	}
	m.e2e.Observe((now - r.arrival).Seconds())
	m.queue.Observe((r.scheduledAt - r.arrival).Seconds())
	m.inference.Observe((now - r.scheduledAt).Seconds())
	m.promptLen.Observe(float64(len(r.prompt)))
	if m.embedding {
		return
	}
	m.prefill.Observe((r.firstTokenAt - r.firstScheduledAt).Seconds())
	m.decode.Observe((now - r.firstTokenAt).Seconds())
	m.genLen.Observe(float64(gen))
	m.maxTokens.Observe(float64(r.maxTokens))
	if gen > 1 {
		m.tpot.Observe((now - r.firstTokenAt).Seconds() / float64(gen-1))
	}
}
