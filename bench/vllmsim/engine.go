package vllmsim

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// ErrEngineDead is returned for requests that meet a dead engine: one killed
// through the fault switch, as vLLM's EngineDeadError.
var ErrEngineDead = errors.New("engine is dead")

// ErrTooLong is returned by Submit for a request that cannot fit in the
// model's context; the server checks first and answers with vLLM's message.
var ErrTooLong = errors.New("request exceeds the maximum model length")

// Finish reasons, as vLLM reports them in responses and in
// vllm:request_success_total{finished_reason}.
const (
	FinishStop   = "stop"
	FinishLength = "length"
	FinishAbort  = "abort"
)

// Options configure an Engine.
type Options struct {
	Profile Profile

	// Speedup runs the simulated clock this many times faster than the
	// wall clock. Zero means unpaced: the clock advances only by step
	// durations and steps run back to back, as fast as the host allows.
	Speedup float64

	// Seed makes output lengths, generated tokens and fault draws
	// reproducible.
	Seed uint64

	// ModelName labels the metrics: the served model name, the profile's
	// model by default.
	ModelName string

	// LegacyMetrics exposes the metric names of older vLLM releases
	// (vllm:gpu_cache_usage_perc, vllm:gpu_prefix_cache_*,
	// vllm:time_per_output_token_seconds) without the engine label.
	LegacyMetrics bool

	// Quirks make the metrics page unlike vLLM's (quirks.go).
	Quirks Quirks
}

// Engine is a simulated vLLM V1 engine: a scheduler, a paged KV cache and a
// step loop timed by the profile's roofline model.
//
// Submit and Abort are safe for concurrent use. Run drives the loop in real
// (or sped-up) time; Step drives one step by hand for tests and for
// calibration and must not be mixed with Run.
type Engine struct {
	prof    Profile
	speedup float64
	seed    uint64
	// m is owned by the step loop, which starts it over when the engine
	// dies (a restarted vLLM's counters start from zero); reg is its
	// registry, for /metrics.
	m    *engineMetrics
	newM func() *engineMetrics
	reg  atomic.Pointer[prometheus.Registry]

	mu      sync.Mutex // guards the fields below it
	inbox   []*Request
	aborts  []*Request
	dead    bool
	kills   uint64 // Kill calls so far: a kill is never lost to a quick Revive
	load    int    // requests submitted and not finished
	nextSeq uint64
	wake    chan struct{}

	clock simClock

	// Owned by the step loop.
	pool      *blockPool
	killsSeen uint64
	running   []*Request
	waiting   []*Request // front is next; preempted requests go to the front
	plan      []scheduled
	stats     EngineStats
}

// EngineStats are cumulative engine counters, read by tests and reports.
type EngineStats struct {
	Steps             uint64
	Preemptions       uint64
	PromptTokens      uint64 // prompt tokens of requests that produced output
	GenerationTokens  uint64
	PrefixQueryTokens uint64
	PrefixHitTokens   uint64
	Finished          uint64
}

type scheduled struct {
	r      *Request
	numNew int
}

// NewEngine returns an engine for the given options. It fails when the
// profile cannot hold one request of max_model_len, as vLLM refuses to start.
func NewEngine(opts Options) (*Engine, error) {
	p := opts.Profile
	if err := p.Validate(); err != nil {
		return nil, err
	}
	if capTok := (p.NumGPUBlocks - 1) * p.BlockSize; p.MaxModelLen > capTok {
		return nil, fmt.Errorf("max_model_len %d needs more KV cache than %d blocks of %d tokens hold (%d tokens); lower max_model_len or raise num_gpu_blocks",
			p.MaxModelLen, p.NumGPUBlocks, p.BlockSize, capTok)
	}
	if opts.Speedup < 0 || math.IsNaN(opts.Speedup) || math.IsInf(opts.Speedup, 0) {
		return nil, fmt.Errorf("speedup %g must be a finite number >= 0", opts.Speedup)
	}
	e := &Engine{
		prof:    p,
		speedup: opts.Speedup,
		seed:    opts.Seed,
		newM: func() *engineMetrics {
			return newEngineMetrics(p, cmp.Or(opts.ModelName, p.Model), opts.LegacyMetrics, opts.Quirks)
		},
		wake: make(chan struct{}, 1),
		pool: newBlockPool(p.NumGPUBlocks, p.PrefixCaching && !p.Embedding),
	}
	e.m = e.newM()
	e.reg.Store(e.m.reg)
	e.clock.init(opts.Speedup)
	return e, nil
}

