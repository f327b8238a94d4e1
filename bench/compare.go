package bench

import (
	"fmt"
	"io"
	"math"
	"slices"
	"strings"
)

// Delta is one figure of two reports side by side.
type Delta struct {
	Metric string  `json:"metric"`
	A      float64 `json:"a"`
	B      float64 `json:"b"`
	Delta  float64 `json:"delta"` // B - A
	Ratio  float64 `json:"ratio"` // B / A; NaN when A is 0
	// Noise is the smallest |Delta| taken as a real change: two standard
	// errors of the difference for means, a relative tolerance otherwise.
	Noise float64 `json:"noise"`
	// Flag is "better" or "worse" when |Delta| exceeds Noise, else "".
	Flag string `json:"flag,omitempty"`
}

// Comparison is Compare's result: the headline figures of each report, of
// each tenant present in both, and of each load point when both reports
// have the same number of them (two sweeps).
type Comparison struct {
	A, B    string // labels (file names)
	Overall []Delta
	Tenants map[string][]Delta
	Points  [][]Delta
	// Warnings name the settings the two runs differ in: their verdicts
	// then compare different experiments, not only different targets.
	Warnings []string
}

// Tolerances below which a change counts as noise.
const (
	noiseThroughput = 0.03 // relative, throughputs and goodput
	noiseMedian     = 0.05 // relative, medians and percentiles up to p90
	noiseTail       = 0.10 // relative, percentiles above p90
)

// lowerIsBetter reports a metric's direction.
func lowerIsBetter(m string) bool {
	return strings.HasSuffix(m, "_ms") || m == "failed" || m == "duration"
}

// Compare sets b against a (the baseline), headline load point against
// headline load point and tenant against tenant of the same name.
func Compare(a, b *Report) Comparison {
	c := Comparison{Overall: compareSummaries(a.Summary, b.Summary), Tenants: map[string][]Delta{}, Warnings: settingsDiffer(a, b)}
	for _, ta := range a.Tenants {
		for _, tb := range b.Tenants {
			if ta.Name == tb.Name && (len(a.Tenants) > 1 || len(b.Tenants) > 1) {
				c.Tenants[ta.Name] = compareSummaries(ta.Summary, tb.Summary)
			}
		}
	}
	if len(a.LoadPoints) > 1 && len(a.LoadPoints) == len(b.LoadPoints) {
		for i := range a.LoadPoints {
			c.Points = append(c.Points, compareSummaries(a.LoadPoints[i].Summary, b.LoadPoints[i].Summary))
		}
	}
	return c
}

func compareSummaries(a, b Summary) []Delta {
	ma, mb := a.Metrics(), b.Metrics()
	names := make([]string, 0, len(ma))
	for k := range ma {
		if _, ok := mb[k]; ok && !a.absent[k] && !b.absent[k] {
			names = append(names, k)
		}
	}
	slices.SortFunc(names, func(x, y string) int { return strings.Compare(metricOrder(x), metricOrder(y)) })
	var out []Delta
	for _, n := range names {
		d := Delta{Metric: n, A: ma[n], B: mb[n], Delta: mb[n] - ma[n], Ratio: math.NaN()}
		if d.A != 0 {
			d.Ratio = d.B / d.A
		}
		d.Noise = noise(n, a, b)
		if d.Noise >= 0 && math.Abs(d.Delta) > d.Noise {
			if (d.Delta < 0) == lowerIsBetter(n) {
				d.Flag = "better"
			} else {
				d.Flag = "worse"
			}
		}
		out = append(out, d)
	}
	return out
}

