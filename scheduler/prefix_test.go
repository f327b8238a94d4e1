package scheduler

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvgate/kvgate/gpu"
)

// text returns n bytes of distinct text seeded by s.
func text(s string, n int) string {
	var b strings.Builder
	for i := 0; b.Len() < n; i++ {
		b.WriteString(s)
		b.WriteByte(' ')
		b.WriteString(strings.Repeat("x", i%7))
	}
	return b.String()[:n]
}

func TestHashChunksChain(t *testing.T) {
	sys := text("system prompt of tenant one", 640) // 10 chunks
	a := HashChunks(sys+text("question a", 200), PrefixChunkBytes)
	b := HashChunks(sys+text("question b", 200), PrefixChunkBytes)
	if len(a) != 13 || len(b) != 13 {
		t.Fatalf("chunks %d and %d, want 13 full chunks of 840 bytes", len(a), len(b))
	}
	for i := range 10 {
		if a[i] != b[i] {
			t.Fatalf("chunk %d of a shared prefix differs", i)
		}
	}
	for i := 10; i < 13; i++ {
		if a[i] == b[i] {
			t.Errorf("chunk %d of different questions hashes alike", i)
		}
	}
	// Chained: the same chunk text after a different prefix hashes apart.
	other := HashChunks(text("system prompt of tenant two", 640)+sys[576:640], PrefixChunkBytes)
	if other[10] == a[9] {
		t.Error("a chunk's hash ignores what came before it")
	}
	// A partial chunk is not hashed; a prompt under one chunk has none.
	if got := HashChunks(sys[:100], PrefixChunkBytes); len(got) != 1 {
		t.Errorf("100 bytes gave %d chunks, want 1", len(got))
	}
	if NewPrefix("", "short", 2) != nil {
		t.Error("a prompt under one chunk got a prefix")
	}
	p := NewPrefix("", sys, 160)
	if p.ChunkTokens != 16 || p.tokens(10) != 160 {
		t.Errorf("chunk tokens %v, 10 chunks %d tokens; want 16 and 160", p.ChunkTokens, p.tokens(10))
	}
}

func TestPrefixIndexEviction(t *testing.T) {
	x := newPrefixIndex()
	const capacity = 1000
	a := HashChunks(text("a", 64*10), 64)
	x.sent(a, 160, capacity, nil)
	if got := x.match(a); got != 10 {
		t.Fatalf("match %d after sending, want 10", got)
	}
	// Output and other prompts turn the cache over: 800 more tokens keep
	// a (800 ≤ 1000 since), the next 300 push it out.
	x.grew(800, capacity, nil)
	if got := x.match(a); got != 10 {
		t.Fatalf("match %d within one turnover, want 10", got)
	}
	b := HashChunks(text("b", 64*4), 64)
	x.sent(b, 300, capacity, nil)
	if got := x.match(a); got != 0 {
		t.Errorf("match %d after the cache turned over, want 0", got)
	}
	if got := x.match(b); got != 4 {
		t.Errorf("match %d for the recent prompt, want 4", got)
	}

	// Resending refreshes: a chunk sent again is recent again.
	x = newPrefixIndex()
	x.sent(a, 160, capacity, nil)
	x.grew(900, capacity, nil)
	x.sent(a[:5], 0, capacity, nil) // its first half, found cached
	x.grew(500, capacity, nil)
	if got := x.match(a); got != 5 {
		t.Errorf("match %d: the refreshed first half should stay and the rest go; want 5", got)
	}

	// A chunk pinned by a request in flight is never forgotten.
	x = newPrefixIndex()
	x.sent(a, 160, capacity, nil)
	pinned := func(h uint64) bool { return h == a[0] }
	x.grew(5000, capacity, pinned)
	if got := x.match(a); got != 1 {
		t.Errorf("match %d with a[0] pinned, want 1", got)
	}
}

func TestPrefixIndexCorrection(t *testing.T) {
	x := newPrefixIndex()
	x.observe(0, 0) // the baseline
	x.predicted(correctEvery, 2*correctEvery)
	// The backend found half of what kvgate predicted: its cache turns
	// over faster than kvgate's own traffic says.
	x.observe(correctEvery/2, 2*correctEvery)
	if x.scale != 0.5 {
		t.Fatalf("scale %v after half the predicted hits, want 0.5", x.scale)
	}
	// A short window changes nothing.
	x.predicted(100, 100)
	x.observe(correctEvery/2, 2*correctEvery+100)
	if x.scale != 0.5 {
		t.Errorf("scale %v after a window too short to judge", x.scale)
	}
	// As many hits as predicted or more: the bound grows back, up to 1.
	for range 5 {
		x.predicted(correctEvery, correctEvery)
		x.observe(x.baseHits+2*correctEvery, x.baseQuery+correctEvery)
	}
	if x.scale != 1 {
		t.Errorf("scale %v after hits matched, want back at 1", x.scale)
	}
	// It never falls under the floor.
	for range 20 {
		x.predicted(correctEvery, correctEvery)
		x.observe(x.baseHits, x.baseQuery+correctEvery)
	}
	if x.scale != minIndexScale {
		t.Errorf("scale %v after no hits at all, want the floor %v", x.scale, minIndexScale)
	}
	// Counters going back: the backend restarted with an empty cache.
	a := HashChunks(text("a", 640), 64)
	x.sent(a, 160, 10_000, nil)
	x.observe(0, 0)
	if x.match(a) != 0 {
		t.Error("the index kept chunks across a backend restart")
	}
}

