package gateway

import (
	"context"
	"fmt"
	"net/http"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvgate/kvgate/bench/eventually"

	"github.com/kvgate/kvgate/bench"
	"github.com/kvgate/kvgate/store"
)

// burstRun is one run of the fairness experiment.
type burstRun struct {
	jobsPerSec float64         // every job, from the first acceptance to the last completion
	smallWait  []time.Duration // small tenants' jobs: acceptance to first start, sorted
}

// runBurst has tenant bulkKey hand over bulk jobs at once (accepted before
// the runner starts, as a burst arrives faster than any fleet runs it),
// then starts the runner and sends a steady trickle of jobs from the small
// tenants' keys (one every gap, round-robin over the keys) until the bulk
// is drained. It returns the fleet's job throughput from the runner's
// start, and the small jobs' waits.
func runBurst(t *testing.T, f *fleet, bulkKey string, smallKeys []string, bulk int, gap time.Duration) burstRun {
	t.Helper()
	auth := func(k string) []string { return []string{"Authorization", "Bearer " + k} }
	var (
		mu       sync.Mutex
		smallIDs []string
		wg       sync.WaitGroup
		failed   atomic.Int64
	)
	const clients = 16
	for c := range clients {
		wg.Go(func() {
			for i := c; i < bulk; i += clients {
				if resp, _ := submitJob(t, f, fmt.Sprintf("bulk-%d", i), chatJob(fmt.Sprintf("bulk document %d", i), 8), auth(bulkKey)...); resp.StatusCode != http.StatusAccepted {
					failed.Add(1)
				}
			}
		})
	}
	wg.Wait()
	if failed.Load() > 0 {
		t.Fatalf("%d bulk submissions failed", failed.Load())
	}
	start := time.Now()
	runRunner(t, f, f.store, f.api, 30*time.Second, 256)
	stop := make(chan struct{})
	var trickle sync.WaitGroup
	trickle.Go(func() {
		tick := time.NewTicker(gap)
		defer tick.Stop()
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			case <-tick.C:
			}
			key := smallKeys[i%len(smallKeys)]
			resp, v := submitJob(t, f, fmt.Sprintf("small-%d", i), chatJob(fmt.Sprintf("small document %d", i), 8), auth(key)...)
			if resp.StatusCode != http.StatusAccepted {
				failed.Add(1)
				continue
			}
			mu.Lock()
			smallIDs = append(smallIDs, v.ID)
			mu.Unlock()
		}
	})
	last := time.Now()
	eventually.Within(t, 5*time.Minute, "the bulk to drain", func() bool {
		n, err := countStates(f, store.Succeeded)
		mu.Lock()
		defer mu.Unlock()
		if time.Since(last) > 5*time.Second {
			last = time.Now()
			var states []string
			rows, _ := f.store.DB().Query(`SELECT state || ':' || count(*) FROM jobs GROUP BY state`)
			for rows != nil && rows.Next() {
				var s string
				_ = rows.Scan(&s)
				states = append(states, s)
			}
			t.Logf("succeeded %d of %d; %v", n, bulk+len(smallIDs), states)
		}
		return err == nil && n >= bulk+len(smallIDs)
	})
	close(stop)
	trickle.Wait()
	eventually.Within(t, time.Minute, "the last small jobs", func() bool {
		n, err := countStates(f, store.Succeeded)
		return err == nil && n == bulk+len(smallIDs)
	})
	elapsed := time.Since(start)
	if failed.Load() > 0 {
		t.Fatalf("%d submissions failed", failed.Load())
	}
	run := burstRun{jobsPerSec: float64(bulk+len(smallIDs)) / elapsed.Seconds()}
	for _, id := range smallIDs {
		as, err := f.store.Attempts(context.Background(), id)
		if err != nil || len(as) == 0 {
			t.Fatalf("small job %s: attempts %v, %v", id, as, err)
		}
		j, err := getAnyJob(f, id)
		if err != nil {
			t.Fatal(err)
		}
		run.smallWait = append(run.smallWait, as[0].StartedAt.Sub(j.CreatedAt))
	}
	slices.Sort(run.smallWait)
	return run
}

// getAnyJob reads a job whatever its tenant.
func getAnyJob(f *fleet, id string) (store.Job, error) {
	var tenant string
	if err := f.store.DB().QueryRow(`SELECT tenant FROM jobs WHERE id = $1`, id).Scan(&tenant); err != nil {
		return store.Job{}, err
	}
	return f.store.Get(context.Background(), tenant, id)
}

