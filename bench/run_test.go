package bench

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvgate/kvgate/bench/vllmsim"
)

func newSim(t *testing.T, speedup float64) (*vllmsim.Sim, string) {
	t.Helper()
	p, err := vllmsim.LookupProfile("h100-llama-3.1-8b")
	if err != nil {
		t.Fatal(err)
	}
	sim, srv := vllmsim.NewTestServer(t, vllmsim.Config{Profile: p, Speedup: speedup, Seed: 1})
	return sim, srv.URL
}

func TestRunStreamingAgainstSimulator(t *testing.T) {
	_, url := newSim(t, 50)
	cfg := Config{
		Target: url + "/v1", Model: "meta-llama/Llama-3.1-8B-Instruct", Stream: true,
		Workload:   Workload{Input: Dist{Mean: 64}, Output: Dist{Mean: 16}},
		Arrival:    Arrival{Rate: 200},
		NumPrompts: 40, Seed: 7,
		SLO: SLO{TTFT: time.Hour},
	}
	rep, err := Run(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	s := rep.Summary
	if s.Completed != 40 || s.Failed != 0 {
		t.Fatalf("completed %d failed %d, want 40 and 0: %v", s.Completed, s.Failed, s.Errors)
	}
	if s.TotalOutputTokens != 40*16 {
		t.Errorf("output tokens %d, want %d (ignore_eos, max_tokens 16)", s.TotalOutputTokens, 40*16)
	}
	if s.TotalInputTokens < 40*64 || s.TotalInputTokens > 40*70 {
		t.Errorf("input tokens %d, want about %d", s.TotalInputTokens, 40*64)
	}
	if s.TTFT.Mean <= 0 || s.ITL.Mean <= 0 || s.TPOT.Mean <= 0 || s.E2EL.Mean < s.TTFT.Mean {
		t.Errorf("latencies: ttft %+v itl %+v tpot %+v e2el %+v", s.TTFT, s.ITL, s.TPOT, s.E2EL)
	}
	if s.RequestGoodput != s.RequestThroughput {
		t.Errorf("goodput %v with a one-hour TTFT SLO, want all of throughput %v", s.RequestGoodput, s.RequestThroughput)
	}
	if len(rep.TTFTs) != 40 || len(rep.ITLs) != 40 || rep.NumPrompts != 40 {
		t.Errorf("per-request arrays: %d ttfts, %d itls, num_prompts %d", len(rep.TTFTs), len(rep.ITLs), rep.NumPrompts)
	}
	if len(rep.Provenance.Models) != 1 || rep.Provenance.ServerVersion == "" {
		t.Errorf("provenance %+v lacks the simulator's model or version", rep.Provenance)
	}
}

const model = "meta-llama/Llama-3.1-8B-Instruct"

func TestRunChatAndNonStreaming(t *testing.T) {
	_, url := newSim(t, 50)
	for _, tc := range []struct {
		endpoint string
		stream   bool
	}{{EndpointChat, true}, {EndpointChat, false}, {EndpointCompletions, false}} {
		rep, err := Run(context.Background(), Config{Target: url, Model: model, Endpoint: tc.endpoint, Stream: tc.stream,
			Workload: Workload{Input: Dist{Mean: 20}, Output: Dist{Mean: 6}}, NumPrompts: 8, Arrival: Arrival{Rate: 500}})
		if err != nil {
			t.Fatal(err)
		}
		s := rep.Summary
		if s.Completed != 8 || s.TotalOutputTokens != 48 || s.TotalInputTokens < 8*20 {
			t.Errorf("%s stream %v: completed %d, tokens in %d out %d; errors %v", tc.endpoint, tc.stream, s.Completed, s.TotalInputTokens, s.TotalOutputTokens, s.Errors)
		}
		if (s.TTFT.Mean > 0) != tc.stream || s.E2EL.Mean <= 0 {
			t.Errorf("%s stream %v: mean TTFT %v, E2EL %v", tc.endpoint, tc.stream, s.TTFT.Mean, s.E2EL.Mean)
		}
		if want := map[string]string{EndpointChat: "openai-chat", EndpointCompletions: "openai"}[tc.endpoint]; rep.Backend != want {
			t.Errorf("backend %q, want %q", rep.Backend, want)
		}
	}
}

func TestRunErrorClasses(t *testing.T) {
	sim, url := newSim(t, 50)
	for _, tc := range []struct {
		faults  vllmsim.Faults
		stream  bool
		timeout time.Duration
		want    string
	}{
		{vllmsim.Faults{RateLimitRate: 1}, true, 0, ErrRateLimited},
		{vllmsim.Faults{UnavailableRate: 1}, true, 0, ErrOverloaded},
		{vllmsim.Faults{ServerErrorRate: 1}, true, 0, ErrServer},
		{vllmsim.Faults{DropRate: 1}, true, 0, ErrStream},
		{vllmsim.Faults{MalformedRate: 1}, false, 0, ErrStream},
		{vllmsim.Faults{Dead: true}, true, 0, ErrServer},
		{vllmsim.Faults{HangRate: 1}, true, 100 * time.Millisecond, ErrTimeout},
	} {
		sim.SetFaults(tc.faults)
		rep, err := Run(context.Background(), Config{Target: url, Model: model, Stream: tc.stream, RequestTimeout: tc.timeout,
			Workload: Workload{Input: Dist{Mean: 10}, Output: Dist{Mean: 20}}, NumPrompts: 4, Arrival: Arrival{Rate: 1000}})
		if err != nil {
			t.Fatal(err)
		}
		if s := rep.Summary; s.Completed != 0 || s.Errors[tc.want] != 4 {
			t.Errorf("faults %+v: completed %d, errors %v; want 4 %s", tc.faults, s.Completed, s.Errors, tc.want)
		}
	}
	sim.SetFaults(vllmsim.Faults{})
	rep, err := Run(context.Background(), Config{Target: url, Model: "no-such-model", NumPrompts: 2, Workload: Workload{Input: Dist{Mean: 5}, Output: Dist{Mean: 2}}})
	if err != nil {
		t.Fatal(err)
	}
	if rep.Summary.Errors[ErrClient] != 2 || rep.Requests[0].Status != 404 || rep.Requests[0].Error == "" {
		t.Errorf("unknown model: %v, first %+v", rep.Summary.Errors, rep.Requests[0])
	}
	closed := httptest.NewServer(http.NotFoundHandler())
	closed.Close()
	rep, err = Run(context.Background(), Config{Target: closed.URL, Model: model, NumPrompts: 2, Workload: Workload{Input: Dist{Mean: 5}, Output: Dist{Mean: 2}}})
	if err != nil {
		t.Fatal(err)
	}
	if rep.Summary.Errors[ErrTransport] != 2 {
		t.Errorf("closed port: errors %v, want 2 transport", rep.Summary.Errors)
	}
}

func TestStreamWithoutUsageCountsChunks(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		fmt.Fprint(w, "data: {\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\n")
		for _, tok := range []string{"He", "llo", " there"} {
			fmt.Fprintf(w, "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\": %q}}]}\n\n", tok)
			w.(http.Flusher).Flush()
		}
		fmt.Fprint(w, "data: [DONE]\n\n")
	}))
	defer srv.Close()
	rep, err := Run(context.Background(), Config{Target: srv.URL, Model: model, Endpoint: EndpointChat, Stream: true,
		NumPrompts: 3, Workload: Workload{Input: Dist{Mean: 5}, Output: Dist{Mean: 9}}})
	if err != nil {
		t.Fatal(err)
	}
	r := rep.Requests[0]
	// The role chunk carries no text: three tokens, two gaps.
	if rep.Summary.Completed != 3 || r.OutputTokens != 3 || len(r.ITLs) != 2 || r.TTFT <= 0 || r.InputTokens != 5 {
		t.Errorf("record %+v; summary errors %v", r, rep.Summary.Errors)
	}
}

