package scenario

import (
	"cmp"
	"context"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/kvgate/kvgate/bench"
	"github.com/kvgate/kvgate/bench/vllmsim"
)

// Options size and place a scenario run. Zero values take the defaults in
// brackets.
type Options struct {
	// Scale multiplies a scenario's simulated duration and job counts
	// [1: a minute of simulated traffic, burst's 10,000 jobs]; make bench
	// runs a fraction of it.
	Scale float64
	// Speedup runs the simulated GPUs' clock this many times faster than
	// wall time [4]; arrival rates are multiplied by it.
	Speedup float64
	// Seed makes arrivals and prompts reproducible [1].
	Seed uint64
	// Out is the directory reports are written under, as
	// Out/<scenario>/<target>/; empty writes none.
	Out string
	// Targets are the targets to run, a subset of Targets [all].
	Targets []string
	// Log receives progress lines [discarded].
	Log *slog.Logger
	// TargetLog receives the targets' own logs: kvgate's, mostly
	// [discarded]. Stopping a target cuts its open requests, which it logs.
	TargetLog *slog.Logger
}

func (o *Options) defaults() error {
	o.Scale = cmp.Or(o.Scale, 1)
	o.Speedup = cmp.Or(o.Speedup, 4)
	o.Seed = cmp.Or(o.Seed, 1)
	if len(o.Targets) == 0 {
		o.Targets = Targets
	}
	if o.Log == nil {
		o.Log = slog.New(slog.DiscardHandler)
	}
	if o.TargetLog == nil {
		o.TargetLog = slog.New(slog.DiscardHandler)
	}
	switch {
	case !(o.Scale > 0) || math.IsInf(o.Scale, 0):
		return fmt.Errorf("scale %v must be a positive number", o.Scale)
	case !(o.Speedup >= 1) || math.IsInf(o.Speedup, 0):
		return fmt.Errorf("speed-up %v must be a number of at least 1", o.Speedup)
	}
	for _, t := range o.Targets {
		if !slices.Contains(Targets, t) {
			return fmt.Errorf("unknown target %q (have %s)", t, strings.Join(Targets, ", "))
		}
	}
	return nil
}

// Scenario is a named, reproducible benchmark.
type Scenario struct {
	Name  string
	About string
	plan  func(o Options) (plan, error)
}

// plan is a scenario at one size, in simulated time: rates are per
// simulated second and durations simulated.
type plan struct {
	fleet fleetSpec
	// cfg is the load, without a target; tenants marked Deferred submit
	// jobs to kvgate and plain requests to the baselines, which have no
	// job API.
	cfg bench.Config
	// keys maps kvgate API keys to tenants.
	keys map[string]string
	// focus names the tenants whose latency and errors the verdict shows
	// (the interactive ones); empty means all.
	focus []string
	// sending is how long arrivals last; throughput is measured from
	// measureFrom to its end, past the warm-up.
	sending, measureFrom time.Duration
	// events happen during the run, at simulated offsets.
	events []event
	// describe is the verdict's heading.
	describe string
}

// event is something done to the fleet mid-run.
type event struct {
	at   time.Duration
	what string
	do   func(ctx context.Context, s *stack) error
}

// registry is every scenario, in the order List gives them.
var registry = []Scenario{
	{Name: "overload", About: "twice the fleet's capacity of 600-in/400-out streamed requests: throughput, preemptions, TTFT, errors", plan: planOverload},
	{Name: "mixed", About: "interactive chat streaming at a moderate rate plus batch jobs filling the rest: interactive TTFT and total throughput", plan: planMixed},
	{Name: "burst", About: "tenant A submits 10,000 jobs at once while tenant B chats: B's TTFT and latency", plan: planBurst},
	{Name: "batch-api", About: "interactive chat beside one Batch API batch that keeps the fleet busy: interactive TTFT against the batch's requests sent as plain ones", plan: planBatchAPI},
	{Name: "interactive-alone", About: "batch-api's interactive chat without the batch: the unloaded reference of its TTFT", plan: planInteractiveAlone},
	{Name: "backend-failure", About: "one of three backends dies a third of the way in: errors and throughput", plan: planBackendFailure},
	{Name: "closed-overload", About: "64 closed-loop clients of 1,000-in/500-out streamed requests on two backends: the output tok/s kept", plan: planClosedOverload},
	{Name: "shared-prefix", About: "tenants with ~6k-token system prompts, users asking ~1,200-token questions, Poisson arrivals rising in steps past saturation: throughput, TTFT, prefix hit rate", plan: planSharedPrefix},
	{Name: "multi-turn", About: "chat sessions whose every turn resends the growing history, arrivals rising in steps past saturation: throughput, TTFT, prefix hit rate", plan: planMultiTurn},
}

