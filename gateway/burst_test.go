package gateway

import (
	"context"
	"fmt"
	"net/http"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/kvgate/kvgate/bench/eventually"

	"github.com/kvgate/kvgate/store"
)

// TestJobBurst: one tenant hands kvgate a burst of jobs at once (10,000;
// 1,000 under the race detector, whose slowdown would only stretch the
// run). Every one is accepted, runs exactly once on the simulated fleet
// and succeeds; acceptance latency and completion latency are logged as
// separate figures. The store is PostgreSQL, the events go through NATS
// JetStream, each attempt is charged to the usage ledger, and the runner
// is what kvgate serve runs.
func TestJobBurst(t *testing.T) {
	n := 1_000 // a quick check; the experiment's full size
	if experiments() {
		n = 10_000
	}
	f := startFleet(t, fleetOpts{backends: 2, jobs: true, pg: true, signals: true, speedup: 100, ledger: true})
	exec := &countingExec{Server: f.api}
	runRunner(t, f, f.store, exec, 30*time.Second, 256)

	const clients = 32
	accept := make([]time.Duration, n)
	ids := make([]string, n)
	var wg sync.WaitGroup
	start := time.Now()
	for c := range clients {
		wg.Go(func() {
			for i := c; i < n; i += clients {
				t0 := time.Now()
				resp, v := submitJob(t, f, fmt.Sprintf("doc-%d", i), chatJob(fmt.Sprintf("summarise document %d", i), 8))
				accept[i] = time.Since(t0)
				if resp.StatusCode != http.StatusAccepted {
					t.Errorf("job %d: %d", i, resp.StatusCode)
					return
				}
				ids[i] = v.ID
			}
		})
	}
	wg.Wait()
	acceptedIn := time.Since(start)
	if t.Failed() {
		return
	}
	eventually.Within(t, 5*time.Minute, fmt.Sprintf("%d jobs to finish", n), func() bool {
		c, err := countStates(f, store.Succeeded, store.FailedTerminal, store.ReviewRequired, store.Cancelled)
		return err == nil && c == n
	})
	drainedIn := time.Since(start)

	var complete []time.Duration
	seen := map[string]bool{}
	for _, id := range ids {
		if seen[id] {
			t.Fatalf("job %s returned for two keys", id)
		}
		seen[id] = true
		j, err := f.store.Get(context.Background(), "default", id)
		if err != nil || j.State != store.Succeeded {
			t.Fatalf("job %s: %s %v", id, j.State, err)
		}
		complete = append(complete, j.UpdatedAt.Sub(j.CreatedAt))
	}
	var runs, succeeded int
	if err := f.store.DB().QueryRow(`SELECT count(*), count(*) FILTER (WHERE outcome = 'succeeded') FROM attempts`).Scan(&runs, &succeeded); err != nil {
		t.Fatal(err)
	}
	if calls := exec.calls.Load(); calls != int64(n) || succeeded != n {
		t.Errorf("%d jobs: %d backend calls, %d successful attempts (%d attempts in all); want each run exactly once", n, calls, succeeded, runs)
	}
	slices.Sort(accept)
	slices.Sort(complete)
	pct := func(d []time.Duration, p float64) time.Duration { return d[min(len(d)-1, int(p*float64(len(d))))] }
	t.Logf("burst of %d jobs (%d clients): accepted in %s (%.0f jobs/s), acceptance latency p50 %s p99 %s; "+
		"drained in %s (%.0f jobs/s), completion latency p50 %s p99 %s",
		n, clients, acceptedIn.Round(time.Millisecond), float64(n)/acceptedIn.Seconds(),
		pct(accept, 0.5).Round(10*time.Microsecond), pct(accept, 0.99).Round(10*time.Microsecond),
		drainedIn.Round(time.Millisecond), float64(n)/drainedIn.Seconds(),
		pct(complete, 0.5).Round(time.Millisecond), pct(complete, 0.99).Round(time.Millisecond))
}

func countStates(f *fleet, states ...store.State) (int, error) {
	var n int
	args := make([]any, len(states))
	ph := ""
	for i, s := range states {
		args[i] = string(s)
		if i > 0 {
			ph += ","
		}
		ph += fmt.Sprintf("$%d", i+1)
	}
	err := f.store.DB().QueryRow(`SELECT count(*) FROM jobs WHERE state IN (`+ph+`)`, args...).Scan(&n)
	return n, err
}
