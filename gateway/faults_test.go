package gateway

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvgate/kvgate/bench/eventually"

	"github.com/kvgate/kvgate/bench/vllmsim"
	"github.com/kvgate/kvgate/scheduler"
	"github.com/kvgate/kvgate/store"
	"github.com/kvgate/kvgate/store/postgres/pgtest"
)

// Fault tests for durable jobs. Each ends with every accepted job final,
// completed at most once, and its attempts explaining its history.

var errKilled = errors.New("process killed")

// dyingStore is the real store as one worker process sees it: once dead,
// nothing that process does reaches the database any more.
type dyingStore struct {
	store.Store
	dead          atomic.Bool
	dieOnComplete bool // die at the Complete call itself, after the checkpoint
}

func (d *dyingStore) check() error {
	if d.dead.Load() {
		return errKilled
	}
	return nil
}

func (d *dyingStore) Claim(ctx context.Context, now time.Time, lease time.Duration, limit int, models ...string) ([]store.Job, error) {
	if err := d.check(); err != nil {
		return nil, err
	}
	return d.Store.Claim(ctx, now, lease, limit, models...)
}

func (d *dyingStore) Heartbeat(ctx context.Context, id string, fence int64, now time.Time, lease time.Duration) error {
	if err := d.check(); err != nil {
		return err
	}
	return d.Store.Heartbeat(ctx, id, fence, now, lease)
}

func (d *dyingStore) MarkSent(ctx context.Context, id string, fence int64, now time.Time, lease time.Duration, reserved *store.Charge) error {
	if err := d.check(); err != nil {
		return err
	}
	return d.Store.MarkSent(ctx, id, fence, now, lease, reserved)
}

func (d *dyingStore) SaveStage(ctx context.Context, id string, fence int64, stage string, data []byte, now time.Time) error {
	if err := d.check(); err != nil {
		return err
	}
	return d.Store.SaveStage(ctx, id, fence, stage, data, now)
}

func (d *dyingStore) Complete(ctx context.Context, c store.Completion) error {
	if d.dieOnComplete {
		d.dead.Store(true)
	}
	if err := d.check(); err != nil {
		return err
	}
	return d.Store.Complete(ctx, c)
}

func (d *dyingStore) Fail(ctx context.Context, f store.Failure) error {
	if err := d.check(); err != nil {
		return err
	}
	return d.Store.Fail(ctx, f)
}

func (d *dyingStore) Reap(ctx context.Context, now time.Time, limit int) (int, error) {
	if err := d.check(); err != nil {
		return 0, err
	}
	return d.Store.Reap(ctx, now, limit)
}

// countingExec is the gateway's executor, counting the backend calls and
// optionally killing a store once the backend has answered.
type countingExec struct {
	*Server
	calls atomic.Int64
	kill  *dyingStore
}

func (e *countingExec) Prepare(ctx context.Context, j store.Job) (*scheduler.Call, error) {
	return wrapRun(e.Server.Prepare(ctx, j))(func(ctx context.Context, run runFunc) (scheduler.Outcome, error) {
		out, err := run(ctx)
		e.calls.Add(1)
		if e.kill != nil && err == nil {
			e.kill.dead.Store(true) // the answer is in memory; the process dies
		}
		return out, err
	})
}

// runFunc runs a prepared call on its grant.
type runFunc func(ctx context.Context) (scheduler.Outcome, error)

// wrapRun returns a prepared call whose Run goes through around.
func wrapRun(c *scheduler.Call, err error) func(around func(ctx context.Context, run runFunc) (scheduler.Outcome, error)) (*scheduler.Call, error) {
	return func(around func(ctx context.Context, run runFunc) (scheduler.Outcome, error)) (*scheduler.Call, error) {
		if err != nil {
			return nil, err
		}
		inner := c.Run
		c.Run = func(ctx context.Context, g *scheduler.Grant, sending func() error) (scheduler.Outcome, error) {
			return around(ctx, func(ctx context.Context) (scheduler.Outcome, error) { return inner(ctx, g, sending) })
		}
		return c, nil
	}
}

