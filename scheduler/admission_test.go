package scheduler

import (
	"math/rand/v2"
	"testing"
	"time"
)

func TestProjectPeak(t *testing.T) {
	tests := []struct {
		name    string
		flights []flight
		extra   flight
		want    int
	}{
		{"alone", nil, flight{held: 100, remaining: 50}, 150},
		// Two requests finishing together peak together.
		{"same end", []flight{{100, 50}}, flight{100, 50}, 300},
		// The short one is gone before the long one peaks.
		{"staggered", []flight{{100, 10}}, flight{100, 500}, 600},
		{"staggered, both grow", []flight{{1000, 10}}, flight{100, 20}, 1120},
		// The naive bound Σ(held+remaining) would be 2270.
		{"three phases", []flight{{500, 100}, {300, 300}, {50, 1000}}, flight{10, 10}, 1150},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			sortFlights(tc.flights)
			if got := projectPeak(tc.flights, tc.extra); got != tc.want {
				t.Errorf("projectPeak = %d, want %d", got, tc.want)
			}
		})
	}
}

// TestProjectPeakAgainstStepping checks the closed form against growing the
// flights one token at a time.
func TestProjectPeakAgainstStepping(t *testing.T) {
	flights := []flight{{700, 30}, {20, 900}, {400, 400}, {0, 1}, {1000, 0}, {64, 64}}
	for k := range flights {
		fs, extra := append([]flight(nil), flights[:k]...), flights[k]
		peak := 0
		for step := 0; step <= 1000; step++ {
			occ := 0
			for _, f := range append(fs, extra) {
				if step <= f.remaining {
					occ += f.held + step
				}
			}
			peak = max(peak, occ)
		}
		sortFlights(fs)
		if got := projectPeak(fs, extra); got != peak {
			t.Errorf("flights %v + %v: projectPeak %d, stepping %d", fs, extra, got, peak)
		}
	}
}

