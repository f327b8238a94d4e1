package vllmsim

import (
	"errors"
	"slices"
	"testing"
	"time"
)

// tinyProfile is a deployment small enough to reason about by hand: blocks
// of 4 tokens, 8 usable blocks (32 tokens of KV).
func tinyProfile() Profile {
	p, _ := LookupProfile("h100-llama-3.1-8b")
	p.BlockSize = 4
	p.NumGPUBlocks = 9
	p.MaxNumSeqs = 8
	p.MaxNumBatchedTokens = 64
	p.MaxModelLen = 32
	p.PrefixCaching = false
	return p
}

// prompt returns n tokens; requests with different ids share no tokens
// beyond the first shared ones.
func prompt(id, n, shared int) []int {
	toks := make([]int, n)
	for i := range toks {
		if i < shared {
			toks[i] = pieceBase + i
		} else {
			toks[i] = pieceBase + 1000*(id+1) + i
		}
	}
	return toks
}

type reqSpec struct {
	at        int // submitted before this step (0-based)
	prompt    int
	shared    int // leading tokens shared with every other request
	maxTokens int
}

type planned struct{ req, numNew int }

func TestStep(t *testing.T) {
	tests := []struct {
		name    string
		tweak   func(*Profile)
		reqs    []reqSpec
		steps   int       // steps run; the last one is checked
		plan    []planned // the checked step's schedule, by request index
		run     int       // running after it
		wait    int       // waiting after it
		preempt uint64    // preemptions so far
	}{
		{
			name:  "prompt within the budget prefills in one step",
			reqs:  []reqSpec{{prompt: 10, maxTokens: 4}},
			steps: 1, plan: []planned{{0, 10}}, run: 1,
		},
		{
			name:  "long prompt is chunked to the token budget",
			tweak: func(p *Profile) { p.MaxNumBatchedTokens = 8 },
			reqs:  []reqSpec{{prompt: 20, maxTokens: 4}},
			steps: 2, plan: []planned{{0, 8}}, run: 1,
		},
		{
			name:  "last chunk of a chunked prefill",
			tweak: func(p *Profile) { p.MaxNumBatchedTokens = 8 },
			reqs:  []reqSpec{{prompt: 20, maxTokens: 4}},
			steps: 3, plan: []planned{{0, 4}}, run: 1,
		},
		{
			name:  "decodes go first and a prefill gets what is left",
			tweak: func(p *Profile) { p.MaxNumBatchedTokens = 6; p.NumGPUBlocks = 20; p.MaxModelLen = 40 },
			reqs:  []reqSpec{{prompt: 3, maxTokens: 8}, {prompt: 3, maxTokens: 8}, {at: 1, prompt: 12, maxTokens: 4}},
			steps: 2, plan: []planned{{0, 1}, {1, 1}, {2, 4}}, run: 3,
		},
		{
			name:  "max_num_seqs caps admissions",
			tweak: func(p *Profile) { p.MaxNumSeqs = 2 },
			reqs:  []reqSpec{{prompt: 5, maxTokens: 2}, {prompt: 5, maxTokens: 2}, {prompt: 5, maxTokens: 2}},
			steps: 1, plan: []planned{{0, 5}, {1, 5}}, run: 2, wait: 1,
		},
		{
			name:  "a waiting request that does not fit waits; admission never preempts",
			reqs:  []reqSpec{{prompt: 20, maxTokens: 8}, {prompt: 20, maxTokens: 8}},
			steps: 1, plan: []planned{{0, 20}}, run: 1, wait: 1,
		},
		{
			name:  "full prefills of two requests take every block",
			reqs:  []reqSpec{{prompt: 14, maxTokens: 16}, {prompt: 14, maxTokens: 16}},
			steps: 1, plan: []planned{{0, 14}, {1, 14}}, run: 2,
		},
		{
			// Both hold 4 blocks (16 tokens); at 17 tokens the older one
			// needs a fifth and none is free: the newest is preempted by
			// recompute and goes back to the front of the waiting queue.
			name:  "out of blocks, the newest running request is preempted",
			reqs:  []reqSpec{{prompt: 14, maxTokens: 16}, {prompt: 14, maxTokens: 16}},
			steps: 4, plan: []planned{{0, 1}}, run: 1, wait: 1, preempt: 1,
		},
		{
			// After the preemption the victim needs 5 blocks and 3 are
			// free: it waits rather than take blocks from the survivor.
			name:  "the preempted request waits while it does not fit",
			reqs:  []reqSpec{{prompt: 14, maxTokens: 16}, {prompt: 14, maxTokens: 16}},
			steps: 5, plan: []planned{{0, 1}}, run: 1, wait: 1, preempt: 1,
		},
		{
			name:  "prefix cache hit skips the cached full blocks",
			tweak: func(p *Profile) { p.PrefixCaching = true; p.NumGPUBlocks = 20; p.MaxModelLen = 40 },
			reqs:  []reqSpec{{prompt: 20, shared: 16, maxTokens: 4}, {at: 1, prompt: 20, shared: 16, maxTokens: 4}},
			steps: 2, plan: []planned{{0, 1}, {1, 4}}, run: 2,
		},
		{
			name:  "a full prompt hit still computes the last token",
			tweak: func(p *Profile) { p.PrefixCaching = true; p.NumGPUBlocks = 20; p.MaxModelLen = 40 },
			reqs:  []reqSpec{{prompt: 16, shared: 16, maxTokens: 4}, {at: 1, prompt: 16, shared: 16, maxTokens: 4}},
			steps: 2, plan: []planned{{0, 1}, {1, 4}}, run: 2,
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			p := tinyProfile()
			if tc.tweak != nil {
				tc.tweak(&p)
			}
			e, err := NewEngine(Options{Profile: p})
			if err != nil {
				t.Fatal(err)
			}
			reqs := make([]*Request, len(tc.reqs))
			for step := range tc.steps {
				for i, s := range tc.reqs {
					if s.at != step {
						continue
					}
					reqs[i], err = e.Submit(SubmitParams{Prompt: prompt(i, s.prompt, s.shared), MaxTokens: s.maxTokens, IgnoreEOS: true})
					if err != nil {
						t.Fatal(err)
					}
				}
				if _, ok := e.Step(); !ok {
					t.Fatalf("step %d scheduled nothing", step)
				}
			}
			var got []planned
			for _, s := range e.plan {
				got = append(got, planned{slices.Index(reqs, s.r), s.numNew})
			}
			if !slices.Equal(got, tc.plan) {
				t.Errorf("plan = %v, want %v", got, tc.plan)
			}
			if len(e.running) != tc.run || len(e.waiting) != tc.wait {
				t.Errorf("running %d, waiting %d; want %d, %d", len(e.running), len(e.waiting), tc.run, tc.wait)
			}
			if e.stats.Preemptions != tc.preempt {
				t.Errorf("preemptions = %d, want %d", e.stats.Preemptions, tc.preempt)
			}
			checkBlocks(t, e)
		})
	}
}

