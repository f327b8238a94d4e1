package bench

import (
	"encoding/csv"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
)

// File names WriteFiles uses in its directory.
const (
	FileJSON        = "report.json"
	FileSummaryCSV  = "summary.csv"
	FileRequestsCSV = "requests.csv"
	FileMarkdown    = "report.md"
	FileHTML        = "report.html"
)

// WriteFiles writes the report in every format into dir, creating it:
// report.json, summary.csv, requests.csv, report.md and report.html.
func (r *Report) WriteFiles(dir string) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return fmt.Errorf("bench: %w", err)
	}
	for name, write := range map[string]func(io.Writer) error{
		FileJSON: r.WriteJSON, FileSummaryCSV: r.WriteCSV, FileRequestsCSV: r.WriteRequestsCSV,
		FileMarkdown: r.WriteMarkdown, FileHTML: r.WriteHTML,
	} {
		f, err := os.Create(filepath.Join(dir, name))
		if err != nil {
			return fmt.Errorf("bench: %w", err)
		}
		err = write(f)
		if cerr := f.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			return fmt.Errorf("bench: write %s: %w", name, err)
		}
	}
	return nil
}

// WriteJSON writes the report as indented JSON (see Report for its fields).
func (r *Report) WriteJSON(w io.Writer) error {
	b, err := json.Marshal(r)
	if err != nil {
		return err
	}
	var out strings.Builder
	var v any
	_ = json.Unmarshal(b, &v)
	enc := json.NewEncoder(&out)
	enc.SetIndent("", "  ")
	if err := enc.Encode(v); err != nil {
		return err
	}
	_, err = io.WriteString(w, out.String())
	return err
}

// summaryColumns are the CSV summary's figures, in order, after the point,
// rate and tenant columns.
func (r *Report) summaryColumns() []string {
	cols := []string{"duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
		"request_throughput", "request_goodput", "good_fraction", "output_throughput", "total_token_throughput",
		"max_output_tokens_per_s", "max_concurrent_requests", "max_send_lag_ms"}
	for _, m := range []string{"ttft", "tpot", "itl", "e2el"} {
		cols = append(cols, "mean_"+m+"_ms", "median_"+m+"_ms", "std_"+m+"_ms")
		for _, p := range r.percentiles() {
			cols = append(cols, percentileKey(p, m))
		}
	}
	return cols
}

func (r *Report) percentiles() []float64 {
	if len(r.Config.Percentiles) > 0 {
		return r.Config.Percentiles
	}
	var ps []float64
	for p := range r.Summary.TTFT.Percentiles {
		ps = append(ps, p)
	}
	slices.Sort(ps)
	return ps
}

func fmtNum(v float64) string {
	if math.IsInf(v, 1) {
		return "inf"
	}
	return strconv.FormatFloat(v, 'f', -1, 64)
}

// WriteCSV writes one row per load point (tenant "all") and per tenant of
// each load point, with the summary's figures as columns.
func (r *Report) WriteCSV(w io.Writer) error {
	cw := csv.NewWriter(w)
	cols := r.summaryColumns()
	_ = cw.Write(append([]string{"point", "request_rate", "tenant", "class", "jain_index"}, cols...))
	row := func(p LoadPoint, tenant, class string, s Summary) {
		m := s.Metrics()
		rec := []string{strconv.Itoa(p.Index), p.RequestRate.String(), tenant, class, fmtNum(p.JainIndex)}
		for _, c := range cols {
			rec = append(rec, fmtNum(m[c]))
		}
		_ = cw.Write(rec)
	}
	for _, p := range r.LoadPoints {
		row(p, "all", "", p.Summary)
		for _, t := range p.Tenants {
			row(p, t.Name, t.Class, t.Summary)
		}
	}
	cw.Flush()
	return cw.Error()
}

// WriteRequestsCSV writes one row per request.
func (r *Report) WriteRequestsCSV(w io.Writer) error {
	cw := csv.NewWriter(w)
	_ = cw.Write([]string{"point", "tenant", "intended_s", "sent_s", "ttft_ms", "tpot_ms", "e2el_ms", "mean_itl_ms",
		"input_tokens", "output_tokens", "status", "error_class", "error", "job_id"})
	for _, q := range r.Requests {
		itl := 0.0
		for _, g := range q.ITLs {
			itl += ms(g)
		}
		if len(q.ITLs) > 0 {
			itl /= float64(len(q.ITLs))
		}
		_ = cw.Write([]string{strconv.Itoa(q.Point), q.Tenant, fmtNum(q.Intended.Seconds()), fmtNum(q.Sent.Seconds()),
			fmtNum(ms(q.TTFT)), fmtNum(ms(q.TPOT)), fmtNum(ms(q.E2EL)), fmtNum(itl),
			strconv.Itoa(q.InputTokens), strconv.Itoa(q.OutputTokens), strconv.Itoa(q.Status), q.ErrorClass, q.Error, q.JobID})
	}
	cw.Flush()
	return cw.Error()
}