func runRunner(t *testing.T, f *fleet, st store.Store, exec scheduler.Executor, lease time.Duration, concurrency int) {
	t.Helper()
	r := scheduler.NewRunner(st, f.sched, exec, scheduler.RunnerConfig{Concurrency: concurrency, Lease: lease,
		Poll: 20 * time.Millisecond, ReapEvery: 50 * time.Millisecond,
		Backoff: scheduler.Backoff{Base: 10 * time.Millisecond, Max: 50 * time.Millisecond}})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { _ = r.Run(ctx); close(done) }()
	t.Cleanup(func() { cancel(); <-done })
}

// outcomes counts a job's attempts by outcome.
func outcomes(t *testing.T, st store.Store, id string) (map[string]int, []store.Attempt) {
	t.Helper()
	as, err := st.Attempts(context.Background(), id)
	if err != nil {
		t.Fatal(err)
	}
	m := map[string]int{}
	for _, a := range as {
		m[a.Outcome]++
	}
	return m, as
}

// A worker dies after the backend answered: before the checkpoint, the
// next worker pays for the inference again (the answer died with the
// process); after it, the next worker completes from the checkpoint
// without calling the model. A job with no stage after the inference (no
// policy) writes no checkpoint: its end holds the answer, and a death at
// the end costs what a death before the checkpoint costs. Either way the
// job succeeds once, and its attempts show the lost lease, then the
// success. The tenant's ledger holds each attempt once: the lost one as
// its reservation, uncertain (charged by the reap: the attempt held no
// permit, its usage was to land with its end), and the next one's
// inference, if it paid for one, as reported.
func TestWorkerKilledAfterBackendAnswered(t *testing.T) {
	for _, tc := range []struct {
		name          string
		afterStage    bool // die at the Complete call, not at the answer
		policy        bool // a validation stage follows the inference
		wantSecondRun int64
	}{
		{"before the checkpoint", false, true, 1},
		{"after the checkpoint", true, true, 0},
		{"at the end, no stage after the inference", true, false, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := startFleet(t, fleetOpts{backends: 1, jobs: true, pg: true, speedup: 50, ledger: true})
			job := chatJob("die after answering", 4)
			if tc.policy {
				if resp, b := f.post(t, "/v1/validation-policies", `{"name":"invoice","rules":[{"rule":"json"},{"rule":"schema"}]}`); resp.StatusCode != http.StatusCreated {
					t.Fatalf("policy: %d %s", resp.StatusCode, b)
				}
				job = schemaJob("die after answering", "invoice")
			}
			_, v := submitJob(t, f, "k", job)

			dying := &dyingStore{Store: f.store, dieOnComplete: tc.afterStage}
			first := &countingExec{Server: f.api}
			if !tc.afterStage {
				first.kill = dying
			}
			runRunner(t, f, dying, first, 300*time.Millisecond, 8)
			eventually.True(t, "the first worker to die", func() bool { return dying.dead.Load() })

			// The restarted process (or another replica): its reaper finds
			// the expired lease.
			second := &countingExec{Server: f.api}
			runRunner(t, f, f.store, second, 10*time.Second, 8)
			waitState(t, f, v.ID, store.Succeeded)

			if first.calls.Load() != 1 || second.calls.Load() != tc.wantSecondRun {
				t.Errorf("backend calls: first worker %d, second %d; want 1 and %d", first.calls.Load(), second.calls.Load(), tc.wantSecondRun)
			}
			by, as := outcomes(t, f.store, v.ID)
			if by["succeeded"] != 1 || by["lease_expired"] < 1 || as[0].Outcome != "lease_expired" || as[len(as)-1].Outcome != "succeeded" {
				t.Errorf("attempts %+v: want the lost lease first and one success last", as)
			}
			last := as[len(as)-1]
			if u := ledgerOf(t, f.store, ""); u.Requests != 1+tc.wantSecondRun || u.Attempts != 1+tc.wantSecondRun ||
				u.Uncertain != 1 || u.UncertainTokens <= 0 || u.ReservedTokens != 0 ||
				u.PromptTokens != int64(last.PromptTokens) || u.CompletionTokens != int64(last.CompletionTokens) ||
				(tc.wantSecondRun == 1) != (last.PromptTokens > 0) {
				t.Errorf("ledger %+v, last attempt %+v: want the lost attempt uncertain and %d inference reported", u, last, tc.wantSecondRun)
			}
		})
	}
}