// TestPrefixIndexRebuild: an index is soft state. A replica that starts
// empty (or a restarted one) predicts nothing, routes by load, and after
// routing a prompt once predicts it as a replica that had always run.
func TestPrefixIndexRebuild(t *testing.T) {
	snaps := []*gpu.Snapshot{backendSnap("a", 100_000), backendSnap("b", 100_000)}
	sys := text("the long system prompt of one tenant", 6000)
	ticket := func(q string) *Ticket {
		prompt := sys + text(q, 800)
		return &Ticket{Model: model, PromptTokens: len(prompt) / 4, MaxTokens: 100, Prefix: NewPrefix("", prompt, len(prompt)/4)}
	}
	old := newTestScheduler(t, Policy{}, snaps...)
	g, err := old.Acquire(context.Background(), ticket("q0"))
	if err != nil {
		t.Fatal(err)
	}
	g.Release()

	fresh := newTestScheduler(t, Policy{}, snaps...)
	tk := ticket("q1")
	if h := fresh.expectedHit(snaps[0], tk, 0) + fresh.expectedHit(snaps[1], tk, 0); h != 0 {
		t.Fatalf("an empty replica predicts hits %v", h)
	}
	g2, err := fresh.Acquire(context.Background(), ticket("q2"))
	if err != nil {
		t.Fatal(err)
	}
	g2.Release()
	want := 6000.0 / float64(len(sys)+800)
	for _, c := range []struct {
		s       *Scheduler
		backend string
	}{{old, g.Backend}, {fresh, g2.Backend}} {
		sn := snaps[0]
		if c.backend == "b" {
			sn = snaps[1]
		}
		if hit := c.s.expectedHit(sn, tk, 0); hit < want-0.02 || hit > want+0.02 {
			t.Errorf("hit %.3f on the backend the prompt went to, want about %.3f (the system prompt)", hit, want)
		}
	}
}

// TestSharedBlocksReservedOnce: 100 requests with one 6,000-token system
// prompt reserve it once, not 100 times, and release it with the last.
func TestSharedBlocksReservedOnce(t *testing.T) {
	s := newTestScheduler(t, Policy{KVTarget: 1}, backendSnap("a", 200_000))
	sys := text("system", 24_000) // 6,000 tokens at 4 bytes each
	var grants []*Grant
	for i := range 100 {
		prompt := sys + text(string(rune('a'+i%26))+strings.Repeat("q", i), 400)
		tk := &Ticket{Model: model, PromptTokens: len(prompt) / 4, MaxTokens: 100, Prefix: NewPrefix("", prompt, len(prompt)/4)}
		g, err := s.Acquire(context.Background(), tk)
		if err != nil {
			t.Fatalf("request %d: %v (reserved %+v)", i, err, s.Loads())
		}
		// The first has prefilled the system prompt (a stream's first
		// token): the backend has it cached for the others.
		g.Progress(1)
		grants = append(grants, g)
	}
	// 6,000 shared + 100 × (100 question + 100 out), give or take the
	// chunk at the prompts' junction.
	r := s.Loads()[0].Reserved
	if r > 6_000+100*(100+100+16) || r < 6_000+100*(100+100-16) {
		t.Errorf("100 requests reserve %d tokens, want about 26,000 (600,000 counted apart)", r)
	}
	for _, g := range grants[:99] {
		g.Release()
	}
	if r := s.Loads()[0].Reserved; r < 6_000 || r > 6_000+216 {
		t.Errorf("one request left reserves %d, want its whole prompt and output (~6,200)", r)
	}
	grants[99].Release()
	if r := s.Loads()[0].Reserved; r != 0 {
		t.Errorf("nothing in flight reserves %d", r)
	}
	if l := s.ledgers["a"]; len(l.pins) != 0 || l.shared != 0 {
		t.Errorf("pins left: %d chunks, %d tokens", len(l.pins), l.shared)
	}
}