// TestStreamWithoutTextFails: a stream that ends with [DONE] having
// carried no text (a role chunk, a usage chunk) failed, as vLLM's
// benchmark counts it; and a stream's end is its [DONE], not the close of
// its body after.
func TestStreamWithoutTextFails(t *testing.T) {
	held := make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		fmt.Fprint(w, "data: {\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\n")
		fmt.Fprint(w, "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":0}}\n\n")
		fmt.Fprint(w, "data: [DONE]\n\n")
		w.(http.Flusher).Flush()
		select { // the body closes late
		case <-held:
		case <-time.After(300 * time.Millisecond):
		}
	}))
	defer srv.Close()
	defer close(held)
	rep, err := Run(context.Background(), Config{Target: srv.URL, Model: model, Endpoint: EndpointChat, Stream: true,
		NumPrompts: 2, Workload: Workload{Input: Dist{Mean: 5}, Output: Dist{Mean: 9}}})
	if err != nil {
		t.Fatal(err)
	}
	if rep.Summary.Completed != 0 || rep.Summary.Errors[ErrStream] != 2 {
		t.Errorf("completed %d, errors %v; want both failed as stream errors", rep.Summary.Completed, rep.Summary.Errors)
	}
	if e := rep.Requests[0].E2EL; e <= 0 || e >= 300*time.Millisecond {
		t.Errorf("E2EL %s: want the time to [DONE], not to the body's late close", e)
	}
}

