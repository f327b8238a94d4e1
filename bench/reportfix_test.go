package bench

import (
	"bytes"
	"math"
	"strings"
	"testing"
	"time"
)

// TestSweepHeaderNamesRates: a sweep's header names the rates it ran, not
// the configured "poisson at inf req/s" that the sweep replaced.
func TestSweepHeaderNamesRates(t *testing.T) {
	r := &Report{Config: Config{Sweep: &Sweep{Points: 3}, Arrival: Arrival{Kind: ArrivalPoisson, Rate: math.Inf(1)}}, Knee: -1,
		LoadPoints: []LoadPoint{{Index: 0, RequestRate: Rate(math.Inf(1))}, {Index: 1, RequestRate: 2.5}, {Index: 2, RequestRate: 12.25}}}
	var b strings.Builder
	if err := r.WriteMarkdown(&b); err != nil {
		t.Fatal(err)
	}
	md := b.String()
	if strings.Contains(md, "at inf req/s") || !strings.Contains(md, "arrivals poisson, a sweep of 3 rates: 2.5, 12.2, inf (full speed) req/s") {
		t.Errorf("sweep header:\n%s", md)
	}
	if !strings.Contains(md, "no knee: latency never turned up") {
		t.Errorf("a sweep without a knee does not say so:\n%s", md)
	}
	// A single rate keeps its own.
	r = &Report{Config: Config{Arrival: Arrival{Kind: ArrivalPoisson, Rate: 8}}, Knee: -1, LoadPoints: []LoadPoint{{RequestRate: 8}}}
	if h := arrivalHeader(r); h != "arrivals poisson at 8 req/s" {
		t.Errorf("single-rate header %q", h)
	}
}

// TestSingleRateRunHasNoKnee runs one rate against the simulator: its only
// point is not marked as a knee in any report.
func TestSingleRateRunHasNoKnee(t *testing.T) {
	rep := smallRun(t, nil)
	if rep.Knee != -1 {
		t.Fatalf("knee %d, want -1 for a single-rate run", rep.Knee)
	}
	var md, html bytes.Buffer
	if err := rep.WriteMarkdown(&md); err != nil {
		t.Fatal(err)
	}
	if err := rep.WriteHTML(&html); err != nil {
		t.Fatal(err)
	}
	if strings.Contains(md.String(), "knee") || strings.Contains(html.String(), ">knee<") {
		t.Error("a single-rate run's report marks a knee")
	}
}

// TestCompareWarnsOnDifferentSettings: verdicts between runs of different
// settings come with a warning naming them; alike runs get none.
func TestCompareWarnsOnDifferentSettings(t *testing.T) {
	base := func() *Report {
		return &Report{ModelID: "m", RequestRate: 10, NumPrompts: 100,
			Config: Config{Model: "m", Stream: true, Arrival: Arrival{Kind: ArrivalPoisson, Rate: 10}, Seed: 1,
				Workload: Workload{Kind: DatasetRandom, Input: Dist{Mean: 600}, Output: Dist{Mean: 400}}},
			Summary: Summary{Completed: 100, OutputThroughput: 1000}}
	}
	a, b := base(), base()
	b.Summary.OutputThroughput = 1200
	var out strings.Builder
	c := Compare(a, b)
	if err := c.Write(&out); err != nil {
		t.Fatal(err)
	}
	if len(c.Warnings) != 0 || strings.Contains(out.String(), "Warning") {
		t.Errorf("alike runs warned: %v", c.Warnings)
	}
	b.RequestRate, b.Config.Arrival.Rate, b.Config.Stream = 20, 20, false
	b.Config.Workload.Output.Mean = 100
	out.Reset()
	c = Compare(a, b)
	if err := c.Write(&out); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"Warning: the runs' settings differ", "request rate: 10 → 20", "streaming: true → false", "workload: random in 600 out 400 → random in 600 out 100"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("comparison lacks %q:\n%s", want, out.String())
		}
	}
	if !strings.Contains(out.String(), "BETTER") {
		t.Errorf("the verdicts should still print:\n%s", out.String())
	}
}

// TestLatencyCDFOnALogAxis: TTFT and ITL (tens of ms) and E2EL (seconds)
// share a log axis, on which each curve has room.
func TestLatencyCDFOnALogAxis(t *testing.T) {
	lo, hi, ticks := logScale(18, 5200)
	if lo != 10 || hi != 10_000 || len(ticks) != 4 {
		t.Fatalf("logScale(18, 5200) = %v, %v, %v", lo, hi, ticks)
	}
	r := &Report{Knee: -1, LoadPoints: []LoadPoint{{}}}
	for i := range 50 {
		r.Requests = append(r.Requests, Record{TTFT: time.Duration(40+i) * time.Millisecond,
			E2EL: time.Duration(4000+10*i) * time.Millisecond, ITLs: []time.Duration{20 * time.Millisecond, 22 * time.Millisecond}})
	}
	var html bytes.Buffer
	if err := r.WriteHTML(&html); err != nil {
		t.Fatal(err)
	}
	page := html.String()
	i := strings.Index(page, "Latency CDFs")
	if i < 0 || !strings.Contains(page[i:], "ms (log scale)") {
		t.Fatal("no latency CDF on a log axis")
	}
	// On a linear axis to 5,000 ms the ITL curve would sit in the first
	// 0.5% of the width; on the log axis 20 ms is a third of the way.
	pw := chartW - padL - padR
	x20 := (math.Log10(20) - math.Log10(lo)) / (math.Log10(hi) - math.Log10(lo)) * pw
	if x20 < pw/10 {
		t.Errorf("20 ms at %.0f of %.0f px", x20, pw)
	}
}

// TestChartsFillThePage: the charts are as wide as the page, not a third
// of it.
func TestChartsFillThePage(t *testing.T) {
	if pw := chartW - padL - padR; pw < 0.6*pageW {
		t.Errorf("plot area %.0f px in a %.0f px page", pw, pageW)
	}
	r := &Report{Knee: -1, LoadPoints: []LoadPoint{{}}}
	var html bytes.Buffer
	if err := r.WriteHTML(&html); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(html.String(), "max-width:1400px") || !strings.Contains(html.String(), "svg{display:block;margin:1.5em 0;width:100%") {
		t.Error("page or chart width not set to fill")
	}
}

func TestTickKeepsDigits(t *testing.T) {
	for v, want := range map[float64]string{0: "0", 7.5: "7.5", 22.5: "22.5", 30: "30", 67.5: "67.5", 1250: "1250",
		22_500: "22.5k", 40_000: "40k", 1_500_000: "1.5M", 0.25: "0.25"} {
		if got := tick(v); got != want {
			t.Errorf("tick(%v) = %q, want %q", v, got, want)
		}
	}
}
