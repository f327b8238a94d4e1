package baseline

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/kvgate/kvgate/bench/eventually"

	"github.com/kvgate/kvgate/bench/vllmsim"
	"github.com/kvgate/kvgate/gpu"
)

// page is a vLLM /metrics page with the given engine state.
func page(waiting, running, kv float64) string {
	return fmt.Sprintf(`# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} %g
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} %g
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} %g
`, running, waiting, kv)
}

func parsed(t *testing.T, waiting, running, kv float64) gpu.EngineMetrics {
	t.Helper()
	m, err := gpu.ParseEngineMetrics(strings.NewReader(page(waiting, running, kv)))
	if err != nil {
		t.Fatal(err)
	}
	return m
}

func TestPick(t *testing.T) {
	type be struct {
		waiting, kv float64
		stale       bool
		unhealthy   bool
		inflight    int64
	}
	for _, tc := range []struct {
		name     string
		backends []be
		turn     int
		want     int
	}{
		{"least in flight among qualifying", []be{{inflight: 3}, {inflight: 1}, {inflight: 2}}, 0, 1},
		{"KV over 0.8 is filtered", []be{{kv: 0.81}, {kv: 0.5, inflight: 4}}, 0, 1},
		{"queue over 5 is filtered", []be{{waiting: 6}, {waiting: 2, inflight: 4}}, 0, 1},
		{"thresholds are inclusive", []be{{waiting: 5, kv: 0.8}, {waiting: 6, inflight: 0}}, 1, 0},
		{"stale metrics do not qualify", []be{{stale: true}, {kv: 0.7, inflight: 5}}, 0, 1},
		{"unhealthy does not qualify", []be{{unhealthy: true}, {kv: 0.7, inflight: 5}}, 0, 1},
		{"none qualifies: least loaded of the healthy", []be{{kv: 0.95, inflight: 9}, {kv: 0.99, inflight: 2}, {unhealthy: true}}, 0, 1},
		{"all unhealthy: least loaded of all", []be{{unhealthy: true, inflight: 2}, {unhealthy: true, inflight: 1}}, 0, 1},
		{"equal load: lower saturation", []be{{waiting: 4, kv: 0.2}, {waiting: 1, kv: 0.6}, {waiting: 0, kv: 0.3}}, 0, 2},
		{"queue dominates saturation", []be{{waiting: 5, kv: 0.1}, {waiting: 0, kv: 0.7}}, 0, 1},
		{"full tie: turn 0 starts at 0", []be{{}, {}, {}}, 0, 0},
		{"full tie: turn 1 starts at 1", []be{{}, {}, {}}, 1, 1},
		{"full tie: turn wraps", []be{{}, {}, {}}, 5, 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cands := make([]candidate, len(tc.backends))
			for i, b := range tc.backends {
				cands[i] = candidate{metrics: parsed(t, b.waiting, 1, b.kv), fresh: !b.stale, unhealthy: b.unhealthy, inflight: b.inflight}
			}
			if got := pick(cands, 5, 0.8, tc.turn); got != tc.want {
				t.Errorf("pick = %d, want %d", got, tc.want)
			}
		})
	}
}

func smallProfile(t *testing.T) vllmsim.Profile {
	t.Helper()
	p, err := vllmsim.LookupProfile("h100-llama-3.1-8b")
	if err != nil {
		t.Fatal(err)
	}
	p.NumGPUBlocks, p.MaxModelLen = 130, 2048 // 2,080 KV tokens
	return p
}

const model = "meta-llama/Llama-3.1-8B-Instruct"