// TestNoSharingWithoutPrefixCaching: on a backend whose vLLM caches no
// prefixes (enable_prefix_caching False), prompts that share a system
// prompt share no KV: each is reserved whole.
func TestNoSharingWithoutPrefixCaching(t *testing.T) {
	sn := backendSnap("a", 2_000_000)
	sn.Metrics.NoPrefixCaching = true
	s := newTestScheduler(t, Policy{KVTarget: 1}, sn)
	sys := text("system", 24_000) // 6,000 tokens at 4 bytes each
	var grants []*Grant
	want := 0
	for i := range 10 {
		prompt := sys + text(string(rune('a'+i)), 400)
		tk := &Ticket{Model: model, PromptTokens: len(prompt) / 4, MaxTokens: 100, Prefix: NewPrefix("", prompt, len(prompt)/4)}
		g, err := s.Acquire(context.Background(), tk)
		if err != nil {
			t.Fatalf("request %d: %v", i, err)
		}
		g.Progress(1)
		grants = append(grants, g)
		want += tk.PromptTokens + tk.MaxTokens
	}
	if r := s.Loads()[0].Reserved; r != want {
		t.Errorf("10 requests sharing a system prompt reserve %d tokens on a backend without prefix caching, want %d, each whole", r, want)
	}
	if l := s.ledgers["a"]; len(l.pins) != 0 || l.shared != 0 {
		t.Errorf("pins on a backend without prefix caching: %d chunks, %d tokens", len(l.pins), l.shared)
	}
	for _, g := range grants {
		g.Release()
	}
}

// TestRoutingPrefixAndLoad: a tenant's prompts stick to the backend that
// has its prefix while it can admit them, then spill to the next best;
// never by prefix alone.
func TestRoutingPrefixAndLoad(t *testing.T) {
	clock := newTestClock()
	s, err := New(&staticSource{snaps: []*gpu.Snapshot{backendSnap("a", 40_000), backendSnap("b", 40_000)}}, Options{Policy: Policy{KVTarget: 1}, Now: clock.now})
	if err != nil {
		t.Fatal(err)
	}
	sysA := text("tenant a's system prompt", 24_000)
	// 7,000-token prompts, 6,000 of them the tenant's system prompt; short
	// outputs, so that the projection cannot count on them ending early.
	tk := func(sys, q string) *Ticket {
		prompt := sys + text(q, 4_000)
		return &Ticket{Model: model, PromptTokens: len(prompt) / 4, MaxTokens: 10, Prefix: NewPrefix("", prompt, len(prompt)/4)}
	}
	acquire := func(tk *Ticket) *Grant {
		t.Helper()
		g, err := s.Acquire(context.Background(), tk)
		if err != nil {
			t.Fatal(err)
		}
		return g
	}
	first := acquire(tk(sysA, "q0"))
	first.Progress(1) // prefilled: its prefix is cached there
	// The other backend is empty, but the prefix is worth more than its
	// headroom: sticky.
	for i := range 5 {
		if g := acquire(tk(sysA, "q"+strings.Repeat("x", i+1))); g.Backend != first.Backend {
			t.Errorf("request %d went to %s, away from the prefix on %s with room to spare", i+1, g.Backend, first.Backend)
		}
	}
	// ~12,000 reserved there: the system prompt once, 6 × 1,000 own.
	// A large prompt with no prefix goes where the headroom is; another
	// then fits only beside the tenant.
	big := acquire(&Ticket{Model: model, PromptTokens: 20_000, MaxTokens: 10})
	if big.Backend == first.Backend {
		t.Fatalf("a prompt with no prefix went to the loaded backend")
	}
	filler := acquire(&Ticket{Model: model, PromptTokens: 27_000, MaxTokens: 10})
	if filler.Backend != first.Backend {
		t.Fatalf("filler went to %s", filler.Backend)
	}
	// ~39,000 of 40,000 held: the tenant's next request (1,000 new
	// tokens) no longer fits beside its prefix. It waits there for a
	// moment (room comes back as soon as a request there ends), then,
	// once it has waited half the starvation guard, spills, whole, to the
	// other backend, which keeps room to spare after it (27,000 of 40,000).
	ch := acquireAsync(context.Background(), s, tk(sysA, "spill"))
	waitQueued(t, s, 1)
	clock.advance(s.Policy().StarvationGuard / 4)
	s.Wake()
	if q := s.Queued()[Interactive]; q != 1 {
		t.Fatalf("%d queued after a quarter of the guard, want the request still waiting for its prefix", q)
	}
	clock.advance(s.Policy().StarvationGuard / 4)
	s.Wake()
	o := <-ch
	if o.err != nil {
		t.Fatal(o.err)
	}
	spill := o.g
	if spill.Backend == first.Backend {
		t.Errorf("the request stayed on a backend without headroom")
	}
	// Both now hold the prefix (the spilled request prefilled it): load
	// decides between them.
	spill.Progress(1)
	big.Release()
	filler.Release()
	next := acquire(tk(sysA, "after"))
	if next.Backend == first.Backend {
		t.Errorf("with the prefix on both, the more loaded backend won")
	}
}