func TestDecide(t *testing.T) {
	p := Policy{}
	p.defaults()
	p.KVTarget = 0.9 // degraded 0.7, backend waiting 2
	base := func() load {
		return load{routable: true, capacity: 100_000, maxNumSeqs: 256, exact: true, share: 1}
	}
	tests := []struct {
		name        string
		mod         func(*load)
		prompt, out int
		ok          bool
		reason      string
	}{
		{name: "empty backend admits", prompt: 1000, out: 1000, ok: true},
		{name: "unroutable", mod: func(l *load) { l.routable = false }, prompt: 10, out: 10, reason: reasonUnroutable},
		{name: "a backend cooling down after a 429", mod: func(l *load) { l.cooling = true }, prompt: 10, out: 10, reason: reasonCooldown},
		{name: "stale metrics count as saturated", mod: func(l *load) { l.stale = true }, prompt: 10, out: 10, reason: reasonStale},
		{name: "unknown capacity", mod: func(l *load) { l.capacity = 0 }, prompt: 10, out: 10, reason: reasonNoCapacity},
		{name: "up to the target", prompt: 45_000, out: 45_000, ok: true},
		{name: "over the target waits to run alone", mod: func(l *load) { l.inflight, l.reserved = 1, 1 }, prompt: 45_000, out: 45_001, reason: reasonAlone},
		{name: "degraded GPUs lower the target", mod: func(l *load) {
			l.degraded = true
			l.flights = []flight{{held: 10_000, remaining: 10_000}}
			l.reserved, l.inflight = 20_000, 1
		}, prompt: 35_000, out: 25_000, reason: reasonKV},
		{name: "degraded still admits under the lowered target", mod: func(l *load) { l.degraded = true }, prompt: 30_000, out: 30_000, ok: true},
		{
			name: "max_num_seqs from kvgate's own count",
			mod:  func(l *load) { l.maxNumSeqs = 3; l.inflight = 3 }, prompt: 1, out: 1, reason: reasonSeqs,
		},
		{
			name: "max_num_seqs from the measurement plus what was sent since",
			mod:  func(l *load) { l.maxNumSeqs = 10; l.measuredRunning = 8; l.newSinceScrape = 2 }, prompt: 1, out: 1, reason: reasonSeqs,
		},
		{name: "vLLM's own queue is not near zero", mod: func(l *load) { l.measuredWaiting = 3 }, prompt: 1, out: 1, reason: reasonWaiting},
		{name: "a short vLLM queue is tolerated", mod: func(l *load) { l.measuredWaiting = 2 }, prompt: 1, out: 1, ok: true},
		{
			name: "load kvgate did not send counts",
			mod:  func(l *load) { l.measuredUsed = 80_000 }, prompt: 6_000, out: 5_000, reason: reasonKV,
		},
		{
			name: "kvgate's own measured load is not counted twice",
			mod: func(l *load) {
				l.measuredUsed = 60_000
				l.heldBeforeScrape = 60_000
				l.flights = []flight{{held: 60_000, remaining: 0}}
				l.reserved, l.inflight = 60_000, 1
			},
			prompt: 10_000, out: 10_000, ok: true,
		},
		{
			// Worst case 50k + 40k > 90k, but the in-flight request ends
			// long before the new one grows: the projection admits.
			name: "projection admits what the worst case refuses",
			mod: func(l *load) {
				l.flights = []flight{{held: 49_990, remaining: 10}}
				l.reserved, l.inflight = 50_000, 1
			},
			prompt: 20_000, out: 30_000, ok: true,
		},
		{
			// At t=20k both hold 50k and 41k: 91k > 90k.
			name: "projection refuses a true overlap",
			mod: func(l *load) {
				l.flights = []flight{{held: 30_000, remaining: 20_000}}
				l.reserved, l.inflight = 50_000, 1
			},
			prompt: 21_000, out: 30_000, reason: reasonKV,
		},
		{
			name: "a replica's share caps its own flights",
			mod: func(l *load) {
				l.share = 0.5 // of 90k: 45k; at t=6k the two hold 36k + 16k
				l.flights = []flight{{held: 30_000, remaining: 10_000}}
				l.reserved, l.inflight = 40_000, 1
			},
			prompt: 10_000, out: 6_000, reason: reasonShare,
		},
		{
			name: "within its share a replica admits",
			mod: func(l *load) {
				l.share = 0.5
				l.flights = []flight{{held: 30_000, remaining: 10_000}}
				l.reserved, l.inflight = 40_000, 1
			},
			prompt: 2_000, out: 1_000, ok: true,
		},
		{
			name: "a share caps sequences too",
			mod: func(l *load) {
				l.share, l.maxNumSeqs = 0.25, 8
				l.flights = []flight{{held: 2, remaining: 0}, {held: 2, remaining: 0}}
				l.reserved, l.inflight = 4, 2
			}, prompt: 1, out: 1, reason: reasonShare,
		},
		{
			name: "a replica with no share yet admits nothing beside its own flights",
			mod: func(l *load) {
				l.share = 0
				l.flights = []flight{{held: 10, remaining: 10}}
				l.reserved, l.inflight = 20, 1
			}, prompt: 1, out: 1, reason: reasonShare,
		},
		{
			name: "a replica with nothing in flight may send one request that fits the whole",
			mod:  func(l *load) { l.share = 0.1 }, prompt: 30_000, out: 30_000, ok: true,
		},
		{
			name: "without the exact ledger, a tight fit asks for it",
			mod: func(l *load) {
				l.exact = false
				l.reserved, l.inflight = 50_000, 1
			},
			prompt: 20_000, out: 30_000, reason: reasonKV,
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			l := base()
			if tc.mod != nil {
				tc.mod(&l)
			}
			v := decide(&l, tc.prompt, tc.out, &p)
			if v.ok != tc.ok || v.reason != tc.reason {
				t.Errorf("decide = %+v, want ok=%v reason=%q", v, tc.ok, tc.reason)
			}
			if v.ok && (v.headroom < 0 || v.headroom > 1) {
				t.Errorf("headroom %v outside [0, 1]", v.headroom)
			}
		})
	}
}

func TestRoundingSlack(t *testing.T) {
	for _, tc := range []struct{ n, bs, want int }{
		{0, 16, 0},
		{5, 1, 0},
		{1, 16, 15}, // one sequence: its worst case
		{40, 16, 0}, // checked by range below
	} {
		got := roundingSlack(tc.n, tc.bs)
		if tc.n == 40 {
			// Between the mean waste and the worst case.
			if got <= tc.n*(tc.bs-1)/2 || got >= tc.n*(tc.bs-1) {
				t.Errorf("roundingSlack(40, 16) = %d, want between %d and %d", got, tc.n*(tc.bs-1)/2, tc.n*(tc.bs-1))
			}
			continue
		}
		if got != tc.want {
			t.Errorf("roundingSlack(%d, %d) = %d, want %d", tc.n, tc.bs, got, tc.want)
		}
	}
}

