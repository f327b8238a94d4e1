package scheduler

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvgate/kvgate/store"
)

// jobStore is what the runner needs of the durable store; store.Store
// satisfies it.
type jobStore interface {
	Claim(ctx context.Context, now time.Time, lease time.Duration, limit int, models ...string) ([]store.Job, error)
	Heartbeat(ctx context.Context, id string, fence int64, now time.Time, lease time.Duration) error
	MarkSent(ctx context.Context, id string, fence int64, now time.Time, lease time.Duration, reserved *store.Charge) error
	Complete(ctx context.Context, c store.Completion) error
	Fail(ctx context.Context, f store.Failure) error
	Reap(ctx context.Context, now time.Time, limit int) (int, error)
	SaveStage(ctx context.Context, id string, fence int64, stage string, data []byte, now time.Time) error
	Stage(ctx context.Context, id, stage string) ([]byte, error)
}

// Executor prepares and runs a durable job's request; package gateway
// implements it.
type Executor interface {
	// Prepare parses and counts the job's request, once, and returns the
	// admission ticket and the call to run on the grant, or an
	// *ExecError (ClassInvalid for a request that cannot run).
	Prepare(ctx context.Context, j store.Job) (*Call, error)
}

// claimWidener is an Executor that runs jobs of more models than those a
// routable backend serves: a model alias's, whose jobs fall back to the
// alias's next model (gateway/aliases.go). ClaimModels returns the models
// to claim given the routable ones.
type claimWidener interface {
	ClaimModels(routable []string) []string
}

// Call is a prepared job request.
type Call struct {
	Ticket *Ticket
	// Admit takes what the job's tenant must grant before the job may
	// wait for a backend (its quota: the same order as an interactive
	// request's), or fails with an *ExecError (ClassQuota when the tenant
	// is over its quota). The runner may call it again after a refusal.
	Admit func(ctx context.Context) error
	// Run sends the request to the granted backend and returns its answer,
	// or an *ExecError saying how the attempt failed. It calls sending
	// right before the request leaves, and sends nothing if that fails
	// (the claim lost the job).
	Run func(ctx context.Context, g *Grant, sending func() error) (Outcome, error)
	// Release gives back what Prepare took; it is idempotent, and needed
	// whether Run ran or not.
	Release func()
	// Charge, when Admit set it instead of taking a permit, is the usage
	// the runner charges to the job's tenant with the attempt's own writes
	// (store.Charge): Admit fills in the reservation, which the runner's
	// sent mark holds, and Run how the request ended, which the attempt's
	// end charges.
	Charge *store.Charge
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

// The stage whose checkpoint spares a retry the model call (stages.go
// lists them all).
const stageInference = store.StageInference

// RunnerConfig tunes a Runner. Zero values take the defaults in brackets.
type RunnerConfig struct {
	Concurrency int           // jobs run at once by this process [64]
	Lease       time.Duration // claim lease, renewed every third of it [1m]
	Poll        time.Duration // store scan period when nothing wakes it [500ms]
	ReapEvery   time.Duration // reaper period [5s]
	Backoff     Backoff
	// QuotaWait is the longest an attempt waits in place, holding its
	// slot, for its tenant's own quota; a longer wait hands the job back
	// for a retry at the reset, which spends no attempt [1m: a rate
	// window's reset].
	QuotaWait time.Duration
	Logger    *slog.Logger
	Now       func() time.Time
	// OnEvents, when set, is called after the runner committed outbox
	// events (claims, outcomes): the wiring wakes the relay with it.
	OnEvents func()
	// ClaimLinger is the longest a claim waits for attempts in flight to
	// end when its busy slots, not the fleet's room, are what keep it
	// short, so that the slots freed meanwhile join it: fewer and fuller
	// claims, each one statement and one commit whatever its size, where
	// short jobs end one after another. Negative: claim at once
	// [DefaultClaimLinger].
	ClaimLinger time.Duration
}

// DefaultClaimLinger is RunnerConfig.ClaimLinger's default: short beside
// any inference, long beside the end of a job that takes no time (beside
// River, whose producer fetches at most once a millisecond at its
// quickest, claims of zero-delay jobs grew from half a runner's slots to
// all of them, and the claim → complete rate by about a quarter;
// docs/benchmarks.md).
const DefaultClaimLinger = time.Millisecond

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
	// draining, once set, stops the claims; work in flight goes on until
	// Run's context ends.
	draining atomic.Bool
	// unsent cancels the attempts whose request has not left yet: a
	// drain hands them back at once.
	unsentMu sync.Mutex
	unsent   map[*attempt]struct{}

	rngMu    sync.Mutex
	rng      *rand.Rand
	inflight atomic.Int64 // claimed jobs being worked on
	// admitting counts claimed jobs not yet in the scheduler's books
	// (admitted, or queued there: Ticket.Booked); work ends it once, with
	// admit.
	admitting atomic.Int64
}

