package gateway

import (
	"os"
	"testing"
)

// experiments says whether the long experiments run: they measure
// throughput, preemption and waits for tens of seconds, which the race
// detector and packages tested in parallel would distort, so they run on
// their own (make experiments, part of make test) with
// KVGATE_EXPERIMENTS=1, and a plain go test ./gateway/ stays quick.
func experiments() bool { return os.Getenv("KVGATE_EXPERIMENTS") == "1" && !raceEnabled }

// experiment skips a long experiment unless experiments run.
func experiment(t *testing.T) {
	t.Helper()
	if !experiments() {
		t.Skip("a long experiment: make experiments runs it (KVGATE_EXPERIMENTS=1, without -race)")
	}
}
