package scheduler

import (
	"context"
	"testing"
	"time"

	"github.com/kvgate/kvgate/bench/eventually"
)

// Replicas split the fleet while they live; one that leaves hands its
// share back; one that joins waits until the others have shrunk.
func TestMembershipShares(t *testing.T) {
	ns := startNATS(t, t.TempDir(), 0)
	_, js := connect(t, ns.ClientURL())
	a := newTestScheduler(t, Policy{}, backendSnap("x", 1000))
	b := newTestScheduler(t, Policy{}, backendSnap("x", 1000))
	cfg := MembershipConfig{Interval: 50 * time.Millisecond, TTL: 10 * time.Second} // no key expires during the test, however loaded the machine
	cfg.ID = "a"
	ma, err := NewMembership(context.Background(), js, a, cfg)
	if err != nil {
		t.Fatal(err)
	}
	runBG(t, ma.Run)
	eventually.True(t, "a alone with the whole fleet", func() bool { return a.Share() == 1 })

	cfg.ID = "b"
	mb, err := NewMembership(context.Background(), js, b, cfg)
	if err != nil {
		t.Fatal(err)
	}
	// b's first look: a exists and may not have shrunk: b takes nothing.
	mb.refresh(context.Background(), time.Now())
	if b.Share() != 0 {
		t.Errorf("a joining replica took %v at once, want 0 until the others shrink", b.Share())
	}
	// Past the grace it takes its half; after a gap longer than its key
	// lives (a partition), it joins anew, with the grace again.
	mb.joined = time.Now().Add(-time.Minute)
	mb.refresh(context.Background(), time.Now())
	if b.Share() != 0.5 {
		t.Errorf("past the grace: share %v, want 0.5", b.Share())
	}
	mb.renewed = time.Now().Add(-cfg.TTL - time.Second)
	mb.refresh(context.Background(), time.Now())
	if b.Share() != 0 {
		t.Errorf("renewing after a partition: share %v, want 0 until the others shrink", b.Share())
	}
	stopB := runBG(t, mb.Run)
	eventually.True(t, "halves", func() bool { return a.Share() == 0.5 && b.Share() == 0.5 })
	stopB()
	eventually.True(t, "a whole again after b left", func() bool { return a.Share() == 1 })
}