// checkBlocks holds the pool's books: every usable block is either free or
// referenced by exactly the requests that hold it.
func checkBlocks(t *testing.T, e *Engine) {
	t.Helper()
	refs := make(map[int32]int32)
	for _, r := range slices.Concat(e.running, e.waiting) {
		for _, b := range r.blocks {
			refs[b]++
		}
		if r.state == stateWaiting && r.numComputed == 0 && len(r.blocks) != 0 {
			t.Errorf("waiting request holds %d blocks", len(r.blocks))
		}
	}
	free := 0
	for id := int32(1); id < int32(len(e.pool.blocks)); id++ {
		b := e.pool.blocks[id]
		if b.ref != refs[id] {
			t.Errorf("block %d: ref %d, held by %d requests", id, b.ref, refs[id])
		}
		if b.inFree != (b.ref == 0) {
			t.Errorf("block %d: ref %d but inFree=%v", id, b.ref, b.inFree)
		}
		if b.inFree {
			free++
		}
	}
	if free != e.pool.numFree() {
		t.Errorf("free count %d, queue holds %d", e.pool.numFree(), free)
	}
}

// drain steps a hand-driven engine until it is idle.
func drain(t *testing.T, e *Engine) {
	t.Helper()
	for i := 0; !e.Idle(); i++ {
		if i > 1_000_000 {
			t.Fatal("engine never went idle")
		}
		if _, ok := e.Step(); !ok && !e.Idle() {
			t.Fatal("engine stalled")
		}
	}
}

func TestPreemptedRequestRecomputesAndFinishes(t *testing.T) {
	e, err := NewEngine(Options{Profile: tinyProfile()})
	if err != nil {
		t.Fatal(err)
	}
	a, _ := e.Submit(SubmitParams{Prompt: prompt(0, 14, 0), MaxTokens: 16, IgnoreEOS: true})
	b, _ := e.Submit(SubmitParams{Prompt: prompt(1, 14, 0), MaxTokens: 16, IgnoreEOS: true})
	drain(t, e)
	for _, r := range []*Request{a, b} {
		out, fin, reason, err := r.Read(0)
		if !fin || err != nil || reason != FinishLength || len(out) != 16 {
			t.Errorf("request ended %v/%q/%v with %d tokens, want length with 16", fin, reason, err, len(out))
		}
	}
	if a.Preemptions() != 0 || b.Preemptions() == 0 {
		t.Errorf("preemptions: older %d, newer %d; want 0 and some", a.Preemptions(), b.Preemptions())
	}
	if e.pool.numFree() != e.pool.usable() || e.pool.usage() != 0 {
		t.Errorf("after the run %d of %d blocks free, usage %v", e.pool.numFree(), e.pool.usable(), e.pool.usage())
	}
	// Preemption recomputes: more prompt work than the prompts alone.
	if got := e.Stats(); got.Finished != 2 || got.GenerationTokens != 32 {
		t.Errorf("stats %+v", got)
	}
}

