package gateway

import (
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/kvgate/kvgate/bench/eventually"
)

// TestLargerThanTargetRunsAlone: a request within the backend's context
// and KV capacity but above kv_target × capacity is not refused as too
// large (vLLM would run it): it waits until kvgate has nothing else on the
// backend, then runs.
func TestLargerThanTargetRunsAlone(t *testing.T) {
	p := llamaProfile(t)
	p.NumGPUBlocks, p.MaxModelLen = 600, 9500 // 9,600 tokens of KV; 9,120 under the 0.95 target
	f := startFleet(t, fleetOpts{profile: p, speedup: 200})
	// A request already in flight: the large one must wait for it.
	first := make(chan int, 1)
	go func() {
		resp, _ := f.post(t, "/v1/completions", `{"model":"`+llama+`","prompt":"a","max_tokens":3000,"ignore_eos":true}`)
		first <- resp.StatusCode
	}()
	eventually.True(t, "the first request to be admitted", func() bool { return f.inflight() == 1 })
	start := time.Now()
	resp, body := f.post(t, "/v1/completions", `{"model":"`+llama+`","prompt":"a","max_tokens":9300,"ignore_eos":true}`)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("status %d: %s", resp.StatusCode, body)
	}
	var out struct {
		Usage struct {
			CompletionTokens int `json:"completion_tokens"`
		} `json:"usage"`
	}
	if err := json.Unmarshal(body, &out); err != nil || out.Usage.CompletionTokens != 9300 {
		t.Fatalf("usage %+v (%v): %s", out.Usage, err, body)
	}
	t.Logf("the large request took %v", time.Since(start))
	if code := <-first; code != http.StatusOK {
		t.Errorf("the first request: status %d", code)
	}
	// It waited for the backend to be its alone.
	mresp, err := http.Get(f.srv.URL + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	page, _ := io.ReadAll(mresp.Body)
	mresp.Body.Close()
	if !strings.Contains(string(page), `reason="needs_backend_alone"`) {
		t.Errorf("/metrics shows no refusal for needs_backend_alone: the large request did not wait")
	}
	// Beyond the context it is still refused at once.
	resp, body = f.post(t, "/v1/completions", `{"model":"`+llama+`","prompt":"a","max_tokens":9600}`)
	if resp.StatusCode != http.StatusBadRequest || !strings.Contains(string(body), "context") {
		t.Errorf("beyond the context: status %d: %s", resp.StatusCode, body)
	}
}
