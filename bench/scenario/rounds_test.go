package scenario

import (
	"math"
	"strings"
	"testing"
)

func TestRoundsRatiosAndMedians(t *testing.T) {
	fig := func(tok, kv float64) RoundFigures {
		return RoundFigures{FleetTokPerSec: tok, KVUse: kv, Running: 10 * kv, Speedup: 4}
	}
	rs := &Rounds{Scenario: "overload", Speedup: 4, Targets: []string{TargetKVGate, TargetRoundRobin}, Rounds: []Round{
		{Order: []string{TargetKVGate, TargetRoundRobin}, Figures: map[string]RoundFigures{TargetKVGate: fig(900, 0.8), TargetRoundRobin: fig(1000, 0.9)}},
		// A round where the host starved everything: the ratio still
		// compares like with like, where a ratio of medians would not.
		{Order: []string{TargetRoundRobin, TargetKVGate}, Figures: map[string]RoundFigures{TargetKVGate: fig(95, 0.8), TargetRoundRobin: fig(100, 0.9)}},
		{Order: []string{TargetKVGate, TargetRoundRobin}, Figures: map[string]RoundFigures{TargetKVGate: fig(4000, 0.8), TargetRoundRobin: fig(4000, 0.9)}},
	}}
	tok := func(f RoundFigures) float64 { return f.FleetTokPerSec }
	if got := rs.Ratio(1, TargetRoundRobin, tok); math.Abs(got-0.95) > 1e-9 {
		t.Errorf("round 2 ratio %v, want 0.95", got)
	}
	if got := rs.MedianRatio(TargetRoundRobin, tok); math.Abs(got-0.95) > 1e-9 {
		t.Errorf("median ratio %v, want 0.95", got)
	}
	if got := rs.Ratio(0, TargetThreshold, tok); !math.IsNaN(got) {
		t.Errorf("ratio to a target that did not run: %v, want NaN", got)
	}
	zero := &Rounds{Targets: rs.Targets, Rounds: []Round{{Figures: map[string]RoundFigures{TargetKVGate: fig(1, 1), TargetRoundRobin: {}}}}}
	if got := zero.MedianRatio(TargetRoundRobin, tok); !math.IsNaN(got) {
		t.Errorf("median of no ratios: %v, want NaN", got)
	}
	if got := median([]float64{3, 1, 2, 10}); got != 2.5 {
		t.Errorf("median of an even count %v, want 2.5", got)
	}
	var b strings.Builder
	if err := rs.WriteText(&b); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		"| round | figure | kvgate | round-robin | kvgate/round-robin |",
		"| 2 | fleet output tok/s | 95 | 100 | 0.950 |",
		"| median | fleet output tok/s | 900 | 1000 | 0.950 |",
		"| median | KV use | 0.8 | 0.9 | 0.889 |",
	} {
		if !strings.Contains(b.String(), want) {
			t.Errorf("table lacks %q:\n%s", want, b.String())
		}
	}
}

func TestParseRefusals(t *testing.T) {
	page := `# HELP kvgate_scheduler_backend_refusals_total x
# TYPE kvgate_scheduler_backend_refusals_total counter
kvgate_scheduler_backend_refusals_total{backend="a",reason="kv_budget"} 10
kvgate_scheduler_backend_refusals_total{backend="b",reason="kv_budget"} 5
kvgate_scheduler_backend_refusals_total{backend="b",reason="pacing"} 2.5e+01
kvgate_scheduler_admissions_total{class="interactive"} 7
`
	got, err := parseRefusals(strings.NewReader(page))
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 2 || got["kv_budget"] != 15 || got["pacing"] != 25 {
		t.Errorf("refusals %v, want kv_budget 15 and pacing 25", got)
	}
}