// NewRunner returns a runner; Run starts it.
func NewRunner(st jobStore, sched *Scheduler, exec Executor, cfg RunnerConfig) *Runner {
	cfg.Concurrency = cmp.Or(cfg.Concurrency, 64)
	cfg.Lease = cmp.Or(cfg.Lease, time.Minute)
	cfg.Poll = cmp.Or(cfg.Poll, 500*time.Millisecond)
	cfg.ReapEvery = cmp.Or(cfg.ReapEvery, 5*time.Second)
	cfg.QuotaWait = cmp.Or(cfg.QuotaWait, time.Minute)
	cfg.ClaimLinger = cmp.Or(cfg.ClaimLinger, DefaultClaimLinger)
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

// Drain stops claiming new jobs and hands back at once, spending nothing,
// the claimed jobs whose request has not left yet (waiting for their
// quota, for room in kvgate's queue; an embeddings job between two of its
// batches, the ones before checkpointed), so that a replica that stays
// takes them. The attempts whose request has left go on until they end, and
// then Run returns nil, or until Run's context ends (then each hands its
// job back without spending an attempt). Safe to call more than once.
func (r *Runner) Drain() {
	if !r.draining.Swap(true) {
		r.unsentMu.Lock()
		for t := range r.unsent {
			t.cancel(errDrained)
		}
		n := len(r.unsent)
		r.unsentMu.Unlock()
		r.log.Info("runner draining: no new claims", "in_flight", r.inflight.Load(), "handed_back", n)
	}
	r.Wake()
}

// errDrained stops an attempt whose request had not left when the drain
// began.
var errDrained = errors.New("kvgate is draining")

// attempt is what the runner tracks of one attempt in flight: whether it
// is in the scheduler's books, admitted or queued there (admitting counts
// it until then),
// and whether a request of its is about to leave (a drain hands it back
// while none is). An embeddings job's attempt sends several requests, one
// after another: between them it is unsent again. Its methods other than
// sent are called from the attempt's own goroutine.
type attempt struct {
	r        *Runner
	cancel   context.CancelCauseFunc
	admitted bool
}

// track registers a claimed attempt as unsent; cancel stops it (at once,
// when the runner is draining already).
func (r *Runner) track(cancel context.CancelCauseFunc) *attempt {
	t := &attempt{r: r, cancel: cancel}
	t.unsent()
	return t
}

// admit records that the attempt is in the scheduler's books (admitted
// or queued there), or past needing them; once only.
func (t *attempt) admit() {
	if !t.admitted {
		t.admitted = true
		t.r.admitting.Add(-1)
	}
}

// waiting and resumed bracket a wait for the tenant's quota: waiting for
// its tenant, an attempt not yet admitted takes no room from the others'.
func (t *attempt) waiting() {
	if !t.admitted {
		t.r.admitting.Add(-1)
	}
}

func (t *attempt) resumed() {
	if !t.admitted {
		t.r.admitting.Add(1)
	}
}

// unsent registers the attempt as holding no request that has left: a
// drain (now, or later) cancels it.
func (t *attempt) unsent() {
	r := t.r
	r.unsentMu.Lock()
	defer r.unsentMu.Unlock()
	if r.draining.Load() {
		t.cancel(errDrained)
	}
	if r.unsent == nil {
		r.unsent = map[*attempt]struct{}{}
	}
	r.unsent[t] = struct{}{}
}

// sent records that a request of the attempt is leaving: a drain lets it
// finish.
func (t *attempt) sent() {
	r := t.r
	r.unsentMu.Lock()
	delete(r.unsent, t)
	r.unsentMu.Unlock()
}

// Run claims and runs jobs until ctx is done, then waits for the jobs it
// runs: each hands its job back at once without spending an attempt, so
// that another process takes it rather than after the lease expires. It
// returns ctx's error.
//
// It claims no more than it has free slots and the fleet has room to
// start soon (Scheduler.Room), and only jobs whose model a routable
// backend serves: a fleet that serves nothing yet (its backends are
// loading their models) leaves its jobs READY in the store.
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
			// A reap of many expired leases (a replica lost) writes for
			// each: not cut by a short lease's third.
			rctx, stop := context.WithTimeout(ctx, max(r.storeWait(), 30*time.Second))
			n, err := r.st.Reap(rctx, r.cfg.Now(), 1000)
			stop()
			if err != nil {
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
		// Every attempt's end wakes the loop (twice: its slot freed, its
		// end written); those that came together share one claim, not one
		// each: a claim is a statement, and one that finds work a commit.
	coalesce:
		for {
			select {
			case <-done:
			default:
				break coalesce
			}
		}
		r.linger(ctx, slots, done)
		if r.draining.Load() {
			if r.inflight.Load() == 0 {
				return nil // drained
			}
			continue
		}
		// Jobs claimed but not yet in the scheduler's books (not yet
		// queued there) count against the room here. Only the models
		// with room are claimed (ClaimRoom).
		room, models := r.sched.ClaimRoom()
		free := min(cap(slots)-len(slots), room-int(r.admitting.Load()))
		if w, ok := r.exec.(claimWidener); ok {
			models = w.ClaimModels(models)
		}
		if free <= 0 || len(models) == 0 {
			continue
		}
		cctx, stop := r.bounded(ctx)
		jobs, err := r.st.Claim(cctx, r.cfg.Now(), r.cfg.Lease, free, models...)
		stop()
		if err != nil {
			if ctx.Err() == nil {
				r.log.Warn("claim failed", "err", err)
			}
			continue
		}
		if len(jobs) > 0 && r.cfg.OnEvents != nil {
			r.cfg.OnEvents()
		}
		known := r.claimFacts(ctx, jobs)
		for _, j := range jobs {
			slots <- struct{}{}
			r.inflight.Add(1)
			r.admitting.Add(1)
			wg.Go(func() {
				wake := func() {
					select {
					case done <- struct{}{}:
					default:
					}
				}
				// The slot is the attempt's, not its final write's: it is
				// freed once the outcome is known, so that the next claim
				// does not wait for the commit, and the writes of many
				// workers meet in one batch (group commit in the store).
				var freeOnce sync.Once
				free := func() { freeOnce.Do(func() { <-slots; wake() }) }
				defer func() {
					r.inflight.Add(-1)
					free()
					wake()
				}()
				r.work(ctx, j, free, known[j.ID])
				if r.cfg.OnEvents != nil {
					r.cfg.OnEvents()
				}
			})
		}
	}
}

