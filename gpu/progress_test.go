package gpu

import (
	"context"
	"math"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvgate/kvgate/bench/eventually"
	"github.com/kvgate/kvgate/bench/vllmsim"
)

func TestBoundDecodeRate(t *testing.T) {
	for _, tc := range []struct {
		name                              string
		tokens, seqSeconds, steps, maxCap float64
		want                              float64
	}{
		{"plain", 4900, 100, 0, 500, 49},
		{"nothing ran", 4900, 0, 0, 500, 0},
		{"no output", 0, 100, 0, 500, 0},
		{"NaN", math.NaN(), 100, 0, 500, 0},
		{"above one token a step", 5000, 10, 60, 500, 60},
		{"above the physical bound", 122_500, 100, 0, 500, 500},
		{"no bound given", 122_500, 100, 0, 0, 1225},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := boundDecodeRate(tc.tokens, tc.seqSeconds, tc.steps, tc.maxCap); got != tc.want {
				t.Errorf("boundDecodeRate = %v, want %v", got, tc.want)
			}
		})
	}
}

// TestRateSamplesBurstyCounter: a counter that jumps by a whole request's
// output when it ends reads many times the truth over one 100 ms scrape
// interval; over the window it reads the truth.
func TestRateSamplesBurstyCounter(t *testing.T) {
	var r rateSamples
	t0 := time.Unix(1000, 0)
	// 20 sequences at 49 tokens/s each, 500 tokens a request: one request
	// ends every 500/(20×49) ≈ 0.51 s, its 500 tokens counted at once.
	const running, perSeq, out = 20, 49.0, 500
	gen, naiveMax := 0.0, 0.0
	interval := 100 * time.Millisecond
	prevGen := 0.0
	for i := range 60 {
		at := t0.Add(time.Duration(i) * interval)
		ended := math.Floor(at.Sub(t0).Seconds() * running * perSeq / out)
		gen = ended * out
		if i > 0 {
			naiveMax = max(naiveMax, (gen-prevGen)/interval.Seconds()/running)
		}
		prevGen = gen
		r.add(at, gen, running)
		if i < 10 && r.rate(0, 0) != 0 {
			t.Fatalf("a rate after %v, shorter than the window's least span", at.Sub(t0))
		}
	}
	got := r.rate(0, DefaultMaxDecodeRate)
	t.Logf("one interval reads up to %.0f tokens/s per sequence; the window %.1f", naiveMax, got)
	if naiveMax < 200 {
		t.Fatalf("the bursty counter should fool a one-interval rate (%.0f)", naiveMax)
	}
	if got < perSeq/1.5 || got > perSeq*1.5 {
		t.Errorf("window rate %.1f, want about %v", got, perSeq)
	}
	// A counter that goes back (a restart) starts the window again.
	r.add(t0.Add(time.Hour), 10, running)
	if got := r.rate(0, 0); got != 0 {
		t.Errorf("after a reset: %v, want 0 until the window refills", got)
	}
}

// TestDecodeRateWithoutStepCounter runs the simulator without
// vllm:iteration_tokens_total and counting output at each request's end,
// as an emulator did: the pool must read a decode rate near the one the
// clients see, and say it follows progress by it.
func TestDecodeRateWithoutStepCounter(t *testing.T) {
	const speedup = 10
	_, srv := startSim(t, func(c *vllmsim.Config) {
		c.Speedup = speedup
		c.Quirks = vllmsim.Quirks{NoStepCounter: true, OutputAtFinish: true}
	})
	_, plain := startSim(t, func(c *vllmsim.Config) { c.Speedup = speedup })
	pc := fastPool()
	pc.StaleAfter = 2 * time.Second
	pc.MaxDecodeRate = DefaultMaxDecodeRate * speedup // the fleet's clock runs faster
	p := newTestPool(t, []BackendConfig{{Name: "quirky", URL: srv.URL}, {Name: "plain", URL: plain.URL}}, pc)
	runPool(t, p)

	ctx, cancel := context.WithCancel(t.Context())
	var wg sync.WaitGroup
	t.Cleanup(wg.Wait)
	t.Cleanup(cancel)
	var mu sync.Mutex
	var truth []float64 // output tokens per wall second of each request
	const outTokens = 100
	for i := range 8 {
		wg.Go(func() {
			for n := 0; ctx.Err() == nil; n++ {
				start := time.Now()
				u, err := complete(ctx, srv.URL, strings.Repeat("x", 40+i+n%7), outTokens)
				if err != nil {
					return
				}
				mu.Lock()
				truth = append(truth, float64(u.CompletionTokens)/time.Since(start).Seconds())
				mu.Unlock()
			}
		})
	}
	eventually.True(t, "a decode rate and 16 requests done", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return mustSnapshot(t, p, "quirky").DecodeRate > 0 && len(truth) >= 16
	})
	s := mustSnapshot(t, p, "quirky")
	mu.Lock()
	med := median(truth)
	mu.Unlock()
	t.Logf("pool's decode rate %.0f tokens/s per sequence; clients saw a median %.0f (end to end, prefill included)", s.DecodeRate, med)
	// The clients' figure includes the prefill and any wait: a lower
	// bound on the truth. The one-interval rate read many times it.
	if s.DecodeRate < 0.7*med || s.DecodeRate > 2.5*med {
		t.Errorf("decode rate %.0f, want near the %.0f the clients saw", s.DecodeRate, med)
	}
	if got := s.ProgressSource(); got != ProgressDecodeRate {
		t.Errorf("quirky backend's progress source %q, want %q", got, ProgressDecodeRate)
	}
	if got := mustSnapshot(t, p, "plain").ProgressSource(); got != ProgressSteps {
		t.Errorf("plain backend's progress source %q, want %q", got, ProgressSteps)
	}
}

func median(v []float64) float64 {
	v = slices.Clone(v)
	slices.Sort(v)
	return v[len(v)/2]
}
