package scenario

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvgate/kvgate/bench"
)

func TestRegistry(t *testing.T) {
	var names []string
	for _, s := range List() {
		names = append(names, s.Name)
		if s.About == "" {
			t.Errorf("%s has no description", s.Name)
		}
		got, err := Lookup(s.Name)
		if err != nil || got.Name != s.Name {
			t.Errorf("Lookup(%q) = %q, %v", s.Name, got.Name, err)
		}
		p, err := s.plan(Options{Scale: 1, Speedup: 4, Seed: 1})
		if err != nil {
			t.Errorf("%s: %v", s.Name, err)
			continue
		}
		cfg := p.cfg
		cfg.Target = "http://127.0.0.1:1"
		vc, err := cfg.Validate()
		if err != nil {
			t.Errorf("%s: its load does not validate: %v", s.Name, err)
		}
		// Each tenant keeps its own workload and arrivals through the
		// harness's defaults.
		for i, tn := range vc.Tenants {
			if tn.Workload.Input.Mean != p.cfg.Tenants[i].Workload.Input.Mean || tn.Workload.Output.Mean != p.cfg.Tenants[i].Workload.Output.Mean ||
				tn.Arrival.Rate != p.cfg.Tenants[i].Arrival.Rate || tn.NumPrompts != p.cfg.Tenants[i].NumPrompts {
				t.Errorf("%s: tenant %s became %+v", s.Name, tn.Name, tn)
			}
		}
		if p.sending <= 0 || p.measureFrom >= p.sending || p.describe == "" {
			t.Errorf("%s: sending %v, measured from %v, describe %q", s.Name, p.sending, p.measureFrom, p.describe)
		}
		for _, f := range p.focus {
			if !slices.ContainsFunc(p.cfg.Tenants, func(tn bench.Tenant) bool { return tn.Name == f }) {
				t.Errorf("%s: focus tenant %s is not in the load", s.Name, f)
			}
		}
	}
	for _, want := range []string{"overload", "mixed", "burst", "backend-failure", "shared-prefix", "multi-turn"} {
		if !slices.Contains(names, want) {
			t.Errorf("no %s scenario in %v", want, names)
		}
	}
	if _, err := Lookup("nope"); err == nil || !strings.Contains(err.Error(), "overload") {
		t.Errorf("Lookup of an unknown name: %v", err)
	}
}

func TestPlanSizes(t *testing.T) {
	burst, _ := Lookup("burst")
	full, err := burst.plan(Options{Scale: 1, Speedup: 4, Seed: 1})
	if err != nil {
		t.Fatal(err)
	}
	if n := full.cfg.Tenants[0].NumPrompts; n != 10000 || !full.cfg.Tenants[0].Deferred {
		t.Errorf("burst at scale 1: tenant A sends %d (deferred %v), want 10,000 jobs", n, full.cfg.Tenants[0].Deferred)
	}
	small, _ := burst.plan(Options{Scale: 0.1, Speedup: 4, Seed: 1})
	if n := small.cfg.Tenants[0].NumPrompts; n != 1000 {
		t.Errorf("burst at scale 0.1: %d jobs, want 1,000", n)
	}
	over, _ := Lookup("overload")
	p, _ := over.plan(Options{Scale: 0.5, Speedup: 4, Seed: 1})
	if rate := p.cfg.Tenants[0].Arrival.Rate; rate != 2*perBackendRate*float64(p.fleet.backends) {
		t.Errorf("overload rate %v is not twice the fleet's capacity", rate)
	}
	if p.sending != 30*time.Second {
		t.Errorf("overload at scale 0.5 sends for %v, want 30s", p.sending)
	}
	w := toWall(p.cfg, 4)
	if w.Tenants[0].Arrival.Rate != 4*p.cfg.Tenants[0].Arrival.Rate || w.RequestTimeout != p.cfg.RequestTimeout/4 {
		t.Errorf("wall config at 4x: rate %v, timeout %v", w.Tenants[0].Arrival.Rate, w.RequestTimeout)
	}
	if p.cfg.Tenants[0].Arrival.Rate == w.Tenants[0].Arrival.Rate {
		t.Error("toWall changed the plan's own tenants")
	}
}

