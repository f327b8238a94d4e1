package scheduler

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/kvgate/kvgate/bench/eventually"
	"github.com/kvgate/kvgate/gpu"
	"github.com/kvgate/kvgate/store"
)

// claimLog records the limit and the size of every claim that found work.
type claimLog struct {
	store.Store
	mu     sync.Mutex
	claims [][2]int // limit, jobs claimed
}

func (s *claimLog) Claim(ctx context.Context, now time.Time, lease time.Duration, limit int, models ...string) ([]store.Job, error) {
	js, err := s.Store.Claim(ctx, now, lease, limit, models...)
	if len(js) > 0 {
		s.mu.Lock()
		s.claims = append(s.claims, [2]int{limit, len(js)})
		s.mu.Unlock()
	}
	return js, err
}

func (s *claimLog) log() [][2]int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.claims)
}

// acceptN puts n jobs in st without waking a runner (its poll finds
// them).
func acceptN(t *testing.T, st store.Store, prefix string, n int) {
	t.Helper()
	for i := range n {
		acceptJob(t, st, fmt.Sprint(prefix, i))
	}
}

// TestRunnerClaimLingersForEndingAttempts: attempts that end one after
// another, within the linger, free their slots into one claim, where the
// runner without a linger claims for each slot as it frees.
func TestRunnerClaimLingersForEndingAttempts(t *testing.T) {
	for _, tc := range []struct {
		name   string
		linger time.Duration
	}{
		{"lingers", time.Hour},
		{"at once", -1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			st := &claimLog{Store: openStore(t)}
			acceptN(t, st, "first", 4)
			exec := &scriptedExecutor{hold: make(chan struct{}), started: make(chan struct{}, 8)}
			f := startRunnerOn(t, st, &staticSource{snaps: []*gpu.Snapshot{backendSnap("a", 100_000)}}, exec, time.Minute,
				func(c *RunnerConfig) { c.ClaimLinger = tc.linger })
			for range 4 {
				<-exec.started // the first claim took all four
			}
			acceptN(t, st, "second", 4)
			// The four attempts end one by one, each given the time for a
			// runner that does not linger to claim in its slot.
			for range 4 {
				exec.hold <- struct{}{}
				time.Sleep(30 * time.Millisecond)
			}
			for range 4 {
				<-exec.started
			}
			claims := st.log()
			switch {
			case len(claims) < 2 || claims[0] != [2]int{4, 4}:
				t.Errorf("claims (limit, jobs) %v, want [4 4] first", claims)
			case tc.linger > 0 && claims[1] != [2]int{4, 4}:
				t.Errorf("claims (limit, jobs) %v, want [4 4] twice: the ends within the linger share a claim", claims)
			case tc.linger < 0 && claims[1][0] == 4:
				t.Errorf("claims (limit, jobs) %v: without a linger the first end's claim should not wait for the others", claims)
			}
			close(exec.hold)
			eventually.True(t, "every job to succeed", func() bool {
				return f.runner.inflight.Load() == 0
			})
		})
	}
}

// TestRunnerClaimLingerIsBounded: a slot held by a long attempt keeps a
// new job waiting for the linger at most, never for the attempt.
func TestRunnerClaimLingerIsBounded(t *testing.T) {
	st := openStore(t)
	acceptN(t, st, "long", 1)
	exec := &scriptedExecutor{hold: make(chan struct{}), started: make(chan struct{}, 2)}
	f := startRunnerOn(t, st, &staticSource{snaps: []*gpu.Snapshot{backendSnap("a", 100_000)}}, exec, time.Minute,
		func(c *RunnerConfig) { c.ClaimLinger = 20 * time.Millisecond })
	<-exec.started
	f.submit(t, "new")
	select {
	case <-exec.started: // claimed beside the long attempt, which still holds its slot
	case <-time.After(time.Minute):
		t.Fatal("the new job waited for the long attempt's slot")
	}
	close(exec.hold)
}
