package bench

import (
	"math"
	"slices"
	"strings"
	"testing"
)

func TestCompareFlagsBeyondNoise(t *testing.T) {
	a := &Report{Summary: Summary{Completed: 100, RequestThroughput: 10, OutputThroughput: 100,
		TTFT: Latency{Mean: 100, Std: 20, Median: 90, Percentiles: map[float64]float64{99: 200}}}}
	b := &Report{Summary: Summary{Completed: 100, Failed: 2, RequestThroughput: 10.2, OutputThroughput: 120,
		TTFT: Latency{Mean: 110, Std: 20, Median: 93, Percentiles: map[float64]float64{99: 250}}}}
	c := Compare(a, b)
	got := map[string]Delta{}
	for _, d := range c.Overall {
		got[d.Metric] = d
	}
	for _, tc := range []struct {
		metric string
		flag   string
		noise  float64
	}{
		{"request_throughput", "", 0.03 * 10.2},     // +2% is within 3%
		{"output_throughput", "better", 0.03 * 120}, // +20%
		{"mean_ttft_ms", "worse", 2 * math.Sqrt(8)}, // +10 ms against two standard errors, 5.66 ms
		{"median_ttft_ms", "", 0.05 * 93},           // +3 ms within 5%
		{"p99_ttft_ms", "worse", 0.10 * 250},        // +50 ms beyond 10%
		{"failed", "worse", 0},                      // any new failure
	} {
		d, ok := got[tc.metric]
		if !ok {
			t.Errorf("no %s", tc.metric)
			continue
		}
		if d.Flag != tc.flag || !near(d.Noise, tc.noise) {
			t.Errorf("%s: flag %q noise %v, want %q and %v", tc.metric, d.Flag, d.Noise, tc.flag, tc.noise)
		}
	}
	if d := got["output_throughput"]; d.Delta != 20 || !near(d.Ratio, 1.2) {
		t.Errorf("output_throughput delta %v ratio %v", d.Delta, d.Ratio)
	}
	if d := got["total_input_tokens"]; d.Flag != "" || !math.IsNaN(d.Ratio) || d.Noise != -1 {
		t.Errorf("token totals are not judged: %+v", d)
	}
	if len(c.Flagged()) != 4 {
		t.Errorf("flagged %v, want 4", c.Flagged())
	}
	var sb strings.Builder
	if err := c.Write(&sb); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(sb.String(), "| p99_ttft_ms | 200.00 | 250.00 | 50.00 | 1.250 | 25.00 | WORSE |") {
		t.Errorf("table:\n%s", sb.String())
	}
	// Throughputs come first, then each latency's mean, median, percentiles.
	if c.Overall[0].Metric != "request_throughput" {
		t.Errorf("first row %s", c.Overall[0].Metric)
	}
	if same := Compare(a, a); len(same.Flagged()) != 0 {
		t.Errorf("a report against itself flags %v", same.Flagged())
	}
}

func TestCompareTenants(t *testing.T) {
	mk := func(tput float64) *Report {
		return &Report{Tenants: []TenantSummary{{Name: "acme", Summary: Summary{OutputThroughput: tput}}, {Name: "globex"}}}
	}
	c := Compare(mk(100), mk(50))
	if len(c.Tenants) != 2 {
		t.Fatalf("tenants %v", c.Tenants)
	}
	for _, d := range c.Tenants["acme"] {
		if d.Metric == "output_throughput" && d.Flag != "worse" {
			t.Errorf("acme output throughput halved: %+v", d)
		}
	}
}

func TestComparePoints(t *testing.T) {
	mk := func(tputs ...float64) *Report {
		r := &Report{}
		for i, v := range tputs {
			r.LoadPoints = append(r.LoadPoints, LoadPoint{Index: i, Summary: Summary{RequestThroughput: v}})
		}
		return r
	}
	c := Compare(mk(10, 20), mk(10, 15))
	if len(c.Points) != 2 || c.Points[0][0].Flag != "" || c.Points[1][0].Metric != "request_throughput" || c.Points[1][0].Flag != "worse" {
		t.Errorf("points %+v", c.Points)
	}
	var b strings.Builder
	_ = c.Write(&b)
	if !strings.Contains(b.String(), "## load point 1") {
		t.Errorf("table:\n%s", b.String())
	}
	if c := Compare(mk(10, 20), mk(10, 20, 30)); c.Points != nil {
		t.Error("sweeps of different lengths compared point by point")
	}
}

// TestCompareLeavesOutWhatAFileLacks: a vllm bench serve file holds only
// the latency families it was asked for (no e2el by default) and no
// good_fraction: a comparison with it has no rows for them, rather than
// reading them as 0 and flagging the other side's figures.
func TestCompareLeavesOutWhatAFileLacks(t *testing.T) {
	v, err := ReadReport("testdata/vllm-result.json")
	if err != nil {
		t.Fatal(err)
	}
	k := smallRun(t, nil)
	for _, c := range []Comparison{Compare(v, k), Compare(k, v)} {
		for _, d := range c.Overall {
			if strings.Contains(d.Metric, "e2el") || d.Metric == "good_fraction" {
				t.Errorf("a row for %s, which the vLLM file lacks: %+v", d.Metric, d)
			}
		}
	}
	if c := Compare(k, k); !slices.ContainsFunc(c.Overall, func(d Delta) bool { return d.Metric == "median_e2el_ms" }) {
		t.Error("two kvgate reports are not compared on E2EL")
	}
}
