package postgres_test

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/kvgate/kvgate/store"
	"github.com/kvgate/kvgate/store/postgres"
	"github.com/kvgate/kvgate/store/sqlstore"
	"github.com/kvgate/kvgate/store/storetest"
)

func benchJob(i int) store.NewJob {
	return store.NewJob{
		ID: uuid.Must(uuid.NewV7()).String(), EventID: uuid.Must(uuid.NewV7()).String(),
		Tenant: fmt.Sprint("t", i%100), IdempotencyKey: fmt.Sprint("k", i), RequestHash: "h",
		Endpoint: "/v1/chat/completions", Model: "m",
		Body:        json.RawMessage(`{"model":"m","messages":[{"role":"user","content":"Extract the line items of this invoice."}],"max_tokens":256}`),
		MaxAttempts: 5, TokenEstimate: 300, Deadline: time.Now().Add(time.Hour), Now: time.Now(),
	}
}

func reportLatency(b *testing.B, lat []time.Duration, name string) {
	slices.Sort(lat)
	if len(lat) == 0 {
		return
	}
	ms := func(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }
	b.ReportMetric(ms(lat[len(lat)/2]), name+"-p50-ms")
	b.ReportMetric(ms(lat[min(len(lat)-1, len(lat)*99/100)]), name+"-p99-ms")
}

// BenchmarkAccept measures durable acceptance (job row and outbox event in
// one transaction) from 32 concurrent clients.
//
//	go test -run '^$' -bench Accept -benchtime 20000x ./store/postgres/
func BenchmarkAccept(b *testing.B) {
	s := openB(b)
	ctx := context.Background()
	var n atomic.Int64
	var mu sync.Mutex
	var lat []time.Duration
	b.SetParallelism(16) // 32 goroutines on 2 cores
	reportCheckpoints(b, s)
	b.ResetTimer()
	start := time.Now()
	b.RunParallel(func(pb *testing.PB) {
		var mine []time.Duration
		for pb.Next() {
			t0 := time.Now()
			if _, _, err := s.Accept(ctx, benchJob(int(n.Add(1)))); err != nil {
				b.Error(err)
				return
			}
			mine = append(mine, time.Since(t0))
		}
		mu.Lock()
		lat = append(lat, mine...)
		mu.Unlock()
	})
	b.ReportMetric(float64(b.N)/time.Since(start).Seconds(), "jobs/s")
	reportLatency(b, lat, "accept")
}

// BenchmarkAcceptOpenLoop measures durable acceptance under an open-loop
// load at issue 4's goal rate: acceptRate Accepts a second, each started
// on its own schedule whether or not earlier ones have finished, and its
// latency taken from when it was due, so a stall counts against every
// request it delays (no coordinated omission). Half a second of the same
// load first, unmeasured, opens the pool's connections and prepares the
// statement on each, as a running gateway has long done. b.N is the
// number of measured Accepts: -benchtime 10000x is ten seconds of load.
//
//	go test -run '^$' -bench AcceptOpenLoop -benchtime 10000x ./store/postgres/
func BenchmarkAcceptOpenLoop(b *testing.B) {
	const acceptRate = 1000
	s := openB(b)
	warm := acceptRate / 2
	openLoop(b, s, acceptRate, 0, warm)
	reportCheckpoints(b, s)
	b.ResetTimer()
	start := time.Now()
	lat := openLoop(b, s, acceptRate, warm, b.N)
	b.ReportMetric(float64(b.N)/time.Since(start).Seconds(), "jobs/s")
	reportLatency(b, lat, "accept")
}

// openLoop issues n Accepts (jobs first to first+n-1) at rate a second
// and returns each one's latency from when it was due.
func openLoop(b *testing.B, s store.Store, rate, first, n int) []time.Duration {
	ctx := context.Background()
	interval := time.Second / time.Duration(rate)
	lat := make([]time.Duration, n)
	var wg sync.WaitGroup
	start := time.Now()
	for i := range n {
		due := start.Add(time.Duration(i) * interval)
		if d := time.Until(due); d > 0 {
			time.Sleep(d)
		}
		wg.Go(func() {
			if _, _, err := s.Accept(ctx, benchJob(first+i)); err != nil {
				b.Error(err)
			}
			lat[i] = time.Since(due)
		})
	}
	wg.Wait()
	return lat
}

