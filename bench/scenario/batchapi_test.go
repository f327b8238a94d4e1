package scenario

import (
	"context"
	"testing"
	"time"
)

// TestBatchAPIScenario runs batch-api against kvgate at a small scale: the
// batch tenant's requests go as one Batch API batch, and every line comes
// back completed from its output file, beside the interactive tenant's.
func TestBatchAPIScenario(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a fleet")
	}
	sc, err := Lookup("batch-api")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	res, err := sc.Run(ctx, Options{Scale: 0.01, Speedup: 5, Seed: 5, Targets: []string{TargetKVGate}})
	if err != nil {
		t.Fatal(err)
	}
	rep := res.Targets[0].Report
	lines := 0
	for _, r := range rep.Requests {
		if r.Tenant != "batch" {
			continue
		}
		lines++
		if r.ErrorClass != "" || r.Status != 200 || r.OutputTokens == 0 {
			t.Errorf("batch line: %+v", r)
		}
	}
	if want := rep.Config.Tenants[1].NumPrompts; lines != want || want == 0 {
		t.Errorf("%d batch lines reported, want %d", lines, want)
	}
	for _, ts := range rep.Tenants {
		if ts.Name == "interactive" && ts.Summary.Completed == 0 {
			t.Errorf("the interactive tenant completed nothing beside the batch")
		}
	}
}
