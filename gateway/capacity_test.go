package gateway

import (
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvgate/kvgate/bench/vllmsim"
	"github.com/kvgate/kvgate/scheduler"
)

// overloadRun is one run of the overload experiment.
type overloadRun struct {
	tokPerSec   float64 // output tokens per simulated second over the measured window
	preemptions float64
	ok, shed    int64 // answered 200; refused with 503 (kvgate) or not finished (direct)
}

// engineCounters sums a fleet's generation and preemption counters.
func engineCounters(t testing.TB, sims []*vllmsim.Sim, urls []string) (gen, preempt float64, now time.Duration) {
	t.Helper()
	for _, u := range urls {
		resp, err := http.Get(u + "/metrics")
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		for _, line := range strings.Split(string(b), "\n") {
			var v float64
			switch {
			case strings.HasPrefix(line, "vllm:generation_tokens_total{"):
				fmt.Sscan(line[strings.LastIndexByte(line, ' ')+1:], &v)
				gen += v
			case strings.HasPrefix(line, "vllm:num_preemptions_total{"):
				fmt.Sscan(line[strings.LastIndexByte(line, ' ')+1:], &v)
				preempt += v
			}
		}
	}
	return gen, preempt, sims[0].Engine().Now()
}

// driveOverload sends Poisson arrivals at rate (per simulated second) for
// dur (simulated) to target(i), and measures the fleet over the last
// two-thirds of the run.
func driveOverload(t *testing.T, sims []*vllmsim.Sim, urls []string, target func(i int) string,
	speedup, rate float64, dur time.Duration, seed uint64) overloadRun {
	t.Helper()
	rng := rand.New(rand.NewPCG(seed, 7))
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 2048, MaxConnsPerHost: 0}}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var wg sync.WaitGroup
	var res overloadRun
	var ok, shed atomic.Int64

	wallDur := time.Duration(float64(dur) / speedup)
	start := time.Now()
	measureAt := start.Add(wallDur / 3)
	var gen0, pre0, gen1 float64
	var sim0, sim1 time.Duration
	_, pre0, _ = engineCounters(t, sims, urls)
	measured := false
	next := start
	for i := 0; ; i++ {
		next = next.Add(time.Duration(rng.ExpFloat64() / (rate * speedup) * float64(time.Second)))
		if next.After(start.Add(wallDur)) {
			break
		}
		if !measured && next.After(measureAt) {
			time.Sleep(time.Until(measureAt))
			gen0, _, sim0 = engineCounters(t, sims, urls)
			measured = true
		}
		time.Sleep(time.Until(next))
		// Distinct prompts of ~600 tokens (" xyz" is one token), 400 out.
		words := make([]string, 600)
		for w := range words {
			words[w] = string([]byte{'a' + byte(rng.IntN(26)), 'a' + byte(rng.IntN(26)), 'a' + byte(rng.IntN(26))})
		}
		body := fmt.Sprintf(`{"model":"%s","prompt":" %s","max_tokens":400,"ignore_eos":true}`, llama, strings.Join(words, " "))
		url := target(i)
		wg.Go(func() {
			req, _ := http.NewRequestWithContext(ctx, http.MethodPost, url+"/v1/completions", strings.NewReader(body))
			req.Header.Set("Content-Type", "application/json")
			resp, err := client.Do(req)
			if err != nil {
				shed.Add(1)
				return
			}
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			if resp.StatusCode == 200 {
				ok.Add(1)
			} else {
				shed.Add(1)
			}
		})
	}
	gen1, res.preemptions, sim1 = engineCounters(t, sims, urls)
	res.preemptions -= pre0
	res.tokPerSec = (gen1 - gen0) / (sim1 - sim0).Seconds()
	cancel() // requests still queued or running are cut
	wg.Wait()
	res.ok, res.shed = ok.Load(), shed.Load()
	return res
}

// TestOverloadNoPreemption drives a fleet of two simulated H100s (with a
// 32k-token KV cache each, so that the experiment is short) at twice what
// it can serve, once through kvgate and once straight to the backends
// round-robin, on the same arrivals. kvgate must cause no preemption and
// keep at least 95% of the round-robin run's output token throughput.
func TestOverloadNoPreemption(t *testing.T) {
	experiment(t) // 40 seconds, measuring throughput
	p := llamaProfile(t)
	p.NumGPUBlocks, p.MaxModelLen = 2048, 8192
	const (
		speedup = 4.0
		// One backend serves about 10 requests/s of 600 in / 400 out:
		// ~40 sequences share its 32k tokens, ~3.8 s each.
		rate = 40.0
		dur  = 40 * time.Second
	)

	gw := startFleet(t, fleetOpts{profile: p, backends: 2, speedup: speedup,
		policy: scheduler.Policy{MaxQueueWait: 5 * time.Second}})
	peak := watchKVUsage(t, gw.urls)
	viaKVGate := driveOverload(t, gw.sims, gw.urls, func(int) string { return gw.srv.URL }, speedup, rate, dur, 1)
	viaKVGatePeak := peak()

	direct := startFleet(t, fleetOpts{profile: p, backends: 2, speedup: speedup})
	roundRobin := driveOverload(t, direct.sims, direct.urls, func(i int) string { return direct.urls[i%2] }, speedup, rate, dur, 1)

	ratio := viaKVGate.tokPerSec / roundRobin.tokPerSec
	t.Logf("2x overload, 2 simulated H100s (32k KV tokens each), %v simulated at %.0fx:", dur, speedup)
	t.Logf("  kvgate:      %7.0f output tok/s, %4.0f preemptions, %d answered, %d shed with 503", viaKVGate.tokPerSec, viaKVGate.preemptions, viaKVGate.ok, viaKVGate.shed)
	t.Logf("  round-robin: %7.0f output tok/s, %4.0f preemptions, %d answered, %d unfinished", roundRobin.tokPerSec, roundRobin.preemptions, roundRobin.ok, roundRobin.shed)
	t.Logf("  kvgate / round-robin throughput: %.3f; peak KV use through kvgate %.3f", ratio, viaKVGatePeak)
	if viaKVGate.preemptions != 0 {
		t.Errorf("kvgate caused %v preemptions", viaKVGate.preemptions)
	}
	if roundRobin.preemptions == 0 {
		t.Errorf("round-robin at twice capacity caused no preemption: the experiment does not overload")
	}
	if ratio < 0.95 {
		t.Errorf("kvgate's throughput is %.1f%% of round-robin's, want at least 95%%", 100*ratio)
	}
}