func TestChunkScanning(t *testing.T) {
	for _, tc := range []struct {
		data        string
		text, usage bool
		errorEvent  bool
	}{
		{`{"choices":[{"index":0,"text":"a","finish_reason":null}]}`, true, false, false},
		{`{"choices":[{"index":0,"text":"","finish_reason":"length"}]}`, false, false, false},
		{`{"choices":[{"delta":{"role":"assistant","content":""}}],"usage":null}`, false, false, false},
		{`{"choices":[{"delta":{"content": "x"}}]}`, true, false, false},
		{`{"choices":[{"delta":{"reasoning_content":"think"}}]}`, true, false, false},
		{`{"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":4}}`, false, true, false},
		{`{"choices":[{"delta":{"content":"a"}}],"usage": {"prompt_tokens":3}}`, true, true, false},
		{`{"error":{"message":"EngineCore died","code":500}}`, false, false, true},
		{`{"object":"error","message":"boom"}`, false, false, true},
	} {
		d := []byte(tc.data)
		if hasText(d) != tc.text || hasUsage(d) != tc.usage || isErrorEvent(d) != tc.errorEvent {
			t.Errorf("%s: text %v usage %v error %v", tc.data, hasText(d), hasUsage(d), isErrorEvent(d))
		}
	}
}

func TestSlowTargetCannotHideLatency(t *testing.T) {
	// The target serves one request at a time in 10 ms, and the client has
	// one connection: requests sent every 5 ms queue. Timed from their
	// intended send time, the last one waited ~100 ms; timed from when the
	// client got to send it, it would look like 10 ms.
	var mu sync.Mutex
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		defer mu.Unlock()
		<-time.After(10 * time.Millisecond) // the service time
		fmt.Fprint(w, `{"choices":[{"text":"x"}],"usage":{"prompt_tokens":2,"completion_tokens":1}}`)
	}))
	defer srv.Close()
	rep, err := Run(context.Background(), Config{Target: srv.URL, Model: model, MaxConnections: 1, NumPrompts: 20,
		Arrival: Arrival{Kind: ArrivalConstant, Rate: 200}, Workload: Workload{Input: Dist{Mean: 2}, Output: Dist{Mean: 1}}})
	if err != nil {
		t.Fatal(err)
	}
	last := rep.Requests[len(rep.Requests)-1]
	if rep.Summary.Completed != 20 || last.E2EL < 80*time.Millisecond {
		t.Errorf("last request's latency %v, want at least 80 ms of queueing (20 × 10 ms served, sent over 100 ms)", last.E2EL)
	}
}

