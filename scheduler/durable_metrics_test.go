package scheduler

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/kvgate/kvgate/bench/eventually"
	"github.com/kvgate/kvgate/store"
)

// failingStats is the real store whose Stats fails once told to.
type failingStats struct {
	store.StatsReader
	fail atomic.Bool
}

func (f *failingStats) Stats(ctx context.Context, now time.Time) (store.Stats, error) {
	if f.fail.Load() {
		return store.Stats{}, errors.New("database gone")
	}
	return f.StatsReader.Stats(ctx, now)
}

// TestDurableMetrics: the backlog, oldest eligible age and outbox age
// come from a real store on the collector's period, the broker lag from a
// real JetStream consumer; the store's gauges are withheld once its reads
// have failed for three periods; completion latency is observed from
// final events only.
func TestDurableMetrics(t *testing.T) {
	ns := startNATS(t, t.TempDir(), 0)
	st := openSQLite(t)
	f := startSignals(t, st, ns.ClientURL())
	accepted := time.Now()
	acceptJobs(t, st, "acme", 3)   // token estimates 0, 1, 2
	acceptJobs(t, st, "globex", 2) // 0, 1

	now := accepted.Add(90 * time.Second)
	var clock atomic.Pointer[time.Time]
	clock.Store(&now)
	fs := &failingStats{StatsReader: st.(store.StatsReader)}
	d := NewDurableMetrics(DurableMetricsConfig{Store: fs, Every: time.Second, Now: func() time.Time { return *clock.Load() },
		Pending: func(ctx context.Context) (uint64, bool, error) {
			n, err := consumerPending(ctx, f.cons)
			return n, err == nil, err
		}})
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(d.Collectors()...)

	// Published and not yet consumed: five events of lag.
	if n, err := f.relay().Once(context.Background()); err != nil || n != 5 {
		t.Fatalf("relay: %d, %v", n, err)
	}
	acceptJobs(t, st, "acme", 1) // one more, unpublished: the outbox's age
	d.Refresh(context.Background())
	want := `
# HELP kvgate_inbox_pending Broker lag: job events on the stream the shared inbox consumer has not acknowledged (pending plus unacknowledged deliveries).
# TYPE kvgate_inbox_pending gauge
kvgate_inbox_pending 5
# HELP kvgate_jobs_runnable Durable runnable backlog: jobs a claim could take now (READY or RETRY_SCHEDULED, available, before their deadline), by class and tenant.
# TYPE kvgate_jobs_runnable gauge
kvgate_jobs_runnable{class="batch",tenant="acme"} 4
kvgate_jobs_runnable{class="batch",tenant="globex"} 2
# HELP kvgate_jobs_runnable_tokens Token estimate (prompt plus reserved output) of the durable runnable backlog, by class and tenant.
# TYPE kvgate_jobs_runnable_tokens gauge
kvgate_jobs_runnable_tokens{class="batch",tenant="acme"} 3
kvgate_jobs_runnable_tokens{class="batch",tenant="globex"} 1
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want), "kvgate_inbox_pending", "kvgate_jobs_runnable", "kvgate_jobs_runnable_tokens"); err != nil {
		t.Error(err)
	}
	oldest := gauge(t, reg, "kvgate_jobs_oldest_runnable_age_seconds", `class="batch"`)
	if oldest < 89 || oldest > 91+time.Since(accepted).Seconds() {
		t.Errorf("oldest runnable age %v, want about 90s", oldest)
	}
	if age := gauge(t, reg, "kvgate_outbox_oldest_unpublished_age_seconds", ""); age < 89 || age > 91+time.Since(accepted).Seconds() {
		t.Errorf("outbox age %v, want about 90s", age)
	}

	// The inbox consumes: the lag goes to zero.
	runBG(t, f.inbox.Run)
	eventually.True(t, "the inbox consumed the five", func() bool {
		d.Refresh(context.Background())
		return gauge(t, reg, "kvgate_inbox_pending", "") == 0
	})

	// A claim empties globex's backlog: its series stays, at 0.
	for range 3 {
		if _, err := st.Claim(context.Background(), now, time.Minute, 10); err != nil {
			t.Fatal(err)
		}
	}
	d.Refresh(context.Background())
	if v := gauge(t, reg, "kvgate_jobs_runnable", `class="batch",tenant="globex"`); v != 0 {
		t.Errorf("globex after its jobs were claimed: %v, want 0", v)
	}
	if v := gauge(t, reg, "kvgate_jobs_oldest_runnable_age_seconds", `class="batch"`); v != 0 {
		t.Errorf("oldest runnable age with no backlog: %v, want 0", v)
	}

	// The store fails: its gauges stay for three periods, then go.
	fs.fail.Store(true)
	later := now.Add(2 * time.Second)
	clock.Store(&later)
	d.Refresh(context.Background())
	if _, ok := find(t, reg, "kvgate_jobs_runnable", `class="batch",tenant="acme"`); !ok {
		t.Error("backlog withheld after one failed read")
	}
	later = now.Add(4 * time.Second)
	clock.Store(&later)
	d.Refresh(context.Background())
	if _, ok := find(t, reg, "kvgate_jobs_runnable", `class="batch",tenant="acme"`); ok {
		t.Error("backlog still reported after three periods of failed reads")
	}
	if n := testutil.ToFloat64(d.errors); n != 2 {
		t.Errorf("stats errors %v, want 2", n)
	}

	// Completion: final events only, against the job id's time.
	id := uuid.Must(uuid.NewV7())
	sec, nsec := id.Time().UnixTime()
	at := time.Unix(sec, nsec).Add(42 * time.Second)
	d.ObserveEvent(Event{JobID: id.String(), State: store.Running, CreatedAt: at})
	d.ObserveEvent(Event{JobID: "not-a-uuid", State: store.Succeeded, CreatedAt: at})
	d.ObserveEvent(Event{JobID: id.String(), State: store.Succeeded, CreatedAt: at})
	want = `
# HELP kvgate_job_completion_seconds Durable jobs' time from acceptance to a final state (succeeded, review, failed, cancelled), observed once per final event fleet-wide, where the shared inbox receives it: a review's decision and a replayed job's new end count again, from the job's first acceptance.
# TYPE kvgate_job_completion_seconds histogram
kvgate_job_completion_seconds_bucket{le="0.1"} 0
kvgate_job_completion_seconds_bucket{le="0.5"} 0
kvgate_job_completion_seconds_bucket{le="1"} 0
kvgate_job_completion_seconds_bucket{le="2.5"} 0
kvgate_job_completion_seconds_bucket{le="5"} 0
kvgate_job_completion_seconds_bucket{le="10"} 0
kvgate_job_completion_seconds_bucket{le="30"} 0
kvgate_job_completion_seconds_bucket{le="60"} 1
kvgate_job_completion_seconds_bucket{le="120"} 1
kvgate_job_completion_seconds_bucket{le="300"} 1
kvgate_job_completion_seconds_bucket{le="600"} 1
kvgate_job_completion_seconds_bucket{le="1800"} 1
kvgate_job_completion_seconds_bucket{le="3600"} 1
kvgate_job_completion_seconds_bucket{le="7200"} 1
kvgate_job_completion_seconds_bucket{le="21600"} 1
kvgate_job_completion_seconds_bucket{le="86400"} 1
kvgate_job_completion_seconds_bucket{le="+Inf"} 1
kvgate_job_completion_seconds_sum 42
kvgate_job_completion_seconds_count 1
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want), "kvgate_job_completion_seconds"); err != nil {
		t.Error(err)
	}
}