// Profile returns the engine's profile.
func (e *Engine) Profile() Profile { return e.prof }

// Now returns the simulated time since the engine started.
func (e *Engine) Now() time.Duration { return e.clock.now() }

// Stalled is the simulated time added so far because the host ran the
// engine late (more than maxLag behind a step's deadline): time in which
// the simulated GPU did nothing, not for want of work but of CPU. Over a
// run, it says how much the host starved the simulator.
func (e *Engine) Stalled() time.Duration {
	e.clock.mu.Lock()
	defer e.clock.mu.Unlock()
	return e.clock.stalled
}

// Load returns the number of requests submitted and not yet finished.
func (e *Engine) Load() int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.load
}

// Dead reports whether the engine has been killed.
func (e *Engine) Dead() bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.dead
}

// Stats returns the cumulative counters. Call it from the goroutine that
// steps the engine, or after Run has returned.
func (e *Engine) Stats() EngineStats { return e.stats }

// SubmitParams describe one generation or pooling request.
type SubmitParams struct {
	Prompt    []int
	MaxTokens int  // output cap; ignored for pooling
	IgnoreEOS bool // generate exactly MaxTokens
	MinTokens int
	// Arrival, when set, is the simulated time the request reached the
	// server, if earlier than its submission; latencies run from it.
	Arrival *time.Duration
}

// Submit queues a request. The request's prompt plus MaxTokens must fit in
// max_model_len; on an embedding profile the request only prefills.
// It returns ErrEngineDead after Kill and ErrTooLong for an oversize request.
func (e *Engine) Submit(p SubmitParams) (*Request, error) {
	n := len(p.Prompt)
	if n == 0 {
		return nil, errors.New("empty prompt")
	}
	if e.prof.Embedding {
		p.MaxTokens = 0
		if n > e.prof.MaxModelLen {
			return nil, ErrTooLong
		}
	} else if p.MaxTokens < 1 || n+p.MaxTokens > e.prof.MaxModelLen {
		return nil, ErrTooLong
	}
	r := &Request{
		prompt:    p.Prompt,
		tokens:    slices.Clip(p.Prompt),
		maxTokens: p.MaxTokens,
		notify:    make(chan struct{}, 1),
		doneCh:    make(chan struct{}),

		firstScheduledAt: -1,
	}
	r.target, r.rng = e.plan1(p)
	e.mu.Lock()
	if e.dead {
		e.mu.Unlock()
		return nil, ErrEngineDead
	}
	e.nextSeq++
	r.seq = e.nextSeq
	r.arrival = e.clock.now()
	if p.Arrival != nil && *p.Arrival < r.arrival {
		r.arrival = *p.Arrival
	}
	e.inbox = append(e.inbox, r)
	e.load++
	e.mu.Unlock()
	e.signal()
	return r, nil
}

// plan1 draws the request's output length and its token stream from a
// generator seeded by the engine seed and the prompt, so that the same
// prompt gets the same answer, as greedy decoding would give.
func (e *Engine) plan1(p SubmitParams) (int, *rand.Rand) {
	if e.prof.Embedding {
		return 0, nil
	}
	h := blockHash(e.seed, p.Prompt)
	rng := rand.New(rand.NewPCG(h, e.seed^0x9e3779b97f4a7c15))
	if p.IgnoreEOS {
		return p.MaxTokens, rng
	}
	median := float64(max(e.prof.OutputMedian, 1))
	n := int(math.Round(median * math.Exp(rng.NormFloat64())))
	n = max(n, p.MinTokens, 1)
	return min(n, p.MaxTokens), rng
}

// Abort cancels a request; it finishes with reason "abort" at the next step
// and frees its blocks. Aborting a finished request does nothing.
func (e *Engine) Abort(r *Request) {
	e.mu.Lock()
	e.aborts = append(e.aborts, r)
	e.mu.Unlock()
	e.signal()
}

// Kill makes the engine dead: every request fails with ErrEngineDead,
// /health answers 503, and new requests are refused until Revive.
func (e *Engine) Kill() {
	e.mu.Lock()
	e.dead = true
	e.kills++
	e.mu.Unlock()
	e.signal()
}

// Revive brings a killed engine back with an empty cache, as a restarted
// vLLM would come up.
func (e *Engine) Revive() {
	e.mu.Lock()
	e.dead = false
	e.mu.Unlock()
	e.signal()
}

