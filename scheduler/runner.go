package scheduler

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvgate/kvgate/store"
)

// jobStore is what the runner needs of the durable store; store.Store
// satisfies it.
type jobStore interface {
	Claim(ctx context.Context, now time.Time, lease time.Duration, limit int) ([]store.Job, error)
	Heartbeat(ctx context.Context, id string, fence int64, now time.Time, lease time.Duration) error
	Complete(ctx context.Context, c store.Completion) error
	Fail(ctx context.Context, f store.Failure) error
	Reap(ctx context.Context, now time.Time, limit int) (int, error)
	SaveStage(ctx context.Context, id string, fence int64, stage string, data []byte) error
	Stage(ctx context.Context, id, stage string) ([]byte, error)
}

// Executor runs a durable job's request on a backend; package gateway
// implements it.
type Executor interface {
	// Ticket returns the admission ticket for a job's request.
	Ticket(j store.Job) (*Ticket, error)
	// Execute sends the request to the granted backend and returns its
	// answer, or an *ExecError saying how the attempt failed.
	Execute(ctx context.Context, j store.Job, g *Grant) (Outcome, error)
}

// Outcome is a backend's successful answer to a job's request.
type Outcome struct {
	Body             []byte
	PromptTokens     int
	CompletionTokens int
}

// ExecError is a failed attempt, classified.
type ExecError struct {
	Class      ErrorClass
	Status     int           // the backend's HTTP status, 0 if none
	RetryAfter time.Duration // the backend's delay hint
	Err        error
}

func (e *ExecError) Error() string { return fmt.Sprintf("%s: %v", e.Class, e.Err) }
func (e *ExecError) Unwrap() error { return e.Err }

// The stage whose checkpoint spares a retry the model call.
const stageInference = "inference"

// RunnerConfig tunes a Runner. Zero values take the defaults in brackets.
type RunnerConfig struct {
	Concurrency int           // jobs run at once by this process [64]
	Lease       time.Duration // claim lease, renewed every third of it [1m]
	Poll        time.Duration // store scan period when nothing wakes it [500ms]
	ReapEvery   time.Duration // reaper period [5s]
	Backoff     Backoff
	// QuotaWait is the longest an attempt waits in place, holding its
	// slot, for its tenant's own quota; a longer wait hands the job back
	// as a retry, which counts as an attempt [1m: a rate window's reset].
	QuotaWait time.Duration
	Logger    *slog.Logger
	Now       func() time.Time
	// OnEvents, when set, is called after the runner committed outbox
	// events (claims, outcomes): the wiring wakes the relay with it.
	OnEvents func()
}

// Runner executes durable jobs: it claims them from the store, admits them
// through the scheduler as the batch class (they use what interactive
// traffic leaves), runs them through the executor, and records the outcome
// under the claim's fence, heartbeating the lease meanwhile. It also runs
// the reaper. The store is the truth: the runner scans it on a timer, so a
// lost wake-up delays work and never loses it.
type Runner struct {
	st    jobStore
	sched *Scheduler
	exec  Executor
	cfg   RunnerConfig
	log   *slog.Logger
	wake  chan struct{}
	m     *runnerMetrics

	rngMu sync.Mutex
	rng   *rand.Rand
}

// NewRunner returns a runner; Run starts it.
func NewRunner(st jobStore, sched *Scheduler, exec Executor, cfg RunnerConfig) *Runner {
	cfg.Concurrency = cmp.Or(cfg.Concurrency, 64)
	cfg.Lease = cmp.Or(cfg.Lease, time.Minute)
	cfg.Poll = cmp.Or(cfg.Poll, 500*time.Millisecond)
	cfg.ReapEvery = cmp.Or(cfg.ReapEvery, 5*time.Second)
	cfg.QuotaWait = cmp.Or(cfg.QuotaWait, time.Minute)
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	return &Runner{
		st: st, sched: sched, exec: exec, cfg: cfg,
		log:  cfg.Logger.With("component", "runner"),
		wake: make(chan struct{}, 1),
		m:    newRunnerMetrics(),
		rng:  rand.New(rand.NewPCG(rand.Uint64(), rand.Uint64())),
	}
}

// Wake asks the runner to look for work now, after a job was accepted.
func (r *Runner) Wake() {
	select {
	case r.wake <- struct{}{}:
	default:
	}
}

// Collectors returns the runner's metrics, to register once.
func (r *Runner) Collectors() []prometheus.Collector { return r.m.collectors() }

