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

func noEnv(string) string { return "" }
