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

// BenchmarkStreamRelay streams 4-token completions through kvgate from an
// unpaced simulator, all in-process, from 16 clients: a CPU profile of it
// (-cpuprofile) shows what the relay costs per stream.
//
//	go test -run '^$' -bench StreamRelay -benchtime 5000x -cpuprofile /tmp/relay.prof ./gateway/
func BenchmarkStreamRelay(b *testing.B) {
	f := startFleet(b, fleetOpts{profile: llamaProfile(b)})
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 64}}
	body := `{"model":"` + llama + `","prompt":"hello","max_tokens":4,"ignore_eos":true,"stream":true}`
	b.SetParallelism(8)
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			resp, err := client.Post(f.srv.URL+"/v1/completions", "application/json", strings.NewReader(body))
			if err != nil {
				b.Error(err)
				return
			}
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			if resp.StatusCode != http.StatusOK {
				b.Errorf("status %d", resp.StatusCode)
				return
			}
		}
	})
}

func TestPetWatchdog(t *testing.T) {
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	now := time.Now()
	if got := petWatchdog(timer, time.Hour, time.Time{}); got.Before(now) {
		t.Error("the first line did not reset the watchdog")
	}
	recent := time.Now().Add(-time.Second) // within an hour/64
	if got := petWatchdog(timer, time.Hour, recent); !got.Equal(recent) {
		t.Error("reset again within idle/64 of the last reset")
	}
	old := time.Now().Add(-2 * time.Minute) // more than an hour/64 ago
	if got := petWatchdog(timer, time.Hour, old); !got.After(old) {
		t.Error("not reset idle/64 after the last reset")
	}
}