// TestSpillWaitsOnSaturatedFleet: a request whose prefix is on a busy
// backend, with the other backend nearly full too, waits for its own
// backend rather than copy its prefix where it would leave under a fifth
// of the capacity.
func TestSpillWaitsOnSaturatedFleet(t *testing.T) {
	s := newTestScheduler(t, Policy{KVTarget: 1}, backendSnap("a", 40_000), backendSnap("b", 40_000))
	sys := text("tenant b's system prompt", 24_000)
	tk := func(q string) *Ticket {
		prompt := sys + text(q, 4_000)
		return &Ticket{Model: model, PromptTokens: len(prompt) / 4, MaxTokens: 10, Prefix: NewPrefix("", prompt, len(prompt)/4)}
	}
	acquireOn(t, s, tk("b0"), "a")
	acquireOn(t, s, &Ticket{Model: model, PromptTokens: 28_000, MaxTokens: 1}, "b")
	hog := acquireOn(t, s, &Ticket{Model: model, PromptTokens: 32_490, MaxTokens: 1}, "a")
	// a: ~39,500 held, no room for 1,000 more; b: 28,000, room for the
	// whole 7,000-token prompt but only 5,000 left after it.
	ch := acquireAsync(context.Background(), s, tk("b1"))
	waitQueued(t, s, 1)
	hog.Release()
	o := <-ch
	if o.err != nil {
		t.Fatal(o.err)
	}
	if o.g.Backend != "a" {
		t.Errorf("the waiting request went to %s, not back to its prefix on a", o.g.Backend)
	}
}

// TestShortPromptsSpillPastBusyBackend: short chat prompts share their
// first chunk (the chat template's head), most of each prompt in share
// but a few dozen tokens. While the backend that has it refuses for a
// moment only (vLLM's queue at its bound), the next one goes to the idle
// backend rather than wait for it; a request whose 6,000-token system
// prompt is there still waits.
func TestShortPromptsSpillPastBusyBackend(t *testing.T) {
	head := "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nsummarise the doc" // 64+ bytes
	sys := text("a tenant's system prompt", 24_000)
	for _, tc := range []struct {
		name   string
		prompt func(i int) string
		spills bool
	}{
		{"short prompts, a shared chat template head", func(i int) string { return head + fmt.Sprint(" key-", i) }, true},
		{"a 6,000-token system prompt", func(i int) string { return sys + text(fmt.Sprint("q", i), 400) }, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a, b := backendSnap("a", 40_000), backendSnap("b", 40_000)
			s := newTestScheduler(t, Policy{KVTarget: 1}, a, b)
			tk := func(i int) *Ticket {
				prompt := tc.prompt(i)
				return &Ticket{Model: model, PromptTokens: len(prompt) / 4, MaxTokens: 8, Prefix: NewPrefix("", prompt, len(prompt)/4)}
			}
			acquireOn(t, s, tk(0), "a").Progress(1)
			if hit := s.expectedHit(a, tk(1), 0); hit < spillHit {
				t.Fatalf("expected hit of the next prompt on a: %.2f, want at least spillHit", hit)
			}
			a.Metrics.Waiting = 3 // vLLM's queue on a over max_backend_waiting (2)
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			ch := acquireAsync(ctx, s, tk(1))
			if !tc.spills {
				waitQueued(t, s, 1) // waits for a, where its system prompt is
				return
			}
			select {
			case o := <-ch:
				if o.err != nil || o.g.Backend != "b" {
					t.Errorf("the next short prompt: %v, %v; want b", o.g, o.err)
				}
			case <-time.After(10 * time.Second):
				t.Errorf("the next short prompt waited for a few dozen tokens on a, with b idle")
			}
		})
	}
}

func TestRouteScore(t *testing.T) {
	tests := []struct {
		name  string
		a, b  [3]float64 // hit, headroom, held
		aWins bool
	}{
		{name: "no prefixes: most headroom", a: [3]float64{0, 0.5}, b: [3]float64{0, 0.3}, aWins: true},
		{name: "the prefix beats an idle backend", a: [3]float64{0.8, 0.1}, b: [3]float64{0, 0.95}, aWins: true},
		{name: "equal prefixes: the less loaded", a: [3]float64{0.8, 0.2}, b: [3]float64{0.8, 0.6}, aWins: false},
		{name: "a small prefix does not outweigh load", a: [3]float64{0.1, 0.05}, b: [3]float64{0, 0.9}, aWins: false},
		{name: "of two with the prefix, the one using it", a: [3]float64{0.8, 0.2, 0.8}, b: [3]float64{0.8, 0.6, 0}, aWins: true},
		{name: "in use, but far busier", a: [3]float64{0.8, 0.02, 0.1}, b: [3]float64{0.8, 0.9, 0}, aWins: false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			sa, sb := routeScore(tc.a[0], tc.a[2], tc.a[1], 0.95), routeScore(tc.b[0], tc.b[2], tc.b[1], 0.95)
			if (sa > sb) != tc.aWins {
				t.Errorf("scores %.3f vs %.3f", sa, sb)
			}
		})
	}
}