func TestProgressBracket(t *testing.T) {
	g := &Grant{maxOut: 400}
	// A stream reports exactly; a token may be in the making.
	g.generated.Store(100)
	if lo, hi := g.progress(time.Time{}, -1, 0, 0, 0.95); lo != 100 || hi != 101 {
		t.Errorf("reported 100: bracket [%d, %d], want [100, 101]", lo, hi)
	}
	g.generated.Store(-1)
	g.admittedStep = 1000
	const lots = 1e9 // output the backend counted since: no bound
	// 201 steps since admission: at most 201 tokens, at least 0.95×200.
	if lo, hi := g.progress(time.Time{}, 1201, 0, lots, 0.95); lo != 190 || hi != 202 {
		t.Errorf("201 steps: bracket [%d, %d], want [190, 202]", lo, hi)
	}
	// Never past the output budget; never negative.
	if lo, hi := g.progress(time.Time{}, 9999, 0, lots, 0.95); lo != 399 || hi != 400 {
		t.Errorf("long past the end: bracket [%d, %d], want [399, 400]", lo, hi)
	}
	if lo, hi := g.progress(time.Time{}, 1000, 0, lots, 0.95); lo != 0 || hi != 1 {
		t.Errorf("just admitted: bracket [%d, %d], want [0, 1]", lo, hi)
	}
	// Steps that ran ahead of the output (several API processes summing
	// their step histograms): the low end is what the backend counted.
	if lo, hi := g.progress(time.Time{}, 1201, 0, 30, 0.95); lo != 30 || hi != 202 {
		t.Errorf("201 steps, 30 tokens counted since: bracket [%d, %d], want [30, 202]", lo, hi)
	}
	// Without a step counter: time × decode rate, bracketed twice as wide.
	g.admittedStep = -1
	g.admittedAt = time.Unix(100, 0)
	lo, hi := g.progress(time.Unix(102, 0), -1, 50, 1e6, 0.95) // estimate 100
	if lo != 90 || hi != 111 {
		t.Errorf("time-based 100: bracket [%d, %d], want [90, 111]", lo, hi)
	}
}

// TestProgressCounterBound: without a step counter, the low end of the
// bracket is never more than the output the backend counted since the
// admission, whatever the decode rate claims (an emulator read 586-1,225
// tokens/s per sequence where the truth was ~49).
func TestProgressCounterBound(t *testing.T) {
	for _, tc := range []struct {
		name         string
		rate, genNow float64
		lo, hi       int
	}{
		{"counter above the estimate", 50, 1e6 + 5000, 90, 111},
		{"counter below the estimate", 50, 1e6 + 40, 40, 111},
		{"nothing counted since", 50, 1e6, 0, 111},
		{"an absurd rate, few tokens counted", 1200, 1e6 + 60, 60, 400},
		{"counter reset below the admission's", 50, 10, 0, 111},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := &Grant{maxOut: 400, admittedStep: -1, admittedGen: 1e6, admittedAt: time.Unix(100, 0)}
			g.generated.Store(-1)
			lo, hi := g.progress(time.Unix(102, 0), -1, tc.rate, tc.genNow, 0.95)
			if lo != tc.lo || hi != tc.hi {
				t.Errorf("bracket [%d, %d], want [%d, %d]", lo, hi, tc.lo, tc.hi)
			}
		})
	}
}

func TestPacing(t *testing.T) {
	p := Policy{}
	p.defaults()
	base := load{routable: true, capacity: 100_000, maxNumSeqs: 1024, exact: true, share: 1,
		meanOut: 400, meanFinal: 1000, inflight: 10, reserved: 10_000}
	// 95k budget / 800 per request ≈ 119 at once; 400 steps each: one
	// admission every ~3.4 steps keeps them evenly spread (0.8 of it paced).
	gap := pacingGap(&base, 95_000)
	if gap < 2.5 || gap > 3 {
		t.Fatalf("pacingGap = %v, want about 2.7", gap)
	}
	for _, tc := range []struct {
		name  string
		paced bool
		since float64
		ok    bool
	}{
		{"no backlog: never paced", false, 0, true},
		{"backlog, just admitted", true, 1, false},
		{"backlog, gap passed", true, 3, true},
		{"backlog, no step counter", true, -1, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l := base
			l.paced, l.stepsSinceAdmit = tc.paced, tc.since
			v := decide(&l, 100, 100, &p)
			if v.ok != tc.ok || (!v.ok && v.reason != reasonPacing) {
				t.Errorf("decide = %+v, want ok=%v", v, tc.ok)
			}
		})
	}
}