// linger waits, up to ClaimLinger, while the claim the runner could make
// now would be shorter for its busy slots alone: some slots are free, the
// fleet has room for more jobs than that, and attempts in flight may end
// within the linger. Each end that frees a slot meanwhile (done) joins
// the claim; it returns once the slots no longer bind, at the linger's
// end, or when ctx ends.
func (r *Runner) linger(ctx context.Context, slots chan struct{}, done <-chan struct{}) {
	short := func() bool {
		free := cap(slots) - len(slots)
		return free > 0 && free < cap(slots) && free < r.sched.Room()-int(r.admitting.Load())
	}
	if r.cfg.ClaimLinger <= 0 || r.draining.Load() || !short() {
		return
	}
	t := time.NewTimer(r.cfg.ClaimLinger)
	defer t.Stop()
	for short() {
		select {
		case <-done:
		case <-t.C:
			return
		case <-ctx.Done():
			return
		}
	}
}

var errLeaseLost = errors.New("lease lost")

// factsStore is a store that reads what the attempts of many jobs read
// before their stages in one statement (sqlstore.Store.AttemptFacts):
// each job's entity and pinned policy, as JobEntity and JobOutcome read
// them one at a time.
type factsStore interface {
	AttemptFacts(ctx context.Context, ids []string) (map[string]store.JobEntity, map[string]store.JobOutcome, error)
}

// facts are what an attempt reads of its job before its stages, read for
// its whole claim at once; a nil *facts means unread, and each stage
// reads its own as before.
type facts struct {
	entity  *store.JobEntity  // nil: the job names no entity
	outcome *store.JobOutcome // nil: the job pins no policy
}

