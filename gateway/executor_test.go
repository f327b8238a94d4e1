package gateway

import (
	"context"
	"strings"
	"testing"

	"github.com/kvgate/kvgate/store"
)

// TestJobAnswerTooLarge: a backend answer over what a job keeps
// (Jobs.MaxAnswerBytes) fails the job at once, with an error that says
// so, its one attempt spent and not retried (it would be as large on any
// backend), and the backend, which did its work, is not counted failing.
func TestJobAnswerTooLarge(t *testing.T) {
	f := startFleet(t, fleetOpts{jobs: true, runner: true, speedup: 50, gateway: Config{Jobs: Jobs{MaxAnswerBytes: 200}}})
	resp, v := submitJob(t, f, "too-large", chatJob("a long answer, please", 100))
	if resp.StatusCode != 202 {
		t.Fatalf("submit: %d", resp.StatusCode)
	}
	waitJob(t, f, "default", v.ID, store.FailedTerminal)
	j, err := f.store.Get(context.Background(), "default", v.ID)
	if err != nil {
		t.Fatal(err)
	}
	if j.Attempt != 1 || !strings.Contains(j.LastError, "the most a job's result holds") {
		t.Errorf("job after an answer too large: attempt %d, error %q; want 1 attempt and an error saying why", j.Attempt, j.LastError)
	}
	for _, sn := range f.pool.Snapshots() {
		if !sn.Routable() || sn.Failures > 0 {
			t.Errorf("backend %s after answering in full: routable %v, %d failures", sn.Name, sn.Routable(), sn.Failures)
		}
	}
}