func TestOutputLength(t *testing.T) {
	p := tinyProfile()
	p.MaxModelLen, p.NumGPUBlocks, p.OutputMedian = 400, 200, 40
	e, err := NewEngine(Options{Profile: p, Seed: 7})
	if err != nil {
		t.Fatal(err)
	}
	var reqs []*Request
	for i := range 20 {
		r, err := e.Submit(SubmitParams{Prompt: prompt(i, 8, 0), MaxTokens: 300})
		if err != nil {
			t.Fatal(err)
		}
		reqs = append(reqs, r)
	}
	exact, _ := e.Submit(SubmitParams{Prompt: prompt(99, 8, 0), MaxTokens: 300, IgnoreEOS: true})
	capped, _ := e.Submit(SubmitParams{Prompt: prompt(98, 8, 0), MaxTokens: 3})
	drain(t, e)
	lengths := map[int]bool{}
	for _, r := range reqs {
		out, _, reason, _ := r.Read(0)
		lengths[len(out)] = true
		if len(out) < 1 || len(out) > 300 {
			t.Errorf("output length %d outside [1, 300]", len(out))
		}
		if len(out) < 300 && reason != FinishStop {
			t.Errorf("reason %q for %d tokens under max_tokens 300, want stop", reason, len(out))
		}
	}
	if len(lengths) < 5 {
		t.Errorf("output lengths barely vary: %v", lengths)
	}
	if out, _, reason, _ := exact.Read(0); len(out) != 300 || reason != FinishLength {
		t.Errorf("ignore_eos gave %d tokens (%s), want exactly 300 (length)", len(out), reason)
	}
	if out, _, _, _ := capped.Read(0); len(out) > 3 {
		t.Errorf("max_tokens 3 gave %d tokens", len(out))
	}

	// The same prompt and seed give the same answer.
	e2, _ := NewEngine(Options{Profile: p, Seed: 7})
	again, _ := e2.Submit(SubmitParams{Prompt: prompt(0, 8, 0), MaxTokens: 300})
	drain(t, e2)
	first, _, _, _ := reqs[0].Read(0)
	second, _, _, _ := again.Read(0)
	if !slices.Equal(first, second) {
		t.Errorf("same prompt, same seed, different output: %d vs %d tokens", len(first), len(second))
	}
}

func TestAbortFreesBlocks(t *testing.T) {
	e, _ := NewEngine(Options{Profile: tinyProfile()})
	r, _ := e.Submit(SubmitParams{Prompt: prompt(0, 10, 0), MaxTokens: 20, IgnoreEOS: true})
	e.Step()
	if e.pool.numFree() == e.pool.usable() {
		t.Fatal("running request holds no blocks")
	}
	e.Abort(r)
	e.Step()
	if _, fin, reason, _ := r.Read(0); !fin || reason != FinishAbort {
		t.Errorf("aborted request: finished %v, reason %q", fin, reason)
	}
	if e.pool.numFree() != e.pool.usable() || !e.Idle() || e.Load() != 0 {
		t.Errorf("after abort: %d/%d blocks free, idle %v, load %d", e.pool.numFree(), e.pool.usable(), e.Idle(), e.Load())
	}
	e.Abort(r) // aborting twice is harmless
	e.Step()
	checkBlocks(t, e)
}

func TestKillFailsRequests(t *testing.T) {
	e, _ := NewEngine(Options{Profile: tinyProfile()})
	r, _ := e.Submit(SubmitParams{Prompt: prompt(0, 10, 0), MaxTokens: 20, IgnoreEOS: true})
	e.Step()
	e.Kill()
	e.Step()
	if _, fin, _, err := r.Read(0); !fin || !errors.Is(err, ErrEngineDead) {
		t.Errorf("request on a dead engine: finished %v, err %v", fin, err)
	}
	if _, err := e.Submit(SubmitParams{Prompt: prompt(1, 4, 0), MaxTokens: 2}); !errors.Is(err, ErrEngineDead) {
		t.Errorf("submit to a dead engine: %v", err)
	}
	e.Revive()
	r2, err := e.Submit(SubmitParams{Prompt: prompt(1, 4, 0), MaxTokens: 2, IgnoreEOS: true})
	if err != nil {
		t.Fatal(err)
	}
	drain(t, e)
	if out, _, _, err := r2.Read(0); err != nil || len(out) != 2 {
		t.Errorf("after revive: %d tokens, %v", len(out), err)
	}
}