// TestDecideShared drives the pure decision with shared prompt chunks.
func TestDecideShared(t *testing.T) {
	p := Policy{}
	p.defaults()
	p.KVTarget = 1
	base := func() load {
		return load{routable: true, capacity: 100_000, maxNumSeqs: 1024, share: 1, blockSize: 1}
	}
	// 100 requests of one 6,000-token system prompt plus 200 own tokens
	// and 100 output each: 6,000 once + 100 × 300 = 36,000.
	hundred := func(l *load) {
		l.shared, l.inflight = 6_000, 100
		l.reserved = l.shared + 100*300
		l.flights = make([]flight, 100)
		for i := range l.flights {
			l.flights[i] = flight{held: 200, remaining: 100}
		}
		sortFlights(l.flights)
	}
	tests := []struct {
		name        string
		mod         func(*load)
		prompt, out int // prompt: what the request adds, its shared chunks left out
		ok          bool
		reason      string
	}{
		{name: "shared once: room for a large request", mod: hundred, prompt: 50_000, out: 10_000, ok: true},
		{name: "shared once: the budget still binds", mod: hundred, prompt: 70_000, out: 5_000, reason: reasonKV},
		{
			// Counted per request, 100 × 6,300 would be over 600k.
			name: "the projection counts the shared chunks once", prompt: 60_000, out: 3_000, ok: true,
			mod: func(l *load) { hundred(l); l.exact = true },
		},
		{
			// The measurement includes the shared chunks and the flights;
			// heldBeforeScrape says they are kvgate's, not foreign load.
			name: "measured shared chunks are not counted twice", prompt: 60_000, out: 3_000, ok: true,
			mod: func(l *load) {
				hundred(l)
				l.exact = true
				l.measuredUsed = 6_000 + 100*200
				l.heldBeforeScrape = 6_000 + 100*200
			},
		},
		{
			name: "foreign load beside the shared chunks counts", prompt: 60_000, out: 3_000, reason: reasonKV,
			mod: func(l *load) {
				hundred(l)
				l.exact = true
				l.measuredUsed = 6_000 + 100*200 + 5_000
				l.heldBeforeScrape = 6_000 + 100*200
			},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			l := base()
			if tc.mod != nil {
				tc.mod(&l)
			}
			v := decide(&l, tc.prompt, tc.out, &p)
			if v.needExact && !l.exact {
				l.exact = true
				v = decide(&l, tc.prompt, tc.out, &p)
			}
			if v.ok != tc.ok || (!tc.ok && v.reason != tc.reason) {
				t.Errorf("decide = %+v, want ok=%v reason=%q", v, tc.ok, tc.reason)
			}
		})
	}
}

// TestSpills drives the pure spill decision: a request whose prefix is on
// a backend busy for a moment waits for it; one saturated there copies its
// prefix only where room stays to spare.
func TestSpills(t *testing.T) {
	tests := []struct {
		name      string
		hasPrefix bool
		lost      float64 // hit+held given up
		tokens    float64 // the prompt's tokens it stands for
		headroom  float64 // left on the other backend after admission
		transient bool
		waited    bool // half the starvation guard
		want      bool
	}{
		{"no prefix: anywhere", false, 0.9, 5400, 0.01, true, false, true},
		{"little prefix lost: anywhere", true, 0.1, 600, 0.05, true, false, true},
		{"vLLM's queue at its bound, idle fleet: waits", true, 0.8, 4800, 0.9, true, true, false},
		{"pacing, idle fleet: waits", true, 0.8, 4800, 0.9, true, true, false},
		{"saturated for a while, room to spare elsewhere: spills", true, 0.8, 4800, 0.5, false, true, true},
		{"saturated just now, room to spare elsewhere: waits", true, 0.8, 4800, 0.5, false, false, false},
		{"saturated, little room elsewhere: waits", true, 0.8, 4800, 0.1, false, true, false},
		// A short chat prompt: the template's head is most of it.
		{"a few tokens lost, vLLM's queue at its bound: anywhere", true, 0.6, 40, 0.9, true, false, true},
		{"a few tokens lost, saturated just now: anywhere", true, 0.6, 40, 0.05, false, false, true},
		{"spillTokens lost, vLLM's queue at its bound: waits", true, 0.6, spillTokens, 0.9, true, true, false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if got := spills(tc.hasPrefix, tc.lost, tc.tokens, tc.headroom, tc.transient, tc.waited); got != tc.want {
				t.Errorf("spills = %v, want %v", got, tc.want)
			}
		})
	}
	for reason, want := range map[string]bool{reasonWaiting: true, reasonPacing: true, reasonKV: false, reasonSeqs: false, reasonShare: false, reasonHold: false} {
		if got := transientBusy(reason); got != want {
			t.Errorf("transientBusy(%q) = %v, want %v", reason, got, want)
		}
	}
}

