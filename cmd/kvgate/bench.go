package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"go.yaml.in/yaml/v3"

	"github.com/kvgate/kvgate/bench"
	"github.com/kvgate/kvgate/gpu"
)

const benchUsage = `Usage:
  kvgate bench run --target URL --model NAME [--out DIR] [flags]   drive load, write reports
  kvgate bench run --config FILE [flags]                           the same, settings from YAML
  kvgate bench compare A.json B.json [--fail-on-worse]             deltas between two reports
  kvgate bench scenario NAME|all|list                              named scenarios (kvgate bench scenario --help)

kvgate bench run --help lists the flags. Reports: DIR/report.json (vllm bench
serve's field names), summary.csv, requests.csv, report.md, report.html.
`

// runBench is `kvgate bench`.
func runBench(ctx context.Context, args []string, getenv func(string) string, stdout, stderr io.Writer) error {
	if len(args) == 0 {
		fmt.Fprint(stderr, benchUsage)
		return errors.New("bench: no subcommand given")
	}
	switch args[0] {
	case "run":
		return runBenchRun(ctx, args[1:], getenv, stdout, stderr)
	case "compare":
		return runBenchCompare(args[1:], stdout, stderr)
	case "scenario":
		return runBenchScenario(ctx, args[1:], getenv, stdout, stderr)
	case "help", "-h", "--help":
		fmt.Fprint(stdout, benchUsage)
		return nil
	}
	fmt.Fprint(stderr, benchUsage)
	return fmt.Errorf("bench: unknown subcommand %q", args[0])
}

// listFlag is a repeatable string flag.
type listFlag []string

func (l *listFlag) String() string     { return strings.Join(*l, " ") }
func (l *listFlag) Set(v string) error { *l = append(*l, v); return nil }

// rateFlag is a request rate: a positive number or inf.
type rateFlag float64

func (r *rateFlag) String() string { return bench.Rate(*r).String() }
func (r *rateFlag) Set(v string) error {
	f, err := parseRate(v)
	*r = rateFlag(f)
	return err
}

func parseRate(v string) (float64, error) {
	if strings.EqualFold(v, "inf") {
		return math.Inf(1), nil
	}
	f, err := strconv.ParseFloat(v, 64)
	if err != nil || !(f > 0) {
		return 0, fmt.Errorf("rate %q is neither a positive number nor inf", v)
	}
	return f, nil
}

// benchFlags are `kvgate bench run`'s settings.
type benchFlags struct {
	target, model, apiKey, out, endpoint, label       string
	stream, quiet, deferred, nvml, ignoreEOS          bool
	numPrompts, maxConcurrency, concurrency, maxConns int
	duration, requestTimeout, scrapeInterval          time.Duration
	rate                                              rateFlag
	burstiness                                        float64
	arrival, jobFollow                                string
	dataset, datasetPath                              string
	inputLen, outputLen                               int
	rangeRatio, inputStd, outputStd                   float64
	inputDist, outputDist                             string
	prefixLen, prefixGroups, sharegptOutput           int
	timeScale                                         float64
	goodput, percentiles, sweepRates                  string
	sweepPoints                                       int
	seed                                              uint64
	scrape, tenants, metadata                         listFlag
}