// metricOrder sorts figures: throughputs first, then latencies by metric.
func metricOrder(m string) string {
	head := []string{"request_throughput", "request_goodput", "good_fraction", "output_throughput", "total_token_throughput",
		"max_output_tokens_per_s", "completed", "failed", "max_concurrent_requests"}
	if i := slices.Index(head, m); i >= 0 {
		return fmt.Sprintf("0%02d", i)
	}
	for i, lat := range []string{"_ttft_ms", "_tpot_ms", "_itl_ms", "_e2el_ms"} {
		if strings.HasSuffix(m, lat) {
			kind := strings.TrimSuffix(m, lat)
			rank := "9"
			switch {
			case kind == "mean":
				rank = "0"
			case kind == "median":
				rank = "1"
			case kind == "std":
				rank = "8"
			case strings.HasPrefix(kind, "p"):
				rank = "2" + fmt.Sprintf("%08.3f", parseP(kind))
			}
			return fmt.Sprintf("1%d%s", i, rank)
		}
	}
	return "2" + m
}

func parseP(kind string) float64 {
	var p float64
	_, _ = fmt.Sscanf(strings.TrimPrefix(kind, "p"), "%g", &p)
	return p
}

// noise returns the change in metric m below which it is noise; -1 for
// figures not judged (token totals, durations, counts of the run's shape).
func noise(m string, a, b Summary) float64 {
	rel := func(tol float64) float64 { return tol * math.Max(math.Abs(a.Metrics()[m]), math.Abs(b.Metrics()[m])) }
	switch m {
	case "request_throughput", "request_goodput", "output_throughput", "total_token_throughput", "max_output_tokens_per_s":
		return rel(noiseThroughput)
	case "good_fraction":
		return 0.02
	case "failed":
		return 0
	}
	for name, la := range a.latencies() {
		lb := b.latencies()[name]
		switch {
		case m == "mean_"+name+"_ms":
			na, nb := float64(max(1, a.Completed)), float64(max(1, b.Completed))
			se := 2 * math.Sqrt(la.Std*la.Std/na+lb.Std*lb.Std/nb)
			return math.Max(se, rel(0.01))
		case m == "median_"+name+"_ms":
			return rel(noiseMedian)
		case strings.HasSuffix(m, "_"+name+"_ms") && strings.HasPrefix(m, "p"):
			if parseP(strings.TrimSuffix(m, "_"+name+"_ms")) > 90 {
				return rel(noiseTail)
			}
			return rel(noiseMedian)
		}
	}
	return -1
}

// Write prints the comparison as Markdown tables.
func (c Comparison) Write(w io.Writer) error {
	var b strings.Builder
	fmt.Fprintf(&b, "# %s → %s\n\n", orDash(c.A), orDash(c.B))
	if len(c.Warnings) > 0 {
		b.WriteString("**Warning: the runs' settings differ**, so BETTER and WORSE below measure the settings as well as the targets:\n\n")
		for _, w := range c.Warnings {
			fmt.Fprintf(&b, "- %s\n", w)
		}
		b.WriteString("\n")
	}
	writeDeltas(&b, c.Overall)
	names := make([]string, 0, len(c.Tenants))
	for n := range c.Tenants {
		names = append(names, n)
	}
	slices.Sort(names)
	for _, n := range names {
		fmt.Fprintf(&b, "\n## tenant %s\n\n", n)
		writeDeltas(&b, c.Tenants[n])
	}
	for i, ds := range c.Points {
		fmt.Fprintf(&b, "\n## load point %d\n\n", i)
		writeDeltas(&b, ds)
	}
	_, err := io.WriteString(w, b.String())
	return err
}

func writeDeltas(b *strings.Builder, ds []Delta) {
	b.WriteString("| metric | A | B | B − A | B / A | noise | |\n|---|---|---|---|---|---|---|\n")
	for _, d := range ds {
		ratio, nz := "-", "-"
		if !math.IsNaN(d.Ratio) {
			ratio = f3(d.Ratio)
		}
		if d.Noise >= 0 {
			nz = f2(d.Noise)
		}
		fmt.Fprintf(b, "| %s | %s | %s | %s | %s | %s | %s |\n", d.Metric, f2(d.A), f2(d.B), f2(d.Delta), ratio, nz, strings.ToUpper(d.Flag))
	}
}

// Flagged returns the deltas flagged better or worse.
func (c Comparison) Flagged() []Delta {
	var out []Delta
	for _, d := range c.Overall {
		if d.Flag != "" {
			out = append(out, d)
		}
	}
	return out
}