// claimFacts reads the facts of a claim's jobs in one statement where the
// store can: one read per claim, where each attempt read its entity and
// its policy (two reads a job). Both are written with the job at
// acceptance and never change while it runs. When the read fails, the
// attempts read their own, whose failures each attempt handles (a wait).
func (r *Runner) claimFacts(ctx context.Context, jobs []store.Job) map[string]*facts {
	fs, ok := r.st.(factsStore)
	if !ok || len(jobs) == 0 {
		return nil
	}
	ids := make([]string, len(jobs))
	for i, j := range jobs {
		ids[i] = j.ID
	}
	fctx, stop := r.bounded(ctx)
	defer stop()
	ents, outs, err := fs.AttemptFacts(fctx, ids)
	if err != nil {
		r.log.Debug("claim facts unread", "err", err)
		return nil
	}
	known := make(map[string]*facts, len(jobs))
	for _, id := range ids {
		f := &facts{}
		if e, ok := ents[id]; ok {
			f.entity = &e
		}
		if o, ok := outs[id]; ok {
			f.outcome = &o
		}
		known[id] = f
	}
	return known
}

// work runs one claimed attempt to its recorded end; it calls free when
// the attempt's outcome is known, before the writes that record it. f is
// what its claim read of the job (nil: unread).
func (r *Runner) work(parent context.Context, j store.Job, free func(), f *facts) {
	ctx, cancel := context.WithCancelCause(parent)
	log := r.log.With("job_id", j.ID, "tenant", j.Tenant, "attempt", j.Attempt+1, "fence", j.Fence)
	var hb sync.WaitGroup
	hb.Go(func() { r.heartbeat(ctx, cancel, j) })
	defer hb.Wait()
	defer cancel(nil) // stops the heartbeat before the wait

	at := r.track(cancel)
	defer at.admit()
	defer at.sent()
	a := store.Attempt{JobID: j.ID, Attempt: j.Attempt + 1, Fence: j.Fence, StartedAt: r.cfg.Now()}
	// The final writes must land even when the process is stopping.
	wctx := context.WithoutCancel(ctx)

	ent, ok := r.entityGate(ctx, wctx, log, j, a, f) // stages.go
	if !ok {
		return
	}
	// A stage is written only under an owning claim's fence (SaveStage's
	// condition), so a job on its first claim (fence 1) has none: the
	// read is spared.
	body, err := []byte(nil), store.ErrNotFound
	if j.Fence > 1 {
		sctx, stop := r.bounded(ctx)
		body, err = r.st.Stage(sctx, j.ID, stageInference)
		stop()
	}
	reused := err == nil
	last := false // the inference is the job's last stage (lastStage)
	switch {
	case reused:
		r.m.stageReused.Inc() // an earlier attempt paid for the inference
	case errors.Is(err, store.ErrNotFound):
		out, xerr := r.inferStage(ctx, j, &a, at) // embed.go: in batches for many inputs
		free()
		if xerr != nil {
			r.failed(wctx, ctx, log, j, a, xerr)
			return
		}
		a.PromptTokens, a.CompletionTokens = out.PromptTokens, out.CompletionTokens
		body = out.Body
		if last = r.lastStage(wctx, j, f); !last {
			if err := r.record(wctx, func(ctx context.Context, now time.Time) error {
				return r.st.SaveStage(ctx, j.ID, j.Fence, stageInference, body, now)
			}); err != nil {
				r.lost(log, err)
				return
			}
		}
	default:
		// The store did not answer: nothing was sent, nothing is spent.
		free()
		r.failed(wctx, ctx, log, j, a, &ExecError{Class: ClassStore, Err: err})
		return
	}

	// The next stage (stages.go) never calls the backend.
	state, err := store.Succeeded, error(nil)
	if !last {
		state, err = r.validation(wctx, j, body, f)
	}
	if err != nil {
		if errors.Is(err, store.ErrLeaseLost) || !reused {
			// This attempt called the backend: as for an end that cannot
			// be written, the reaper counts it and retries the job from
			// the inference's checkpoint.
			r.lost(log, err)
			return
		}
		r.failed(wctx, ctx, log, j, a, &ExecError{Class: ClassStore, Err: err}) // nothing sent: a wait
		return
	}
	free()
	a.Outcome, a.EndedAt = store.OutcomeSucceeded, r.cfg.Now()
	// An attempt that sent nothing spends nothing: the inference's
	// checkpoint reused, or every batch of an embeddings job's (their
	// answers checkpointed by attempts before it).
	reused = reused || !a.Sent
	err = r.recordEnd(wctx, j, func(ctx context.Context, now time.Time) error {
		return r.st.Complete(ctx, store.Completion{JobID: j.ID, Fence: j.Fence, State: state, Result: body,
			Reused: reused, Entity: ent, Attempt: a, Now: now})
	})
	if err != nil {
		r.lost(log, err)
		return
	}
	if ent != nil {
		// The entity's rule decides in the completing transaction: the
		// store may have ended the job SUPERSEDED instead.
		if g, ok := r.st.(interface {
			Get(ctx context.Context, tenant, id string) (store.Job, error)
		}); ok {
			gctx, stop := r.bounded(wctx)
			defer stop()
			if got, err := g.Get(gctx, j.Tenant, j.ID); err == nil {
				state = got.State
			}
		}
	}
	r.m.finished.WithLabelValues(strings.ToLower(string(state))).Inc()
}