func benchFlagSet(stderr io.Writer, f *benchFlags) *flag.FlagSet {
	fs := flag.NewFlagSet("kvgate bench run", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.String("config", "", "YAML file of settings: keys are these flags' names (tenants: a list of maps); flags override it")
	fs.StringVar(&f.target, "target", "", "base URL of any OpenAI-compatible server: kvgate, vLLM, the simulator (http://host:port or .../v1)")
	fs.StringVar(&f.model, "model", "", "model id to request")
	fs.StringVar(&f.apiKey, "api-key", "", "bearer key (default $OPENAI_API_KEY)")
	fs.StringVar(&f.out, "out", "bench-results", "directory for the reports")
	fs.StringVar(&f.endpoint, "endpoint", "/v1/completions", "/v1/completions or /v1/chat/completions (or completions, chat)")
	fs.BoolVar(&f.stream, "stream", true, "stream, to measure TTFT, TPOT and ITL (--stream=false: end-to-end latency only)")
	fs.IntVar(&f.numPrompts, "num-prompts", 1000, "requests per load point (0: bounded by --duration only, at a finite --request-rate)")
	fs.DurationVar(&f.duration, "duration", 0, "stop sending after this long, per load point (0: no limit)")
	f.rate = rateFlag(math.Inf(1))
	fs.Var(&f.rate, "request-rate", "requests per second over all tenants, or inf to send all at once")
	fs.Float64Var(&f.burstiness, "burstiness", 1, "Gamma shape of the gaps: 1 Poisson, <1 burstier, >1 smoother")
	fs.StringVar(&f.arrival, "arrival", "", "poisson, gamma, constant, concurrency or trace (default from the other flags)")
	fs.IntVar(&f.concurrency, "concurrency", 0, "closed-loop clients over all tenants, each sending when its last answer ends (instead of a rate)")
	fs.IntVar(&f.maxConcurrency, "max-concurrency", 0, "cap on requests in flight (0: none)")
	fs.IntVar(&f.maxConns, "max-connections", bench.DefaultMaxConnections, "cap on connections to the target; requests beyond wait, timed (-1: none)")
	fs.StringVar(&f.dataset, "dataset-name", bench.DatasetRandom, "random, sharegpt, prefix, system-prompt, multi-turn or trace")
	fs.StringVar(&f.datasetPath, "dataset-path", "", "ShareGPT JSON file or JSONL trace (Mooncake format)")
	fs.IntVar(&f.inputLen, "random-input-len", 1024, "mean prompt length in tokens")
	fs.IntVar(&f.outputLen, "random-output-len", 128, "mean output length in tokens (max_tokens, with ignore_eos)")
	fs.Float64Var(&f.rangeRatio, "random-range-ratio", 0, "uniform lengths in [len·(1−r), len·(1+r)], as vllm")
	fs.StringVar(&f.inputDist, "input-dist", "", "prompt length distribution: fixed, uniform, normal, lognormal")
	fs.StringVar(&f.outputDist, "output-dist", "", "output length distribution: fixed, uniform, normal, lognormal")
	fs.Float64Var(&f.inputStd, "input-stddev", 0, "standard deviation of prompt lengths (normal, lognormal)")
	fs.Float64Var(&f.outputStd, "output-stddev", 0, "standard deviation of output lengths (normal, lognormal)")
	fs.IntVar(&f.prefixLen, "prefix-len", 0, "shared prefix tokens (dataset prefix)")
	fs.IntVar(&f.prefixGroups, "prefix-groups", 1, "number of distinct shared prefixes (dataset prefix), system prompts (system-prompt) or sessions (multi-turn)")
	fs.IntVar(&f.sharegptOutput, "sharegpt-output-len", 0, "replace ShareGPT's and the trace's output lengths")
	fs.BoolVar(&f.ignoreEOS, "ignore-eos", false, "ask for exactly max_tokens on ShareGPT and trace workloads too (always on for random and prefix)")
	fs.Float64Var(&f.timeScale, "trace-time-scale", 1, "stretch a trace's timestamps (2: half as fast)")
	fs.StringVar(&f.goodput, "goodput", "", `SLOs for goodput, e.g. "ttft:500 tpot:50 e2el:10000" (ms)`)
	fs.StringVar(&f.percentiles, "metric-percentiles", "50,90,99,99.9", "latency percentiles to report")
	fs.StringVar(&f.sweepRates, "sweep-rates", "", "comma-separated rates: one load point each, the knee marked")
	fs.IntVar(&f.sweepPoints, "sweep-points", 0, "sweep: one point at full speed, then N-1 rates up to its throughput")
	fs.Var(&f.tenants, "tenant", "a tenant: name=acme,key=sk-..,rate=5,weight=1,deferred=true,num-prompts=100,\n"+
		"dataset-name=..,random-input-len=..,random-output-len=..,concurrency=..,burstiness=.. (repeatable)")
	fs.BoolVar(&f.deferred, "deferred", false, "submit every request as a job (POST /v1/jobs) and follow it to its end")
	fs.StringVar(&f.jobFollow, "job-follow", bench.JobFollowSSE, "follow deferred jobs by sse (their event streams), poll, or none (latency: the acceptance's alone)")
	fs.Uint64Var(&f.seed, "seed", 0, "seed for arrivals and prompts")
	fs.Var(&f.scrape, "scrape", "a /metrics URL to sample during the run (kvgate's, vLLM's); repeatable")
	fs.DurationVar(&f.scrapeInterval, "scrape-interval", time.Second, "how often to scrape")
	fs.DurationVar(&f.requestTimeout, "request-timeout", 10*time.Minute, "cut a request after this long")
	fs.StringVar(&f.label, "label", "", "label copied into the report")
	fs.Var(&f.metadata, "metadata", "KEY=VALUE copied into the report; repeatable")
	fs.BoolVar(&f.quiet, "quiet", false, "no progress output")
	fs.BoolVar(&f.nvml, "nvml", true, "sample this machine's GPUs through NVML during the run, where NVML is present")
	fs.Usage = func() {
		fmt.Fprint(stderr, benchUsage+"\nFlags of kvgate bench run:\n")
		fs.PrintDefaults()
	}
	return fs
}

// applyConfigFile sets flags from a YAML file whose keys are flag names.
func applyConfigFile(fs *flag.FlagSet, path string) error {
	b, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	var m map[string]any
	if err := yaml.Unmarshal(b, &m); err != nil {
		return fmt.Errorf("%s: %w", path, err)
	}
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	for _, k := range keys {
		name := strings.ReplaceAll(k, "_", "-")
		if name == "tenants" {
			name = "tenant"
		}
		if fs.Lookup(name) == nil || name == "config" {
			return fmt.Errorf("%s: unknown setting %q", path, k)
		}
		var vals []string
		switch v := m[k].(type) {
		case []any:
			for _, e := range v {
				vals = append(vals, yamlValue(e))
			}
		case map[string]any:
			for _, mk := range sortedKeys(v) {
				vals = append(vals, mk+"="+yamlValue(v[mk]))
			}
		default:
			vals = []string{yamlValue(v)}
		}
		for _, v := range vals {
			if err := fs.Set(name, v); err != nil {
				return fmt.Errorf("%s: %s: %w", path, k, err)
			}
		}
	}
	return nil
}

func sortedKeys(m map[string]any) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	return keys
}