// A worker whose lease the reaper took wakes up late: the store refuses
// it (here before it sends its request: its mark as sent is refused), and
// the job keeps the one result of the worker that owns it.
func TestStaleWorkerAfterReap(t *testing.T) {
	f := startFleet(t, fleetOpts{backends: 1, jobs: true, pg: true, speedup: 50})
	_, v := submitJob(t, f, "k", chatJob("slow worker", 4))
	// The slow worker: its heartbeats never land (a long GC pause, a
	// partition), and its backend call is held until the job is done.
	slow := &pausedStore{Store: f.store}
	release := make(chan struct{})
	var releaseOnce sync.Once
	held := &heldExec{Server: f.api, release: release, started: make(chan struct{}, 1)}
	// One slot: holding this job, the slow worker claims nothing else.
	runRunner(t, f, slow, held, 300*time.Millisecond, 1)
	t.Cleanup(func() { releaseOnce.Do(func() { close(release) }) }) // runs before the runner's stop
	<-held.started
	second := &countingExec{Server: f.api}
	runRunner(t, f, f.store, second, 10*time.Second, 8)
	waitState(t, f, v.ID, store.Succeeded)
	result, _ := f.store.Result(context.Background(), "default", v.ID)
	releaseOnce.Do(func() { close(release) }) // the stale worker answers now and tries to complete
	eventually.True(t, "the stale completion to be refused", func() bool { return slow.refused.Load() > 0 })
	after, _ := f.store.Result(context.Background(), "default", v.ID)
	if string(after) != string(result) {
		t.Error("the stale worker overwrote the result")
	}
	if by, as := outcomes(t, f.store, v.ID); by["succeeded"] != 1 || by["lease_expired"] != 1 {
		t.Errorf("attempts %+v: want one lost lease and one success", as)
	}
}

// pausedStore drops heartbeats and counts the writes the store refused as
// stale.
type pausedStore struct {
	store.Store
	refused atomic.Int64
}

func (p *pausedStore) Heartbeat(context.Context, string, int64, time.Time, time.Duration) error {
	return nil // never reaches the database
}

func (p *pausedStore) MarkSent(ctx context.Context, id string, fence int64, now time.Time, lease time.Duration, reserved *store.Charge) error {
	err := p.Store.MarkSent(ctx, id, fence, now, lease, reserved)
	if errors.Is(err, store.ErrLeaseLost) {
		p.refused.Add(1)
	}
	return err
}

func (p *pausedStore) SaveStage(ctx context.Context, id string, fence int64, stage string, data []byte, now time.Time) error {
	err := p.Store.SaveStage(ctx, id, fence, stage, data, now)
	if errors.Is(err, store.ErrLeaseLost) {
		p.refused.Add(1)
	}
	return err
}

func (p *pausedStore) Complete(ctx context.Context, c store.Completion) error {
	err := p.Store.Complete(ctx, c)
	if errors.Is(err, store.ErrLeaseLost) {
		p.refused.Add(1)
	}
	return err
}

type heldExec struct {
	*Server
	release chan struct{}
	started chan struct{}
	once    sync.Once
}

func (h *heldExec) Prepare(ctx context.Context, j store.Job) (*scheduler.Call, error) {
	return wrapRun(h.Server.Prepare(ctx, j))(func(ctx context.Context, run runFunc) (scheduler.Outcome, error) {
		h.once.Do(func() { h.started <- struct{}{} })
		<-h.release
		return run(context.WithoutCancel(ctx))
	})
}

// tcpProxy forwards a port to PostgreSQL and can cut every connection.
type tcpProxy struct {
	target string
	mu     sync.Mutex
	ln     net.Listener
	addr   string
	conns  map[net.Conn]bool
}

func startProxy(t *testing.T, target string) *tcpProxy {
	t.Helper()
	p := &tcpProxy{target: target, conns: map[net.Conn]bool{}}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p.addr = ln.Addr().String()
	p.serve(ln)
	t.Cleanup(p.cut)
	return p
}

func (p *tcpProxy) serve(ln net.Listener) {
	p.mu.Lock()
	p.ln = ln
	p.mu.Unlock()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			up, err := net.Dial("tcp", p.target)
			if err != nil {
				c.Close()
				continue
			}
			p.mu.Lock()
			p.conns[c], p.conns[up] = true, true
			p.mu.Unlock()
			go func() { _, _ = io.Copy(up, c); up.Close() }()
			go func() { _, _ = io.Copy(c, up); c.Close() }()
		}
	}()
}