// lastStage reports whether the inference is job j's last stage: no
// policy is pinned to judge its answer (stages.go). Its checkpoint would
// then be written just before the job's end, which records the same
// answer as the result under the same fence: the end alone is written,
// one commit where there were two. No guarantee narrows: no retry can
// come after a recorded end, and a process that dies before the end
// costs what one that died before the checkpoint cost (the answer is
// paid for again), the window being one commit either way. A job that
// names a policy, or one whose policy the store could not say, is
// checkpointed first as before.
func (r *Runner) lastStage(ctx context.Context, j store.Job, f *facts) bool {
	if f != nil {
		return f.outcome == nil
	}
	os, ok := r.st.(outcomeStore)
	if !ok {
		return true // no store of policies: validation has nothing to judge
	}
	octx, stop := r.bounded(ctx)
	defer stop()
	_, err := os.JobOutcome(octx, j.ID)
	return errors.Is(err, store.ErrNotFound)
}

// infer prepares the job's request, waiting in place for a short quota
// reset (see quotaPause), admits it through the scheduler as the batch
// class, marks it sent and runs it on the granted backend. It records the
// backend and whether the request may have left in a, and in a.Charge the
// usage the attempt's end charges: this request's, when Admit took no
// permit for it, and earlier's, what the attempt's requests before this
// one used (an embeddings job's batches).
func (r *Runner) infer(ctx context.Context, j store.Job, a *store.Attempt, at *attempt, earlier store.Spent) (Outcome, error) {
	call, err := r.exec.Prepare(ctx, j)
	if err != nil {
		return Outcome{}, err
	}
	defer call.Release()
	var waited time.Duration
	for {
		err := call.Admit(ctx)
		if err == nil {
			break
		}
		d, ok := r.quotaPause(j, err, waited)
		if !ok {
			return Outcome{}, err
		}
		r.m.quotaWaits.Inc()
		at.waiting()
		t := time.NewTimer(d)
		select {
		case <-ctx.Done():
		case <-t.C:
		}
		t.Stop()
		at.resumed()
		if ctx.Err() != nil {
			return Outcome{}, err
		}
		waited += d
	}
	t := call.Ticket
	t.Class, t.Tenant, t.Deadline = Batch, j.Tenant, j.Deadline
	// Queued in the scheduler, the ticket counts against Room there: the
	// admitting count lets go of it then, not once it is admitted, so
	// that a job waiting for a backend is counted once, not twice.
	t.Booked = at.admit
	g, err := r.sched.Acquire(ctx, t)
	at.admit()
	if err != nil {
		return Outcome{}, admissionError(err)
	}
	defer g.Release()
	a.Backend = g.Backend
	ch := call.Charge
	if ch == nil && earlier.Requests > 0 {
		ch = &store.Charge{} // this request's permit charges it; the earlier ones still ride on the attempt
	}
	if ch != nil {
		// Run fills in how the request ended; the attempt's end charges
		// it with the earlier ones, and the sent mark holds all their
		// reservations for a reap.
		ch.Earlier = earlier
		defer func() { a.Charge = ch }()
	}
	return call.Run(ctx, g, func() error {
		mctx, stop := r.bounded(ctx)
		defer stop()
		if err := r.st.MarkSent(mctx, j.ID, j.Fence, r.cfg.Now(), r.cfg.Lease, ch); errors.Is(err, store.ErrLeaseLost) {
			return err
		} else if err != nil {
			// Unmarked, the request must not leave: a wait, not an attempt.
			return &ExecError{Class: ClassStore, Err: err}
		}
		at.sent() // from here a drain lets it finish
		a.Sent = true
		return nil
	})
}

