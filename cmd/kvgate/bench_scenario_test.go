package main

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvgate/kvgate/bench/scenario"
)

func TestBenchScenarioList(t *testing.T) {
	var out, errOut strings.Builder
	if err := runBenchScenario(context.Background(), []string{"list"}, noEnv, &out, &errOut); err != nil {
		t.Fatal(err)
	}
	for _, sc := range scenario.List() {
		if !strings.Contains(out.String(), sc.Name) {
			t.Errorf("list lacks %s:\n%s", sc.Name, out.String())
		}
	}
}

func TestBenchScenarioErrors(t *testing.T) {
	for _, args := range [][]string{
		{},
		{"nope"},
		{"overload", "--scale", "0"},
		{"overload", "--targets", "nginx"},
		{"overload", "extra"},
		{"overload", "--rounds", "0"},
	} {
		var out, errOut strings.Builder
		if err := runBenchScenario(context.Background(), args, noEnv, &out, &errOut); err == nil {
			t.Errorf("%q: no error", args)
		}
	}
}

// TestBenchScenarioRuns runs a tiny overload scenario against two targets
// with flags after the name, and checks the verdict and the files.
func TestBenchScenarioRuns(t *testing.T) {
	if testing.Short() {
		t.Skip("starts two fleets")
	}
	dir := t.TempDir()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var out, errOut strings.Builder
	err := runBenchScenario(ctx, []string{"--seed", "2", "overload", "--out", dir, "--scale", "0.03", "--speedup", "5",
		"--targets", "kvgate,round-robin"}, noEnv, &out, &errOut)
	if err != nil {
		t.Fatalf("%v\n%s", err, errOut.String())
	}
	for _, want := range []string{"overload:", "kvgate/round-robin", scenario.RowTTFTp99, scenario.RowPreemptions, "reports: " + filepath.Join(dir, "overload")} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("output lacks %q:\n%s", want, out.String())
		}
	}
	if strings.Contains(out.String(), "kvgate/threshold") {
		t.Errorf("threshold did not run but has a column:\n%s", out.String())
	}
	for _, f := range []string{"verdict.json", "verdict.md", "kvgate/report.json", "round-robin/report.html"} {
		if _, err := os.Stat(filepath.Join(dir, "overload", f)); err != nil {
			t.Error(err)
		}
	}
}

// TestBenchScenarioRounds runs a tiny overload scenario in two rounds and
// checks the rounds' table: each round's figures and ratios, the medians,
// kvgate's refusals, and each round's reports in a directory of its own.
func TestBenchScenarioRounds(t *testing.T) {
	if testing.Short() {
		t.Skip("starts four fleets")
	}
	dir := t.TempDir()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	var out, errOut strings.Builder
	err := runBenchScenario(ctx, []string{"overload", "--out", dir, "--scale", "0.03", "--speedup", "5",
		"--targets", "kvgate,round-robin", "--rounds", "2"}, noEnv, &out, &errOut)
	if err != nil {
		t.Fatalf("%v\n%s", err, errOut.String())
	}
	table, err := os.ReadFile(filepath.Join(dir, "overload", "rounds.md"))
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		"# overload, 2 rounds", "| round | figure | kvgate | round-robin | kvgate/round-robin |",
		"| 1 | fleet output tok/s |", "| 2 | fleet tok/s, host stalls out |", "| median | simulators stalled |",
		"| median | preemptions |", "kvgate's admission refusals by reason",
		"Run order: 1: kvgate, round-robin; 2: round-robin, kvgate",
	} {
		if !strings.Contains(string(table), want) || !strings.Contains(out.String(), want) {
			t.Errorf("rounds' table (file and output) lacks %q:\n%s", want, table)
		}
	}
	for _, f := range []string{"round-1/overload/verdict.md", "round-2/overload/kvgate/report.json", "round-2/overload/round-robin/report.json"} {
		if _, err := os.Stat(filepath.Join(dir, f)); err != nil {
			t.Error(err)
		}
	}
}

func noEnv(string) string { return "" }