func TestTenants(t *testing.T) {
	sim, _ := newSim(t, 50)
	var mu sync.Mutex
	keys := map[string]int{}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/v1/completions" {
			mu.Lock()
			keys[r.Header.Get("Authorization")]++
			mu.Unlock()
		}
		sim.ServeHTTP(w, r)
	}))
	defer srv.Close()
	rep, err := Run(context.Background(), Config{Target: srv.URL, Model: model, Stream: true, APIKey: "sk-shared",
		Workload: Workload{Input: Dist{Mean: 16}, Output: Dist{Mean: 4}}, Arrival: Arrival{Rate: 300},
		Tenants: []Tenant{
			{Name: "acme", APIKey: "sk-acme", NumPrompts: 12},
			{Name: "globex", NumPrompts: 6, Workload: Workload{Input: Dist{Mean: 8}, Output: Dist{Mean: 8}}, Arrival: Arrival{Concurrency: 2}},
		}})
	if err != nil {
		t.Fatal(err)
	}
	if keys["Bearer sk-acme"] != 12 || keys["Bearer sk-shared"] != 6 {
		t.Errorf("keys seen %v, want 12 acme and 6 with the shared key", keys)
	}
	if len(rep.Tenants) != 2 {
		t.Fatalf("tenants %+v", rep.Tenants)
	}
	a, g := rep.Tenants[0].Summary, rep.Tenants[1].Summary
	if a.Completed != 12 || a.TotalOutputTokens != 48 || g.Completed != 6 || g.TotalOutputTokens != 48 {
		t.Errorf("acme %d reqs %d tokens, globex %d reqs %d tokens", a.Completed, a.TotalOutputTokens, g.Completed, g.TotalOutputTokens)
	}
	want := JainIndex([]float64{a.OutputThroughput, g.OutputThroughput})
	if !near(rep.JainIndex, want) || rep.JainIndex <= 0.5 {
		t.Errorf("Jain's index %v, want %v (equal tokens)", rep.JainIndex, want)
	}
	if rep.Summary.Completed != 18 {
		t.Errorf("overall completed %d, want 18", rep.Summary.Completed)
	}
}

func TestConcurrencyLimits(t *testing.T) {
	_, url := newSim(t, 20)
	w := Workload{Input: Dist{Mean: 16}, Output: Dist{Mean: 30}}
	closed, err := Run(context.Background(), Config{Target: url, Model: model, Stream: true, Workload: w, NumPrompts: 24, Arrival: Arrival{Concurrency: 3}})
	if err != nil {
		t.Fatal(err)
	}
	capped, err := Run(context.Background(), Config{Target: url, Model: model, Stream: true, Workload: w, NumPrompts: 24, MaxConcurrency: 2})
	if err != nil {
		t.Fatal(err)
	}
	both, err := Run(context.Background(), Config{Target: url, Model: model, Stream: true, Workload: w, NumPrompts: 24, MaxConcurrency: 2,
		Tenants: []Tenant{{Name: "closed", Arrival: Arrival{Concurrency: 4}}, {Name: "open", Arrival: Arrival{Rate: 1000}}}})
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name string
		rep  *Report
		max  int
	}{{"3 closed-loop clients", closed, 3}, {"max concurrency 2", capped, 2}, {"max concurrency 2 over 4 clients and an open loop", both, 2}} {
		s := tc.rep.Summary
		if s.Completed != 24 || s.MaxConcurrentRequests > tc.max || s.MaxConcurrentRequests < 1 {
			t.Errorf("%s: completed %d, peak concurrency %d", tc.name, s.Completed, s.MaxConcurrentRequests)
		}
	}
	if capped.MaxConcurrency == nil || *capped.MaxConcurrency != 2 {
		t.Error("max_concurrency not reported")
	}
}

func TestDurationBoundsOpenLoop(t *testing.T) {
	_, url := newSim(t, 50)
	rep, err := Run(context.Background(), Config{Target: url, Model: model, Duration: 300 * time.Millisecond,
		Arrival: Arrival{Kind: ArrivalConstant, Rate: 100}, Workload: Workload{Input: Dist{Mean: 8}, Output: Dist{Mean: 2}}})
	if err != nil {
		t.Fatal(err)
	}
	// Constant 100/s for 300 ms: sends at 10, 20, ..., 290 ms.
	if n := len(rep.Requests); n != 29 {
		t.Errorf("%d requests, want 29", n)
	}
}