// List returns the scenarios in a stable order.
func List() []Scenario { return slices.Clone(registry) }

// Lookup returns the scenario with the given name.
func Lookup(name string) (Scenario, error) {
	for _, s := range registry {
		if s.Name == name {
			return s, nil
		}
	}
	names := make([]string, len(registry))
	for i, s := range registry {
		names[i] = s.Name
	}
	return Scenario{}, fmt.Errorf("unknown scenario %q (have %s)", name, strings.Join(names, ", "))
}

// TargetResult is what one target measured, in simulated time.
type TargetResult struct {
	Target string
	Report *bench.Report // rescaled to simulated time
	// FleetTokPerSec is the output tokens per simulated second the fleet
	// generated over the measurement window (from vllm:generation_tokens_total).
	FleetTokPerSec float64
	// Stalled is the share of the measurement window's simulated time the
	// engines lost to the host running them late (vllmsim.Engine.Stalled):
	// on a starved host the simulated GPUs stop while simulated time goes
	// on, so FleetTokPerSec falls for every target alike. FleetTokPerBusySec
	// is the output per simulated second with that time taken out: what the
	// same GPUs would have produced had the host kept up with them (the
	// targets' own delays, a request sent late, still count).
	Stalled            float64
	FleetTokPerBusySec float64
	// Preemptions is the fleet's vllm:num_preemptions_total over the run.
	Preemptions float64
	// PrefixHitRate is the fleet's prefix-cache hit rate over the run,
	// from the simulators' counters (vllm:prefix_cache_hits_total over
	// _queries_total); PredictedHitRate is what kvgate's index predicted
	// for the requests it sent (-1 for the baselines, or without data).
	PrefixHitRate, PredictedHitRate float64
	// Speedup is how much faster than wall time the fleet's clock ran.
	Speedup float64
	// Focus is the summary of the focus tenants' requests (all, when none
	// is named) sent from the measured window's start (plan.measureFrom)
	// on: the latency rows, past the warm-up as the throughput is.
	// FocusFailed counts their failures over the whole run.
	Focus       bench.Summary
	FocusFailed int
	// Events are the scenario's mid-run events that happened, in order.
	Events []string
	Dir    string // where its reports are, or ""
	// Refusals are kvgate's admission refusals over the run
	// (kvgate_scheduler_backend_refusals_total, summed over the
	// backends) by reason: which rule held tickets back, counted once per
	// ticket and backend and pass. Nil for the baselines.
	Refusals map[string]float64

	gatewayMetrics string // kvgate's /metrics in the report's time series
}

// Result is a scenario run: one result per target and the verdict.
type Result struct {
	Scenario string
	Describe string
	Focus    []string // the tenants latency and error rows show; empty: all
	Targets  []TargetResult
	Verdict  Verdict
}

// Run runs the scenario against each target in turn and returns what they
// measured. It returns an error when a target cannot be started or a run
// fails outright (failed requests are measurements, not errors), or ctx's
// error when ctx ends first.
func (sc Scenario) Run(ctx context.Context, o Options) (*Result, error) {
	if err := o.defaults(); err != nil {
		return nil, err
	}
	p, err := sc.plan(o)
	if err != nil {
		return nil, err
	}
	res := &Result{Scenario: sc.Name, Describe: p.describe, Focus: p.focus}
	for _, target := range o.Targets {
		o.Log.Info("scenario target starting", "scenario", sc.Name, "target", target)
		tr, err := runTarget(ctx, sc.Name, target, p, o)
		if err != nil {
			return nil, fmt.Errorf("%s against %s: %w", sc.Name, target, err)
		}
		o.Log.Info("scenario target done", "scenario", sc.Name, "target", target,
			"completed", tr.Report.Summary.Completed, "failed", tr.Report.Summary.Failed,
			"fleet_tok_per_s", math.Round(tr.FleetTokPerSec), "speedup", fmt.Sprintf("%.2f", tr.Speedup))
		res.Targets = append(res.Targets, *tr)
	}
	res.Verdict = newVerdict(res)
	if o.Out != "" {
		dir := filepath.Join(o.Out, sc.Name)
		if err := res.Verdict.writeFiles(dir); err != nil {
			return nil, err
		}
		var chart strings.Builder
		if err := res.WriteChart(&chart); err != nil {
			return nil, err
		}
		if err := os.WriteFile(filepath.Join(dir, "chart.svg"), []byte(chart.String()), 0o644); err != nil {
			return nil, err
		}
	}
	return res, nil
}