// TestPinsFollowReestimatedPrompt: a prompt hashed under a cold token
// estimate (a third of a token per byte) and re-estimated before its
// admission counts its chunks at the new size, and a chunk pinned under
// the cold estimate and held ever since takes the new size from the next
// request that pins it; everything returns to zero.
func TestPinsFollowReestimatedPrompt(t *testing.T) {
	s := newTestScheduler(t, Policy{KVTarget: 1}, backendSnap("a", 100_000))
	sys := text("system", 24_000) // 6,000 tokens at 4 bytes each
	tk := func(q string, estimate func(int) int) *Ticket {
		prompt := sys + text(q, 400)
		return &Ticket{Model: model, PromptTokens: estimate(len(prompt)), MaxTokens: 10, Prefix: NewPrefix("", prompt, len(prompt)/3)}
	}
	coldEst := func(n int) int { return n / 3 }
	trueEst := func(n int) int { return n / 4 }
	first, err := s.Acquire(context.Background(), tk("q0", coldEst))
	if err != nil {
		t.Fatal(err)
	}
	cold := s.ledgers["a"].shared
	if cold < 8_000 {
		t.Fatalf("the cold estimate pins %d tokens, want about 8,100 (a third too many)", cold)
	}
	second, err := s.Acquire(context.Background(), tk("q1", trueEst))
	if err != nil {
		t.Fatal(err)
	}
	// The system prompt, shared, now at 16 tokens a chunk: ~6,000, plus
	// the two questions' own chunks.
	if sh := s.ledgers["a"].shared; sh > 6_000+2*100+64 || sh < 6_000 {
		t.Errorf("shared %d after a re-estimated request pinned the prompt, want about 6,200", sh)
	}
	first.Release()
	second.Release()
	if l := s.ledgers["a"]; l.reserved != 0 || l.shared != 0 || len(l.pins) != 0 {
		t.Errorf("after both: reserved %d, shared %d, %d pins", l.reserved, l.shared, len(l.pins))
	}
}

// TestPrefixSharedOnlyOnceComputed: vLLM shares a prefix's blocks only
// once they are computed, so a request sent while the one that brought
// its prefix is still prefilling allocates the prefix again and reserves
// it as its own; one sent after the first token shares it.
func TestPrefixSharedOnlyOnceComputed(t *testing.T) {
	s := newTestScheduler(t, Policy{KVTarget: 1}, backendSnap("a", 100_000))
	sys := text("system", 24_000) // 6,000 tokens
	tk := func(q string) *Ticket {
		prompt := sys + text(q, 400)
		return &Ticket{Model: model, PromptTokens: len(prompt) / 4, MaxTokens: 10, Prefix: NewPrefix("", prompt, len(prompt)/4)}
	}
	first, err := s.Acquire(context.Background(), tk("q0"))
	if err != nil {
		t.Fatal(err)
	}
	base := s.Loads()[0].Reserved // ~6,100 + 10
	second, err := s.Acquire(context.Background(), tk("q1"))
	if err != nil {
		t.Fatal(err)
	}
	if add := s.Loads()[0].Reserved - base; add < 6_000 {
		t.Errorf("a request sent during the first one's prefill reserves %d, want its whole prompt (~6,100): vLLM allocates it again", add)
	}
	first.Progress(1)
	mid := s.Loads()[0].Reserved
	third, err := s.Acquire(context.Background(), tk("q2"))
	if err != nil {
		t.Fatal(err)
	}
	if add := s.Loads()[0].Reserved - mid; add > 300 {
		t.Errorf("a request sent after the first one's first token reserves %d, want only its own ~110", add)
	}
	for _, g := range []*Grant{first, second, third} {
		g.Release()
	}
	if l := s.ledgers["a"]; l.reserved != 0 || l.shared != 0 || len(l.pins) != 0 {
		t.Errorf("after all: reserved %d, shared %d, %d pins", l.reserved, l.shared, len(l.pins))
	}
}

// TestNewPrefixPlacedByRecentWork: a prompt no backend holds (a new
// tenant) goes where the recent work is least, not to the backend that is
// idle this instant because its own tenant's request just ended: routing
// is sticky, so the new tenant's later requests follow it there.
func TestNewPrefixPlacedByRecentWork(t *testing.T) {
	s := newTestScheduler(t, Policy{KVTarget: 1}, backendSnap("a", 40_000), backendSnap("b", 40_000))
	tk := func(sys, q string) *Ticket {
		prompt := text(sys, 24_000) + text(q, 4_000)
		return &Ticket{Model: model, PromptTokens: len(prompt) / 4, MaxTokens: 10, Prefix: NewPrefix("", prompt, len(prompt)/4)}
	}
	acquire := func(tk *Ticket) *Grant {
		t.Helper()
		g, err := s.Acquire(context.Background(), tk)
		if err != nil {
			t.Fatal(err)
		}
		return g
	}
	first := acquire(tk("tenant a", "q0")) // 7,000 tokens, a new prefix: either backend
	other := "a"
	if first.Backend == "a" {
		other = "b"
	}
	// A short request without chunks goes to the other backend, which
	// has more headroom now; then the tenant's request ends.
	small := acquire(&Ticket{Model: model, PromptTokens: 1_000, MaxTokens: 10})
	if small.Backend != other {
		t.Fatalf("the short request went to %s, not the emptier %s", small.Backend, other)
	}
	first.Release()
	// first's backend is now idle (the most headroom) but took 7,000
	// tokens of recent work, the other 1,000: the new tenant goes there.
	if g := acquire(tk("tenant b", "q0")); g.Backend != other {
		t.Errorf("the new tenant went to %s, the backend with the most recent work, not %s", g.Backend, other)
	}
	// A request of the first tenant still goes back to its prefix.
	if g := acquire(tk("tenant a", "q1")); g.Backend != first.Backend {
		t.Errorf("the first tenant's request went to %s, away from its prefix on %s", g.Backend, first.Backend)
	}
}

