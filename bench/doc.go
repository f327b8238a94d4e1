// Package bench measures kvgate and the servers behind it: it generates
// load against any OpenAI-compatible target (kvgate, vLLM, the simulator),
// measures every request, and writes reports. Its subpackage vllmsim is the
// vLLM simulator everything is measured against; `kvgate bench` is its
// command line.
//
// # Driving load
//
//	rep, err := bench.Run(ctx, bench.Config{
//		Target: "http://127.0.0.1:8080/v1", Model: "meta-llama/Llama-3.1-8B-Instruct",
//		Endpoint: bench.EndpointChat, Stream: true,
//		Workload: bench.Workload{Kind: bench.DatasetRandom, Input: bench.Dist{Mean: 1024}, Output: bench.Dist{Mean: 128}},
//		Arrival:  bench.Arrival{Rate: 20, Burstiness: 1},       // Poisson at 20 req/s
//		Tenants:  []bench.Tenant{{Name: "acme", APIKey: "sk-a"}, {Name: "batchco", APIKey: "sk-b", Deferred: true}},
//		NumPrompts: 1000, SLO: bench.SLO{TTFT: 500 * time.Millisecond},
//		Scrape: []string{"http://127.0.0.1:8080/metrics"},
//	})
//	err = rep.WriteFiles("out/")                                  // report.json, summary.csv, requests.csv, report.md, report.html
//	cmp := bench.Compare(baseline, rep)                           // deltas, ratios, flags beyond noise
//
// A Config names the target, the workload (Workload: synthetic length
// distributions, a ShareGPT file, a prefix-sharing mix, a JSONL trace), the
// arrivals (Arrival: Poisson, Gamma with burstiness rescaled as vllm bench
// serve does, constant, closed-loop concurrency, trace timestamps), the
// tenants (each with its key, class, weight, arrivals, workload, and
// optionally deferred through /v1/jobs), SLOs for goodput, and the
// /metrics endpoints scraped during the run. Sweep runs several load
// points, by listed rates or up to the saturation throughput measured at
// full speed, and marks the knee: the highest-rate point whose median
// end-to-end latency is within 1.5 times the lowest rate's, with at most
// 10% failed and, under SLOs, at least 90% good.
//
// Run returns a *Report: per-request Records, one LoadPoint per offered
// load with its Summary and per-tenant TenantSummary (and Jain's index),
// the scraped time series, and provenance. Summary's JSON uses vllm bench
// serve's field names (request_throughput, mean_ttft_ms, p99_ttft_ms,
// p99.9_itl_ms, ...), and a report's top level is its headline load point
// in vllm's layout, so tools that read vllm's result files read these.
// ReadReport reads one back (or a vllm result file); Compare sets two side
// by side. Summarize, Percentile and JainIndex are the arithmetic, exported
// for callers that hold records of their own.
//
// # Timing
//
// Open-loop requests are timed from their intended send time, not from
// when a busy client got around to sending them, so a slow target cannot
// hide its latency (no coordinated omission); each summary's
// max_send_lag_ms says how late the harness itself was. Closed-loop
// clients (concurrency arrivals) and requests held back by MaxConcurrency
// are timed from when they could go, as vllm bench serve times them.
// Streaming requests ask for stream_options.include_usage: token counts
// come from the usage chunk, or from counting text chunks when none comes.
//
// The package is a harness: no kvgate library package imports it outside
// tests. It is not a tokenizer: synthetic prompts are made of words that
// are one token each in Llama-3's and the simulator's tokenizers, and the
// token counts reported are the server's.
package bench