func (e *Engine) signal() {
	select {
	case e.wake <- struct{}{}:
	default:
	}
}

// Run drives the step loop until ctx is done, pacing steps to the wall clock
// by the speed-up. It returns ctx's error; requests still in flight are left
// unfinished.
func (e *Engine) Run(ctx context.Context) error {
	var timer *time.Timer
	for {
		if e.intake() {
			e.clock.rest()
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-e.wake:
			}
			continue
		}
		d := e.schedule()
		if len(e.plan) == 0 {
			// Work exists but none fits, which only an abort or a death
			// can change: wait for one.
			e.clock.rest()
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-e.wake:
			}
			continue
		}
		if wait := e.clock.pace(d); wait > 0 {
			if timer == nil {
				timer = time.NewTimer(wait)
			} else {
				timer.Reset(wait)
			}
			select {
			case <-ctx.Done():
				timer.Stop()
				return ctx.Err()
			case <-timer.C:
			}
		}
		e.apply(e.clock.advance(d))
	}
}

// Step runs one step by hand on an unpaced engine: it takes new requests
// and aborts, schedules, advances the clock by the step's duration, and
// delivers tokens. It returns the step's duration and whether anything was
// scheduled.
func (e *Engine) Step() (time.Duration, bool) {
	if e.intake() {
		return 0, false
	}
	d := e.schedule()
	if len(e.plan) == 0 {
		return 0, false
	}
	e.apply(e.clock.advance(d))
	return d, true
}

// Idle reports, for a hand-stepped engine, whether nothing is queued,
// running or submitted.
func (e *Engine) Idle() bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	return len(e.inbox) == 0 && len(e.aborts) == 0 && len(e.running) == 0 && len(e.waiting) == 0
}

// intake moves new requests and aborts into the scheduler's queues and
// reports whether the engine is idle.
func (e *Engine) intake() bool {
	e.mu.Lock()
	inbox, aborts, kills := e.inbox, e.aborts, e.kills
	e.inbox, e.aborts = nil, nil
	e.mu.Unlock()
	died := kills != e.killsSeen
	e.killsSeen = kills

	now := e.clock.now()
	for _, r := range inbox {
		r.state = stateWaiting
		e.waiting = append(e.waiting, r)
	}
	for _, r := range aborts {
		e.finishOutOfBand(r, FinishAbort, nil, now)
	}
	if died {
		for _, r := range slices.Concat(e.running, e.waiting) {
			e.finishOutOfBand(r, FinishAbort, ErrEngineDead, now)
		}
		// A dead engine loses its cache and its counters; Revive starts
		// cold, as a restarted vLLM does.
		e.pool = newBlockPool(e.prof.NumGPUBlocks, e.pool.caching)
		e.m = e.newM()
		e.reg.Store(e.m.reg)
	}
	idle := len(e.running) == 0 && len(e.waiting) == 0
	if idle || len(inbox)+len(aborts) > 0 || died {
		e.m.setQueues(len(e.running), len(e.waiting), e.pool.usage())
	}
	return idle
}

// finishOutOfBand ends a request that is not finishing through a step: an
// abort or an engine death.
func (e *Engine) finishOutOfBand(r *Request, reason string, err error, now time.Duration) {
	switch r.state {
	case stateRunning:
		e.running = slices.DeleteFunc(e.running, func(x *Request) bool { return x == r })
	case stateWaiting:
		e.waiting = slices.DeleteFunc(e.waiting, func(x *Request) bool { return x == r })
	default:
		return // finished already, or never reached the queues
	}
	e.pool.release(r.blocks)
	r.blocks = nil
	e.finish(r, reason, err, now)
}