func metricsOf(t *testing.T, url string) gpu.EngineMetrics {
	t.Helper()
	resp, err := http.Get(url + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	m, err := gpu.ParseEngineMetrics(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return m
}

func complete(t *testing.T, url, body string) {
	t.Helper()
	resp, err := http.Post(url+"/v1/completions", "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("status %d: %s", resp.StatusCode, b)
	}
}

func TestRoundRobinAlternates(t *testing.T) {
	var urls []string
	for i := range 2 {
		_, srv := vllmsim.NewTestServer(t, vllmsim.Config{Profile: smallProfile(t), Seed: uint64(i)})
		urls = append(urls, srv.URL)
	}
	rr, err := NewRoundRobin(urls)
	if err != nil {
		t.Fatal(err)
	}
	gw := httptest.NewServer(rr)
	defer gw.Close()
	// Request i asks for i+1 tokens: backend 0 gets 1+3+5, backend 1 gets 2+4+6.
	for i := range 6 {
		complete(t, gw.URL, fmt.Sprintf(`{"model":%q,"prompt":"hi","max_tokens":%d,"ignore_eos":true}`, model, i+1))
	}
	if g0, g1 := metricsOf(t, urls[0]).Generation, metricsOf(t, urls[1]).Generation; g0 != 9 || g1 != 12 {
		t.Errorf("generated tokens per backend = %v, %v; want 9, 12", g0, g1)
	}
}

func TestRoundRobinStreams(t *testing.T) {
	// Paced at real time: 400 tokens take a few seconds, so the stream is
	// still running when its first event has been relayed.
	_, srv := vllmsim.NewTestServer(t, vllmsim.Config{Profile: smallProfile(t), Speedup: 1})
	rr, err := NewRoundRobin([]string{srv.URL})
	if err != nil {
		t.Fatal(err)
	}
	gw := httptest.NewServer(rr)
	defer gw.Close()
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, gw.URL+"/v1/completions",
		strings.NewReader(fmt.Sprintf(`{"model":%q,"prompt":"hi","max_tokens":400,"ignore_eos":true,"stream":true}`, model)))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if ct := resp.Header.Get("Content-Type"); resp.StatusCode != 200 || !strings.HasPrefix(ct, "text/event-stream") {
		t.Fatalf("status %d, content type %q", resp.StatusCode, ct)
	}
	lines := bufio.NewScanner(resp.Body)
	events := 0
	for events < 3 && lines.Scan() {
		if strings.HasPrefix(lines.Text(), "data: {") {
			events++
		}
	}
	if events < 3 {
		t.Fatalf("only %d events before the stream ended: %v", events, lines.Err())
	}
	// Events arrive while the request is still generating: the proxy
	// flushes them as they come rather than when the response ends.
	if m := metricsOf(t, srv.URL); m.Running != 1 || m.Generation >= 400 {
		t.Errorf("after 3 relayed events the backend has %v running and %v tokens generated; want 1 running, < 400", m.Running, m.Generation)
	}
}

func TestRoundRobinRejectsBadBackends(t *testing.T) {
	if _, err := NewRoundRobin(nil); err == nil {
		t.Error("no backends: no error")
	}
	if _, err := NewThreshold([]string{"not a url"}, ThresholdConfig{}); err == nil {
		t.Error("bad URL: no error")
	}
}

func TestThresholdAvoidsSaturatedAndDeadBackends(t *testing.T) {
	p := smallProfile(t)
	var (
		sims []*vllmsim.Sim
		urls []string
	)
	for i := range 3 {
		sim, srv := vllmsim.NewTestServer(t, vllmsim.Config{Profile: p, Speedup: 1, Seed: uint64(i)})
		sims, urls = append(sims, sim), append(urls, srv.URL)
	}
	th, err := NewThreshold(urls, ThresholdConfig{Staleness: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	ctx := t.Context()
	if err := th.Refresh(ctx); err != nil {
		t.Fatal(err)
	}

	// Fill backend 0's KV cache past 0.8 with a long request sent to it
	// directly, which the router does not know of.
	fill, cancelFill := context.WithCancel(ctx)
	defer cancelFill()
	prompt := strings.Repeat(" xyz", 1800)
	go func() {
		req, _ := http.NewRequestWithContext(fill, http.MethodPost, urls[0]+"/v1/completions",
			strings.NewReader(fmt.Sprintf(`{"model":%q,"prompt":%q,"max_tokens":240,"ignore_eos":true}`, model, prompt)))
		if resp, err := http.DefaultClient.Do(req); err == nil {
			resp.Body.Close()
		}
	}()
	eventually.True(t, "backend 0 to pass 0.8 KV", func() bool { return metricsOf(t, urls[0]).KVUsage > 0.8 })
	// Kill backend 2: its metrics read empty, but its health probe fails.
	if resp, err := http.DefaultClient.Do(newPut(t, urls[2]+"/admin/faults", `{"dead":true}`)); err != nil {
		t.Fatal(err)
	} else {
		resp.Body.Close()
	}
	if err := th.Refresh(ctx); err == nil {
		t.Error("refresh with a dead backend returned no error")
	}
	for range 6 {
		if got := th.Pick(); got != 1 {
			t.Fatalf("pick = %d with backend 0 at KV > 0.8 and backend 2 dead; want 1", got)
		}
	}

	// Through HTTP: every request lands on backend 1.
	gw := httptest.NewServer(th)
	defer gw.Close()
	for range 4 {
		complete(t, gw.URL, fmt.Sprintf(`{"model":%q,"prompt":"hi","max_tokens":2,"ignore_eos":true}`, model))
	}
	if g := metricsOf(t, urls[1]).Generation; g != 8 {
		t.Errorf("backend 1 generated %v tokens, want 8", g)
	}

	// With backend 0 drained and backend 2 revived, all three qualify again
	// and ties rotate over them.
	cancelFill()
	eventually.True(t, "backend 0 to drain", func() bool { return metricsOf(t, urls[0]).KVUsage < 0.8 })
	sims[2].SetFaults(vllmsim.Faults{})
	if err := th.Refresh(ctx); err != nil {
		t.Fatal(err)
	}
	seen := map[int]bool{}
	for range 3 {
		seen[th.Pick()] = true
	}
	if len(seen) != 3 {
		t.Errorf("three idle backends, picks went to %v", seen)
	}
}

func TestThresholdRunScrapes(t *testing.T) {
	_, srv := vllmsim.NewTestServer(t, vllmsim.Config{Profile: smallProfile(t)})
	th, err := NewThreshold([]string{srv.URL}, ThresholdConfig{ScrapeInterval: 10 * time.Millisecond, HealthInterval: 10 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- th.Run(ctx) }()
	b := th.backends[0]
	eventually.True(t, "a scrape", func() bool {
		b.mu.Lock()
		defer b.mu.Unlock()
		return !b.scrapedAt.IsZero()
	})
	cancel()
	if err := <-done; err != context.Canceled {
		t.Errorf("Run returned %v, want context.Canceled", err)
	}
}

func newPut(t *testing.T, url, body string) *http.Request {
	t.Helper()
	req, err := http.NewRequest(http.MethodPut, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	return req
}