func TestPlaceScore(t *testing.T) {
	tests := []struct {
		name  string
		a, b  [2]float64 // recent share, headroom
		aWins bool
	}{
		{name: "less recent work wins over more headroom", a: [2]float64{0.1, 0.5}, b: [2]float64{0.4, 0.95}, aWins: true},
		{name: "one tenant in sixteen outweighs half the headroom", a: [2]float64{0.25, 0.45}, b: [2]float64{0.3125, 0.95}, aWins: true},
		{name: "equal work: the more headroom", a: [2]float64{0.25, 0.3}, b: [2]float64{0.25, 0.6}, aWins: false},
		{name: "near ties go to headroom", a: [2]float64{0.25, 0.1}, b: [2]float64{0.26, 0.9}, aWins: false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			sa, sb := placeScore(tc.a[0], tc.a[1], 0.95), placeScore(tc.b[0], tc.b[1], 0.95)
			if (sa > sb) != tc.aWins {
				t.Errorf("scores %.3f vs %.3f", sa, sb)
			}
		})
	}
}

// TestHeldBackendBackfills: a backend kept for the oldest ticket waiting
// for its prefix there (it has waited the starvation guard) still takes a
// later, smaller ticket that ends before the holder can start, and
// refuses one that would run on and take the room the holder needs; the
// holder then goes first when room appears.
func TestHeldBackendBackfills(t *testing.T) {
	s := newTestScheduler(t, Policy{KVTarget: 1, StarvationGuard: time.Nanosecond, MaxQueueWait: 5 * time.Second}, backendSnap("a", 40_000))
	sysA := text("tenant a's system prompt", 24_000) // 6,000 tokens
	acquire := func(tk *Ticket) *Grant {
		t.Helper()
		g, err := s.Acquire(context.Background(), tk)
		if err != nil {
			t.Fatal(err)
		}
		g.Progress(1)
		return g
	}
	tenant := func(q string, qBytes, out int) *Ticket {
		prompt := sysA + text(q, qBytes)
		return &Ticket{Model: model, PromptTokens: len(prompt) / 4, MaxTokens: out, Prefix: NewPrefix("", prompt, len(prompt)/4)}
	}
	first := acquire(tenant("q0", 4_000, 10))                                      // 7,000 tokens, ends in 9 steps
	long := acquire(&Ticket{Model: model, PromptTokens: 20_000, MaxTokens: 1_000}) // runs 999 more
	short := acquire(&Ticket{Model: model, PromptTokens: 5_000, MaxTokens: 11})    // ends in 10
	// ~33,000 held: the tenant's next request, 9,000 new tokens beside its
	// prefix, waits for it on a; it fits once short and first have ended,
	// with ~13,000 free then.
	holder := acquireAsync(context.Background(), s, tenant("q1", 36_000, 10))
	waitQueued(t, s, 1)
	small := acquireAsync(context.Background(), s, &Ticket{Model: model, PromptTokens: 1_000, MaxTokens: 5})
	waitQueued(t, s, 2)
	medium := acquireAsync(context.Background(), s, &Ticket{Model: model, PromptTokens: 4_500, MaxTokens: 100})
	waitQueued(t, s, 3)
	s.Wake()
	o := <-small
	if o.err != nil {
		t.Fatal(o.err)
	}
	if q := s.Queued()[Interactive]; q != 2 {
		t.Fatalf("%d queued after the pass, want the holder and the medium ticket", q)
	}
	select {
	case o := <-medium:
		t.Fatalf("the medium ticket, which would run on beside the holder, got %v", o.g.Backend)
	default:
	}
	// Room for the holder, not for both: the holder goes first.
	o.g.Release()
	short.Release()
	h := <-holder
	if h.err != nil {
		t.Fatal(h.err)
	}
	if q := s.Queued()[Interactive]; q != 1 {
		t.Errorf("%d queued after room appeared, want the medium ticket alone (behind the holder)", q)
	}
	h.g.Release()
	first.Release()
	long.Release()
	if m := <-medium; m.err != nil {
		t.Fatal(m.err)
	} else {
		m.g.Release()
	}
}

// testClock is a clock tests advance by hand; safe for concurrent use.
type testClock struct {
	mu sync.Mutex
	t  time.Time
}

func newTestClock() *testClock { return &testClock{t: time.Now()} }