// schedule runs vLLM V1's scheduling pass and returns the step's duration;
// the step's work is left in e.plan.
func (e *Engine) schedule() time.Duration {
	p := &e.prof
	budget := p.MaxNumBatchedTokens
	e.plan = e.plan[:0]
	preempted := false

	// Running requests first, in arrival order.
	for i := 0; i < len(e.running) && budget > 0; i++ {
		r := e.running[i]
		numNew := min(len(r.tokens)-r.numComputed, budget, p.MaxModelLen-1-r.numComputed)
		if numNew <= 0 {
			continue
		}
		selfPreempted := false
		for !e.allocate(r, numNew, nil) {
			// No block: preempt the newest running request by recompute.
			victim := e.running[len(e.running)-1]
			e.running = e.running[:len(e.running)-1]
			e.preempt(victim)
			preempted = true
			if victim == r {
				selfPreempted = true
				break
			}
		}
		if selfPreempted {
			break
		}
		e.plan = append(e.plan, scheduled{r, numNew})
		budget -= numNew
	}

	// Then waiting requests, unless this step had to preempt: admissions
	// never take blocks from running requests.
	for !preempted && budget > 0 && len(e.waiting) > 0 && len(e.running) < p.MaxNumSeqs {
		r := e.waiting[0]
		var hit []int32
		if r.numComputed == 0 {
			// A full prompt hit still recomputes its last token.
			full := (len(r.tokens) - 1) / p.BlockSize
			hit = e.pool.lookup(r.blockHashes(p.BlockSize, full))
		}
		computed := len(hit) * p.BlockSize
		numNew := len(r.tokens) - computed
		if numNew > budget {
			if p.Embedding {
				break // pooling models do not chunk their prefill
			}
			numNew = budget
		}
		if !e.allocate(r, numNew, hit) {
			break
		}
		e.waiting = e.waiting[1:]
		r.state = stateRunning
		r.numComputed = computed
		r.scheduledAt = e.clock.now()
		if r.firstScheduledAt < 0 {
			r.firstScheduledAt = r.scheduledAt
		}
		e.stats.PrefixQueryTokens += uint64(len(r.tokens))
		e.stats.PrefixHitTokens += uint64(computed)
		if e.pool.caching {
			e.m.prefixQueried(len(r.tokens), computed)
		}
		e.running = append(e.running, r)
		e.plan = append(e.plan, scheduled{r, numNew})
		budget -= numNew
	}

	seqs, ctxTokens, prefill, batch := 0, 0, 0, 0
	for _, s := range e.plan {
		seqs++
		batch += s.numNew
		ctxTokens += s.r.numComputed + s.numNew
		if s.numNew > 1 || s.r.numComputed < len(s.r.tokens)-1 || len(s.r.tokens) == len(s.r.prompt) {
			prefill += s.numNew
		}
	}
	if batch > 0 {
		e.m.iteration(batch)
	}
	return p.StepTime(seqs, ctxTokens, prefill)
}

// allocate gives r the blocks it needs to hold numNew more tokens, after
// taking the prefix-cache hits in hit (for a request not yet running). It
// changes nothing and returns false when the free blocks do not suffice.
func (e *Engine) allocate(r *Request, numNew int, hit []int32) bool {
	bs := e.prof.BlockSize
	computed := r.numComputed
	held := len(r.blocks)
	if hit != nil {
		computed, held = len(hit)*bs, len(hit)
	}
	need := (computed+numNew+bs-1)/bs - held
	if need+e.pool.evictableAmong(hit) > e.pool.numFree() {
		return false
	}
	if hit != nil {
		e.pool.touch(hit)
		r.blocks = append(r.blocks[:0], hit...)
	}
	if need > 0 {
		r.blocks = e.pool.take(need, r.blocks)
	}
	// Full blocks of known tokens become findable by later requests.
	if e.pool.caching {
		full := (computed + numNew) / bs
		hashes := r.blockHashes(bs, full)
		for i := r.cachedBlocks; i < full; i++ {
			e.pool.cacheBlock(r.blocks[i], hashes[i])
		}
		r.cachedBlocks = max(r.cachedBlocks, full)
	}
	return true
}

func (e *Engine) preempt(r *Request) {
	e.pool.release(r.blocks)
	r.blocks = r.blocks[:0]
	r.numComputed = 0
	r.cachedBlocks = 0
	r.preemptions++
	r.state = stateWaiting
	e.stats.Preemptions++
	e.m.preempted()
	e.waiting = slices.Insert(e.waiting, 0, r)
}

