package sqlstore

import (
	"context"
	"errors"
	"sync"
	"testing"
	"testing/synctest"
	"time"
)

type call struct {
	in, out int
}

// TestGroupOutcomes runs many concurrent calls through a group: each gets
// its own outcome, and calls that queue behind a running batch go out
// together, never more than the maximum at once.
func TestGroupOutcomes(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var mu sync.Mutex
		var sizes []int
		release := make(chan struct{})
		g := newGroup(1, 8, func(_ context.Context, cs []*call) {
			mu.Lock()
			sizes = append(sizes, len(cs))
			first := len(sizes) == 1
			mu.Unlock()
			if first {
				<-release // hold the only slot while the others queue
			}
			for _, c := range cs {
				c.out = c.in * 2
			}
		})
		ctx := context.Background()
		const calls = 40
		cs := make([]*call, calls)
		errs := make([]error, calls)
		var wg sync.WaitGroup
		cs[0] = &call{in: 0}
		wg.Go(func() { errs[0] = g.do(ctx, cs[0]) })
		synctest.Wait() // the first batch, alone, holds the slot
		for i := 1; i < calls; i++ {
			cs[i] = &call{in: i}
			wg.Go(func() { errs[i] = g.do(ctx, cs[i]) })
		}
		synctest.Wait() // the others queue
		close(release)
		wg.Wait()
		for i, c := range cs {
			if errs[i] != nil || c.out != 2*i {
				t.Errorf("call %d: outcome %d, %v; want %d", i, c.out, errs[i], 2*i)
			}
		}
		if sizes[0] != 1 {
			t.Errorf("first batch: %d calls, want 1 (nothing queued before it)", sizes[0])
		}
		total := 0
		for _, n := range sizes {
			if n > 8 {
				t.Errorf("a batch of %d calls, more than the maximum 8", n)
			}
			total += n
		}
		if total != calls {
			t.Errorf("batches held %d calls, want %d", total, calls)
		}
		// 39 queued calls in batches of at most 8: five batches.
		if len(sizes) != 1+5 {
			t.Errorf("batches %v: want the queued calls in five full or nearly full batches", sizes)
		}
	})
}

// TestGroupCancel: a caller that gives up returns at once; a batch goes
// on while any of its callers waits, and is cancelled when none does.
func TestGroupCancel(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		g := newGroup(1, 8, func(ctx context.Context, cs []*call) {
			if cs[0].in == 1 {
				<-ctx.Done() // runs until its callers give up
			}
			for _, c := range cs {
				c.out = -1
			}
		})
		c1, c2, c3 := &call{in: 1}, &call{in: 2}, &call{in: 3}
		ctx1, cancel1 := context.WithCancel(context.Background())
		ctx2, cancel2 := context.WithCancel(context.Background())
		done1, done2 := make(chan error, 1), make(chan error, 1)
		go func() { done1 <- g.do(ctx1, c1) }()
		synctest.Wait()
		// c2 leads the next batch, which waits for the slot c1's holds.
		go func() { done2 <- g.do(ctx2, c2) }()
		synctest.Wait()
		cancel2()
		if err := <-done2; !errors.Is(err, context.Canceled) {
			t.Errorf("the second caller gave up: %v, want context.Canceled", err)
		}
		// A new call does not join the abandoned batch: it opens its own.
		done3 := make(chan error, 1)
		go func() { done3 <- g.do(context.Background(), c3) }()
		synctest.Wait()
		select {
		case err := <-done1:
			t.Fatalf("the first batch ended with its caller still waiting: %v", err)
		default:
		}
		cancel1()
		if err := <-done1; err != nil {
			t.Errorf("the first caller, after its batch ran: %v", err)
		}
		if err := <-done3; err != nil {
			t.Errorf("the third caller: %v", err)
		}
		if c1.out != -1 || c2.out != 0 || c3.out != -1 {
			t.Errorf("outcomes %d, %d, %d; want -1 (ran, cancelled), 0 (never ran), -1 (ran)", c1.out, c2.out, c3.out)
		}
	})
}

// TestGroupLinger: in a group with a linger, the calls that arrive within
// it share the first call's batch, and a batch that fills runs at once
// (synctest's clock: the times are exact).
func TestGroupLinger(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		type run struct {
			calls int
			at    time.Duration
		}
		var mu sync.Mutex
		var runs []run
		start := time.Now()
		g := newGroup(1, 4, func(_ context.Context, cs []*call) {
			mu.Lock()
			runs = append(runs, run{len(cs), time.Since(start)})
			mu.Unlock()
			for _, c := range cs {
				c.out = c.in * 2
			}
		})
		g.linger = 2 * time.Millisecond
		ctx := context.Background()
		var wg sync.WaitGroup
		for i := range 3 {
			wg.Go(func() { _ = g.do(ctx, &call{in: i}) })
		}
		synctest.Wait()
		time.Sleep(time.Millisecond)                  // within the linger
		wg.Go(func() { _ = g.do(ctx, &call{in: 3}) }) // fills the batch
		wg.Wait()
		time.Sleep(5 * time.Millisecond)
		for i := range 5 { // the first four fill a batch; the fifth lingers alone
			wg.Go(func() { _ = g.do(ctx, &call{in: i}) })
		}
		wg.Wait()
		want := []run{{4, time.Millisecond}, {4, 6 * time.Millisecond}, {1, 8 * time.Millisecond}}
		if len(runs) != len(want) {
			t.Fatalf("batches %v, want %v", runs, want)
		}
		for i := range want {
			if runs[i] != want[i] {
				t.Errorf("batch %d: %v, want %v (all: %v)", i, runs[i], want[i], runs)
			}
		}
	})
}