// admissionError classes a refusal of the scheduler: a request no backend
// could ever hold is the job's own fault; the rest are waits.
func admissionError(err error) error {
	var tooLarge *TooLargeError
	var rejected *RejectedError
	switch {
	case errors.As(err, &tooLarge):
		return &ExecError{Class: ClassInvalid, Err: err}
	case errors.Is(err, ErrNoBackend), errors.Is(err, ErrNoRoutableBackend):
		var ue *UnroutableError
		retry := time.Duration(0)
		if errors.As(err, &ue) {
			retry = ue.RetryAfter
		}
		return &ExecError{Class: ClassNoBackend, RetryAfter: retry, Err: err}
	case errors.As(err, &rejected) && rejected.Reason == "shutting_down":
		return &ExecError{Class: ClassShutdown, Err: err}
	case errors.As(err, &rejected):
		return &ExecError{Class: ClassCapacity, RetryAfter: rejected.RetryAfter, Err: err}
	}
	return &ExecError{Class: ClassCapacity, Err: err} // ctx ended
}

// quotaPause says whether a refusal of the job's tenant's quota is worth
// waiting out in place, and for how long: at the quota's reset, or sooner
// (Backoff.Max), or after a jitter under Backoff.Base when the reset is
// unknown (a concurrency cap: when work in flight ends). A reset further
// than QuotaWait, a wait longer than QuotaWait in all, or one past the
// deadline is not: failed then hands the job back for a retry at the
// reset, spending nothing, so that a tenant's long wait does not hold a
// runner slot other tenants' jobs could use.
func (r *Runner) quotaPause(j store.Job, err error, waited time.Duration) (time.Duration, bool) {
	var xe *ExecError
	if !errors.As(err, &xe) || xe.Class != ClassQuota || xe.RetryAfter > r.cfg.QuotaWait {
		return 0, false
	}
	r.rngMu.Lock()
	d := r.cfg.Backoff.Delay(1, min(xe.RetryAfter, cmp.Or(r.cfg.Backoff.Max, time.Minute)), r.rng)
	r.rngMu.Unlock()
	if waited+d > r.cfg.QuotaWait || !r.cfg.Now().Add(d).Before(j.Deadline) {
		return 0, false
	}
	return d, true
}

// errUnrecorded: an attempt that reached a backend could not write what it
// got. Its end is left to the reaper, which counts it (its sent mark),
// rather than recorded as a wait that would spend nothing.
var errUnrecorded = errors.New("an answer that could not be recorded")

// failed records an attempt that did not succeed. What the store makes of
// it follows one rule (store.Failure): an attempt whose class spends
// counts, and is retried at a full-jitter delay (never sooner than the
// backend's Retry-After) while attempts and the deadline allow; a wait
// hands the job back without spending, for a retry at the wait's end; an
// attempt interrupted by kvgate's own shutdown hands it back at once.
func (r *Runner) failed(wctx, ctx context.Context, log *slog.Logger, j store.Job, a store.Attempt, err error) {
	if errors.Is(context.Cause(ctx), errLeaseLost) || errors.Is(err, store.ErrLeaseLost) {
		r.lost(log, store.ErrLeaseLost)
		return
	}
	if errors.Is(err, errUnrecorded) {
		r.lost(log, err) // the reaper ends the attempt, counted
		return
	}
	var xe *ExecError
	if !errors.As(err, &xe) {
		xe = &ExecError{Class: ClassBackend, Err: err}
	}
	if ctx.Err() != nil {
		// Stopping: hand the job back for another process at once.
		xe = &ExecError{Class: ClassShutdown, Err: xe}
	}
	if xe.Class == ClassRefused {
		a.Sent = false // the connection was refused: nothing left
	}
	now := r.cfg.Now()
	f := store.Failure{JobID: j.ID, Fence: j.Fence, Now: now}
	a.ErrorClass, a.Error, a.EndedAt = string(xe.Class), xe.Err.Error(), now
	r.rngMu.Lock()
	switch {
	case xe.Class == ClassShutdown:
		a.Outcome = store.OutcomeInterrupted
	case !xe.Class.Spends():
		// Consecutive waits back off like retries (claims that spent
		// nothing: the fence counts every claim, those since the job's
		// last replay this run's), so that a job waiting hours for its
		// deadline does not churn the store every second.
		waits := max(int(j.Fence-j.ReplayFence)-j.Attempt, 1)
		a.Outcome, f.RetryAt = store.OutcomeWait, now.Add(r.cfg.Backoff.Delay(waits, xe.RetryAfter, r.rng))
	case xe.Class.Transient():
		a.Outcome, a.Spent, f.RetryAt = store.OutcomeFailed, true, now.Add(r.cfg.Backoff.Delay(j.Attempt+1, xe.RetryAfter, r.rng))
	default:
		a.Outcome, a.Spent = store.OutcomeFailed, true
	}
	r.rngMu.Unlock()
	if !f.RetryAt.IsZero() {
		f.RetryAt = r.withinDeadline(now, j.Deadline, f.RetryAt, xe.RetryAfter)
	}
	f.Attempt = a
	if err := r.recordEnd(wctx, j, func(ctx context.Context, now time.Time) error {
		f.Now = now
		return r.st.Fail(ctx, f)
	}); err != nil {
		r.lost(log, err)
		return
	}
	switch {
	case a.Spent && f.RetryAt.IsZero():
		r.m.finished.WithLabelValues("failed").Inc()
		log.Info("job failed", "error_class", xe.Class, "err", xe.Err)
	case a.Spent:
		r.m.retried.WithLabelValues(string(xe.Class)).Inc()
		log.Debug("attempt failed, retry scheduled", "error_class", xe.Class, "retry_at", f.RetryAt, "err", xe.Err)
	default:
		r.m.waits.WithLabelValues(string(xe.Class)).Inc()
		log.Debug("job handed back without spending an attempt", "error_class", xe.Class, "retry_at", f.RetryAt, "err", xe.Err)
	}
}