// apply commits the planned step at simulated time now: tokens are
// computed, a request that has caught up samples its next token, and
// finished requests free their blocks.
func (e *Engine) apply(now time.Duration) {
	e.stats.Steps++
	generated := 0
	for _, s := range e.plan {
		r := s.r
		r.numComputed += s.numNew
		if r.numComputed < len(r.tokens) {
			continue // a prefill chunk: nothing sampled yet
		}
		if e.prof.Embedding {
			r.finishing = FinishStop
			continue
		}
		tok := outputWords[r.rng.IntN(len(outputWords))]
		r.tokens = append(r.tokens, tok)
		generated++
		first := r.emit(tok, now)
		if first {
			e.stats.PromptTokens += uint64(len(r.prompt))
			e.m.firstToken(now-r.arrival, len(r.prompt))
		} else {
			e.m.interToken(now - r.lastTokenAt)
		}
		r.lastTokenAt = now
		if r.generated() >= r.target {
			r.finishing = FinishStop
			if r.target == r.maxTokens {
				r.finishing = FinishLength
			}
		}
	}
	e.stats.GenerationTokens += uint64(generated)
	e.m.generated(generated)

	if slices.ContainsFunc(e.plan, func(s scheduled) bool { return s.r.finishing != "" }) {
		kept := e.running[:0]
		for _, r := range e.running {
			if r.finishing == "" {
				kept = append(kept, r)
				continue
			}
			e.pool.release(r.blocks)
			r.blocks = nil
			e.finish(r, r.finishing, nil, now)
		}
		clear(e.running[len(kept):])
		e.running = kept
	}
	e.m.setQueues(len(e.running), len(e.waiting), e.pool.usage())
}

func (e *Engine) finish(r *Request, reason string, err error, now time.Duration) {
	r.state = stateFinished
	e.stats.Finished++
	e.mu.Lock()
	e.load--
	e.mu.Unlock()
	e.m.finished(r, reason, now)
	r.done(reason, err)
}

// simClock is the engine's simulated clock. Paced, it runs speedup times
// faster than the wall clock; unpaced (speedup 0), it moves only by step
// durations.
//
// While the engine is busy, each step's wall-clock deadline follows from the
// previous one, so a timer that fires late is made up by sleeping less on
// later steps instead of being counted as simulated time; the clock reads
// the end of the last step. Once the engine rests, simulated time flows with
// the wall clock again.
type simClock struct {
	mu      sync.Mutex
	speedup float64
	busy    bool
	simAt   time.Duration
	wallAt  time.Time     // wall time of simAt: the last step's deadline when busy
	stalled time.Duration // simulated time stretched for lateness (Engine.Stalled)
}

// maxLag is how far behind its wall-clock deadline a paced engine may fall
// before its simulated time stretches to match: small slips are caught up
// by sleeping less on later steps, large ones mean the host cannot keep
// this speed-up, and simulated time must not pretend otherwise.
const maxLag = 20 * time.Millisecond

func (c *simClock) init(speedup float64) {
	c.speedup = speedup
	c.wallAt = time.Now()
}

func (c *simClock) now() time.Duration {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.nowLocked(time.Now())
}

func (c *simClock) nowLocked(wall time.Time) time.Duration {
	if c.speedup == 0 || c.busy {
		return c.simAt
	}
	if el := wall.Sub(c.wallAt); el > 0 {
		return c.simAt + time.Duration(float64(el)*c.speedup)
	}
	return c.simAt
}

// rest marks the engine idle: simulated time flows with the wall clock.
func (c *simClock) rest() {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.speedup == 0 || !c.busy {
		return
	}
	c.busy = false
	if wall := time.Now(); wall.After(c.wallAt) {
		c.wallAt = wall // the wait for work starts now, not at the last deadline
	}
}

// pace starts a step of simulated length d and returns how long to sleep
// before its end.
func (c *simClock) pace(d time.Duration) time.Duration {
	if c.speedup == 0 {
		return 0
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	wall := time.Now()
	if !c.busy {
		c.simAt = c.nowLocked(wall)
		c.wallAt = wall
		c.busy = true
	}
	wait := c.wallAt.Add(time.Duration(float64(d) / c.speedup)).Sub(wall)
	if wait < 100*time.Microsecond {
		return 0 // too short for a timer; the debt is paid on a later step
	}
	return wait
}

// advance ends a step of simulated length d and returns the simulated time
// at its end.
func (c *simClock) advance(d time.Duration) time.Duration {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.simAt += d
	if c.speedup == 0 {
		return c.simAt
	}
	deadline := c.wallAt.Add(time.Duration(float64(d) / c.speedup))
	if late := time.Since(deadline); late > maxLag {
		c.simAt += time.Duration(float64(late) * c.speedup)
		c.stalled += time.Duration(float64(late) * c.speedup)
		c.wallAt = time.Now()
	} else {
		c.wallAt = deadline
	}
	return c.simAt
}
