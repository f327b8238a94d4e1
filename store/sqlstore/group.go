package sqlstore

import (
	"context"
	"sync"
	"time"
)

// group is group commit: it coalesces calls that arrive together from
// many goroutines into batches, each written by one statement in one
// transaction, so that a burst costs the database one commit (and one
// round trip, one wake-up of a server process) per batch instead of one
// per call. A call waits for no timer: it joins the batch that is
// waiting for one of group's slots, or starts one. At most slots batches
// run at once, so at low load every call runs at once and alone, and
// under load the calls that queue behind the running batches go out
// together. Each call still gets its own result: run must give every
// call of a batch its outcome, and it does so in a way that a problem
// with one call (a conflict, a bad value) does not fail the others.
//
// A group with a linger is the exception, for calls that no caller's
// client waits for: the first call of a batch waits up to linger for
// others (or for the batch to fill) before the batch takes a slot.
//
// A group is safe for concurrent use and starts no goroutines (but
// abandoned's): the first caller of a batch runs it.
// The shape of the worker's group commits (the ends of attempts, lease
// renewals and sent marks, stage checkpoints): at most workerSlots
// batches of at most workerMax calls at once. No runner slot waits on an
// end or a checkpoint (a slot is freed when the attempt's outcome is
// known), so fewer, fuller batches cost no throughput there and save a
// commit (a WAL flush) and a statement per call they absorb: with four
// slots a drain of zero-delay jobs ended about 6 attempts a statement,
// 0.27 commits a job in all; with two, 0.15-0.18. A sent mark, which its
// slot does wait for, waits for at most the batches in flight. Acceptances
// have as many slots (groupSlots) but smaller batches (groupMax): a caller
// waits for its whole batch.
const (
	workerSlots = 2
	workerMax   = 256
)

// finishLinger is how long a batch of attempts' ends waits for more
// before it takes a slot. Nothing waits for an end but the attempt's own
// goroutine (its runner slot is free already), so a lone end commits
// finishLinger later and nothing else is slower; under load the ends of
// a few milliseconds share one statement and one commit. Beside River
// (bench/peers/river, 64 slots, zero-delay work, alternating builds) it
// took the statements a job from 0.23-0.26 to 0.16-0.17, the commits from
// 0.20-0.21 to 0.16, the server's CPU from 306-336 to 271-279 µs a job,
// and the fair claim → complete rate from 4,294-4,594 to 5,026-5,244
// jobs/s (2 ms: 0.19-0.20 statements a job). A crash loses the ends still
// lingering as it loses those of the batches in flight: their jobs'
// leases run out and the reaper takes them, as it does any attempt whose
// end did not commit.
const finishLinger = 5 * time.Millisecond

type group[C any] struct {
	max    int                                // calls in a batch, at most
	slots  chan struct{}                      // one per batch running
	run    func(ctx context.Context, cs []*C) // gives each call its outcome
	linger time.Duration                      // a batch's wait for more calls: 0, none
	// abandoned, when set, is given each call whose caller gave up
	// waiting (do returned its ctx's error) while its batch went on to
	// run for the callers still waiting: a write its caller was told had
	// failed may have committed after all, and abandoned may undo it.
	// It runs in a goroutine of its own once the batch has run.
	abandoned func(c *C)

	mu      sync.Mutex
	pending *batch[C] // the batch calls join; nil when none is open
}

type batch[C any] struct {
	calls  []*C
	ctx    context.Context // ends when every caller has given up
	cancel context.CancelFunc
	left   int  // callers still waiting, under group.mu
	ran    bool // run was called, set before done closes
	done   chan struct{}
	full   chan struct{} // closed when the batch has max calls (a group with a linger)
}

func newGroup[C any](slots, max int, run func(context.Context, []*C)) *group[C] {
	return &group[C]{max: max, slots: make(chan struct{}, slots), run: run}
}

// do adds c to a batch and returns once the batch has run, with c's
// outcome set by run; or, for a caller whose ctx ends first, at once
// with ctx's error (c may still be written, as a cancelled statement
// may still commit). The batch runs while any of its callers waits for
// it, and is cancelled when none does any more. The caller that opened
// the batch runs it: it returns at once only if every caller has gone;
// otherwise it runs the batch for those still waiting, its own call
// with them, and returns nil when the batch ran.
func (g *group[C]) do(ctx context.Context, c *C) error {
	g.mu.Lock()
	b := g.pending // never cancelled: see leave
	leader := b == nil
	if leader {
		b = &batch[C]{done: make(chan struct{})}
		if g.linger > 0 {
			b.full = make(chan struct{})
		}
		// The leader's values, not its cancellation: the batch is
		// everyone's.
		b.ctx, b.cancel = context.WithCancel(context.WithoutCancel(ctx))
		g.pending = b
	}
	b.calls = append(b.calls, c)
	b.left++
	if len(b.calls) == g.max {
		g.pending = nil // full: the next call opens another
		if b.full != nil {
			close(b.full)
		}
	}
	g.mu.Unlock()

	stop := context.AfterFunc(ctx, func() { g.leave(b) })
	defer stop()

	if !leader {
		select {
		case <-b.done:
			if b.ran {
				return nil
			}
			return ctx.Err() // it never ran: every caller, this one too, gave up
		case <-ctx.Done():
			if g.abandoned != nil {
				go func() {
					<-b.done
					if b.ran {
						g.abandoned(c)
					}
				}()
			}
			return ctx.Err()
		}
	}
	defer b.cancel()
	if g.linger > 0 {
		t := time.NewTimer(g.linger)
		select {
		case <-t.C:
		case <-b.full:
		case <-b.ctx.Done():
		}
		t.Stop()
	}
	select {
	case g.slots <- struct{}{}:
		defer func() { <-g.slots }()
	case <-b.ctx.Done():
		// Every caller gave up while the batch waited for a slot.
	}
	g.mu.Lock()
	if g.pending == b {
		g.pending = nil // sealed: from here b.calls is the leader's alone
	}
	g.mu.Unlock()
	if b.ctx.Err() == nil {
		g.run(b.ctx, b.calls)
		b.ran = true
	}
	close(b.done)
	if b.ran {
		return nil
	}
	return ctx.Err()
}

// leave records that one of b's callers gave up; when none is left, b is
// cancelled, and a batch still open stops taking calls, so that a new
// call never joins a cancelled batch.
func (g *group[C]) leave(b *batch[C]) {
	g.mu.Lock()
	defer g.mu.Unlock()
	b.left--
	if b.left == 0 {
		b.cancel()
		if g.pending == b {
			g.pending = nil
		}
	}
}
