package bench

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"
)

// zeroDelaySSE answers every completion at once as vLLM frames a stream:
// 16 one-token chunks, a usage chunk and [DONE].
func zeroDelaySSE() http.Handler {
	var b strings.Builder
	for i := range 16 {
		fmt.Fprintf(&b, "data: {\"id\":\"cmpl-1\",\"object\":\"text_completion\",\"created\":1,\"model\":\"m\",\"choices\":[{\"index\":0,\"text\":\" t%d\",\"logprobs\":null,\"finish_reason\":null}]}\n\n", i)
	}
	b.WriteString("data: {\"id\":\"cmpl-1\",\"object\":\"text_completion\",\"created\":1,\"model\":\"m\",\"choices\":[],\"usage\":{\"prompt_tokens\":17,\"completion_tokens\":16,\"total_tokens\":33}}\n\n")
	b.WriteString("data: [DONE]\n\n")
	body := []byte(b.String())
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/v1/completions" {
			http.NotFound(w, r)
			return
		}
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = w.Write(body)
	})
}

// BenchmarkHarnessStreaming measures how many streaming requests per second
// the harness drives against a zero-delay SSE target (16 tokens each), with
// 64 closed-loop clients. Run it on one core, where the target's own work
// shares the core too, so the figure is a floor:
//
//	taskset -c 0 go test -run '^$' -bench HarnessStreaming -cpu 1 -benchtime 50000x ./bench/
func BenchmarkHarnessStreaming(b *testing.B) {
	srv := httptest.NewServer(zeroDelaySSE())
	defer srv.Close()
	cfg := Config{Target: srv.URL, Model: "m", Stream: true, NumPrompts: b.N, Arrival: Arrival{Concurrency: 64},
		Workload: Workload{Input: Dist{Mean: 16}, Output: Dist{Mean: 16}}}
	b.ResetTimer()
	start, cpu0 := time.Now(), cpuTime()
	rep, err := Run(context.Background(), cfg)
	el, cpu := time.Since(start), cpuTime()-cpu0
	if err != nil {
		b.Fatal(err)
	}
	if rep.Summary.Completed != b.N || rep.Summary.TotalOutputTokens != 16*b.N {
		b.Fatalf("completed %d of %d, %d tokens; errors %v", rep.Summary.Completed, b.N, rep.Summary.TotalOutputTokens, rep.Summary.Errors)
	}
	b.ReportMetric(float64(b.N)/el.Seconds(), "req/s")
	// CPU per request (harness and target together) does not depend on
	// what else the machine runs: one core's worth is 1e6 / this, in req/s.
	b.ReportMetric(float64(cpu.Microseconds())/float64(b.N), "cpu-µs/req")
	b.ReportMetric(0, "ns/op")
}

// BenchmarkHarnessOpenLoop5000 sends Poisson arrivals at 5,000 streaming
// requests/s to the same target and reports the throughput achieved and
// how late the harness sent (p99 and max of sent − intended): a harness
// that keeps up sends on time.
//
//	taskset -c 0 go test -run '^$' -bench HarnessOpenLoop -cpu 1 -benchtime 25000x ./bench/
func BenchmarkHarnessOpenLoop5000(b *testing.B) {
	srv := httptest.NewServer(zeroDelaySSE())
	defer srv.Close()
	cfg := Config{Target: srv.URL, Model: "m", Stream: true, NumPrompts: b.N, Arrival: Arrival{Rate: 5000},
		Workload: Workload{Input: Dist{Mean: 16}, Output: Dist{Mean: 16}}}
	b.ResetTimer()
	cpu0 := cpuTime()
	rep, err := Run(context.Background(), cfg)
	cpu := cpuTime() - cpu0
	if err != nil {
		b.Fatal(err)
	}
	s := rep.Summary
	if s.Completed != b.N {
		b.Fatalf("completed %d of %d; errors %v", s.Completed, b.N, s.Errors)
	}
	lags := make([]float64, 0, len(rep.Requests))
	for _, r := range rep.Requests {
		lags = append(lags, ms(r.Sent-r.Intended))
	}
	b.ReportMetric(s.RequestThroughput, "req/s")
	b.ReportMetric(latencyOf(lags, []float64{99}).Percentiles[99], "p99-send-lag-ms")
	b.ReportMetric(s.MaxSendLagMs, "max-send-lag-ms")
	b.ReportMetric(s.E2EL.Percentiles[99], "p99-e2el-ms")
	b.ReportMetric(float64(cpu.Microseconds())/float64(b.N), "cpu-µs/req")
	b.ReportMetric(0, "ns/op")
}