// TestFairnessBurst is the fairness experiment on the simulated fleet, on
// PostgreSQL and JetStream as kvgate serve runs them:
//
//  1. Four equal-weight tenants each hand over a backlog of 1,000 jobs;
//     while all four still have work (the first half of all jobs), their
//     shares of the completed jobs give Jain's index (goal: at least 0.95).
//  2. One tenant's burst of 10,000 jobs (1,000 under -short), accepted
//     before the runner starts, while three small tenants send a job every
//     50 ms: how long the small tenants' jobs wait to start, and the
//     fleet's throughput, against the same jobs all from one tenant (where
//     fairness has nothing to do: the small jobs queue behind the burst,
//     first come, first served).
func TestFairnessBurst(t *testing.T) {
	experiment(t) // measures throughput and waits
	bulk := 10_000
	keys := map[string]string{"kb": "bulk", "ks1": "small1", "ks2": "small2", "ks3": "small3",
		"kj1": "j1", "kj2": "j2", "kj3": "j3", "kj4": "j4", "kone": "one"}
	newFleet := func(t *testing.T) *fleet {
		// The runner starts once the backlogs are in.
		return startFleet(t, fleetOpts{backends: 2, jobs: true, pg: true, signals: true, speedup: 100,
			gateway: Config{APIKeys: keys}})
	}

	// Each phase in its own subtest, so that its fleet (and its database
	// connections) are gone before the next starts.
	var (
		shares     []float64
		fair, fifo burstRun
	)
	// 1. Jain's index over four saturated tenants.
	const backlog = 1_000
	t.Run("jain", func(t *testing.T) {
		f := newFleet(t)
		var wg sync.WaitGroup
		for _, k := range []string{"kj1", "kj2", "kj3", "kj4"} {
			wg.Go(func() {
				for i := range backlog {
					submitJob(t, f, fmt.Sprintf("%s-%d", k, i), chatJob(fmt.Sprintf("%s %d", k, i), 8), "Authorization", "Bearer "+k)
				}
			})
		}
		wg.Wait()
		runRunner(t, f, f.store, f.api, 30*time.Second, 256)
		// While every tenant still has work: the first half of all jobs.
		eventually.Within(t, 5*time.Minute, "half the backlog done", func() bool {
			n, err := countStates(f, store.Succeeded)
			return err == nil && n >= 2*backlog
		})
		for _, tenant := range []string{"j1", "j2", "j3", "j4"} {
			var n int
			if err := f.store.DB().QueryRow(`SELECT count(*) FROM jobs WHERE tenant = $1 AND state = 'SUCCEEDED'`, tenant).Scan(&n); err != nil {
				t.Fatal(err)
			}
			shares = append(shares, float64(n))
		}
	})
	// 2. The burst, fair, then all from one tenant.
	t.Run("fair", func(t *testing.T) {
		fair = runBurst(t, newFleet(t), "kb", []string{"ks1", "ks2", "ks3"}, bulk, 50*time.Millisecond)
	})
	t.Run("one-tenant", func(t *testing.T) {
		fifo = runBurst(t, newFleet(t), "kone", []string{"kone"}, bulk, 50*time.Millisecond)
	})
	if t.Failed() {
		return
	}
	index := bench.JainIndex(shares)

	pct := func(d []time.Duration, p float64) time.Duration { return d[min(len(d)-1, int(p*float64(len(d))))] }
	t.Logf("Jain's index, 4 equal-weight tenants x %d jobs, completions while all had work: %.4f (%v)", backlog, index, shares)
	t.Logf("burst of %d jobs, small tenants' jobs every 50 ms:", bulk)
	t.Logf("  fair (4 tenants):     %d small jobs waited p50 %s p99 %s max %s to start; fleet %.0f jobs/s",
		len(fair.smallWait), pct(fair.smallWait, 0.5).Round(time.Millisecond), pct(fair.smallWait, 0.99).Round(time.Millisecond),
		fair.smallWait[len(fair.smallWait)-1].Round(time.Millisecond), fair.jobsPerSec)
	t.Logf("  one tenant (no fairness to apply): %d small jobs waited p50 %s p99 %s max %s; fleet %.0f jobs/s",
		len(fifo.smallWait), pct(fifo.smallWait, 0.5).Round(time.Millisecond), pct(fifo.smallWait, 0.99).Round(time.Millisecond),
		fifo.smallWait[len(fifo.smallWait)-1].Round(time.Millisecond), fifo.jobsPerSec)
	t.Logf("  fleet throughput, fair / one tenant: %.3f", fair.jobsPerSec/fifo.jobsPerSec)
	if index < 0.95 {
		t.Errorf("Jain's index %.4f, want at least 0.95", index)
	}
	if p99 := pct(fair.smallWait, 0.99); p99 > time.Second {
		t.Errorf("small tenants' jobs waited up to %s (p99) to start during the burst, want under a second", p99)
	}
	if pct(fifo.smallWait, 0.5) <= pct(fair.smallWait, 0.5) {
		t.Errorf("without fairness the small jobs waited no longer (p50 %s vs %s): the experiment shows nothing",
			pct(fifo.smallWait, 0.5), pct(fair.smallWait, 0.5))
	}
}
