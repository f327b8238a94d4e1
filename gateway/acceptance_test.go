package gateway

import (
	"bytes"
	"database/sql"
	"fmt"
	"io"
	"net/http"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/kvgate/kvgate/bench/eventually"
	"github.com/kvgate/kvgate/store"
)

// TestAcceptanceOpenLoop: durable acceptance through POST /v1/jobs under
// an open-loop load, with the runner executing the jobs on simulators
// meanwhile (PostgreSQL, NATS JetStream, the usage ledger, the runner
// kvgate serve runs).
// Each request is sent at its own time whether or not earlier ones have
// answered, with a unique Idempotency-Key, and its latency is taken from
// when it was due, so that a stall counts against every request it
// delays (no coordinated omission). It measures 1,000 jobs/s, then
// climbs rates until acceptance p99 passes 25 ms, and logs each rate's
// figures and the highest rate that held. Every accepted job must then
// run exactly once and succeed, and every job event reach the inbox; the
// figures (latencies, the transactions committed per job, how far the
// inbox was behind) are logged, never asserted. The experiment runs with
// KVGATE_EXPERIMENTS=1 (alone: see docs/benchmarks.md, "The durable path
// beside River"); a plain go test runs one short step at 200 jobs/s as a
// check. KVGATE_ACCEPT_RATES (e.g. "1000,2000") and KVGATE_ACCEPT_SECONDS
// choose the steps; KVGATE_ACCEPT_STORE=sqlite puts the jobs on SQLite,
// the embedded default.
func TestAcceptanceOpenLoop(t *testing.T) {
	rates, secs := []int{200}, 1.0
	if experiments() {
		rates, secs = []int{1000, 1500, 2000, 2500, 3000, 4000, 5000}, 5
	}
	if v := os.Getenv("KVGATE_ACCEPT_RATES"); v != "" {
		rates = nil
		for _, f := range strings.Split(v, ",") {
			r, err := strconv.Atoi(strings.TrimSpace(f))
			if err != nil || r <= 0 {
				t.Fatalf("KVGATE_ACCEPT_RATES: %q", v)
			}
			rates = append(rates, r)
		}
	}
	if v, err := strconv.ParseFloat(os.Getenv("KVGATE_ACCEPT_SECONDS"), 64); err == nil && v > 0 {
		secs = v
	}
	// KVGATE_ACCEPT_STORE=sqlite runs it on the embedded default instead.
	pg := os.Getenv("KVGATE_ACCEPT_STORE") != "sqlite"
	// The pool scrapes and probes at its defaults, as kvgate runs: the
	// tests' fast intervals (a scrape of each backend every 20 ms) spent a
	// tenth of this process's CPU encoding and parsing the simulators'
	// metrics, which a deployment's GPU servers encode on their own CPUs.
	f := startFleet(t, fleetOpts{backends: 2, jobs: true, pg: pg, signals: true, speedup: 100, production: true, ledger: true})
	exec := &countingExec{Server: f.api}
	runRunner(t, f, f.store, exec, 30*time.Second, 256)
	// As a load generator keeps its connections: a fresh TCP connection
	// per request would be measured instead of kvgate.
	client := &http.Client{Transport: &http.Transport{MaxIdleConns: 1024, MaxIdleConnsPerHost: 1024, IdleConnTimeout: time.Minute}}
	t.Cleanup(client.CloseIdleConnections)

	var sent atomic.Int64
	step := func(rate, n int) (lat []time.Duration, failed int) {
		interval := time.Second / time.Duration(rate)
		lat = make([]time.Duration, n)
		var bad atomic.Int64
		var wg sync.WaitGroup
		start := time.Now()
		for i := range n {
			due := start.Add(time.Duration(i) * interval)
			if d := time.Until(due); d > 0 {
				time.Sleep(d)
			}
			key := fmt.Sprintf("open-%d", sent.Add(1))
			wg.Go(func() {
				req, _ := http.NewRequest(http.MethodPost, f.srv.URL+"/v1/jobs", strings.NewReader(chatJob("summarise "+key, 8)))
				req.Header.Set("Content-Type", "application/json")
				req.Header.Set("Idempotency-Key", key)
				resp, err := client.Do(req)
				if err == nil {
					_, _ = io.Copy(io.Discard, resp.Body)
					resp.Body.Close()
				}
				lat[i] = time.Since(due)
				if err != nil || resp.StatusCode != http.StatusAccepted {
					bad.Add(1)
				}
			})
		}
		wg.Wait()
		return lat, int(bad.Load())
	}
	pct := func(d []time.Duration, p float64) time.Duration {
		return d[min(len(d)-1, int(p*float64(len(d))))].Round(10 * time.Microsecond)
	}
	// What the database commits per job, every writer together (the
	// acceptance, the runner, the relay, the inbox): what the WAL's flushes
	// are shared among, and a figure the machine's other load moves less
	// than a latency. Its statistics may lag a step by up to a second.
	commits := func() (n int64) {
		if pg {
			_ = f.store.DB().QueryRow(`SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()`).Scan(&n)
		}
		return n
	}
	c00, cpu00, pgcpu00 := commits(), processCPU(), backendsCPU(f.store.DB(), pg)
	// Half a second of load first, unmeasured: connections, prepared
	// statements, the relay's and runner's first rounds.
	if _, bad := step(rates[0], rates[0]/2); bad > 0 {
		t.Fatalf("warm-up: %d requests not accepted", bad)
	}
	held := 0
	for _, rate := range rates {
		n := int(float64(rate) * secs)
		c0 := commits()
		lat, bad := step(rate, n)
		if bad > 0 {
			t.Errorf("%d jobs/s: %d of %d requests not accepted", rate, bad, n)
			break
		}
		slices.Sort(lat)
		p99 := pct(lat, 0.99)
		tx := ""
		if pg {
			tx = fmt.Sprintf("; %.1f transactions per job", float64(commits()-c0)/float64(n))
		}
		t.Logf("acceptance at %d jobs/s for %.0f s on %s, runner executing on simulators: p50 %s p90 %s p99 %s max %s%s",
			rate, secs, storeName(pg), pct(lat, 0.5), pct(lat, 0.9), p99, lat[len(lat)-1].Round(10*time.Microsecond), tx)
		if p99 > 25*time.Millisecond {
			break
		}
		held = rate
	}
	t.Logf("highest open-loop acceptance rate with p99 ≤ 25 ms: %d jobs/s (of %v)", held, rates)

	total := int(sent.Load())
	eventually.Within(t, 5*time.Minute, fmt.Sprintf("%d jobs to finish", total), func() bool {
		c, err := countStates(f, store.Succeeded, store.FailedTerminal, store.ReviewRequired, store.Cancelled)
		return err == nil && c == total
	})
	// The inbox records every job's three events (accepted, running,
	// succeeded): how far behind it is when the jobs are done, and how
	// long it takes to catch up.
	inboxed := func() (n int) {
		_ = f.store.DB().QueryRow(`SELECT count(*) FROM inbox`).Scan(&n)
		return n
	}
	behind, caught := 3*total-inboxed(), time.Now()
	eventually.Within(t, 3*time.Minute, "every event through the inbox", func() bool { return inboxed() >= 3*total })
	t.Logf("the inbox: %d events behind when the jobs were done, caught up %s later", max(behind, 0), time.Since(caught).Round(time.Millisecond))
	// CPU time per job, which the neighbours' load moves less than a
	// latency: this process (the gateway, the runner, the relay, the
	// inbox, and also the simulators, NATS and the load generator), and
	// the database's server processes for this database (on this machine).
	cpu := (processCPU() - cpu00) / time.Duration(total)
	if pg {
		pgcpu := (backendsCPU(f.store.DB(), pg) - pgcpu00) / time.Duration(total)
		time.Sleep(1500 * time.Millisecond) // the statistics' flush
		t.Logf("%.2f transactions committed per job over the whole run (%d jobs; read-only ones included: the acceptance, the claim, the attempt, the ledger, the relay, the inbox); CPU per job: %s in this process, %s in PostgreSQL's backends",
			float64(commits()-c00)/float64(total), total, cpu.Round(time.Microsecond), pgcpu.Round(time.Microsecond))
	} else {
		t.Logf("CPU per job over the whole run (%d jobs): %s in this process (SQLite runs in it)", total, cpu.Round(time.Microsecond))
	}
	var runs, succeeded, jobs int
	if err := f.store.DB().QueryRow(`SELECT count(*), count(*) FILTER (WHERE outcome = 'succeeded') FROM attempts`).Scan(&runs, &succeeded); err != nil {
		t.Fatal(err)
	}
	if err := f.store.DB().QueryRow(`SELECT count(*) FROM jobs WHERE state = 'SUCCEEDED'`).Scan(&jobs); err != nil {
		t.Fatal(err)
	}
	if calls := exec.calls.Load(); calls != int64(total) || succeeded != total || jobs != total {
		t.Errorf("%d jobs accepted: %d succeeded, %d backend calls, %d successful attempts (%d in all); want each run exactly once",
			total, jobs, calls, succeeded, runs)
	}
}

