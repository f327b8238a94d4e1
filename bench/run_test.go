package bench

import (
	"context"
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