// withinDeadline keeps a retry inside its job's deadline, which the store
// ends a retry past (deadline_exceeded): a jittered backoff that would
// pass it waits half the time left instead (no less than the floor), so
// that a job waiting out a backend's absence gets its tries until near
// its deadline, not one unlucky draw's end 40 s early. A floor that passes
// it (a Retry-After, a quota's reset) is kept, as is a wait once half the
// time left is under the backoff's base: the job then ends.
func (r *Runner) withinDeadline(now, deadline, at time.Time, floor time.Duration) time.Time {
	if deadline.IsZero() || at.Before(deadline) {
		return at
	}
	left := deadline.Sub(now)
	d := max(left/2, floor)
	if d >= left || d < cmp.Or(r.cfg.Backoff.Base, time.Second) {
		return at
	}
	return now.Add(d)
}

// record runs one of an attempt's final writes (its checkpoint, its end)
// at the time it is tried, trying again while the store fails it and the
// claim's lease may still hold: a database restart, a deadlock, SQLite's
// file held past its busy timeout or a failover's read-only moment must
// not lose an answer the backend gave, which would pay for the inference
// again and spend another attempt. Only the store's answers about the job
// end the tries at once (final: its lease lost, the job ended or gone);
// the others stop one lease after the first. Each try has a third of the
// lease (storeWait): one that hangs (a connection left half open by a
// host that crashed) is abandoned and tried again on another connection
// while the lease holds. It returns the last error.
func (r *Runner) record(ctx context.Context, write func(ctx context.Context, now time.Time) error) error {
	giveUp := r.cfg.Now().Add(r.cfg.Lease)
	for wait := 50 * time.Millisecond; ; wait = min(2*wait, 2*time.Second) {
		now := r.cfg.Now()
		tctx, stop := context.WithTimeout(ctx, min(r.storeWait(), max(giveUp.Sub(now), 0)))
		err := write(tctx, now)
		stop()
		if err == nil || final(err) || ctx.Err() != nil || !r.cfg.Now().Add(wait).Before(giveUp) {
			return err
		}
		r.m.recordRetries.Inc()
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return err
		case <-t.C:
		}
	}
}

// recordEnd records an attempt's end (Complete, Fail) as record does. A
// try cut by its bound may have committed all the same (a group commit's
// batch goes on without a caller that left it); the next try then finds
// the job ended (ErrLeaseLost), and the attempt record at the claim's
// fence says whether it was this end that landed, rather than a reap.
func (r *Runner) recordEnd(wctx context.Context, j store.Job, write func(ctx context.Context, now time.Time) error) error {
	cut := false
	err := r.record(wctx, func(ctx context.Context, now time.Time) error {
		err := write(ctx, now)
		if err != nil && errors.Is(ctx.Err(), context.DeadlineExceeded) {
			cut = true
		}
		return err
	})
	if cut && errors.Is(err, store.ErrLeaseLost) && r.endLanded(wctx, j) {
		return nil
	}
	return err
}

