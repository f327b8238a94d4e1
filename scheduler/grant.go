package scheduler

import (
	"cmp"
	"math"
	"slices"
	"sync/atomic"
	"time"
)

// ledger is kvgate's record of what it has admitted to one backend.
type ledger struct {
	grants   []*Grant // in admission order
	reserved int      // Σ prompt + maxOut
	sumOut   int      // Σ maxOut
	// lastAdmitStep is the backend's engine step count at kvgate's last
	// admission to it, for pacing; < 0 when unknown.
	lastAdmitStep float64
	// lastPassStep is the backend's step count at the end of the last
	// admission pass over the backlog, for pacing's credit; < 0 unknown.
	lastPassStep float64
	// released are recent releases: the backend's last scrape may still
	// show their KV, which is kvgate's own and not foreign load.
	released []release
	// pins are the prompt chunks the grants hold (prefix.go), shared
	// the KV tokens they take, once each; reserved includes shared.
	pins   map[uint64]*pin
	shared int
	// created is Σ of the grants' created: the shared tokens that came
	// with a request still in flight. shared - created is a base load of
	// chunks whose bringers have ended.
	created int
	// batchInflight counts the batch-class grants (classshare.go).
	batchInflight int
}

type release struct {
	at     time.Time
	tokens int
}

// maxReleases bounds the releases a ledger remembers between two scrapes of
// its backend, should scrapes stop.
const maxReleases = 4096

// Grant is an admitted ticket: the backend to call and the reservation to
// release when the call ends.
type Grant struct {
	Backend string
	URL     string
	Waited  time.Duration // time spent queued

	s          *Scheduler
	l          *ledger
	estimate   func() int // re-counts prompt; nil when exact
	prompt     int
	maxOut     int
	admittedAt time.Time
	// admittedStep is the backend's engine step count at admission, when
	// the backend publishes one (else -1).
	admittedStep float64
	// admittedGen is the backend's vllm:generation_tokens_total as last
	// scraped at admission: a request cannot have produced more output
	// than the backend has since.
	admittedGen float64
	generated   atomic.Int64 // -1 until reported
	// prefix is the prompt's chunks, pinned on the backend while the
	// grant lives; sharedPart the prompt tokens they stand for, reserved
	// in the ledger's shared total rather than in the grant's own part;
	// created the shared tokens this grant's chunks added.
	prefix     *Prefix
	sharedPart int
	created    int
	released   bool // guarded by s.mu
	class      Class
	// backendDone is when the backend finished the request (UnixNano; 0
	// until BackendDone): vLLM frees its KV then, not when the caller,
	// done writing to its client, releases the grant.
	backendDone atomic.Int64
}

// BackendDone records that the backend has finished the request (its
// whole answer read): from then its KV is free there, whatever the
// caller still has to write to its client before it releases the grant.
func (g *Grant) BackendDone() {
	if g.s != nil { // else not the scheduler's (a test's): nothing to date
		g.backendDone.CompareAndSwap(0, g.s.now().UnixNano())
	}
}

// own is the grant's prompt tokens outside its shared chunks.
func (g *Grant) own() int { return g.prompt - g.sharedPart }