func storeName(pg bool) string {
	if pg {
		return "PostgreSQL"
	}
	return "SQLite"
}

// processCPU is the CPU time this process has used, user and system.
func processCPU() time.Duration {
	var ru syscall.Rusage
	if syscall.Getrusage(syscall.RUSAGE_SELF, &ru) != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// backendsCPU is the CPU time used so far by the PostgreSQL server
// processes connected to db's database, read from /proc (0 where the
// server is not on this machine). Backends that exit between two reads
// take theirs with them: the store keeps its pool's connections.
func backendsCPU(db *sql.DB, pg bool) time.Duration {
	if !pg {
		return 0
	}
	rows, err := db.Query(`SELECT pid FROM pg_stat_activity WHERE datname = current_database()`)
	if err != nil {
		return 0
	}
	defer rows.Close()
	var total time.Duration
	for rows.Next() {
		var pid int
		if rows.Scan(&pid) != nil {
			continue
		}
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
		if err != nil {
			continue
		}
		// Fields after the command's closing parenthesis: utime and stime
		// are the 12th and 13th, in clock ticks (100 a second).
		f := strings.Fields(string(b[bytes.LastIndexByte(b, ')')+1:]))
		if len(f) < 13 {
			continue
		}
		u, _ := strconv.ParseInt(f[11], 10, 64)
		st, _ := strconv.ParseInt(f[12], 10, 64)
		total += time.Duration(u+st) * 10 * time.Millisecond
	}
	return total
}