// TestPacingGain: pacing applies only where spreading admissions wins a
// tenth of a request's occupancy or more; prefill-bound traffic (short
// outputs beside long prompts) goes unpaced.
func TestPacingGain(t *testing.T) {
	p := Policy{}
	p.defaults()
	for _, tc := range []struct {
		name               string
		meanOut, meanFinal float64
		paced              bool
	}{
		{"overload: 600 in, 400 out", 400, 1000, true},
		{"closed loop: 1,000 in, 500 out", 500, 1500, true},
		{"system prompt: 1,200 own in, 100 out", 100, 1300, false},
		{"history resent: 3,000 in, 200 out", 200, 3200, false},
		{"at the bound: gain exactly a tenth", 200, 1100, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l := load{routable: true, capacity: 100_000, maxNumSeqs: 1024, exact: true, share: 1,
				meanOut: tc.meanOut, meanFinal: tc.meanFinal, inflight: 10, reserved: 10 * int(tc.meanFinal),
				paced: true, stepsSinceAdmit: 0}
			gap := pacingGap(&l, 95_000)
			if (gap > 0) != tc.paced {
				t.Fatalf("pacingGap = %v, want paced=%v", gap, tc.paced)
			}
			v := decide(&l, 100, 100, &p)
			if v.ok == tc.paced {
				t.Errorf("decide just after an admission = %+v, want paced=%v", v, tc.paced)
			}
		})
	}
}

// TestPacingGainCountsHeldHistory: chunks still pinned after their
// bringer ended (a conversation's next turn holds its history) are part
// of what a request frees when it ends, so they lower spreading's win.
func TestPacingGainCountsHeldHistory(t *testing.T) {
	// 40 in flight, 200 out, 900 each of own KV, 12,000 of history held
	// by the next turns: 1,200 each in all; the win 100/1,100 < 0.1.
	l := load{routable: true, capacity: 100_000, maxNumSeqs: 1024, share: 1,
		meanOut: 200, meanFinal: 900, inflight: 40, sharedBase: 12_000}
	if gap := pacingGap(&l, 95_000); gap != 0 {
		t.Errorf("pacingGap = %v with the held history counted, want 0", gap)
	}
	l.sharedBase = 0 // the same own KV alone: the win 100/800 paces
	if gap := pacingGap(&l, 95_000); gap <= 0 {
		t.Errorf("pacingGap = %v without held history, want > 0", gap)
	}
}

// TestDelaysHolder drives the backfill rule: a ticket may take room on a
// backend an older one holds only where the holder, at the earliest step
// it fits, still fits beside it.
func TestDelaysHolder(t *testing.T) {
	// Two flights: 4,000 held that ends in 10 steps, 4,000 that runs 100.
	two := []flight{{held: 4_000, remaining: 100}, {held: 4_000, remaining: 10}}
	tests := []struct {
		name    string
		flights []flight
		cand    flight
		base    int
		need    int
		want    bool
	}{
		{name: "ends before the holder starts", flights: two, cand: flight{held: 1_500, remaining: 5}, base: 10_000, need: 5_000, want: false},
		{name: "runs on, room for both at the start", flights: two, cand: flight{held: 500, remaining: 50}, base: 10_000, need: 5_000, want: false},
		{name: "runs on and takes the holder's room", flights: two, cand: flight{held: 1_500, remaining: 50}, base: 10_000, need: 5_000, want: true},
		{name: "the holder fits now: the room it needs is its", flights: two[:1], cand: flight{held: 1_500, remaining: 50}, base: 10_000, need: 5_000, want: true},
		{name: "the holder fits now, room for both", flights: two[:1], cand: flight{held: 500, remaining: 50}, base: 10_000, need: 5_000, want: false},
		{name: "nothing in flight", cand: flight{held: 6_000, remaining: 1}, base: 10_000, need: 5_000, want: true},
		{name: "a holder that never fits here holds nothing", flights: two, cand: flight{held: 1_500, remaining: 500}, base: 10_000, need: 12_000, want: false},
		{name: "growth counts: the long flight grew 10", flights: two, cand: flight{held: 991, remaining: 50}, base: 10_000, need: 5_000, want: true},
		{name: "growth counts: one token less fits", flights: two, cand: flight{held: 980, remaining: 50}, base: 10_000, need: 5_000, want: false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if got := delaysHolder(tc.flights, tc.cand, tc.base, tc.need); got != tc.want {
				t.Errorf("delaysHolder = %v, want %v", got, tc.want)
			}
		})
	}
}