// endLanded reports whether the job's attempt at j's fence has its end
// recorded by its owner (not a reap's lease_expired).
func (r *Runner) endLanded(ctx context.Context, j store.Job) bool {
	st, ok := r.st.(interface {
		Attempts(ctx context.Context, id string) ([]store.Attempt, error)
	})
	if !ok {
		return false
	}
	ctx, stop := r.bounded(ctx)
	defer stop()
	as, err := st.Attempts(ctx, j.ID)
	if err != nil {
		return false
	}
	for _, a := range as {
		if a.Fence == j.Fence && a.Outcome != store.OutcomeLeaseExpired {
			return true
		}
	}
	return false
}

// storeWait bounds one call of the runner's to the store: a third of the
// lease, so that a call left hanging (a connection half open) is given up
// while the lease still has two thirds to run, and the next beat or try
// gets through on another connection.
func (r *Runner) storeWait() time.Duration { return r.cfg.Lease / 3 }

// bounded is ctx limited to storeWait.
func (r *Runner) bounded(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, r.storeWait())
}

// final reports whether a store's error is its answer about the job, which
// trying again would only repeat. Not a context's error: a driver's own
// timeout (a connect_timeout to a host out of reach) matches
// context.DeadlineExceeded, and is a store out of reach; record's caller
// ending is record's own look (ctx.Done).
func final(err error) bool {
	for _, e := range []error{store.ErrLeaseLost, store.ErrFinal, store.ErrNotFound, store.ErrConflict} {
		if errors.Is(err, e) {
			return true
		}
	}
	return false
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
	held := j.LeaseUntil // the lease as last confirmed by the store
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		now := r.cfg.Now()
		// No longer than a third of the lease, nor than the lease held: a
		// beat that hangs (a connection half open) is given up in time for
		// the next one, queued meanwhile, to renew the lease, and must not
		// keep the work going past it.
		bctx, stop := context.WithTimeout(ctx, min(held.Sub(now), r.storeWait()))
		err := r.st.Heartbeat(bctx, j.ID, j.Fence, now, r.cfg.Lease)
		stop()
		switch {
		case err == nil:
			held = now.Add(r.cfg.Lease)
		case errors.Is(err, store.ErrLeaseLost):
			cancel(errLeaseLost)
			return
		case ctx.Err() != nil:
		case !now.Before(held):
			// The store could not be told, and the lease has run out:
			// another replica may own the job now. Stop.
			r.log.Warn("heartbeat failed past the lease: giving the job up", "job_id", j.ID, "fence", j.Fence, "err", err)
			cancel(errLeaseLost)
			return
		default:
			// The next beat tries again; the lease outlives two misses.
			r.log.Warn("heartbeat failed", "job_id", j.ID, "fence", j.Fence, "err", err)
		}
	}
}

type runnerMetrics struct {
	finished      *prometheus.CounterVec
	retried       *prometheus.CounterVec
	waits         *prometheus.CounterVec
	recordRetries prometheus.Counter
	stale         prometheus.Counter
	reaped        prometheus.Counter
	stageReused   prometheus.Counter
	quotaWaits    prometheus.Counter
}

func newRunnerMetrics() *runnerMetrics {
	return &runnerMetrics{
		finished: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvgate_scheduler_jobs_finished_total", Help: "Durable jobs this process brought to a final state, by outcome.",
		}, []string{"outcome"}),
		retried: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvgate_scheduler_job_retries_total", Help: "Failed job attempts that spent an attempt and were scheduled for a retry, by error class.",
		}, []string{"class"}),
		waits: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvgate_scheduler_job_waits_total", Help: "Job claims handed back without spending an attempt (no backend, no capacity, a quota, a 429, a refused connection, shutdown), by class.",
		}, []string{"class"}),
		recordRetries: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "kvgate_scheduler_job_record_retries_total", Help: "Times a job attempt's checkpoint or end was written again because the store could not be reached.",
		}),
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
	return []prometheus.Collector{m.finished, m.retried, m.waits, m.recordRetries, m.stale, m.reaped, m.stageReused, m.quotaWaits}
}