// runTarget runs the plan against one target on a fresh fleet.
func runTarget(ctx context.Context, name, target string, p plan, o Options) (_ *TargetResult, err error) {
	dataDir := ""
	if target == TargetKVGate {
		if dataDir, err = os.MkdirTemp("", "kvgate-scenario-"); err != nil {
			return nil, err
		}
		defer os.RemoveAll(dataDir)
	}
	st, err := startStack(ctx, target, p.fleet, p.keys, dataDir, o.TargetLog)
	if err != nil {
		return nil, err
	}
	defer func() {
		if serr := st.stop(); serr != nil && err == nil {
			err = serr
		}
	}()

	speed := p.fleet.speedup
	cfg := toWall(p.cfg, speed)
	// The report's headline describes the run's own workload and arrivals:
	// the first tenant's; the metadata describes every tenant.
	cfg.Workload, cfg.Arrival = cfg.Tenants[0].Workload, cfg.Tenants[0].Arrival
	cfg.Target = st.url
	cfg.Scrape = st.metrics
	cfg.ScrapeInterval = wall(time.Second, speed, 50*time.Millisecond)
	cfg.Label = name + "/" + target
	cfg.Metadata = map[string]string{"scenario": name, "target": target, "time": "simulated", "describe": p.describe,
		"speedup": fmt.Sprint(speed), "fleet": fmt.Sprintf("%d × %s", p.fleet.backends, p.fleet.profile.Name)}
	simCfg := p.cfg
	simCfg.Tenants = slices.Clone(p.cfg.Tenants)
	if !st.jobs {
		for i := range cfg.Tenants {
			// No job API: batch goes as plain requests.
			cfg.Tenants[i].Deferred, simCfg.Tenants[i].Deferred = false, false
			cfg.Tenants[i].Batch, simCfg.Tenants[i].Batch = false, false
		}
	}

	c0, err := readFleet(ctx, st)
	if err != nil {
		return nil, err
	}
	w0 := time.Now()
	var trace admitTrace
	if st.sched != nil && o.Out != "" {
		st.sched.SetAdmitObserver(trace.add)
	}
	runCtx, cancelRun := context.WithCancel(ctx)
	defer cancelRun()
	type ran struct {
		rep *bench.Report
		err error
	}
	done := make(chan ran, 1)
	go func() {
		rep, err := bench.Run(runCtx, cfg)
		done <- ran{rep, err}
	}()

	// Timeline, in wall time from the start: events, then the edges of the
	// throughput window.
	type mark struct {
		at time.Duration
		do func() error
	}
	var (
		c1, c2 fleetCounters
		fired  []string
	)
	marks := []mark{
		{p.measureFrom, func() (err error) { c1, err = readFleet(ctx, st); return err }},
		{p.sending, func() (err error) { c2, err = readFleet(ctx, st); return err }},
	}
	for _, e := range p.events {
		marks = append(marks, mark{e.at, func() error {
			o.Log.Info("scenario event", "scenario", name, "target", target, "event", e.what)
			fired = append(fired, e.what)
			return e.do(ctx, st)
		}})
	}
	slices.SortStableFunc(marks, func(a, b mark) int { return cmp.Compare(a.at, b.at) })
	var r ran
	got := false
	for _, m := range marks {
		timer := time.NewTimer(time.Until(w0.Add(time.Duration(float64(m.at) / speed))))
		select {
		case r = <-done:
			got = true
		case <-timer.C:
		}
		timer.Stop()
		if got {
			break
		}
		if err := m.do(); err != nil {
			cancelRun()
			<-done
			return nil, err
		}
	}
	if !got {
		r = <-done
	}
	if r.err != nil {
		return nil, r.err
	}
	if c2.wall.IsZero() { // the run ended before its sending time was up
		if c2, err = readFleet(ctx, st); err != nil {
			return nil, err
		}
	}
	if c1.wall.IsZero() {
		c1 = c0
	}
	c3, err := readFleet(ctx, st)
	if err != nil {
		return nil, err
	}
	k := c3.speedup(c0)
	var refusals map[string]float64
	if st.gatewayMetrics != "" {
		if refusals, err = readRefusals(ctx, st.gatewayMetrics); err != nil {
			return nil, err
		}
	}
	tr := &TargetResult{
		Target: target, Report: r.rep, Speedup: k, Events: fired,
		gatewayMetrics:   st.gatewayMetrics,
		FleetTokPerSec:   c2.tokPerSec(c1),
		Stalled:          c2.stalledShare(c1),
		Preemptions:      c3.preemptions - c0.preemptions,
		PrefixHitRate:    c3.hitRate(c0),
		PredictedHitRate: -1,
		Refusals:         refusals,
	}
	if st.sched != nil {
		var hit, query float64
		for _, ps := range st.sched.PrefixStats() {
			hit, query = hit+ps.PredictedHitTokens, query+ps.QueryTokens
		}
		if query > 0 {
			tr.PredictedHitRate = hit / query
		}
	}
	if busy := 1 - tr.Stalled; busy > 0 {
		tr.FleetTokPerBusySec = tr.FleetTokPerSec / busy
	}
	toSimTime(tr.Report, k, simCfg)
	tr.Report.Metadata["effective_speedup"] = fmt.Sprintf("%.3f", k)
	tr.Focus, tr.FocusFailed = focusSummary(tr.Report, p.focus, p.measureFrom)
	if o.Out != "" {
		tr.Dir = filepath.Join(o.Out, name, target)
		if err := tr.Report.WriteFiles(tr.Dir); err != nil {
			return nil, err
		}
		if err := dumpMetrics(ctx, st, filepath.Join(tr.Dir, "metrics-end.txt")); err != nil {
			return nil, err
		}
		if st.sched != nil {
			st.sched.SetAdmitObserver(nil)
			if err := trace.write(filepath.Join(tr.Dir, "admissions.csv"), w0, k); err != nil {
				return nil, err
			}
		}
	}
	return tr, nil
}