func (c *testClock) now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *testClock) advance(d time.Duration) {
	c.mu.Lock()
	c.t = c.t.Add(d)
	c.mu.Unlock()
}

// TestStarvingModelKeepsSharedBackend: a backend serves two models. A
// ticket of one that does not fit and has waited the starvation guard
// keeps the backend: a ticket of the other model that would run on and
// take the room it needs is refused (at Acquire as in a pump), one that
// ends before it could start still goes, and the starving ticket goes
// first once room appears. Blocking its model alone left the backend to
// the other model's tickets, which took each room as it appeared.
func TestStarvingModelKeepsSharedBackend(t *testing.T) {
	sn := backendSnap("a", 40_000)
	sn.Models = append(sn.Models, gpu.Model{ID: "lora", MaxModelLen: 100_000})
	s := newTestScheduler(t, Policy{KVTarget: 1, StarvationGuard: time.Nanosecond, MaxQueueWait: 5 * time.Second}, sn)
	acquire := func(tk *Ticket) *Grant {
		t.Helper()
		g, err := s.Acquire(context.Background(), tk)
		if err != nil {
			t.Fatal(err)
		}
		g.Progress(1)
		return g
	}
	long := acquire(&Ticket{Model: model, PromptTokens: 20_000, MaxTokens: 1_000}) // runs 999 more steps
	short := acquire(&Ticket{Model: model, PromptTokens: 10_000, MaxTokens: 11})   // ends in 10
	// ~31,000 held, ~9,000 free: the adapter's 15,000-token ticket fits
	// once short has ended.
	starving := acquireAsync(context.Background(), s, &Ticket{Model: "lora", PromptTokens: 15_000, MaxTokens: 10})
	waitQueued(t, s, 1)
	s.Wake()
	// A base model's ticket that ends in 5 steps, before the starving one
	// could start, goes.
	small := acquire(&Ticket{Model: model, PromptTokens: 1_000, MaxTokens: 5})
	// One that would run on beside it does not: with the 5,600 it keeps,
	// ~14,500 are free when short ends.
	medium := acquireAsync(context.Background(), s, &Ticket{Model: model, PromptTokens: 5_500, MaxTokens: 100})
	waitQueued(t, s, 2)
	s.Wake()
	if q := s.Queued()[Interactive]; q != 2 {
		t.Fatalf("%d queued, want the starving ticket and the medium one", q)
	}
	select {
	case o := <-medium:
		t.Fatalf("the base model's ticket that would delay the starving one got %v", o.g.Backend)
	default:
	}
	small.Release()
	short.Release()
	h := <-starving
	if h.err != nil {
		t.Fatal(h.err)
	}
	h.g.Release()
	long.Release()
	if m := <-medium; m.err != nil {
		t.Fatal(m.err)
	} else {
		m.g.Release()
	}
}

// TestStarvingHoldKeepsToItsClassAndTicket: the hold of a backend serving
// several models is for the starving ticket while it waits, and against
// tickets of its class or a later one. A starving batch ticket (which the
// batch share may be what holds back) keeps nothing from interactive
// tickets; a starving ticket that left the queue keeps nothing at all.
func TestStarvingHoldKeepsToItsClassAndTicket(t *testing.T) {
	for _, tc := range []struct {
		name   string
		class  Class
		leaves bool
	}{
		{name: "a batch ticket starving", class: Batch},
		{name: "an interactive ticket that left", class: Interactive, leaves: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			sn := backendSnap("a", 40_000)
			sn.Models = append(sn.Models, gpu.Model{ID: "lora", MaxModelLen: 100_000})
			s := newTestScheduler(t, Policy{KVTarget: 1, StarvationGuard: time.Nanosecond, MaxQueueWait: 5 * time.Second}, sn)
			var held []*Grant
			for _, tk := range []*Ticket{{Model: model, PromptTokens: 20_000, MaxTokens: 1_000}, {Model: model, PromptTokens: 10_000, MaxTokens: 11}} {
				g, err := s.Acquire(context.Background(), tk)
				if err != nil {
					t.Fatal(err)
				}
				g.Progress(1)
				held = append(held, g)
			}
			ctx, cancel := context.WithCancel(context.Background())
			starving := acquireAsync(ctx, s, &Ticket{Model: "lora", PromptTokens: 15_000, MaxTokens: 10, Class: tc.class})
			waitQueued(t, s, 1)
			s.Wake() // it starves: the backend is kept for it
			if tc.leaves {
				cancel()
				if o := <-starving; o.err == nil {
					t.Fatal("the starving ticket was granted")
				}
			}
			// An interactive ticket that would delay it, at Acquire.
			g, err := s.Acquire(context.Background(), &Ticket{Model: model, PromptTokens: 5_500, MaxTokens: 100})
			if err != nil {
				t.Fatalf("the interactive ticket: %v", err)
			}
			g.Release()
			cancel()
			for _, g := range held {
				g.Release()
			}
		})
	}
}
