package sqlstore

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/kvgate/kvgate/store"
)

// TestQuotaBatchOrder: a batch's calls take their locks in one order:
// tenant, window-locking calls first, ledger day, key.
func TestQuotaBatchOrder(t *testing.T) {
	yesterday := time.Date(2026, 12, 1, 23, 59, 59, 0, time.UTC)
	today := yesterday.Add(2 * time.Second)
	acq := func(tenant, key string, now time.Time, windowless bool) *quotaCall {
		return &quotaCall{acquire: &store.Acquisition{Tenant: tenant, KeyID: key, Now: now}, windowless: windowless}
	}
	rel := func(tenant, key string, day time.Time, windowed bool) *quotaCall {
		p := store.Permit{Tenant: tenant, KeyID: key, Day: store.DayOf(day)}
		if windowed {
			p.WindowStart = day.Truncate(time.Minute)
		}
		return &quotaCall{release: &store.Release{Permit: p}}
	}
	want := []*quotaCall{
		acq("a", "k2", yesterday, false), // a's window-locking calls, by day, then key
		rel("a", "k1", today, true),
		acq("a", "k2", today, false),
		rel("a", "k1", yesterday, false), // then a's ledger-only calls, by day
		acq("a", "", today, true),
		rel("a", "k0", today, false),
		acq("b", "", yesterday, true), // then b's
	}
	name := func(c *quotaCall) string {
		tn, k := c.tenant()
		return fmt.Sprintf("%s/%s/windowed=%v/day=%d/acquire=%v", tn, k, c.windowed(), c.day(), c.acquire != nil)
	}
	r := rand.New(rand.NewPCG(1, 2))
	for range 20 {
		got := slices.Clone(want)
		r.Shuffle(len(got), func(i, j int) { got[i], got[j] = got[j], got[i] })
		slices.SortStableFunc(got, compareCalls)
		for i := range got {
			if got[i] != want[i] {
				t.Fatalf("position %d: %s, want %s", i, name(got[i]), name(want[i]))
			}
		}
	}
}
