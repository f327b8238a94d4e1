package chaos

import (
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"
)

// suite is what TestMain prepares for every scenario.
var suite struct {
	mode   string // full, short or off
	why    string // what chose the mode
	strict bool   // a missing prerequisite fails the run instead of skipping it
	skip   string // outside strict runs: the missing prerequisite
	bin    string // the kvgate binary built for this run
	nats   string // nats-server
	pg     *pgCluster
	dir    string // where scenarios keep their logs
	keep   bool   // keep the logs of scenarios that passed too
	report string // KVGATE_CHAOS_REPORT: a file each scenario's figures are appended to
}

// chooseMode decides which scenarios run. KVGATE_CHAOS=full|short|off
// decides when set (make chaos, make chaos-short). Unset, CI=true runs the
// short subset, -short runs nothing, and a plain go test runs the short
// subset. A run that was asked for explicitly, or runs in CI, fails when a
// prerequisite is missing; a plain local go test skips then.
func chooseMode() error {
	ci := os.Getenv("CI") == "true"
	switch v := os.Getenv("KVGATE_CHAOS"); v {
	case "full", "short":
		suite.mode, suite.why, suite.strict = v, "KVGATE_CHAOS="+v, true
	case "off":
		suite.mode, suite.why = v, "KVGATE_CHAOS=off"
	case "":
		switch {
		case ci:
			suite.mode, suite.why, suite.strict = "short", "CI=true", true
		case testing.Short():
			suite.mode, suite.why = "off", "-short (KVGATE_CHAOS=short runs the short subset)"
		default:
			suite.mode, suite.why = "short", "the default (KVGATE_CHAOS=full runs every scenario)"
		}
	default:
		return fmt.Errorf("KVGATE_CHAOS=%q: want full, short or off", v)
	}
	return nil
}

func TestMain(m *testing.M) {
	flag.Parse()
	os.Exit(runSuite(m))
}

func runSuite(m *testing.M) int {
	if err := chooseMode(); err != nil {
		fmt.Fprintln(os.Stderr, "chaos:", err)
		return 2
	}
	if suite.mode == "off" {
		return m.Run()
	}
	cleanup, err := prepare()
	defer cleanup()
	if err != nil {
		if suite.strict {
			fmt.Fprintf(os.Stderr, "chaos: a prerequisite is missing (%s, so this fails rather than skips): %v\n", suite.why, err)
			return 1
		}
		suite.skip = err.Error()
	}
	return m.Run()
}

// prepare finds nats-server, builds kvgate and starts the private
// PostgreSQL cluster. The cleanup it returns undoes what was done.
func prepare() (func(), error) {
	var undo []func()
	cleanup := func() {
		for i := len(undo) - 1; i >= 0; i-- {
			undo[i]()
		}
	}
	var err error
	if suite.nats, err = findNATS(); err != nil {
		return cleanup, err
	}
	suite.keep = os.Getenv("KVGATE_CHAOS_KEEP") == "1"
	if suite.report = os.Getenv("KVGATE_CHAOS_REPORT"); suite.report != "" {
		head := fmt.Sprintf("chaos suite, %s, %s\n\n", suite.why, time.Now().UTC().Format(time.RFC3339)) +
			"| scenario | jobs | final states | spent attempts | records that spent nothing | attempt records by outcome | engine requests | run to their end | duration | result |\n" +
			"|---|---|---|---|---|---|---|---|---|---|\n"
		if err := os.MkdirAll(filepath.Dir(suite.report), 0o755); err != nil {
			return cleanup, err
		}
		if err := os.WriteFile(suite.report, []byte(head), 0o644); err != nil {
			return cleanup, err
		}
	}
	if d := os.Getenv("KVGATE_CHAOS_DIR"); d != "" {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return cleanup, err
		}
		if suite.dir, err = filepath.Abs(d); err != nil {
			return cleanup, err
		}
	} else {
		if suite.dir, err = os.MkdirTemp("", "kvgate-chaos-"); err != nil {
			return cleanup, err
		}
	}
	binDir, err := os.MkdirTemp("", "kvgate-chaos-bin-")
	if err != nil {
		return cleanup, err
	}
	undo = append(undo, func() { os.RemoveAll(binDir) })
	suite.bin = filepath.Join(binDir, "kvgate")
	goCmd, err := exec.LookPath("go")
	if err != nil {
		goCmd = "/usr/local/go/bin/go" // where CI's Go lives
	}
	start := time.Now()
	build := exec.Command(goCmd, "build", "-o", suite.bin, "github.com/kvgate/kvgate/cmd/kvgate")
	if out, err := build.CombinedOutput(); err != nil {
		return cleanup, fmt.Errorf("go build ./cmd/kvgate: %v\n%s", err, out)
	}
	fmt.Fprintf(os.Stderr, "chaos: %s: built kvgate in %s; logs under %s\n", suite.why, time.Since(start).Round(time.Second), suite.dir)
	if suite.pg, err = startCluster(); err != nil {
		return cleanup, fmt.Errorf("private PostgreSQL: %w", err)
	}
	undo = append(undo, suite.pg.stop)
	return cleanup, nil
}

// need skips a scenario that the chosen mode does not run: "short" ones
// run in both modes, "full" ones only in the full suite.
func need(t *testing.T, subset string) {
	t.Helper()
	switch {
	case suite.mode == "off":
		t.Skipf("chaos suite off: %s", suite.why)
	case suite.skip != "":
		t.Skipf("chaos prerequisite missing (set CI=true or KVGATE_CHAOS to make this fail): %s", suite.skip)
	case subset == "full" && suite.mode != "full":
		t.Skip("full suite only: make chaos (KVGATE_CHAOS=full)")
	}
}