func TestTraceReplay(t *testing.T) {
	_, url := newSim(t, 50)
	rep, err := Run(context.Background(), Config{Target: url, Model: model, Stream: true,
		Workload: Workload{Kind: DatasetTrace, Path: "testdata/trace.jsonl"}, Arrival: Arrival{TimeScale: 0.5}})
	if err != nil {
		t.Fatal(err)
	}
	want := []time.Duration{0, 25, 60, 100, 130}
	if len(rep.Requests) != len(want) {
		t.Fatalf("%d requests, want the trace's 5", len(rep.Requests))
	}
	for i, r := range rep.Requests {
		if r.Intended != want[i]*time.Millisecond {
			t.Errorf("request %d intended at %v, want %v", i, r.Intended, want[i]*time.Millisecond)
		}
	}
	if s := rep.Summary; s.Completed != 5 || s.TotalOutputTokens != 8+4+6+5+3 {
		t.Errorf("completed %d output %d, want 5 and 26; %v", s.Completed, s.TotalOutputTokens, s.Errors)
	}
}

func TestSweepFindsTheKnee(t *testing.T) {
	_, url := newSim(t, 50)
	rep, err := Run(context.Background(), Config{Target: url, Model: model, Stream: true, NumPrompts: 12,
		Workload: Workload{Input: Dist{Mean: 16}, Output: Dist{Mean: 4}}, Sweep: &Sweep{Points: 3}})
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.LoadPoints) != 3 {
		t.Fatalf("%d load points, want 3", len(rep.LoadPoints))
	}
	top := rep.LoadPoints[0].Summary.RequestThroughput
	if !math.IsInf(float64(rep.LoadPoints[0].RequestRate), 1) || !near(float64(rep.LoadPoints[1].RequestRate), top/2) || !near(float64(rep.LoadPoints[2].RequestRate), top) {
		t.Errorf("rates %v, %v, %v; want inf, %v, %v", rep.LoadPoints[0].RequestRate, rep.LoadPoints[1].RequestRate, rep.LoadPoints[2].RequestRate, top/2, top)
	}
	// Whether the top rate turns latency up depends on the machine: the
	// knee is marked only where it did (findKnee's own table test holds
	// the rule), and the headline is the knee, or the top point when the
	// sweep never saturated.
	base, topE2E := rep.LoadPoints[1].Summary.E2EL.Median, rep.LoadPoints[2].Summary.E2EL.Median
	switch saturated := topE2E > 1.5*base; {
	case rep.NumPrompts != 12:
		t.Errorf("num_prompts %d", rep.NumPrompts)
	case saturated && (rep.Knee != 1 || rep.Headline != rep.Knee):
		t.Errorf("the top point saturated (median E2E %v against %v): knee %d headline %d, want 1 and 1", topE2E, base, rep.Knee, rep.Headline)
	case !saturated && (rep.Knee != -1 || rep.Headline != 2):
		t.Errorf("the sweep never saturated (median E2E %v against %v): knee %d headline %d, want -1 and 2", topE2E, base, rep.Knee, rep.Headline)
	}
	for _, p := range rep.LoadPoints {
		if p.Summary.Completed != 12 {
			t.Errorf("point %d completed %d", p.Index, p.Summary.Completed)
		}
	}
	var html strings.Builder
	if err := rep.WriteHTML(&html); err != nil || !strings.Contains(html.String(), "Throughput and goodput against offered load") {
		t.Errorf("sweep HTML lacks the offered-load chart (%v)", err)
	}
	listed, err := Run(context.Background(), Config{Target: url, Model: model, NumPrompts: 6,
		Workload: Workload{Input: Dist{Mean: 16}, Output: Dist{Mean: 4}}, Sweep: &Sweep{Rates: []float64{100, 200}},
		Tenants: []Tenant{{Name: "a", Arrival: Arrival{Rate: 1}}, {Name: "b", Arrival: Arrival{Rate: 3}}}})
	if err != nil {
		t.Fatal(err)
	}
	if len(listed.LoadPoints) != 2 || listed.LoadPoints[1].RequestRate != 200 {
		t.Errorf("listed sweep points %+v", listed.LoadPoints)
	}
}