// TestDecideHeld: on a backend an older ticket holds, decide asks for the
// exact ledger and refuses a ticket that would delay the holder, and
// admits one that would not, as it would without the hold.
func TestDecideHeld(t *testing.T) {
	p := Policy{}
	p.defaults()
	p.KVTarget = 1
	l := load{routable: true, capacity: 10_000, maxNumSeqs: 256, share: 1, blockSize: 1,
		reserved: 8_200, inflight: 2, holdNeed: 5_000}
	if v := decide(&l, 500, 50, &p); v.ok || !v.needExact || v.reason != reasonHold {
		t.Fatalf("without the exact ledger: %+v, want a request for it", v)
	}
	l.exact = true
	l.flights = []flight{{held: 4_000, remaining: 100}, {held: 4_000, remaining: 10}}
	if v := decide(&l, 1_500, 50, &p); v.ok || v.reason != reasonHold {
		t.Errorf("a ticket taking the holder's room: %+v, want %s", v, reasonHold)
	}
	if v := decide(&l, 1_500, 5, &p); !v.ok {
		t.Errorf("a ticket ending before the holder can start: %+v, want admitted", v)
	}
	l.holdNeed = 0
	if v := decide(&l, 1_500, 50, &p); !v.ok {
		t.Errorf("no holder: %+v, want admitted", v)
	}
}

// TestRefusesAllWhateverTheTicket: a load that decide refuses for a reason
// refusesAll names refuses every other ticket too, whatever its size, its
// class, its pacing, a hold and the exact form of the load: the pass that
// stops checking a model at such backends (pumpLocked) passes over no
// ticket that could have been admitted.
func TestRefusesAllWhateverTheTicket(t *testing.T) {
	p := Policy{}
	p.defaults()
	r := rand.New(rand.NewPCG(11, 0))
	found := map[string]int{}
	for range 20_000 {
		l := load{
			routable: r.IntN(8) > 0, cooling: r.IntN(8) == 0, stale: r.IntN(8) == 0, preempting: r.IntN(8) == 0,
			degraded: r.IntN(4) == 0, late: r.IntN(4) == 0, lateness: r.Float64(),
			capacity: r.IntN(4) * 50_000, maxNumSeqs: 1 + r.IntN(64), share: []float64{1, 0.5, 0.25}[r.IntN(3)],
			measuredUsed: r.IntN(150_000), measuredRunning: r.IntN(64), measuredWaiting: r.IntN(4),
			blockSize: 16, inflight: r.IntN(8), newSinceScrape: r.IntN(4), unscheduled: r.IntN(3),
			stepsSinceAdmit: float64(r.IntN(20) - 1), meanOut: float64(r.IntN(1000)), meanFinal: float64(r.IntN(5000)),
		}
		l.reserved = l.inflight * r.IntN(10_000)
		l.class.inflight = r.IntN(l.inflight + 1)
		l.paced, l.class.capped, l.holdNeed = r.IntN(2) == 0, r.IntN(2) == 0, r.IntN(3)*1000
		first := decide(&l, r.IntN(20_000), 1+r.IntN(2_000), &p)
		if first.ok || !refusesAll(first.reason) {
			continue
		}
		found[first.reason]++
		for range 20 {
			o := l
			o.exact = r.IntN(2) == 0
			if o.exact {
				o.flights = []flight{{held: r.IntN(50_000), remaining: r.IntN(2_000)}}
				o.heldBeforeScrape = r.IntN(50_000)
			}
			o.paced, o.class.capped, o.holdNeed = r.IntN(2) == 0, r.IntN(2) == 0, r.IntN(3)*1000
			prompt, out := r.IntN(200_000), r.IntN(4_000)
			if v := decide(&o, prompt, out, &p); v.ok {
				t.Fatalf("decide refused %+v for %s, then admitted a ticket of %d+%d tokens (%+v)", l, first.reason, prompt, out, o)
			}
		}
	}
	for _, reason := range []string{reasonUnroutable, reasonCooldown, reasonStale, reasonNoCapacity, reasonPreempting, reasonWaiting} {
		if found[reason] == 0 {
			t.Errorf("no load refused for %s: the cases do not cover it", reason)
		}
	}
}
