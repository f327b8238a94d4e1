package scenario

import (
	"context"
	"fmt"
	"io"
	"maps"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/kvgate/kvgate/bench"
)

// RoundFigures are what one target measured in one round: the fleet's
// output per simulated second, its preemptions, the KV use and running
// sequences the simulators reported (averaged over the measurement window
// and the backends), and the speed-up the fleet's clock kept against the
// one asked for.
type RoundFigures struct {
	FleetTokPerSec float64 `json:"fleet_tok_per_s"`
	// FleetTokPerBusySec and Stalled: see TargetResult.
	FleetTokPerBusySec float64 `json:"fleet_tok_per_busy_s"`
	Stalled            float64 `json:"stalled"`
	Preemptions        float64 `json:"preemptions"`
	KVUse              float64 `json:"kv_use"`
	Running            float64 `json:"running"`
	Speedup            float64 `json:"speedup"`
}

// Round is one pass over the targets.
type Round struct {
	Order   []string                `json:"order"`
	Figures map[string]RoundFigures `json:"figures"`
	// Refusals are kvgate's admission refusals by reason
	// (TargetResult.Refusals).
	Refusals map[string]float64 `json:"refusals,omitempty"`
}

// Rounds is a scenario run several times over, the targets interleaved:
// on a host whose load moves (other work, a CPU hog), each round's targets
// run minutes apart at most, and each round's ratio compares targets that
// met about the same load. The medians of the per-round ratios are the
// figures to read, not the ratio of medians.
type Rounds struct {
	Scenario string  `json:"scenario"`
	Describe string  `json:"describe"`
	Speedup  float64 `json:"speedup"`
	Targets  []string
	Rounds   []Round `json:"rounds"`
}

// RunRounds runs the scenario rounds times against o.Targets, reversing
// their order every other round (kvgate, round-robin; round-robin, kvgate;
// ...) so that neither always runs first, and writes each round's reports
// under Out/round-N/<scenario>/ and the rounds' table as
// Out/<scenario>/rounds.md.
func (sc Scenario) RunRounds(ctx context.Context, o Options, rounds int) (*Rounds, error) {
	if rounds < 1 {
		return nil, fmt.Errorf("rounds %d must be at least 1", rounds)
	}
	if err := o.defaults(); err != nil {
		return nil, err
	}
	p, err := sc.plan(o)
	if err != nil {
		return nil, err
	}
	out := &Rounds{Scenario: sc.Name, Describe: p.describe, Speedup: o.Speedup, Targets: slices.Clone(o.Targets)}
	for r := range rounds {
		ro := o
		ro.Targets = slices.Clone(o.Targets)
		if r%2 == 1 {
			slices.Reverse(ro.Targets)
		}
		if o.Out != "" {
			ro.Out = filepath.Join(o.Out, fmt.Sprintf("round-%d", r+1))
		}
		o.Log.Info("scenario round starting", "scenario", sc.Name, "round", r+1, "order", strings.Join(ro.Targets, ","))
		res, err := sc.Run(ctx, ro)
		if err != nil {
			return nil, fmt.Errorf("round %d: %w", r+1, err)
		}
		rd := Round{Order: ro.Targets, Figures: map[string]RoundFigures{}}
		for _, t := range res.Targets {
			kv, run := windowGauges(t.Report, t.gatewayMetrics, p.measureFrom, p.sending)
			rd.Figures[t.Target] = RoundFigures{FleetTokPerSec: t.FleetTokPerSec, FleetTokPerBusySec: t.FleetTokPerBusySec, Stalled: t.Stalled, Preemptions: t.Preemptions, KVUse: kv, Running: run, Speedup: t.Speedup}
			if t.Target == TargetKVGate {
				rd.Refusals = t.Refusals
			}
		}
		out.Rounds = append(out.Rounds, rd)
	}
	if o.Out != "" {
		dir := filepath.Join(o.Out, sc.Name)
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return nil, err
		}
		f, err := os.Create(filepath.Join(dir, "rounds.md"))
		if err != nil {
			return nil, err
		}
		werr := out.WriteText(f)
		if err := f.Close(); werr == nil {
			werr = err
		}
		if werr != nil {
			return nil, werr
		}
	}
	return out, nil
}

// windowGauges averages the simulators' KV use and running sequences over
// the samples of the report's time series (in simulated seconds) between
// from and to, over the backends (not kvgate's own page, gateway): -1
// when there are none.
func windowGauges(rep *bench.Report, gateway string, from, to time.Duration) (kv, running float64) {
	var skv, srun float64
	n := 0
	for _, s := range rep.TimeSeries {
		if s.Source == gateway || s.T < from.Seconds() || s.T > to.Seconds() {
			continue
		}
		u, ok := s.Values["kv_usage"]
		if !ok {
			continue
		}
		skv += u
		srun += s.Values["running"]
		n++
	}
	if n == 0 {
		return -1, -1
	}
	return skv / float64(n), srun / float64(n)
}

// Ratio is kvgate's figure over the baseline's in round r (NaN when a
// target did not run or the baseline's figure is 0).
func (rs *Rounds) Ratio(r int, baseline string, f func(RoundFigures) float64) float64 {
	k, okk := rs.Rounds[r].Figures[TargetKVGate]
	b, okb := rs.Rounds[r].Figures[baseline]
	if !okk || !okb || f(b) == 0 {
		return math.NaN()
	}
	return f(k) / f(b)
}