// yamlValue formats a scalar, or a map as k=v,k=v (a tenant).
func yamlValue(v any) string {
	if m, ok := v.(map[string]any); ok {
		var parts []string
		for _, k := range sortedKeys(m) {
			parts = append(parts, strings.ReplaceAll(k, "_", "-")+"="+yamlValue(m[k]))
		}
		return strings.Join(parts, ",")
	}
	if f, ok := v.(float64); ok && math.IsInf(f, 1) {
		return "inf"
	}
	return fmt.Sprint(v)
}

// configFileArg finds --config in args before they are parsed.
func configFileArg(args []string) string {
	for i, a := range args {
		a = strings.TrimLeft(a, "-")
		if v, ok := strings.CutPrefix(a, "config="); ok {
			return v
		}
		if a == "config" && i+1 < len(args) && strings.HasPrefix(args[i], "-") {
			return args[i+1]
		}
	}
	return ""
}

func runBenchRun(ctx context.Context, args []string, getenv func(string) string, stdout, stderr io.Writer) error {
	var f benchFlags
	fs := benchFlagSet(stderr, &f)
	if path := configFileArg(args); path != "" {
		if err := applyConfigFile(fs, path); err != nil {
			return fmt.Errorf("bench run: --config %w", err)
		}
	}
	if err := fs.Parse(joinGoodput(args)); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("bench run: unexpected argument %q", fs.Arg(0))
	}
	if f.apiKey == "" {
		f.apiKey = getenv("OPENAI_API_KEY") // read after parsing, so that help never prints it
	}
	cfg, err := f.config()
	if err != nil {
		return fmt.Errorf("bench run: %w", err)
	}
	if !f.quiet {
		cfg.Progress = stderr
	}
	if f.nvml {
		if nv := gpu.OpenNVML(nil, gpu.NVMLConfig{}); nv.Enabled() {
			cfg.GPUs = nv
		}
	}
	rep, runErr := bench.Run(ctx, cfg)
	if rep == nil {
		return runErr
	}
	if err := rep.WriteFiles(f.out); err != nil {
		return err
	}
	if err := rep.WriteMarkdown(stdout); err != nil {
		return err
	}
	fmt.Fprintf(stdout, "\nreports: %s\n", strings.Join([]string{
		filepath.Join(f.out, bench.FileJSON), filepath.Join(f.out, bench.FileSummaryCSV), filepath.Join(f.out, bench.FileRequestsCSV),
		filepath.Join(f.out, bench.FileMarkdown), filepath.Join(f.out, bench.FileHTML)}, " "))
	return runErr
}