func TestSubmitRejectsOversize(t *testing.T) {
	e, _ := NewEngine(Options{Profile: tinyProfile()})
	for _, sp := range []SubmitParams{
		{Prompt: prompt(0, 30, 0), MaxTokens: 3},
		{Prompt: prompt(0, 4, 0), MaxTokens: 0},
	} {
		if _, err := e.Submit(sp); !errors.Is(err, ErrTooLong) {
			t.Errorf("Submit(%d prompt, %d max) = %v, want ErrTooLong", len(sp.Prompt), sp.MaxTokens, err)
		}
	}
	p := tinyProfile()
	p.MaxModelLen = 100 // more than 8 blocks of 4 tokens
	if _, err := NewEngine(Options{Profile: p}); err == nil {
		t.Error("engine accepted max_model_len above its KV capacity")
	}
}

func TestStepTime(t *testing.T) {
	p, _ := LookupProfile("h100-llama-3.1-8b")
	// Single stream: the blog's fit, 6.44 ms + 4.37e-5 ms per context token.
	for _, ctx := range []int{1000, 100000} {
		got := p.StepTime(1, ctx, 0)
		want := time.Duration((6.44 + 4.37e-5*float64(ctx)) * float64(time.Millisecond))
		if d := got - want; d < -100*time.Microsecond || d > 100*time.Microsecond {
			t.Errorf("StepTime(1, %d, 0) = %v, want about %v", ctx, got, want)
		}
	}
	if p.StepTime(1, 8192, 8192)-p.StepTime(1, 8192, 0) != 8192*p.PrefillPerToken {
		t.Error("prefill tokens do not cost PrefillPerToken each")
	}
	h200, _ := LookupProfile("h200-llama-3.1-8b")
	if h200.StepTime(64, 64*4096, 0) >= p.StepTime(64, 64*4096, 0) {
		t.Error("an H200 decode step is not faster than an H100's")
	}
}

// TestPacedClock runs a paced engine and checks that simulated time runs at
// the speed-up against the wall clock, within a loose band: the machine is
// shared and noisy, so this checks the mechanism, not the host's speed.
func TestPacedClock(t *testing.T) {
	p, _ := LookupProfile("h100-llama-3.1-8b")
	sim, srv := NewTestServer(t, Config{Profile: p, Speedup: 20})
	_ = srv
	e := sim.Engine()
	start, wall := e.Now(), time.Now()
	r, err := e.Submit(SubmitParams{Prompt: prompt(0, 100, 0), MaxTokens: 200, IgnoreEOS: true})
	if err != nil {
		t.Fatal(err)
	}
	<-r.Done()
	simEl, wallEl := e.Now()-start, time.Since(wall)
	// 200 steps of ~6.4 ms: 1.3 s simulated, ~65 ms of wall time at 20x.
	times := r.TokenTimes()
	span := times[len(times)-1] - times[0]
	if span < 199*6*time.Millisecond || span > 199*8*time.Millisecond {
		t.Errorf("200 decode steps took %v simulated, want about 1.3 s", span)
	}
	if ratio := float64(simEl) / float64(wallEl); ratio < 5 || ratio > 25 {
		t.Errorf("simulated %v in %v of wall time: %.1fx, want about 20x", simEl, wallEl, ratio)
	}
}

// TestClockCountsStalls: a step that ends more than maxLag late stretches
// simulated time, and the stretch is what Stalled reports; one within
// maxLag is caught up and stalls nothing.
func TestClockCountsStalls(t *testing.T) {
	var c simClock
	c.init(4)
	c.pace(4 * time.Millisecond) // a 1 ms wall step
	c.advance(4 * time.Millisecond)
	if c.stalled != 0 {
		t.Fatalf("a step on time stalled %v", c.stalled)
	}
	c.pace(4 * time.Millisecond)
	time.Sleep(maxLag + 30*time.Millisecond) // the host ran the engine late
	before := c.simAt
	c.advance(4 * time.Millisecond)
	if c.stalled < 4*(maxLag+25*time.Millisecond) { // less the two steps' own 1 ms, with room
		t.Errorf("stalled %v after a step at least %v late at 4x", c.stalled, maxLag+30*time.Millisecond)
	}
	if got := c.simAt - before - 4*time.Millisecond; got != c.stalled {
		t.Errorf("simulated time stretched by %v, stalled says %v", got, c.stalled)
	}
}