func TestScrapeFollowsTheTarget(t *testing.T) {
	_, url := newSim(t, 20)
	rep, err := Run(context.Background(), Config{Target: url, Model: model, Stream: true, NumPrompts: 30,
		Arrival: Arrival{Rate: 300}, Workload: Workload{Input: Dist{Mean: 64}, Output: Dist{Mean: 40}},
		Scrape: []string{url + "/metrics"}, ScrapeInterval: 10 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.TimeSeries) < 2 {
		t.Fatalf("%d samples", len(rep.TimeSeries))
	}
	peakRunning, peakKV := 0.0, 0.0
	for _, s := range rep.TimeSeries {
		for _, k := range []string{"kv_usage", "running", "waiting", "preemptions_total"} {
			if _, ok := s.Values[k]; !ok {
				t.Fatalf("sample %+v lacks %s", s, k)
			}
		}
		peakRunning, peakKV = max(peakRunning, s.Values["running"]), max(peakKV, s.Values["kv_usage"])
	}
	if peakRunning < 1 || peakKV <= 0 {
		t.Errorf("peak running %v, peak KV usage %v: the scrapes saw no load", peakRunning, peakKV)
	}
	if info := rep.Provenance.Servers[url+"/metrics"]; info["num_gpu_blocks"] != "27494" || info["block_size"] != "16" {
		t.Errorf("provenance of the scraped server: %v", info)
	}
	last := rep.TimeSeries[len(rep.TimeSeries)-1]
	if last.Values["running"] != 0 {
		t.Errorf("final scrape shows %v running, want 0 after the run", last.Values["running"])
	}
}

func TestParseMetrics(t *testing.T) {
	text := `# HELP vllm:num_requests_running x
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3
vllm:num_requests_running{engine="1",model_name="m"} 4
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.7
kvgate_scheduler_queue_depth{class="interactive"} 2
kvgate_scheduler_queue_depth{class="batch"} 5
vllm:num_preemptions_total{engine="0",model_name="m"} 12 1700000000000
something_else 9
vllm:num_requests_waiting{engine="0",model_name="m"} NaN
`
	got, err := parseMetrics(strings.NewReader(text))
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]float64{"running": 7, "kv_usage": 0.6, "queue_depth": 7, "preemptions_total": 12} // NaN waiting: left out
	if len(got) != len(want) {
		t.Errorf("parsed %v, want %v", got, want)
	}
	for k, v := range want {
		if !near(got[k], v) {
			t.Errorf("%s = %v, want %v", k, got[k], v)
		}
	}
}

func TestRunCancelled(t *testing.T) {
	sim, _ := newSim(t, 1)
	ctx, cancel := context.WithCancel(context.Background())
	var once sync.Once
	// Cancel the run once the target has a request in hand.
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/v1/completions" {
			once.Do(cancel)
		}
		sim.ServeHTTP(w, r)
	}))
	defer srv.Close()
	var progress strings.Builder
	rep, err := Run(ctx, Config{Target: srv.URL, Model: model, Stream: true, Duration: time.Hour, Arrival: Arrival{Rate: 50},
		Workload: Workload{Input: Dist{Mean: 8}, Output: Dist{Mean: 1000}}, Progress: &progress})
	if !errors.Is(err, context.Canceled) || rep == nil {
		t.Fatalf("err %v, report %v; want the report so far and context.Canceled", err, rep)
	}
	if len(rep.Requests) == 0 || rep.Summary.Failed != len(rep.Requests) || rep.Summary.Errors[ErrCancelled] != len(rep.Requests) {
		t.Errorf("%d requests, %d failed, errors %v: the in-flight ones should have been cut, as cancelled (not timed out)",
			len(rep.Requests), rep.Summary.Failed, rep.Summary.Errors)
	}
	if !strings.Contains(progress.String(), "point 0: ") || !strings.Contains(progress.String(), "done") {
		t.Errorf("progress: %q", progress.String())
	}
}

