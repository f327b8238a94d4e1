package scheduler

import (
	"testing"
	"time"

	"github.com/kvgate/kvgate/gpu"
	"github.com/kvgate/kvgate/store"
)

// TestClaimRoomPerModel: two backends serve two models. Once model b's
// backend is full and b's claimed jobs queue in the replica, the runner
// claims model a's jobs for a's idle backend, and no more of b's: a
// saturated model's backlog neither takes the other model's room nor
// fills the runner's slots with jobs that cannot start.
func TestClaimRoomPerModel(t *testing.T) {
	snap := func(name, m string) *gpu.Snapshot {
		sn := backendSnap(name, 100_000)
		sn.Models, sn.MaxNumSeqs = []gpu.Model{{ID: m, MaxModelLen: 100_000}}, 2
		return sn
	}
	src := &staticSource{snaps: []*gpu.Snapshot{snap("ba", "a"), snap("bb", "b")}}
	exec := &scriptedExecutor{hold: make(chan struct{}), started: make(chan struct{}, 16)}
	defer close(exec.hold)
	st := openStore(t)
	var bs []store.Job
	for i := range 6 { // b's backlog, older than a's jobs
		bs = append(bs, acceptJob(t, st, "b"+string(rune('0'+i)), func(n *store.NewJob) { n.Model = "b" }))
	}
	f := startRunnerOn(t, st, src, exec, time.Minute, func(c *RunnerConfig) { c.Concurrency = 8 })
	// b's backend takes two; the rest of the first claim queues.
	for range 2 {
		<-exec.started
	}
	if room, models := f.runner.sched.ClaimRoom(); room != 2 || len(models) != 1 || models[0] != "a" {
		t.Errorf("ClaimRoom with b's backend full and b's jobs queued: %d, %v; want 2, [a]", room, models)
	}
	as := []store.Job{f.submit(t, "a0", func(n *store.NewJob) { n.Model = "a" }), f.submit(t, "a1", func(n *store.NewJob) { n.Model = "a" })}
	for _, j := range as {
		f.waitState(t, j.ID, store.Running)
	}
	for range 2 {
		<-exec.started // a's two run on a's backend
	}
	leased := 0
	for _, j := range bs {
		got, err := st.Get(t.Context(), "acme", j.ID)
		if err != nil {
			t.Fatal(err)
		}
		if got.State == store.Running {
			leased++
		}
	}
	// The first claim took four of b's (the room of both backends, before
	// any ran); none since.
	if leased != 4 {
		t.Errorf("%d of b's jobs leased, want the first claim's 4", leased)
	}
}