// toWall turns a plan's load, in simulated time, into the wall-clock load
// the harness sends to a fleet running speed times faster.
func toWall(c bench.Config, speed float64) bench.Config {
	c.Tenants = slices.Clone(c.Tenants)
	c.Arrival.Rate *= speed
	for i := range c.Tenants {
		c.Tenants[i].Arrival.Rate *= speed
	}
	c.Duration = time.Duration(float64(c.Duration) / speed)
	c.RequestTimeout = time.Duration(float64(c.RequestTimeout) / speed)
	c.JobPollInterval = wall(c.JobPollInterval, speed, 50*time.Millisecond)
	return c
}

// putFaults sets a simulated backend's faults over its HTTP admin API.
func putFaults(ctx context.Context, backend, body string) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodPut, backend+"/admin/faults", strings.NewReader(body))
	if err != nil {
		return err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	_, _ = io.Copy(io.Discard, resp.Body)
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("set faults on %s: status %d", backend, resp.StatusCode)
	}
	return nil
}

// focusSummary is the summary of the named tenants' requests (all when
// none is named) at the headline point sent from from on (simulated time
// since the point's start), and how many of all their requests failed.
func focusSummary(rep *bench.Report, focus []string, from time.Duration) (bench.Summary, int) {
	var recs []bench.Record
	failed := 0
	for _, r := range rep.Requests {
		if r.Point != rep.Headline || len(focus) > 0 && !slices.Contains(focus, r.Tenant) {
			continue
		}
		if r.ErrorClass != "" {
			failed++
		}
		if r.Intended >= from {
			recs = append(recs, r)
		}
	}
	pt := rep.LoadPoints[rep.Headline]
	dur := time.Duration(pt.Summary.Duration*float64(time.Second)) - from
	return bench.Summarize(recs, max(dur, time.Nanosecond), rep.Config.SLO, rep.Config.Percentiles), failed
}

// llama is the simulated fleet's model.
func llamaProfile() (vllmsim.Profile, error) {
	p, err := vllmsim.LookupProfile("h100-llama-3.1-8b")
	if err != nil {
		return p, err
	}
	// A 32k-token KV cache per GPU (vLLM's --num-gpu-blocks-override) so
	// that a fleet fills in seconds and a run stays short; everything else
	// is the H100's.
	p.NumGPUBlocks, p.MaxModelLen = 2048, 8192
	return p, nil
}