// Run claims and runs jobs until ctx is done, then waits for the jobs it
// runs: each hands its lease back as a retry, so another process takes it
// at once rather than after the lease expires. It returns ctx's error.
func (r *Runner) Run(ctx context.Context) error {
	var wg sync.WaitGroup
	defer wg.Wait()
	slots := make(chan struct{}, r.cfg.Concurrency)
	poll := time.NewTicker(r.cfg.Poll)
	defer poll.Stop()
	reap := time.NewTicker(r.cfg.ReapEvery)
	defer reap.Stop()
	done := make(chan struct{}, r.cfg.Concurrency)
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-reap.C:
			if n, err := r.st.Reap(ctx, r.cfg.Now(), 1000); err != nil {
				r.log.Warn("reap failed", "err", err)
			} else if n > 0 {
				r.m.reaped.Add(float64(n))
				r.log.Info("reaped expired leases", "jobs", n)
			}
			continue
		case <-poll.C:
		case <-r.wake:
		case <-done:
		}
		free := cap(slots) - len(slots)
		if free == 0 {
			continue
		}
		jobs, err := r.st.Claim(ctx, r.cfg.Now(), r.cfg.Lease, free)
		if err != nil {
			if ctx.Err() == nil {
				r.log.Warn("claim failed", "err", err)
			}
			continue
		}
		if len(jobs) > 0 && r.cfg.OnEvents != nil {
			r.cfg.OnEvents()
		}
		for _, j := range jobs {
			slots <- struct{}{}
			wg.Go(func() {
				defer func() {
					<-slots
					select {
					case done <- struct{}{}:
					default:
					}
				}()
				r.work(ctx, j)
				if r.cfg.OnEvents != nil {
					r.cfg.OnEvents()
				}
			})
		}
	}
}

var errLeaseLost = errors.New("lease lost")

// work runs one claimed attempt to its recorded end.
func (r *Runner) work(parent context.Context, j store.Job) {
	ctx, cancel := context.WithCancelCause(parent)
	log := r.log.With("job_id", j.ID, "tenant", j.Tenant, "attempt", j.Attempt, "fence", j.Fence)
	var hb sync.WaitGroup
	hb.Go(func() { r.heartbeat(ctx, cancel, j) })
	defer hb.Wait()
	defer cancel(nil) // stops the heartbeat before the wait

	started := r.cfg.Now()
	attempt := store.Attempt{JobID: j.ID, Attempt: j.Attempt, Fence: j.Fence, StartedAt: started}
	// The final writes must land even when the process is stopping.
	wctx := context.WithoutCancel(ctx)

	body, err := r.st.Stage(ctx, j.ID, stageInference)
	switch {
	case err == nil:
		r.m.stageReused.Inc() // an earlier attempt paid for the inference
	case errors.Is(err, store.ErrNotFound):
		out, backend, xerr := r.inferWithinQuota(ctx, j)
		attempt.Backend = backend
		if xerr != nil {
			r.failed(wctx, ctx, log, j, attempt, xerr)
			return
		}
		attempt.PromptTokens, attempt.CompletionTokens = out.PromptTokens, out.CompletionTokens
		body = out.Body
		if err := r.st.SaveStage(wctx, j.ID, j.Fence, stageInference, body); err != nil {
			r.lost(log, err)
			return
		}
	default:
		r.failed(wctx, ctx, log, j, attempt, &ExecError{Class: ClassBackend, Err: err})
		return
	}

	now := r.cfg.Now()
	attempt.Outcome, attempt.EndedAt = "succeeded", now
	err = r.st.Complete(wctx, store.Completion{JobID: j.ID, Fence: j.Fence, State: store.Succeeded, Result: body, Attempt: attempt, Now: now})
	if err != nil {
		r.lost(log, err)
		return
	}
	r.m.finished.WithLabelValues("succeeded").Inc()
}

// infer admits the job's request and runs it on the granted backend.
func (r *Runner) infer(ctx context.Context, j store.Job) (Outcome, string, error) {
	t, err := r.exec.Ticket(j)
	if err != nil {
		return Outcome{}, "", &ExecError{Class: ClassInvalid, Err: err}
	}
	t.Class, t.Tenant, t.Deadline = Batch, j.Tenant, j.Deadline
	g, err := r.sched.Acquire(ctx, t)
	if err != nil {
		var tooLarge *TooLargeError
		if errors.As(err, &tooLarge) {
			return Outcome{}, "", &ExecError{Class: ClassInvalid, Err: err}
		}
		return Outcome{}, "", &ExecError{Class: ClassCapacity, Err: err}
	}
	defer g.Release()
	out, err := r.exec.Execute(ctx, j, g)
	return out, g.Backend, err
}

// inferWithinQuota runs infer, and runs it again while the executor says
// the job's tenant is over its own quota (ClassQuota): the claim counted an
// attempt that the store cannot give back, so a wait for the tenant's
// quota happens inside the attempt, with the backend's grant released and
// the lease renewed. It looks again at the quota's reset, or sooner
// (Backoff.Max), or after a jitter under Backoff.Base when the reset is
// unknown (a concurrency cap: when work in flight ends). A reset further
// than QuotaWait, a wait longer than QuotaWait in all, or one past the
// deadline returns the refusal: failed then hands the job back for a
// retry at the reset, which counts as an attempt, so that a tenant's long
// wait does not hold a runner slot other tenants' jobs could use.
func (r *Runner) inferWithinQuota(ctx context.Context, j store.Job) (Outcome, string, error) {
	var waited time.Duration
	for {
		out, backend, err := r.infer(ctx, j)
		var xe *ExecError
		if !errors.As(err, &xe) || xe.Class != ClassQuota || xe.RetryAfter > r.cfg.QuotaWait {
			return out, backend, err
		}
		r.rngMu.Lock()
		d := r.cfg.Backoff.Delay(1, min(xe.RetryAfter, cmp.Or(r.cfg.Backoff.Max, time.Minute)), r.rng)
		r.rngMu.Unlock()
		if waited+d > r.cfg.QuotaWait || !r.cfg.Now().Add(d).Before(j.Deadline) {
			return out, backend, err
		}
		r.m.quotaWaits.Inc()
		t := time.NewTimer(d)
		select {
		case <-ctx.Done():
			t.Stop()
			return out, backend, err
		case <-t.C:
		}
		waited += d
	}
}