// cut closes the listener and every connection: the database is gone.
func (p *tcpProxy) cut() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.ln != nil {
		p.ln.Close()
		p.ln = nil
	}
	for c := range p.conns {
		c.Close()
	}
	clear(p.conns)
}

// restore listens again on the same address.
func (p *tcpProxy) restore(t *testing.T) {
	t.Helper()
	ln, err := net.Listen("tcp", p.addr)
	if err != nil {
		t.Fatal(err)
	}
	p.serve(ln)
}

// With PostgreSQL unreachable, acceptance answers 503 in OpenAI's error
// format, with Retry-After; when it is back, the same Idempotency-Key
// creates the job, and no job or event is ever half-written, even when
// the database goes away in the middle of a stream of acceptances.
func TestPostgresDownAcceptance(t *testing.T) {
	dbURL := pgtest.FreshDatabase(t)
	u, _ := url.Parse(dbURL)
	proxy := startProxy(t, u.Host)
	u.Host = proxy.addr
	q := u.Query()
	q.Set("connect_timeout", "2")
	u.RawQuery = q.Encode()
	st := pgtest.OpenURL(t, u.String())
	f := startFleet(t, fleetOpts{backends: 1, store: st})

	proxy.cut()
	resp, body := f.post(t, "/v1/jobs", chatJob("while the database is down", 4), "Idempotency-Key", "down-1")
	if resp.StatusCode != http.StatusServiceUnavailable || resp.Header.Get("Retry-After") == "" ||
		!strings.Contains(string(body), `"code":"store_unavailable"`) || !strings.Contains(string(body), `"type":"server_error"`) {
		t.Fatalf("acceptance with the database down: %d %s (Retry-After %q)", resp.StatusCode, body, resp.Header.Get("Retry-After"))
	}
	proxy.restore(t)
	eventually.True(t, "acceptance to work again", func() bool {
		resp, _ := f.post(t, "/v1/jobs", chatJob("while the database is down", 4), "Idempotency-Key", "down-1")
		return resp.StatusCode == http.StatusAccepted && resp.Header.Get("Idempotent-Replayed") == ""
	})

	// Cut the database at arbitrary moments during a stream of
	// acceptances; afterwards every job has exactly its one accepted
	// event, and every key answered 202 has its job.
	var (
		wg       sync.WaitGroup
		mu       sync.Mutex
		accepted = map[string]string{}
	)
	var refused atomic.Int64
	stop := make(chan struct{})
	for w := range 4 {
		wg.Go(func() {
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				key := fmt.Sprintf("storm-%d-%d", w, i)
				resp, b := f.post(t, "/v1/jobs", chatJob(key, 4), "Idempotency-Key", key)
				if resp.StatusCode == http.StatusAccepted {
					mu.Lock()
					accepted[key] = string(b)
					mu.Unlock()
				} else if resp.StatusCode == http.StatusServiceUnavailable {
					refused.Add(1)
				} else {
					t.Errorf("acceptance answered %d %s", resp.StatusCode, b)
					return
				}
			}
		})
	}
	for range 5 {
		mu.Lock()
		n0 := len(accepted)
		mu.Unlock()
		eventually.True(t, "more acceptances", func() bool { mu.Lock(); defer mu.Unlock(); return len(accepted) >= n0+5 })
		proxy.cut()
		proxy.restore(t)
	}
	close(stop)
	wg.Wait()
	eventually.True(t, "the database back", func() bool { return st.DB().Ping() == nil })
	var orphans, eventless int
	if err := st.DB().QueryRow(`SELECT
			(SELECT count(*) FROM outbox o WHERE NOT EXISTS (SELECT 1 FROM jobs j WHERE j.id = o.job_id)),
			(SELECT count(*) FROM jobs j WHERE (SELECT count(*) FROM outbox o WHERE o.job_id = j.id AND o.type = 'job.accepted') != 1)`).
		Scan(&orphans, &eventless); err != nil {
		t.Fatal(err)
	}
	if orphans != 0 || eventless != 0 {
		t.Errorf("half-written acceptances: %d events without a job, %d jobs without exactly one accepted event", orphans, eventless)
	}
	for key := range accepted {
		var n int
		if err := st.DB().QueryRow(`SELECT count(*) FROM jobs WHERE idempotency_key = $1`, key).Scan(&n); err != nil || n != 1 {
			t.Errorf("key %s answered 202 but has %d jobs (%v)", key, n, err)
		}
	}
	t.Logf("%d acceptances answered 202 and %d answered 503 across 5 database cuts", len(accepted), refused.Load())
}