// progress brackets the output a grant has produced: lo and hi tokens.
// A stream reports it exactly. Otherwise, with the backend's engine step
// counter, a sequence has made at most one token per step since its
// admission (hi), and at least ProgressFactor of that less the prefill
// step (lo), since it may have waited in vLLM's queue. Without a step
// counter the estimate is the time since admission times the per-sequence
// decode rate, bracketed twice as wide on both sides. Either way the low
// end is no more than the output the backend has counted since the
// admission (genNow, its vllm:generation_tokens_total as last scraped). Admission
// projects a flight from the high end (what it may hold now) to the low
// end (how long it may still grow), which is safe both ways.
func (g *Grant) progress(now time.Time, stepsNow, decodeRate, genNow, factor float64) (lo, hi int) {
	if n := g.generated.Load(); n >= 0 {
		n := min(int(n), g.maxOut)
		return n, min(n+1, g.maxOut) // a token may be in the making
	}
	var loF, hiF float64
	if stepsNow >= 0 && g.admittedStep >= 0 {
		steps := max(0, stepsNow-g.admittedStep)
		loF, hiF = factor*(steps-1), steps+1
	} else {
		est := decodeRate * now.Sub(g.admittedAt).Seconds()
		wide := 2 * (1 - factor)
		loF, hiF = (1-wide)*est, (1+wide)*est+1
	}
	// The output the backend counted since bounds what the request can
	// have produced, whatever the steps say: a server of several API
	// processes (--api-server-count) sums their step histograms, and one
	// engine step can read as several.
	loF = min(loF, max(0, genNow-g.admittedGen))
	const eps = 1e-9 // so that 0.9×100 is 90, not 89
	lo = max(0, min(int(loF+eps), g.maxOut-1))
	hi = max(lo, min(int(math.Ceil(hiF-eps)), g.maxOut))
	return lo, hi
}

// Progress reports how many output tokens the request has produced so
// far, as a streaming response counts them. It makes admission exact.
func (g *Grant) Progress(generated int) { g.generated.Store(int64(generated)) }

// Release returns the grant's reservation and lets waiting tickets in.
// It is idempotent.
func (g *Grant) Release() {
	s := g.s
	s.mu.Lock()
	defer s.mu.Unlock() // deferred: a panic in the pump must not leave the scheduler locked
	if g.released {
		return
	}
	g.released = true
	l := g.l
	l.grants = slices.DeleteFunc(l.grants, func(x *Grant) bool { return x == g })
	freed := l.unpin(g.prefix)
	l.created -= g.created
	l.reserved -= g.own() + g.maxOut + freed
	l.sumOut -= g.maxOut
	if g.class == Batch {
		l.batchInflight--
	}
	now := s.now()
	// When the backend freed it: a scrape after that does not show it.
	at := now
	if d := g.backendDone.Load(); d != 0 && d < now.UnixNano() {
		at = time.Unix(0, d)
	}
	// What the backend's last scrape surely showed of it: its prompt and
	// the output a stream reported, not its whole budget, which would
	// hide other load. Shared chunks others still hold stay theirs.
	held := g.own() + freed
	out := g.maxOut
	if n := g.generated.Load(); n >= 0 {
		out = min(int(n), g.maxOut)
		held += out
	}
	s.prefixSent(g.Backend, nil, float64(out), 0, l.isPinned)
	// In time order (a backend's finish may come before an earlier
	// grant's release); loadOf drops those the next scrape no longer
	// shows.
	if len(l.released) >= maxReleases {
		l.released = append(l.released[:0], l.released[len(l.released)/2:]...)
	}
	i, _ := slices.BinarySearchFunc(l.released, at, func(r release, t time.Time) int { return r.at.Compare(t) })
	for i < len(l.released) && !l.released[i].at.After(at) {
		i++
	}
	l.released = slices.Insert(l.released, i, release{at: at, tokens: held})
	if s.queued > 0 {
		s.pumpLocked(s.src.Snapshots(), now)
	}
}

// BackendLoad is what kvgate has admitted to one backend, for reports.
type BackendLoad struct {
	Backend  string
	Inflight int
	Reserved int // KV tokens, prompt plus max output of each in-flight request
}

// Loads returns the ledger of every backend that has had work.
func (s *Scheduler) Loads() []BackendLoad {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]BackendLoad, 0, len(s.ledgers))
	for name, l := range s.ledgers {
		out = append(out, BackendLoad{Backend: name, Inflight: len(l.grants), Reserved: l.reserved})
	}
	slices.SortFunc(out, func(a, b BackendLoad) int { return cmp.Compare(a.Backend, b.Backend) })
	return out
}
