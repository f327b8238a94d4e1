package scenario

import (
	"encoding/json"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"text/tabwriter"
)

// Verdict rows, in order.
const (
	RowFleetTokPerSec = "fleet output tok/s"
	RowDoneTokPerSec  = "completed output tok/s"
	RowTTFTp50        = "TTFT p50 ms"
	RowTTFTp90        = "TTFT p90 ms"
	RowTTFTp99        = "TTFT p99 ms"
	RowE2Ep99         = "latency p99 ms"
	RowPreemptions    = "preemptions"
	RowErrors         = "errors"
	RowCompleted      = "completed requests"
	// RowHitRate is the fleet's measured prefix-cache hit rate, from the
	// simulators' counters; RowPredicted what kvgate's index predicted.
	RowHitRate   = "prefix hit rate"
	RowPredicted = "predicted hit rate"
)

// Rows are the verdict's rows, in order.
var Rows = []string{RowFleetTokPerSec, RowDoneTokPerSec, RowTTFTp50, RowTTFTp90, RowTTFTp99, RowE2Ep99, RowPreemptions, RowErrors, RowCompleted, RowHitRate, RowPredicted}

// Verdict is a scenario's comparison: each row's value per target, and
// kvgate's value divided by each baseline's.
type Verdict struct {
	Scenario string   `json:"scenario"`
	Describe string   `json:"describe"`
	Focus    string   `json:"focus,omitempty"` // whose latency and errors rows show
	Targets  []string `json:"targets"`
	Rows     []Row    `json:"rows"`
}

// Row is one figure across the targets.
type Row struct {
	Name   string             `json:"name"`
	Values map[string]float64 `json:"values"`
	// Ratios are kvgate / target for each baseline that ran with kvgate;
	// absent when the baseline's value is 0 (the values say why).
	Ratios map[string]float64 `json:"ratios,omitempty"`
}

func newVerdict(res *Result) Verdict {
	v := Verdict{Scenario: res.Scenario, Describe: res.Describe}
	for _, t := range res.Targets {
		v.Targets = append(v.Targets, t.Target)
	}
	for _, name := range Rows {
		row := Row{Name: name, Values: map[string]float64{}}
		for _, t := range res.Targets {
			s := t.Focus
			var x float64
			switch name {
			case RowFleetTokPerSec:
				x = t.FleetTokPerSec
			case RowDoneTokPerSec:
				x = t.Report.Summary.OutputThroughput
			case RowTTFTp50:
				x = s.TTFT.Median
			case RowTTFTp90:
				x = s.TTFT.Percentiles[90]
			case RowTTFTp99:
				x = s.TTFT.Percentiles[99]
			case RowHitRate:
				x = t.PrefixHitRate
			case RowPredicted:
				x = t.PredictedHitRate
			case RowE2Ep99:
				x = s.E2EL.Percentiles[99]
			case RowPreemptions:
				x = t.Preemptions
			case RowErrors:
				x = float64(t.FocusFailed)
			case RowCompleted:
				x = float64(t.Report.Summary.Completed)
			}
			row.Values[t.Target] = x
		}
		if k, ok := row.Values[TargetKVGate]; ok {
			for _, b := range baselines {
				if x, ok := row.Values[b]; ok && x > 0 && row.Name != RowPredicted {
					if row.Ratios == nil {
						row.Ratios = map[string]float64{}
					}
					row.Ratios[b] = k / x
				}
			}
		}
		v.Rows = append(v.Rows, row)
	}
	v.Focus = strings.Join(res.Focus, ", ")
	return v
}

// Row returns the named row.
func (v Verdict) Row(name string) (Row, bool) {
	for _, r := range v.Rows {
		if r.Name == name {
			return r, true
		}
	}
	return Row{}, false
}

// WriteText writes the verdict as an aligned table.
func (v Verdict) WriteText(w io.Writer) error {
	fmt.Fprintf(w, "%s: %s\n", v.Scenario, v.Describe)
	if v.Focus != "" {
		fmt.Fprintf(w, "latency and error rows: %s only\n", v.Focus)
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	header, ratios := v.columns()
	fmt.Fprintln(tw, strings.Join(append(append([]string{"metric"}, header...), ratios...), "\t")+"\t")
	for _, r := range v.Rows {
		fmt.Fprintln(tw, strings.Join(v.cells(r), "\t")+"\t")
	}
	return tw.Flush()
}

// WriteMarkdown writes the verdict as a Markdown table.
func (v Verdict) WriteMarkdown(w io.Writer) error {
	fmt.Fprintf(w, "**%s**: %s", v.Scenario, v.Describe)
	if v.Focus != "" {
		fmt.Fprintf(w, " (latency and error rows: %s only)", v.Focus)
	}
	fmt.Fprint(w, "\n\n")
	header, ratios := v.columns()
	cols := append(append([]string{"metric"}, header...), ratios...)
	fmt.Fprintln(w, "| "+strings.Join(cols, " | ")+" |")
	fmt.Fprintln(w, "|"+strings.Repeat("---|", len(cols)))
	for _, r := range v.Rows {
		fmt.Fprintln(w, "| "+strings.Join(v.cells(r), " | ")+" |")
	}
	_, err := fmt.Fprintln(w)
	return err
}

func (v Verdict) columns() (targets, ratios []string) {
	has := map[string]bool{}
	for _, t := range v.Targets {
		has[t] = true
	}
	if has[TargetKVGate] {
		for _, b := range baselines {
			if has[b] {
				ratios = append(ratios, "kvgate/"+b)
			}
		}
	}
	return v.Targets, ratios
}

func (v Verdict) cells(r Row) []string {
	cells := []string{r.Name}
	for _, t := range v.Targets {
		cells = append(cells, formatValue(r.Values[t]))
	}
	_, ratios := v.columns()
	for _, c := range ratios {
		b := strings.TrimPrefix(c, "kvgate/")
		if x, ok := r.Ratios[b]; ok {
			cells = append(cells, strconv.FormatFloat(x, 'f', 3, 64))
		} else {
			cells = append(cells, "n/a")
		}
	}
	return cells
}

func formatValue(x float64) string {
	switch {
	case x < 0:
		return "n/a" // not measured
	case x < 1 && x > 0:
		return strconv.FormatFloat(x, 'f', 3, 64) // rates
	case x == math.Trunc(x) || math.Abs(x) >= 100:
		return strconv.FormatFloat(math.Round(x), 'f', -1, 64)
	default:
		return strconv.FormatFloat(x, 'f', 1, 64)
	}
}

// writeFiles writes verdict.json, verdict.md and verdict.txt into dir.
func (v Verdict) writeFiles(dir string) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, "verdict.json"), append(b, '\n'), 0o644); err != nil {
		return err
	}
	for name, write := range map[string]func(io.Writer) error{"verdict.md": v.WriteMarkdown, "verdict.txt": v.WriteText} {
		var sb strings.Builder
		if err := write(&sb); err != nil {
			return err
		}
		if err := os.WriteFile(filepath.Join(dir, name), []byte(sb.String()), 0o644); err != nil {
			return err
		}
	}
	return nil
}