// Backend 429 storms (with Retry-After) and timeouts: jobs wait, retry
// no sooner than told, and all finish once the storm passes.
func TestJobsThrough429StormAndTimeouts(t *testing.T) {
	f := startFleet(t, fleetOpts{backends: 2, jobs: true, runner: true, speedup: 50, pg: true,
		gateway: Config{RequestTimeout: 300 * time.Millisecond}})
	f.sims[0].SetFaults(vllmsim.Faults{RateLimitRate: 1, RetryAfterSeconds: 1})
	f.sims[1].SetFaults(vllmsim.Faults{HangRate: 1})
	var ids []string
	for i := range 20 {
		_, v := submitJob(t, f, fmt.Sprintf("k%d", i), chatJob(fmt.Sprintf("storm %d", i), 4))
		ids = append(ids, v.ID)
	}
	eventually.True(t, "429s and timeouts on record", func() bool {
		var n429, nTimeout int
		for _, id := range ids {
			_, as := outcomes(t, f.store, id)
			for _, a := range as {
				switch a.ErrorClass {
				case string(scheduler.ClassRateLimited):
					n429++
				case string(scheduler.ClassTimeout):
					nTimeout++
				}
			}
		}
		return n429 > 0 && nTimeout > 0
	})
	f.sims[0].SetFaults(vllmsim.Faults{})
	f.sims[1].SetFaults(vllmsim.Faults{})
	for _, id := range ids {
		waitState(t, f, id, store.Succeeded)
		by, as := outcomes(t, f.store, id)
		if by["succeeded"] != 1 {
			t.Errorf("job %s: attempts %+v, want exactly one success", id, as)
		}
		for i := 1; i < len(as); i++ {
			prev := as[i-1]
			if !prev.EndedAt.IsZero() && prev.ErrorClass == string(scheduler.ClassRateLimited) && as[i].StartedAt.Sub(prev.EndedAt) < time.Second-10*time.Millisecond {
				t.Errorf("job %s retried %s after a 429 with Retry-After 1s", id, as[i].StartedAt.Sub(prev.EndedAt))
			}
		}
	}
}

// An embeddings job of several batches with no stage after the inference:
// its worker checkpoints every batch and dies at the end. The next worker
// reuses every batch, sends nothing and completes: its attempt is neither
// sent nor spent, so the job has spent only the lost one.
func TestEmbeddingsWorkerKilledAtTheEnd(t *testing.T) {
	p, err := vllmsim.LookupProfile("h100-bge-m3")
	if err != nil {
		t.Fatal(err)
	}
	p.EmbeddingDim = 4
	f := startFleet(t, fleetOpts{profile: p, jobs: true, pg: true, speedup: 50})
	_, v := submitJob(t, f, "k", embedJob(p.Model, 600)) // three batches

	dying := &dyingStore{Store: f.store, dieOnComplete: true}
	first := &countingExec{Server: f.api}
	runRunner(t, f, dying, first, 300*time.Millisecond, 8)
	eventually.True(t, "the first worker to die", func() bool { return dying.dead.Load() })
	second := &countingExec{Server: f.api}
	runRunner(t, f, f.store, second, 10*time.Second, 8)
	waitState(t, f, v.ID, store.Succeeded)

	if first.calls.Load() != 3 || second.calls.Load() != 0 {
		t.Errorf("backend calls: first worker %d, second %d; want 3 and 0", first.calls.Load(), second.calls.Load())
	}
	_, as := outcomes(t, f.store, v.ID)
	last := as[len(as)-1]
	if as[0].Outcome != store.OutcomeLeaseExpired || !as[0].Spent || last.Outcome != store.OutcomeSucceeded || last.Spent || last.Sent {
		t.Errorf("attempts %+v: want the lost lease spent first, and a success that sent and spent nothing last", as)
	}
	if j, err := f.store.Get(context.Background(), "default", v.ID); err != nil || j.Attempt != 1 {
		t.Errorf("the job spent %d attempts (%v), want 1: the lost one", j.Attempt, err)
	}
}