// BenchmarkClaimComplete measures the worker side with a zero-delay
// backend: claim one job, complete it under its fence, from 32 workers.
//
//	go test -run '^$' -bench ClaimComplete -benchtime 20000x ./store/postgres/
func BenchmarkClaimComplete(b *testing.B) {
	s := openB(b)
	ctx := context.Background()
	for i := range b.N {
		if _, _, err := s.Accept(ctx, benchJob(i)); err != nil {
			b.Fatal(err)
		}
	}
	var done atomic.Int64
	b.SetParallelism(16)
	reportCheckpoints(b, s)
	b.ResetTimer()
	start := time.Now()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			js, err := s.Claim(ctx, time.Now(), time.Minute, 1)
			if err != nil {
				b.Error(err)
				return
			}
			if len(js) == 0 {
				continue
			}
			j := js[0]
			if err := s.Complete(ctx, store.Completion{JobID: j.ID, Fence: j.Fence, State: store.Succeeded,
				Result: json.RawMessage(`{"ok":true}`), Attempt: store.Attempt{Attempt: j.Attempt}, Now: time.Now()}); err != nil {
				b.Error(err)
				return
			}
			done.Add(1)
		}
	})
	b.ReportMetric(float64(done.Load())/time.Since(start).Seconds(), "jobs/s")
}

// BenchmarkClaimBatchComplete measures the worker side as
// scheduler.Runner drives it, with a zero-delay backend: each of
// claimRunners runners has runnerSlots slots, claims as many jobs as it
// has free slots in one call, completes each job in its own goroutine
// (under the job's fence; concurrent completions share a statement by
// group commit) and claims again as soon as a slot frees, which is when
// the job's work is done, before its completion is written.
//
//	go test -run '^$' -bench ClaimBatchComplete -benchtime 20000x ./store/postgres/
func BenchmarkClaimBatchComplete(b *testing.B) {
	const claimRunners, runnerSlots = 2, 32
	s := openB(b)
	ctx := context.Background()
	for i := range b.N {
		if _, _, err := s.Accept(ctx, benchJob(i)); err != nil {
			b.Fatal(err)
		}
	}
	var done, claims atomic.Int64
	reportCheckpoints(b, s)
	b.ResetTimer()
	start := time.Now()
	var runners sync.WaitGroup
	for range claimRunners {
		runners.Go(func() {
			slots := make(chan struct{}, runnerSlots)
			freed := make(chan struct{}, runnerSlots)
			var work sync.WaitGroup
			defer work.Wait()
			for done.Load()+int64(len(slots)) < int64(b.N) {
				free := cap(slots) - len(slots)
				if free == 0 {
					<-freed
					continue
				}
				js, err := s.Claim(ctx, time.Now(), time.Minute, free)
				if err != nil {
					b.Error(err)
					return
				}
				claims.Add(1)
				if len(js) == 0 {
					if len(slots) == 0 {
						return // nothing left to claim, nothing running
					}
					<-freed
					continue
				}
				for _, j := range js {
					slots <- struct{}{}
					work.Go(func() {
						<-slots
						select {
						case freed <- struct{}{}:
						default:
						}
						if err := s.Complete(ctx, store.Completion{JobID: j.ID, Fence: j.Fence, State: store.Succeeded,
							Result: json.RawMessage(`{"ok":true}`), Attempt: store.Attempt{Attempt: j.Attempt}, Now: time.Now()}); err != nil {
							b.Error(err)
							return
						}
						done.Add(1)
					})
				}
			}
		})
	}
	runners.Wait()
	b.ReportMetric(float64(done.Load())/time.Since(start).Seconds(), "jobs/s")
	b.ReportMetric(float64(done.Load())/float64(max(claims.Load(), 1)), "jobs/claim")
}