// MedianRatio is the median over the rounds of Ratio.
func (rs *Rounds) MedianRatio(baseline string, f func(RoundFigures) float64) float64 {
	var xs []float64
	for r := range rs.Rounds {
		if x := rs.Ratio(r, baseline, f); !math.IsNaN(x) {
			xs = append(xs, x)
		}
	}
	return median(xs)
}

// median of xs (NaN when empty); xs is sorted in place.
func median(xs []float64) float64 {
	if len(xs) == 0 {
		return math.NaN()
	}
	slices.Sort(xs)
	if n := len(xs); n%2 == 1 {
		return xs[n/2]
	} else {
		return (xs[n/2-1] + xs[n/2]) / 2
	}
}

// roundRows are the figures the rounds' table shows.
var roundRows = []struct {
	name string
	f    func(RoundFigures) float64
}{
	{"fleet output tok/s", func(f RoundFigures) float64 { return f.FleetTokPerSec }},
	{"fleet tok/s, host stalls out", func(f RoundFigures) float64 { return f.FleetTokPerBusySec }},
	{"simulators stalled", func(f RoundFigures) float64 { return f.Stalled }},
	{"KV use", func(f RoundFigures) float64 { return f.KVUse }},
	{"running sequences", func(f RoundFigures) float64 { return f.Running }},
	{"preemptions", func(f RoundFigures) float64 { return f.Preemptions }},
	{"speed-up kept", func(f RoundFigures) float64 { return f.Speedup }},
}

// WriteText writes the rounds as a Markdown table: per round each target's
// figures and kvgate's ratio to each baseline, then the medians.
func (rs *Rounds) WriteText(w io.Writer) error {
	fmt.Fprintf(w, "# %s, %d rounds\n\n%s (asked speed-up %g×)\n\n", rs.Scenario, len(rs.Rounds), rs.Describe, rs.Speedup)
	orders := make([]string, len(rs.Rounds))
	for r, rd := range rs.Rounds {
		orders[r] = fmt.Sprintf("%d: %s", r+1, strings.Join(rd.Order, ", "))
	}
	fmt.Fprintf(w, "Run order: %s\n\n", strings.Join(orders, "; "))
	var baselines []string
	for _, t := range rs.Targets {
		if t != TargetKVGate {
			baselines = append(baselines, t)
		}
	}
	var b strings.Builder
	head := []string{"round", "figure"}
	head = append(head, rs.Targets...)
	for _, bl := range baselines {
		head = append(head, "kvgate/"+bl)
	}
	fmt.Fprintf(&b, "| %s |\n", strings.Join(head, " | "))
	fmt.Fprintf(&b, "|%s\n", strings.Repeat("---|", len(head)))
	for r, rd := range rs.Rounds {
		for _, row := range roundRows {
			cells := []string{fmt.Sprint(r + 1), row.name}
			for _, t := range rs.Targets {
				if fg, ok := rd.Figures[t]; ok {
					cells = append(cells, fmtFigure(row.f(fg)))
				} else {
					cells = append(cells, "")
				}
			}
			for _, bl := range baselines {
				cells = append(cells, fmtRatio(rs.Ratio(r, bl, row.f)))
			}
			fmt.Fprintf(&b, "| %s |\n", strings.Join(cells, " | "))
		}
	}
	for _, row := range roundRows {
		cells := []string{"median", row.name}
		for _, t := range rs.Targets {
			var xs []float64
			for _, rd := range rs.Rounds {
				if fg, ok := rd.Figures[t]; ok {
					xs = append(xs, row.f(fg))
				}
			}
			cells = append(cells, fmtFigure(median(xs)))
		}
		for _, bl := range baselines {
			cells = append(cells, fmtRatio(rs.MedianRatio(bl, row.f)))
		}
		fmt.Fprintf(&b, "| %s |\n", strings.Join(cells, " | "))
	}
	headed := false
	for r, rd := range rs.Rounds {
		if len(rd.Refusals) == 0 {
			continue
		}
		if !headed {
			headed = true
			b.WriteString("\nkvgate's admission refusals by reason (per ticket, backend and pass):\n\n")
		}
		reasons := slices.Sorted(maps.Keys(rd.Refusals))
		cells := make([]string, len(reasons))
		for i, k := range reasons {
			cells[i] = fmt.Sprintf("%s %.0f", k, rd.Refusals[k])
		}
		fmt.Fprintf(&b, "- round %d: %s\n", r+1, strings.Join(cells, ", "))
	}
	_, err := io.WriteString(w, b.String())
	return err
}

func fmtFigure(x float64) string {
	switch {
	case math.IsNaN(x):
		return ""
	case math.Abs(x) >= 100:
		return fmt.Sprintf("%.0f", x)
	}
	return fmt.Sprintf("%.3g", x)
}

func fmtRatio(x float64) string {
	if math.IsNaN(x) || math.IsInf(x, 0) {
		return ""
	}
	return fmt.Sprintf("%.3f", x)
}