// find returns the value of the series of name whose labels render as
// labels (k="v",... in name order; "" for none).
func find(t *testing.T, g prometheus.Gatherer, name, labels string) (float64, bool) {
	t.Helper()
	mfs, err := g.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			var ls []string
			for _, l := range m.GetLabel() {
				ls = append(ls, l.GetName()+`="`+l.GetValue()+`"`)
			}
			if strings.Join(ls, ",") == labels {
				return m.GetGauge().GetValue(), true
			}
		}
	}
	return 0, false
}

func gauge(t *testing.T, g prometheus.Gatherer, name, labels string) float64 {
	t.Helper()
	v, ok := find(t, g, name, labels)
	if !ok {
		t.Fatalf("no series %s{%s}", name, labels)
	}
	return v
}

// TestDurableMetricsLagBeforeFirstPeriod: while the broker's lag has never
// been read (its consumer not there yet, or the broker still starting and
// answering errors), the collector tries again within a fraction of its
// period, so the gauge appears long before the first period ends.
func TestDurableMetricsLagBeforeFirstPeriod(t *testing.T) {
	var calls atomic.Int64
	d := NewDurableMetrics(DurableMetricsConfig{Every: time.Hour,
		Pending: func(ctx context.Context) (uint64, bool, error) {
			switch calls.Add(1) {
			case 1:
				return 0, false, errors.New("broker starting")
			case 2:
				return 0, false, nil // no consumer yet
			}
			return 7, true, nil
		}})
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(d.Collectors()...)
	runBG(t, d.Run)
	eventually.True(t, "the lag is read after an error and a missing consumer", func() bool {
		v, ok := find(t, reg, "kvgate_inbox_pending", "")
		return ok && v == 7
	})
	n := calls.Load()
	time.Sleep(600 * time.Millisecond) // once read, nothing more until the period
	if got := calls.Load(); got != n {
		t.Errorf("%d reads after the first success within the period, want none", got-n)
	}
}