func TestOptionsRejectBadValues(t *testing.T) {
	for _, o := range []Options{{Scale: -1}, {Speedup: 0.5}, {Targets: []string{"nginx"}}} {
		if err := o.defaults(); err == nil {
			t.Errorf("%+v: no error", o)
		}
	}
}

func TestVerdictRatios(t *testing.T) {
	res := &Result{Scenario: "x", Describe: "d", Targets: []TargetResult{
		{Target: TargetKVGate, Report: &bench.Report{Summary: bench.Summary{OutputThroughput: 90, Completed: 10}}, FleetTokPerSec: 100, Preemptions: 0,
			FocusFailed: 2, Focus: bench.Summary{TTFT: bench.Latency{Median: 50, Percentiles: map[float64]float64{99: 100}}}},
		{Target: TargetRoundRobin, Report: &bench.Report{Summary: bench.Summary{OutputThroughput: 60, Completed: 8}}, FleetTokPerSec: 80, Preemptions: 300,
			Focus: bench.Summary{TTFT: bench.Latency{Median: 100, Percentiles: map[float64]float64{99: 400}}}},
	}}
	v := newVerdict(res)
	for _, c := range []struct {
		row  string
		want float64
		ok   bool
	}{{RowFleetTokPerSec, 1.25, true}, {RowDoneTokPerSec, 1.5, true}, {RowTTFTp99, 0.25, true}, {RowPreemptions, 0, true}, {RowErrors, 0, false}} {
		r, found := v.Row(c.row)
		if !found {
			t.Fatalf("no row %q", c.row)
		}
		got, ok := r.Ratios[TargetRoundRobin]
		if ok != c.ok || got != c.want {
			t.Errorf("%s: ratio %v (%v), want %v (%v)", c.row, got, ok, c.want, c.ok)
		}
	}
	// The prefix baseline gets its ratios too; hit rates are ratios of
	// measured rates, and a rate not measured (-1) has none.
	res.Targets[0].PrefixHitRate, res.Targets[1].PrefixHitRate = 0.8, 0.4
	res.Targets = append(res.Targets, TargetResult{Target: TargetPrefix, Report: &bench.Report{}, FleetTokPerSec: 50, PrefixHitRate: -1})
	v = newVerdict(res)
	if r, _ := v.Row(RowFleetTokPerSec); r.Ratios[TargetPrefix] != 2 {
		t.Errorf("kvgate/prefix fleet tok/s %v, want 2", r.Ratios[TargetPrefix])
	}
	if r, _ := v.Row(RowHitRate); r.Ratios[TargetRoundRobin] != 2 || len(r.Ratios) != 1 {
		t.Errorf("hit rate ratios %v, want 2 against round-robin only", r.Ratios)
	}
	var sb strings.Builder
	if err := v.WriteText(&sb); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(sb.String(), "kvgate/round-robin") || !strings.Contains(sb.String(), "kvgate/prefix") || strings.Contains(sb.String(), "kvgate/threshold") || !strings.Contains(sb.String(), "n/a") {
		t.Errorf("verdict text:\n%s", sb.String())
	}
}