// config turns the flags into a bench.Config.
func (f *benchFlags) config() (bench.Config, error) {
	cfg := bench.Config{Target: f.target, Model: f.model, APIKey: f.apiKey, Stream: f.stream, NumPrompts: f.numPrompts,
		Duration: f.duration, MaxConcurrency: f.maxConcurrency, MaxConnections: f.maxConns, Seed: f.seed, RequestTimeout: f.requestTimeout,
		Scrape: f.scrape, ScrapeInterval: f.scrapeInterval, Label: f.label, JobFollow: f.jobFollow}
	if f.numPrompts < 0 {
		return cfg, errors.New("--num-prompts is negative")
	}
	switch strings.TrimPrefix(strings.TrimPrefix(f.endpoint, "/"), "v1/") {
	case "completions":
		cfg.Endpoint = bench.EndpointCompletions
	case "chat/completions", "chat":
		cfg.Endpoint = bench.EndpointChat
	default:
		return cfg, fmt.Errorf("--endpoint %q: want /v1/completions or /v1/chat/completions", f.endpoint)
	}
	var err error
	if cfg.Workload, err = f.workload(map[string]string{}); err != nil {
		return cfg, err
	}
	cfg.Arrival = bench.Arrival{Kind: f.arrival, Rate: float64(f.rate), Burstiness: f.burstiness, Concurrency: f.concurrency, TimeScale: f.timeScale}
	if cfg.SLO, err = parseGoodput(f.goodput); err != nil {
		return cfg, err
	}
	for _, p := range strings.FieldsFunc(f.percentiles, func(r rune) bool { return r == ',' || r == ' ' }) {
		v, err := strconv.ParseFloat(p, 64)
		if err != nil {
			return cfg, fmt.Errorf("--metric-percentiles: %q is not a number", p)
		}
		cfg.Percentiles = append(cfg.Percentiles, v)
	}
	if f.sweepRates != "" || f.sweepPoints > 0 {
		cfg.Sweep = &bench.Sweep{Points: f.sweepPoints}
		for _, r := range strings.Split(f.sweepRates, ",") {
			if r = strings.TrimSpace(r); r == "" {
				continue
			}
			v, err := parseRate(r)
			if err != nil || math.IsInf(v, 1) {
				return cfg, fmt.Errorf("--sweep-rates: %q is not a positive number", r)
			}
			cfg.Sweep.Rates = append(cfg.Sweep.Rates, v)
		}
	}
	for _, kv := range f.metadata {
		k, v, ok := strings.Cut(kv, "=")
		if !ok {
			return cfg, fmt.Errorf("--metadata %q: want KEY=VALUE", kv)
		}
		if cfg.Metadata == nil {
			cfg.Metadata = map[string]string{}
		}
		cfg.Metadata[k] = v
	}
	// The run's rate (or clients) is over all tenants: those without a
	// rate or clients of their own share it.
	var sharing, shared int
	for _, spec := range f.tenants {
		if !specHas(spec, "rate", "request-rate", "concurrency") {
			sharing++
		}
	}
	for _, spec := range f.tenants {
		a := cfg.Arrival
		if !specHas(spec, "rate", "request-rate", "concurrency") {
			if a, err = cfg.Arrival.Share(shared, sharing); err != nil {
				return cfg, fmt.Errorf("--tenant %q: %w", spec, err)
			}
			shared++
		}
		t, err := f.tenant(spec, a)
		if err != nil {
			return cfg, fmt.Errorf("--tenant %q: %w", spec, err)
		}
		cfg.Tenants = append(cfg.Tenants, t)
	}
	if f.deferred {
		if len(cfg.Tenants) == 0 {
			cfg.Tenants = []bench.Tenant{{Name: "default"}}
		}
		for i := range cfg.Tenants {
			cfg.Tenants[i].Deferred = true
		}
	}
	_, err = cfg.Validate()
	return cfg, err
}