// BenchmarkClaimMillionReady measures one claim's latency with a million
// READY jobs queued (inserted in bulk first, then vacuumed, analyzed and
// checkpointed, which takes a while; and twice, as go test runs a
// benchmark once with b.N = 1 first).
//
//	go test -run '^$' -bench ClaimMillionReady -benchtime 5000x -timeout 20m ./store/postgres/
func BenchmarkClaimMillionReady(b *testing.B) {
	s := openB(b)
	ctx := context.Background()
	now := time.Now().UnixMicro()
	_, err := s.DB().ExecContext(ctx, `INSERT INTO jobs (id, tenant, idempotency_key, request_hash, endpoint, model, body, metadata,
		priority, token_estimate, state, state_version, attempt, max_attempts, fence, lease_until, available_at, deadline_at,
		created_at, updated_at, error_class, last_error)
		SELECT lpad(g::text, 12, '0'), 't' || (g % 1000), 'k' || g, 'h', '/v1/completions', 'm', '\x7b7d'::bytea, NULL,
			0, 300, 'READY', 1, 0, 5, 0, 0, $1::bigint + g, $2::bigint, $1::bigint, $1::bigint, '', ''
		FROM generate_series(1, 1000000) g`, now, time.Now().Add(24*time.Hour).UnixMicro())
	if err == nil {
		_, err = s.DB().ExecContext(ctx, `INSERT INTO job_keys (tenant, idempotency_key, id) SELECT tenant, idempotency_key, id FROM jobs`)
	}
	if err != nil {
		b.Fatal(err)
	}
	if _, err := s.DB().ExecContext(ctx, `VACUUM (ANALYZE) jobs, job_keys`); err != nil {
		b.Fatal(err)
	}
	// The load wrote most of a gigabyte of WAL: left alone, the
	// checkpoint it calls for would run during the measurement, and the
	// first change of every page after it would log the whole page. Start
	// measuring from a clean checkpoint instead, as a server that has
	// queued its million jobs over time would be. (It needs superuser or
	// pg_checkpoint; without, the benchmark goes on and the checkpoints
	// metric shows what happened.)
	if _, err := s.DB().ExecContext(ctx, `CHECKPOINT`); err != nil {
		b.Logf("checkpoint before measuring: %v", err)
	}
	lat := make([]time.Duration, 0, b.N)
	claimAt := time.UnixMicro(now + 2_000_000)
	reportCheckpoints(b, s)
	b.ResetTimer()
	for range b.N {
		t0 := time.Now()
		js, err := s.Claim(ctx, claimAt, time.Minute, 1)
		if err != nil || len(js) != 1 {
			b.Fatal(len(js), err)
		}
		lat = append(lat, time.Since(t0))
	}
	reportLatency(b, lat, "claim")
}

// reportCheckpoints reports, when the benchmark ends, how many
// checkpoints the server ran while it was measured: a checkpoint, and the
// full-page images every page's next change then writes, shows in the
// tail latencies, and on a server other tests share (each DROP DATABASE
// forces one) there can be many.
func reportCheckpoints(b *testing.B, s *sqlstore.Store) {
	count := func() (int64, bool) {
		var n int64
		// PostgreSQL 17 moved the counters to pg_stat_checkpointer.
		err := s.DB().QueryRowContext(context.Background(),
			`SELECT checkpoints_timed + checkpoints_req FROM pg_stat_bgwriter`).Scan(&n)
		return n, err == nil
	}
	n0, ok := count()
	if !ok {
		return
	}
	b.Cleanup(func() {
		if n1, ok := count(); ok {
			b.ReportMetric(float64(n1-n0), "checkpoints")
		}
	})
}

func openB(b *testing.B) *sqlstore.Store {
	s, err := postgres.Open(context.Background(), freshDatabase(b))
	if err != nil {
		b.Fatal(err)
	}
	if _, err := postgres.Migrate(context.Background(), s); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { s.Close() })
	return s
}

// BenchmarkPermits: storetest.BenchPermits on PostgreSQL.
//
//	go test -run '^$' -bench Permits -benchtime 20000x ./store/postgres/
func BenchmarkPermits(b *testing.B) { storetest.BenchPermits(b, openB(b)) }