// TestConstantArrivalsWrite: constant arrivals (burstiness inf, or kind
// constant) run and are written, burstiness "inf" as vLLM names it, and
// read back.
func TestConstantArrivalsWrite(t *testing.T) {
	_, url := newSim(t, 50)
	for _, a := range []Arrival{{Rate: 1000, Burstiness: math.Inf(1)}, {Kind: ArrivalConstant, Rate: 1000}} {
		rep, err := Run(context.Background(), Config{Target: url, Model: model, NumPrompts: 2, Arrival: a,
			Workload: Workload{Input: Dist{Mean: 5}, Output: Dist{Mean: 2}}})
		if err != nil {
			t.Fatal(err)
		}
		b, err := json.Marshal(rep)
		if err != nil || !strings.Contains(string(b), `"burstiness":"inf"`) {
			t.Fatalf("arrival %+v: %v, %.300s", a, err, b)
		}
		var back Arrival
		if err := json.Unmarshal(mustJSON(t, rep.Config.Arrival), &back); err != nil || !math.IsInf(back.Burstiness, 1) {
			t.Errorf("read back: %+v, %v", back, err)
		}
	}
}

func mustJSON(t *testing.T, v any) []byte {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func TestConfigValidation(t *testing.T) {
	ok := Config{Target: "http://x", Model: "m", NumPrompts: 1}
	for name, mod := range map[string]func(*Config){
		"no target":    func(c *Config) { c.Target = "" },
		"not http":     func(c *Config) { c.Target = "ftp://x" },
		"no model":     func(c *Config) { c.Model = "" },
		"endpoint":     func(c *Config) { c.Endpoint = "embeddings" },
		"unbounded":    func(c *Config) { c.NumPrompts = 0 },
		"percentile":   func(c *Config) { c.Percentiles = []float64{101} },
		"twin tenants": func(c *Config) { c.Tenants = []Tenant{{Name: "a"}, {Name: "a"}} },
		"sweep rate":   func(c *Config) { c.Sweep = &Sweep{Rates: []float64{-1}} },
		"sweep points": func(c *Config) { c.Sweep = &Sweep{Points: 1} },
		"missing file": func(c *Config) { c.Workload = Workload{Kind: DatasetShareGPT, Path: "testdata/nope.json"} },
	} {
		c := ok
		mod(&c)
		if _, err := Run(context.Background(), c); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
	// Everything at once is a burst of num_prompts: with a duration
	// alone, requests without end.
	for name, c := range map[string]Config{
		"infinite rate, duration only":   {Target: "http://x", Model: "m", Duration: time.Second},
		"automatic sweep, duration only": {Target: "http://x", Model: "m", Duration: time.Second, Sweep: &Sweep{Points: 3}},
	} {
		if _, err := c.Validate(); err == nil || !strings.Contains(err.Error(), "needs num_prompts") {
			t.Errorf("%s: %v, want refused for want of num_prompts", name, err)
		}
	}
	for name, c := range map[string]Config{
		"finite rate, duration only":  {Target: "http://x", Model: "m", Duration: time.Second, Arrival: Arrival{Rate: 5}},
		"finite sweep, duration only": {Target: "http://x", Model: "m", Duration: time.Second, Sweep: &Sweep{Rates: []float64{1, 2}}},
	} {
		if _, err := c.Validate(); err != nil {
			t.Errorf("%s: %v", name, err)
		}
	}
	// The run's arrival is shared by the tenants that take it.
	shared := Config{Target: "http://x", Model: "m", NumPrompts: 10, Arrival: Arrival{Rate: 9},
		Tenants: []Tenant{{Name: "a"}, {Name: "b", Arrival: Arrival{Rate: 1}}, {Name: "c"}}}
	if c, err := shared.Validate(); err != nil || c.Tenants[0].Arrival.Rate != 4.5 || c.Tenants[1].Arrival.Rate != 1 || c.Tenants[2].Arrival.Rate != 4.5 {
		t.Errorf("rate 9 over a, b (its own 1) and c: %+v, %v; want 4.5, 1, 4.5", c.Tenants, err)
	}
	shared.Arrival = Arrival{Kind: ArrivalConcurrency, Concurrency: 5}
	if c, err := shared.Validate(); err != nil || c.Tenants[0].Arrival.Concurrency != 3 || c.Tenants[2].Arrival.Concurrency != 2 {
		t.Errorf("5 clients over a and c: %+v, %v; want 3 and 2", c.Tenants, err)
	}
	shared.Arrival.Concurrency = 1
	if _, err := shared.Validate(); err == nil || !strings.Contains(err.Error(), "cannot be shared") {
		t.Errorf("1 client over 2 tenants: %v, want refused", err)
	}
	c, err := ok.Validate()
	if err != nil || c.Endpoint != EndpointCompletions || len(c.Percentiles) != 4 || c.Tenants[0].Name != "default" ||
		c.Workload.Input.Mean != 1024 || c.Workload.Output.Mean != 128 || !math.IsInf(c.Arrival.Rate, 1) || !c.Workload.IgnoreEOS {
		t.Errorf("defaults %+v, %v", c, err)
	}
}

func TestServerInfo(t *testing.T) {
	text := `vllm:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="True",engine="0",model_name="m",num_gpu_blocks="27494"} 1.0
vllm:cache_config_info{block_size="32",engine="1",model_name="m",num_gpu_blocks="100"} 1.0
kvgate_scheduler_backend_capacity_tokens{backend="gpu0"} 439904
weird{a="x\"y",b="z"} 1
`
	info := serverInfo(strings.NewReader(text))
	want := map[string]string{"block_size": "16", "cache_dtype": "auto", "enable_prefix_caching": "True", "num_gpu_blocks": "27494",
		"engine1.block_size": "32", "engine1.num_gpu_blocks": "100", "capacity_tokens.gpu0": "439904"}
	if len(info) != len(want) {
		t.Errorf("info %v, want %v", info, want)
	}
	for k, v := range want {
		if info[k] != v {
			t.Errorf("%s = %q, want %q", k, info[k], v)
		}
	}
	if l := parseLabels(`a="x\"y",b="z"} 1`); l["a"] != `x"y` || l["b"] != "z" {
		t.Errorf("labels %v", l)
	}
}

func TestProgressBarOnATerminal(t *testing.T) {
	var out strings.Builder
	p := &progress{w: &out, tty: true, stopc: make(chan struct{})}
	p.startPoint(2, 40, 0)
	for range 10 {
		p.sent()
		p.done(false)
	}
	p.sent()
	p.done(true)
	p.sent()
	p.finish()
	got := out.String()
	for _, want := range []string{"\r\033[K[", "] ", "28%", "point 2: 11 done (1 failed), 1 in flight", "\n"} {
		if !strings.Contains(got, want) {
			t.Errorf("progress %q lacks %q", got, want)
		}
	}
	if isTerminal(&out) {
		t.Error("a buffer taken for a terminal")
	}
}

// TestNumPromptsSharedByTheTenantsWithout: --num-prompts is shared by the
// tenants without a count of their own, as --request-rate is by those
// without an arrival; a tenant's own count is its own.
func TestNumPromptsSharedByTheTenantsWithout(t *testing.T) {
	c, err := Config{Target: "http://127.0.0.1:1", Model: model, NumPrompts: 1001, Arrival: Arrival{Rate: 10},
		Tenants: []Tenant{{Name: "a", NumPrompts: 100}, {Name: "b"}, {Name: "c"}}}.Validate()
	if err != nil {
		t.Fatal(err)
	}
	if got := []int{c.Tenants[0].NumPrompts, c.Tenants[1].NumPrompts, c.Tenants[2].NumPrompts}; got[0] != 100 || got[1] != 501 || got[2] != 500 {
		t.Errorf("num_prompts of a, b, c: %v, want 100, 501, 500", got)
	}
}

// TestMarkdownTablesUseTheRunsPercentiles: the tenant table's tail
// column is the run's highest percentile, named, never a p99 it did not
// compute (shown as 0.00 before).
func TestMarkdownTablesUseTheRunsPercentiles(t *testing.T) {
	_, url := newSim(t, 50)
	rep, err := Run(context.Background(), Config{Target: url, Model: model, NumPrompts: 4, Arrival: Arrival{Rate: 1000},
		Percentiles: []float64{50, 90}, Tenants: []Tenant{{Name: "a"}, {Name: "b"}},
		Workload: Workload{Input: Dist{Mean: 5}, Output: Dist{Mean: 4}}})
	if err != nil {
		t.Fatal(err)
	}
	var md strings.Builder
	if err := rep.WriteMarkdown(&md); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(md.String(), "p90 TTFT ms") || strings.Contains(md.String(), "p99") {
		t.Errorf("the tables' tail percentile:\n%s", md.String())
	}
}