// TestScenarioEndToEnd runs the smallest backend-failure scenario against all
// the targets on real HTTP and checks that it wrote the reports and a
// verdict with every row. It asserts what happened, never how fast.
func TestScenarioEndToEnd(t *testing.T) {
	if testing.Short() {
		t.Skip("starts three fleets")
	}
	out := t.TempDir()
	sc, err := Lookup("backend-failure")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	res, err := sc.Run(ctx, Options{Scale: 0.05, Speedup: 5, Seed: 3, Out: out})
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Targets) != len(Targets) {
		t.Fatalf("%d targets ran, want %d", len(res.Targets), len(Targets))
	}
	for _, tr := range res.Targets {
		s := tr.Report.Summary
		if s.Completed == 0 {
			t.Errorf("%s completed nothing: %v", tr.Target, s.Errors)
		}
		if s.Completed+s.Failed != res.Targets[0].Report.Summary.Completed+res.Targets[0].Report.Summary.Failed {
			t.Errorf("%s saw %d requests, kvgate %d: not the same arrivals", tr.Target, s.Completed+s.Failed,
				res.Targets[0].Report.Summary.Completed+res.Targets[0].Report.Summary.Failed)
		}
		if !slices.Equal(tr.Events, []string{"backend 0 dies"}) {
			t.Errorf("%s: events %v, want the backend's death", tr.Target, tr.Events)
		}
		if tr.FleetTokPerSec <= 0 {
			t.Errorf("%s: fleet throughput %v", tr.Target, tr.FleetTokPerSec)
		}
		for _, f := range []string{bench.FileJSON, bench.FileSummaryCSV, bench.FileRequestsCSV, bench.FileMarkdown, bench.FileHTML} {
			if _, err := os.Stat(filepath.Join(out, "backend-failure", tr.Target, f)); err != nil {
				t.Errorf("%s: %v", tr.Target, err)
			}
		}
		// Every target's end-of-run metrics; kvgate's admission trace, a
		// row per admitted request at least.
		if b, err := os.ReadFile(filepath.Join(out, "backend-failure", tr.Target, "metrics-end.txt")); err != nil || !strings.Contains(string(b), "vllm:num_requests_running") {
			t.Errorf("%s: metrics-end.txt: %v", tr.Target, err)
		}
		if tr.Target == TargetKVGate {
			b, err := os.ReadFile(filepath.Join(out, "backend-failure", tr.Target, "admissions.csv"))
			if err != nil {
				t.Fatal(err)
			}
			if rows := strings.Count(string(b), "\n") - 1; rows < s.Completed {
				t.Errorf("admissions.csv has %d rows for %d completed requests", rows, s.Completed)
			}
		}
		rep, err := bench.ReadReport(filepath.Join(out, "backend-failure", tr.Target, bench.FileJSON))
		if err != nil {
			t.Fatal(err)
		}
		if rep.Metadata["time"] != "simulated" || rep.Metadata["describe"] != res.Describe || len(rep.Requests) != s.Completed+s.Failed ||
			rep.Config.Workload.Input.Mean != 600 || float64(rep.Config.Arrival.Rate) != 18 {
			t.Errorf("%s: report metadata %v, %d requests, workload %+v, arrival %+v", tr.Target, rep.Metadata, len(rep.Requests), rep.Config.Workload, rep.Config.Arrival)
		}
	}
	var got []string
	for _, r := range res.Verdict.Rows {
		got = append(got, r.Name)
	}
	if !slices.Equal(got, Rows) {
		t.Errorf("verdict rows %v, want %v", got, Rows)
	}
	svg, err := os.ReadFile(filepath.Join(out, "backend-failure", "chart.svg"))
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"<svg", "fleet KV-cache use", "<polyline", TargetThreshold, "</svg>"} {
		if !strings.Contains(string(svg), want) {
			t.Errorf("chart.svg lacks %q", want)
		}
	}
	text, err := os.ReadFile(filepath.Join(out, "backend-failure", "verdict.txt"))
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range append([]string{"kvgate/round-robin", "kvgate/threshold"}, Rows...) {
		if !strings.Contains(string(text), want) {
			t.Errorf("verdict.txt lacks %q:\n%s", want, text)
		}
	}
	t.Logf("\n%s", text)
}

// TestBurstJobsComplete runs a tiny burst against kvgate alone, in real
// time so that no job can finish before the harness starts following it:
// tenant A's requests go as durable jobs and must be seen to finish.
func TestBurstJobsComplete(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a fleet")
	}
	sc, err := Lookup("burst")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	res, err := sc.Run(ctx, Options{Scale: 0.003, Speedup: 1, Seed: 4, Targets: []string{TargetKVGate}})
	if err != nil {
		t.Fatal(err)
	}
	rep := res.Targets[0].Report
	var a, b bench.Summary
	for _, ts := range rep.Tenants {
		switch ts.Name {
		case "tenant-a":
			a = ts.Summary
		case "tenant-b":
			b = ts.Summary
		}
	}
	// The fleet serves 30 such jobs in a few seconds and the run allows
	// more than a minute.
	if a.Completed != 30 || a.Failed != 0 {
		t.Errorf("tenant A: %d jobs completed, %d failed (%v); want all 30 seen to finish", a.Completed, a.Failed, a.Errors)
	}
	for _, r := range rep.Requests {
		if r.Tenant == "tenant-a" && r.ErrorClass == "" && r.JobID == "" {
			t.Errorf("tenant A's request %+v completed without a job", r)
			break
		}
	}
	if b.Completed == 0 {
		t.Errorf("tenant B completed nothing: %v", b.Errors)
	}
	if res.Verdict.Focus != "tenant-b" {
		t.Errorf("verdict focus %q, want tenant-b", res.Verdict.Focus)
	}
}