// workload builds a workload from the flags, overridden by a tenant's keys.
func (f *benchFlags) workload(over map[string]string) (bench.Workload, error) {
	get := func(k, def string) string {
		if v, ok := over[k]; ok {
			return v
		}
		return def
	}
	var errs []error
	num := func(k string, def float64) float64 {
		v, err := strconv.ParseFloat(get(k, strconv.FormatFloat(def, 'g', -1, 64)), 64)
		if err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", k, err))
		}
		return v
	}
	in, out := num("random-input-len", float64(f.inputLen)), num("random-output-len", float64(f.outputLen))
	ratio := num("random-range-ratio", f.rangeRatio)
	dist := func(kind string, mean, std float64) (bench.Dist, error) {
		if kind == "" {
			kind = bench.DistFixed
			if ratio > 0 {
				kind = bench.DistUniform
			}
		}
		d := bench.Dist{Kind: kind, Mean: mean, StdDev: std}
		if kind == bench.DistUniform {
			if ratio <= 0 || ratio >= 1 {
				return d, errors.New("uniform lengths need --random-range-ratio in (0, 1)")
			}
			d.Min, d.Max = max(1, int(math.Round(mean*(1-ratio)))), int(math.Round(mean*(1+ratio)))
		}
		return d, nil
	}
	w := bench.Workload{Kind: get("dataset-name", f.dataset), Path: get("dataset-path", f.datasetPath),
		PrefixLen: int(num("prefix-len", float64(f.prefixLen))), PrefixGroups: int(num("prefix-groups", float64(f.prefixGroups))),
		FixedOutput: int(num("sharegpt-output-len", float64(f.sharegptOutput))), IgnoreEOS: f.ignoreEOS}
	var err error
	if w.Input, err = dist(get("input-dist", f.inputDist), in, num("input-stddev", f.inputStd)); err != nil {
		return w, err
	}
	if w.Output, err = dist(get("output-dist", f.outputDist), out, num("output-stddev", f.outputStd)); err != nil {
		return w, err
	}
	return w, errors.Join(errs...)
}

// specHas says whether a --tenant spec sets one of keys.
func specHas(spec string, keys ...string) bool {
	for _, part := range strings.Split(spec, ",") {
		k, _, _ := strings.Cut(strings.TrimSpace(part), "=")
		if slices.Contains(keys, strings.ReplaceAll(k, "_", "-")) {
			return true
		}
	}
	return false
}

// tenant parses --tenant name=..,key=..,...; unset keys take the run's
// flags, and its arrival's a, its share of the run's.
func (f *benchFlags) tenant(spec string, a bench.Arrival) (bench.Tenant, error) {
	kv := map[string]string{}
	for _, part := range strings.Split(spec, ",") {
		k, v, ok := strings.Cut(strings.TrimSpace(part), "=")
		if !ok {
			return bench.Tenant{}, fmt.Errorf("%q is not KEY=VALUE", part)
		}
		kv[strings.ReplaceAll(k, "_", "-")] = v
	}
	known := []string{"name", "key", "api-key", "class", "weight", "rate", "request-rate", "burstiness", "arrival", "concurrency",
		"num-prompts", "deferred", "dataset-name", "dataset-path", "random-input-len", "random-output-len", "random-range-ratio",
		"input-dist", "output-dist", "input-stddev", "output-stddev", "prefix-len", "prefix-groups", "sharegpt-output-len"}
	for k := range kv {
		if !slices.Contains(known, k) {
			return bench.Tenant{}, fmt.Errorf("unknown key %q", k)
		}
	}
	t := bench.Tenant{Name: kv["name"], APIKey: kv["key"], Class: kv["class"], Arrival: a}
	if v, ok := kv["api-key"]; ok {
		t.APIKey = v
	}
	var err error
	if t.Workload, err = f.workload(kv); err != nil {
		return t, err
	}
	parse := func(k string, dst *float64) {
		if v, ok := kv[k]; ok && err == nil {
			*dst, err = strconv.ParseFloat(v, 64)
		}
	}
	parse("weight", &t.Weight)
	parse("burstiness", &t.Arrival.Burstiness)
	for _, k := range []string{"rate", "request-rate"} {
		if v, ok := kv[k]; ok && err == nil {
			t.Arrival.Rate, err = parseRate(v)
		}
	}
	if v, ok := kv["concurrency"]; ok && err == nil {
		t.Arrival.Concurrency, err = strconv.Atoi(v)
	}
	if v, ok := kv["arrival"]; ok {
		t.Arrival.Kind = v
	}
	if v, ok := kv["num-prompts"]; ok && err == nil {
		t.NumPrompts, err = strconv.Atoi(v)
	}
	if v, ok := kv["deferred"]; ok && err == nil {
		t.Deferred, err = strconv.ParseBool(v)
	}
	return t, err
}

