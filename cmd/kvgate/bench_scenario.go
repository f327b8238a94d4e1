package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"path/filepath"
	"strings"
	"text/tabwriter"

	"github.com/kvgate/kvgate/bench/scenario"
)

const benchScenarioAbout = `Runs a named benchmark scenario: it starts a simulated vLLM fleet and, in
turn, kvgate, round-robin, an endpoint-picker-style threshold router and an
llm-d-style prefix router in front of a fresh copy of it, all in-process, sends each the same seeded
arrivals, writes each target's reports under DIR/<scenario>/<target>/ and
prints a verdict table of kvgate's figures against the baselines'. Figures
are in simulated time.

Usage:
  kvgate bench scenario list
  kvgate bench scenario NAME|all [flags]
`

// runBenchScenario runs `kvgate bench scenario`.
func runBenchScenario(ctx context.Context, args []string, getenv func(string) string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("kvgate bench scenario", flag.ContinueOnError)
	fs.SetOutput(stderr)
	out := fs.String("out", "", "write reports and verdicts under `DIR`/<scenario>/ (none when empty)")
	scale := fs.Float64("scale", 1, "multiply each scenario's simulated duration and job counts by `X` (burst's 10,000 jobs at 1)")
	speedup := fs.Float64("speedup", 4, "run the simulated GPUs `S` times faster than wall time; arrivals are sped up to match")
	seed := fs.Uint64("seed", 1, "seed of arrivals and prompts")
	targets := fs.String("targets", strings.Join(scenario.Targets, ","), "comma-separated targets to run")
	rounds := fs.Int("rounds", 1, "run the scenario `N` times, the targets interleaved (their order reversed every other round); when given, also writes DIR/<scenario>/rounds.md: each round's figures, kvgate's ratio to each baseline per round, and the medians")
	logLevel := fs.String("log-level", "warn", "progress logging: debug (with kvgate's own logs), info, warn, error")
	fs.Usage = func() {
		fmt.Fprint(stderr, benchScenarioAbout)
		fmt.Fprintln(stderr, "\nScenarios:")
		listScenarios(stderr)
		fmt.Fprintln(stderr, "\nFlags:")
		fs.PrintDefaults()
	}
	// Flags may come before or after the name.
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() == 0 {
		fs.Usage()
		return errors.New("bench scenario: no scenario named")
	}
	name := fs.Arg(0)
	if err := fs.Parse(fs.Args()[1:]); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("bench scenario: unexpected arguments %q", fs.Args())
	}
	roundsSet := false // --rounds given, even as 1: the rounds' table too
	fs.Visit(func(f *flag.Flag) { roundsSet = roundsSet || f.Name == "rounds" })
	if *rounds < 1 {
		return fmt.Errorf("bench scenario: --rounds must be at least 1 (got %d)", *rounds)
	}
	if !(*scale > 0) || !(*speedup >= 1) {
		return fmt.Errorf("bench scenario: --scale must be positive and --speedup at least 1 (got %v and %v)", *scale, *speedup)
	}
	if name == "list" {
		listScenarios(stdout)
		return nil
	}
	var run []scenario.Scenario
	if name == "all" {
		run = scenario.List()
	} else {
		sc, err := scenario.Lookup(name)
		if err != nil {
			return err
		}
		run = []scenario.Scenario{sc}
	}
	log, err := newLogger(stderr, *logLevel)
	if err != nil {
		return err
	}
	opts := scenario.Options{Scale: *scale, Speedup: *speedup, Seed: *seed, Out: *out, Log: log.With("component", "bench")}
	if *logLevel == "debug" {
		opts.TargetLog = log
	}
	for _, t := range strings.Split(*targets, ",") {
		if t = strings.TrimSpace(t); t != "" {
			opts.Targets = append(opts.Targets, t)
		}
	}
	for _, sc := range run {
		log.Info("scenario starting", "scenario", sc.Name)
		if roundsSet {
			rs, err := sc.RunRounds(ctx, opts, *rounds)
			if err != nil {
				return err
			}
			if err := rs.WriteText(stdout); err != nil {
				return err
			}
			if *out != "" {
				fmt.Fprintf(stdout, "reports: %s\n", filepath.Join(*out, sc.Name))
			}
			fmt.Fprintln(stdout)
			continue
		}
		res, err := sc.Run(ctx, opts)
		if err != nil {
			return err
		}
		if err := res.Verdict.WriteText(stdout); err != nil {
			return err
		}
		if *out != "" {
			fmt.Fprintf(stdout, "reports: %s\n", filepath.Join(*out, sc.Name))
		}
		fmt.Fprintln(stdout)
	}
	return nil
}

func listScenarios(w io.Writer) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	for _, sc := range scenario.List() {
		fmt.Fprintf(tw, "  %s\t%s\n", sc.Name, sc.About)
	}
	_ = tw.Flush()
}