// WriteMarkdown writes a readable summary: provenance, the headline load
// point as vllm bench serve prints it, the load points and the tenants.
func (r *Report) WriteMarkdown(w io.Writer) error {
	var b strings.Builder
	fmt.Fprintf(&b, "# kvgate bench: %s\n\n", r.ModelID)
	pv := r.Provenance
	fmt.Fprintf(&b, "- target: `%s` (%s), server version %s, models %s\n", pv.Target, r.Backend, orDash(pv.ServerVersion), orDash(strings.Join(pv.Models, ", ")))
	fmt.Fprintf(&b, "- harness: %s, %s, %d CPUs on %s; seed %d; started %s\n", pv.Harness, pv.GoVersion, pv.NumCPU, pv.Host, pv.Seed, pv.Start.Format("2006-01-02 15:04:05 UTC"))
	c := r.Config
	fmt.Fprintf(&b, "- workload: %s, input %s, output %s; %s (burstiness %s)", c.Workload.Kind,
		distString(c.Workload.Input), distString(c.Workload.Output), arrivalHeader(r), Rate(c.Arrival.Burstiness))
	if c.MaxConcurrency > 0 {
		fmt.Fprintf(&b, ", max concurrency %d", c.MaxConcurrency)
	}
	fmt.Fprintf(&b, "; streaming %v\n", c.Stream)
	if len(pv.GPUs) > 0 {
		fmt.Fprintf(&b, "- GPUs (driver %s): %s\n", orDash(pv.Driver), strings.Join(pv.GPUs, "; "))
	}
	for _, k := range sortedStrings(pv.Extra) {
		fmt.Fprintf(&b, "- %s: %s\n", k, pv.Extra[k])
	}
	for _, u := range sortedStrings(pv.Servers) {
		var parts []string
		for _, k := range sortedStrings(pv.Servers[u]) {
			parts = append(parts, k+"="+pv.Servers[u][k])
		}
		fmt.Fprintf(&b, "- server `%s`: %s\n", u, strings.Join(parts, ", "))
	}
	if len(r.SLO) > 0 {
		var parts []string
		for _, k := range []string{"ttft", "tpot", "e2el"} {
			if v, ok := r.SLO[k]; ok {
				parts = append(parts, fmt.Sprintf("%s ≤ %g ms", k, v))
			}
		}
		fmt.Fprintf(&b, "- goodput SLOs: %s\n", strings.Join(parts, ", "))
	}
	head := "the only load point"
	if len(r.LoadPoints) > 1 {
		head = fmt.Sprintf("load point %d", r.Headline)
		if r.Knee == r.Headline {
			head += ", the knee"
		}
	}
	if note := kneeNote(r); note != "" && len(r.LoadPoints) > 1 {
		head += "; " + note
	}
	fmt.Fprintf(&b, "\n## Result (%s)\n\n| figure | value |\n|---|---|\n", head)
	s := r.Summary
	for _, kv := range []struct {
		k string
		v any
	}{
		{"Successful requests", s.Completed}, {"Failed requests", s.Failed}, {"Request rate configured (req/s)", r.RequestRate},
		{"Benchmark duration (s)", f2(s.Duration)}, {"Total input tokens", s.TotalInputTokens}, {"Total generated tokens", s.TotalOutputTokens},
		{"Request throughput (req/s)", f2(s.RequestThroughput)}, {"Request goodput (req/s)", f2(s.RequestGoodput)},
		{"Output token throughput (tok/s)", f2(s.OutputThroughput)}, {"Peak output token throughput (tok/s)", f2(s.MaxOutputTokensPerS)},
		{"Peak concurrent requests", s.MaxConcurrentRequests}, {"Total token throughput (tok/s)", f2(s.TotalTokenThroughput)},
		{"Jain's index (tenants)", f3(r.JainIndex)}, {"Harness max send lag (ms)", f2(s.MaxSendLagMs)},
	} {
		fmt.Fprintf(&b, "| %s | %v |\n", kv.k, kv.v)
	}
	if len(s.Errors) > 0 {
		fmt.Fprintf(&b, "| Errors by class | %s |\n", errorsString(s.Errors))
	}
	if s.MaxSendLagMs > lateHarnessMs {
		fmt.Fprintf(&b, "\n**The harness fell behind its schedule by up to %.0f ms**: requests are timed from when they should have gone, so latencies stay honest, but the offered load was not what was asked; use fewer requests per second per harness, or more cores.\n", s.MaxSendLagMs)
	}
	b.WriteString("\n| latency (ms) | mean | median | std |")
	ps := r.percentiles()
	for _, p := range ps {
		fmt.Fprintf(&b, " p%s |", fmtNum(p))
	}
	b.WriteString("\n|---|---|---|---|" + strings.Repeat("---|", len(ps)) + "\n")
	for _, m := range []struct {
		name string
		l    Latency
	}{{"TTFT", s.TTFT}, {"TPOT", s.TPOT}, {"ITL", s.ITL}, {"E2EL", s.E2EL}} {
		fmt.Fprintf(&b, "| %s | %s | %s | %s |", m.name, f2(m.l.Mean), f2(m.l.Median), f2(m.l.Std))
		for _, p := range ps {
			fmt.Fprintf(&b, " %s |", f2(m.l.Percentiles[p]))
		}
		b.WriteString("\n")
	}
	// The tables' tail percentile: the highest of the run's (p99 by
	// default), never one it did not compute.
	tail := 99.0
	if len(ps) > 0 {
		tail = slices.Max(ps)
	}
	pt := "p" + fmtNum(tail)
	if len(r.LoadPoints) > 1 {
		fmt.Fprintf(&b, "\n## Load points\n\n| point | offered req/s | req/s | goodput req/s | output tok/s | %[1]s TTFT ms | %[1]s ITL ms | %[1]s E2EL ms | failed | |\n|---|---|---|---|---|---|---|---|---|---|\n", pt)
		for _, p := range r.LoadPoints {
			mark := ""
			if p.Index == r.Knee {
				mark = "knee"
			}
			fmt.Fprintf(&b, "| %d | %s | %s | %s | %s | %s | %s | %s | %d | %s |\n", p.Index, p.RequestRate, f2(p.Summary.RequestThroughput),
				f2(p.Summary.RequestGoodput), f2(p.Summary.OutputThroughput), f2(p.Summary.TTFT.Percentiles[tail]),
				f2(p.Summary.ITL.Percentiles[tail]), f2(p.Summary.E2EL.Percentiles[tail]), p.Summary.Failed, mark)
		}
	}
	if len(r.Tenants) > 1 {
		fmt.Fprintf(&b, "\n## Tenants\n\n| tenant | class | weight | completed | failed | req/s | output tok/s | %[1]s TTFT ms | %[1]s E2EL ms | errors |\n|---|---|---|---|---|---|---|---|---|---|\n", pt)
		for _, t := range r.Tenants {
			s := t.Summary
			fmt.Fprintf(&b, "| %s | %s | %g | %d | %d | %s | %s | %s | %s | %s |\n", t.Name, t.Class, t.Weight, s.Completed, s.Failed,
				f2(s.RequestThroughput), f2(s.OutputThroughput), f2(s.TTFT.Percentiles[tail]), f2(s.E2EL.Percentiles[tail]), errorsString(s.Errors))
		}
	}
	_, err := io.WriteString(w, b.String())
	return err
}

// lateHarnessMs is the send lag above which a report warns that the
// harness, not the target, set the pace.
const lateHarnessMs = 50

func f2(v float64) string { return strconv.FormatFloat(v, 'f', 2, 64) }
func f3(v float64) string { return strconv.FormatFloat(v, 'f', 3, 64) }

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

func distString(d Dist) string {
	switch d.Kind {
	case DistUniform:
		return fmt.Sprintf("uniform %d..%d", d.Min, d.Max)
	case DistNormal, DistLogNormal:
		return fmt.Sprintf("%s %g±%g", d.Kind, d.Mean, d.StdDev)
	}
	return fmt.Sprintf("%g", d.Mean)
}

func errorsString(m map[string]int) string {
	if len(m) == 0 {
		return "-"
	}
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	var parts []string
	for _, k := range keys {
		parts = append(parts, fmt.Sprintf("%s %d", k, m[k]))
	}
	return strings.Join(parts, ", ")
}

func sortedStrings[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	return keys
}