// joinGoodput lets --goodput take several arguments, as vllm's does
// (--goodput ttft:500 tpot:50): the NAME:MS words after it join its value.
func joinGoodput(args []string) []string {
	out := make([]string, 0, len(args))
	for i := 0; i < len(args); i++ {
		a := args[i]
		out = append(out, a)
		if name := strings.TrimLeft(a, "-"); a == name || name != "goodput" || i+1 >= len(args) {
			continue
		}
		v := args[i+1]
		i++
		for i+1 < len(args) && isObjective(args[i+1]) {
			v += " " + args[i+1]
			i++
		}
		out = append(out, v)
	}
	return out
}

func isObjective(s string) bool {
	for _, k := range []string{"ttft:", "tpot:", "e2el:"} {
		if strings.HasPrefix(s, k) {
			return true
		}
	}
	return false
}

// parseGoodput reads vllm's --goodput: "ttft:500 tpot:50 e2el:10000" (ms),
// separated by spaces or commas.
func parseGoodput(s string) (bench.SLO, error) {
	var slo bench.SLO
	for _, part := range strings.FieldsFunc(s, func(r rune) bool { return r == ',' || r == ' ' }) {
		k, v, ok := strings.Cut(part, ":")
		msv, err := strconv.ParseFloat(v, 64)
		if !ok || err != nil || msv <= 0 {
			return slo, fmt.Errorf("--goodput %q: want NAME:MILLISECONDS", part)
		}
		d := time.Duration(msv * float64(time.Millisecond))
		switch k {
		case "ttft":
			slo.TTFT = d
		case "tpot":
			slo.TPOT = d
		case "e2el":
			slo.E2EL = d
		default:
			return slo, fmt.Errorf("--goodput %q: the objectives are ttft, tpot and e2el", part)
		}
	}
	return slo, nil
}

func runBenchCompare(args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("kvgate bench compare", flag.ContinueOnError)
	fs.SetOutput(stderr)
	failOnWorse := fs.Bool("fail-on-worse", false, "exit with an error when a figure is worse beyond noise")
	fs.Usage = func() {
		fmt.Fprint(stderr, "Usage: kvgate bench compare [--fail-on-worse] A.json B.json\n\n"+
			"Sets report B against baseline A (report.json files or their directories; vllm bench serve\n"+
			"result files too): each figure, B − A, B / A, the noise threshold, and BETTER or WORSE\n"+
			"where the change exceeds it.\n\nFlags:\n")
		fs.PrintDefaults()
	}
	// Flags may follow the file names.
	var files []string
	for len(args) > 0 {
		if err := fs.Parse(args); err != nil {
			return err
		}
		if fs.NArg() == 0 {
			break
		}
		files = append(files, fs.Arg(0))
		args = fs.Args()[1:]
	}
	if len(files) != 2 {
		fs.Usage()
		return errors.New("bench compare: want two reports")
	}
	var reps [2]*bench.Report
	for i, p := range files {
		if st, err := os.Stat(p); err == nil && st.IsDir() {
			p = filepath.Join(p, bench.FileJSON)
		}
		r, err := bench.ReadReport(p)
		if err != nil {
			return err
		}
		reps[i] = r
	}
	c := bench.Compare(reps[0], reps[1])
	c.A, c.B = files[0], files[1]
	if err := c.Write(stdout); err != nil {
		return err
	}
	if *failOnWorse {
		var worse []string
		for _, d := range c.Flagged() {
			if d.Flag == "worse" {
				worse = append(worse, d.Metric)
			}
		}
		if len(worse) > 0 {
			return fmt.Errorf("bench compare: worse beyond noise: %s", strings.Join(worse, ", "))
		}
	}
	return nil
}