// TestPrefixPlansShape checks the prefix scenarios' shape: llm-d's
// b2b-saas proportions (the tenants' prefixes more than one backend's
// cache, less than the fleet's), arrivals rising in steps, chat with
// system prompts or growing histories.
func TestPrefixPlansShape(t *testing.T) {
	for _, name := range []string{"shared-prefix", "multi-turn"} {
		sc, err := Lookup(name)
		if err != nil {
			t.Fatal(err)
		}
		p, err := sc.plan(Options{Scale: 1, Speedup: 4, Seed: 1})
		if err != nil {
			t.Fatal(err)
		}
		if p.fleet.backends != 4 || !p.fleet.profile.PrefixCaching {
			t.Errorf("%s: %d backends, prefix caching %v", name, p.fleet.backends, p.fleet.profile.PrefixCaching)
		}
		tn := p.cfg.Tenants[0]
		if tn.Arrival.Steps < 2 || tn.Arrival.Kind != bench.ArrivalPoisson || p.cfg.Endpoint != bench.EndpointChat {
			t.Errorf("%s: arrivals %+v on %s, want Poisson rising in steps, chat", name, tn.Arrival, p.cfg.Endpoint)
		}
		perBackend := p.fleet.profile.NumGPUBlocks * p.fleet.profile.BlockSize
		prefixes := tn.Workload.PrefixLen * tn.Workload.PrefixGroups
		if name == "shared-prefix" && (prefixes <= perBackend || prefixes >= p.fleet.backends*perBackend) {
			t.Errorf("%s: %d tokens of prefixes against %d per backend, %d in the fleet", name, prefixes, perBackend, p.fleet.backends*perBackend)
		}
	}
}

// TestFocusSummaryLeavesOutTheWarmUp: the latency rows count the requests
// sent in the measured window, as the throughput does; the errors row
// counts the whole run's.
func TestFocusSummaryLeavesOutTheWarmUp(t *testing.T) {
	rep := &bench.Report{Headline: 0, LoadPoints: []bench.LoadPoint{{Summary: bench.Summary{Duration: 30}}}}
	add := func(tenant string, at, ttft time.Duration, class string) {
		rep.Requests = append(rep.Requests, bench.Record{Tenant: tenant, Intended: at, TTFT: ttft, E2EL: 2 * ttft, OutputTokens: 4, ErrorClass: class})
	}
	for i := range 10 {
		add("chat", time.Duration(i)*time.Second, 10*time.Millisecond, "") // warm-up: empty queues
	}
	add("chat", 5*time.Second, 0, bench.ErrServer)
	for i := range 20 {
		add("chat", 10*time.Second+time.Duration(i)*time.Second, time.Second, "")
	}
	add("batch", 20*time.Second, time.Hour, "")
	s, failed := focusSummary(rep, []string{"chat"}, 10*time.Second)
	if s.Completed != 20 || s.TTFT.Median != 1000 || failed != 1 || s.Failed != 0 {
		t.Errorf("window of chat: %d completed, TTFT median %v ms, %d failed in the run (%d in the window); want 20, 1000, 1, 0",
			s.Completed, s.TTFT.Median, failed, s.Failed)
	}
	if s, _ := focusSummary(rep, nil, 10*time.Second); s.Completed != 21 {
		t.Errorf("window of all tenants: %d completed, want 21", s.Completed)
	}
}
