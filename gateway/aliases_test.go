package gateway

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/kvgate/kvgate/bench/eventually"
	"github.com/kvgate/kvgate/bench/vllmsim"
	"github.com/kvgate/kvgate/scheduler"
	"github.com/kvgate/kvgate/store"
)

// TestAliasJobFallsBack: a job and a batch's lines accepted through an
// alias while its first model was routable, whose backends all go before
// they run, run on the alias's fallback, as an interactive request would:
// they neither wait for the first model nor fail.
func TestAliasJobFallsBack(t *testing.T) {
	f := startFleet(t, fleetOpts{jobs: true, speedup: 50, backends: 2,
		simConfig: func(i int, c *vllmsim.Config) { c.ServedModelName = []string{"primary", "fallback"}[i] },
		gateway:   Config{Models: map[string][]string{"gpt-4o-mini": {"primary", "fallback"}}}})
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	t.Cleanup(func() { cancel(); wg.Wait() })
	wg.Go(func() { _ = f.api.RunBatches(ctx) })

	resp, b := f.post(t, "/v1/jobs", `{"endpoint":"/v1/chat/completions","body":{"model":"gpt-4o-mini","messages":[{"role":"user","content":"hi"}],"max_tokens":2}}`,
		"Idempotency-Key", "alias-fallback")
	if resp.StatusCode != http.StatusAccepted {
		t.Fatalf("submit: %d %s", resp.StatusCode, b)
	}
	j := decode[jobView](t, b)
	if j.Model != "primary" {
		t.Fatalf("the job is for %q, want primary", j.Model)
	}
	base := f.srv.URL
	lines := batchLines(5, func(i int) string {
		return fmt.Sprintf(`{"model":"gpt-4o-mini","messages":[{"role":"user","content":"line %d"}],"max_tokens":2}`, i)
	})
	bv := createBatch(t, base, "", uploadBatchFile(t, base, "", lines))
	eventually.True(t, "the batch is accepted", func() bool {
		_, b := bsend(t, http.MethodGet, base+"/v1/batches/"+bv.ID, "", "")
		v := decode[batchView](t, b)
		if store.BatchFinal(v.Status) {
			t.Fatalf("batch of alias lines: %s", b)
		}
		return v.Status == store.BatchInProgress && v.Model != nil && *v.Model == "primary"
	})

	// The first model's only backend goes before anything runs.
	f.sims[0].SetFaults(vllmsim.Faults{Dead: true})
	eventually.True(t, "primary is unroutable", func() bool { return f.sched.CheckModel("primary") != nil })
	runner := scheduler.NewRunner(f.store, f.sched, f.api, scheduler.RunnerConfig{
		Concurrency: 16, Lease: 10 * time.Second, Poll: 20 * time.Millisecond, ReapEvery: 100 * time.Millisecond,
		Backoff: scheduler.Backoff{Base: 20 * time.Millisecond, Max: 100 * time.Millisecond},
	})
	wg.Go(func() { _ = runner.Run(ctx) })

	waitJob(t, f, "default", j.ID, store.Succeeded)
	resp, b = send(t, base, http.MethodGet, "/v1/jobs/"+j.ID+"/result", "", "")
	if got := decode[struct{ Model string }](t, b).Model; resp.StatusCode != http.StatusOK || got != "fallback" {
		t.Errorf("result: %d %s, want the fallback's answer", resp.StatusCode, b)
	}
	v := waitBatch(t, base, "", bv.ID, store.BatchCompleted)
	out := outputFile(t, base, "", v.OutputFileID)
	if len(out) != 5 {
		t.Fatalf("output file has %d lines, want 5", len(out))
	}
	for id, o := range out {
		if o.Response == nil || o.Response.StatusCode != http.StatusOK {
			t.Errorf("line %s: %+v", id, o)
			continue
		}
		var body struct{ Model string }
		if err := json.Unmarshal(o.Response.Body, &body); err != nil || body.Model != "fallback" {
			t.Errorf("line %s answered by %q, want fallback", id, body.Model)
		}
	}
}