// failed records a failed attempt: a retry at a full-jitter delay (never
// sooner than the backend's Retry-After) when the class is transient, or
// a terminal failure; the store turns a retry the deadline or the attempt
// budget cannot hold into a terminal one.
func (r *Runner) failed(wctx, ctx context.Context, log *slog.Logger, j store.Job, a store.Attempt, err error) {
	if errors.Is(context.Cause(ctx), errLeaseLost) {
		r.lost(log, store.ErrLeaseLost)
		return
	}
	var xe *ExecError
	if !errors.As(err, &xe) {
		xe = &ExecError{Class: ClassBackend, Err: err}
	}
	now := r.cfg.Now()
	f := store.Failure{JobID: j.ID, Fence: j.Fence, Now: now}
	a.ErrorClass, a.Error, a.EndedAt = string(xe.Class), xe.Err.Error(), now
	switch {
	case ctx.Err() != nil:
		// Stopping: hand the job back for another process at once.
		a.Outcome, f.RetryAt = "interrupted", now
	case xe.Class.Transient():
		r.rngMu.Lock()
		d := r.cfg.Backoff.Delay(j.Attempt, xe.RetryAfter, r.rng)
		r.rngMu.Unlock()
		a.Outcome, f.RetryAt = "retry", now.Add(d)
	default:
		a.Outcome = "failed"
	}
	f.Attempt = a
	if err := r.st.Fail(wctx, f); err != nil {
		r.lost(log, err)
		return
	}
	if f.RetryAt.IsZero() {
		r.m.finished.WithLabelValues("failed").Inc()
		log.Info("job failed", "error_class", xe.Class, "err", xe.Err)
		return
	}
	r.m.retried.WithLabelValues(string(xe.Class)).Inc()
	log.Debug("attempt failed, retry scheduled", "error_class", xe.Class, "retry_at", f.RetryAt, "err", xe.Err)
}

// lost records that the runner no longer owns a job: its result is
// discarded, and whoever owns it now decides.
func (r *Runner) lost(log *slog.Logger, err error) {
	if errors.Is(err, store.ErrLeaseLost) {
		r.m.stale.Inc()
		log.Info("lease lost: result discarded")
		return
	}
	log.Warn("could not record the attempt; the reaper will retry the job", "err", err)
}

// heartbeat renews the lease every third of it until ctx ends, and cancels
// the work with errLeaseLost when the store says the lease is gone.
func (r *Runner) heartbeat(ctx context.Context, cancel context.CancelCauseFunc, j store.Job) {
	t := time.NewTicker(r.cfg.Lease / 3)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		err := r.st.Heartbeat(ctx, j.ID, j.Fence, r.cfg.Now(), r.cfg.Lease)
		if errors.Is(err, store.ErrLeaseLost) {
			cancel(errLeaseLost)
			return
		}
	}
}

type runnerMetrics struct {
	finished    *prometheus.CounterVec
	retried     *prometheus.CounterVec
	stale       prometheus.Counter
	reaped      prometheus.Counter
	stageReused prometheus.Counter
	quotaWaits  prometheus.Counter
}

func newRunnerMetrics() *runnerMetrics {
	return &runnerMetrics{
		finished: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvgate_scheduler_jobs_finished_total", Help: "Durable jobs this process brought to a final state, by outcome.",
		}, []string{"outcome"}),
		retried: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvgate_scheduler_job_retries_total", Help: "Failed job attempts scheduled for a retry, by error class.",
		}, []string{"class"}),
		stale: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvgate_scheduler_job_stale_completions_total", Help: "Job attempts whose lease was lost before they could record their end; their results were discarded.",
		}),
		reaped: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvgate_scheduler_jobs_reaped_total", Help: "Expired job leases the reaper turned into retries or failures.",
		}),
		stageReused: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvgate_scheduler_job_stage_reuses_total", Help: "Job attempts that found the inference checkpointed and did not call the model again.",
		}),
		quotaWaits: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvgate_scheduler_job_quota_waits_total", Help: "Times a job attempt waited in place for its tenant's quota instead of spending an attempt.",
		}),
	}
}

func (m *runnerMetrics) collectors() []prometheus.Collector {
	return []prometheus.Collector{m.finished, m.retried, m.stale, m.reaped, m.stageReused, m.quotaWaits}
}
