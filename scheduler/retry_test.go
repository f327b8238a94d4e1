package scheduler

import (
	"math/rand/v2"
	"testing"
	"time"
)

func TestBackoff(t *testing.T) {
	b := Backoff{Base: time.Second, Max: 8 * time.Second}
	rng := rand.New(rand.NewPCG(1, 2))
	for _, tc := range []struct {
		attempt    int
		retryAfter time.Duration
		lo, hi     time.Duration
	}{
		{1, 0, 0, time.Second},
		{2, 0, 0, 2 * time.Second},
		{4, 0, 0, 8 * time.Second},
		{10, 0, 0, 8 * time.Second}, // capped
		{60, 0, 0, 8 * time.Second}, // no overflow
		{1, 5 * time.Second, 5 * time.Second, 5 * time.Second},
		{4, 3 * time.Second, 3 * time.Second, 8 * time.Second},
	} {
		var seen []time.Duration
		for range 200 {
			d := b.Delay(tc.attempt, tc.retryAfter, rng)
			if d < tc.lo || d > tc.hi {
				t.Fatalf("Delay(%d, %v) = %v, want within [%v, %v]", tc.attempt, tc.retryAfter, d, tc.lo, tc.hi)
			}
			seen = append(seen, d)
		}
		// Full jitter: the delays spread over the range.
		if tc.retryAfter == 0 {
			lo, hi := seen[0], seen[0]
			for _, d := range seen {
				lo, hi = min(lo, d), max(hi, d)
			}
			if hi-lo < (tc.hi-tc.lo)/2 {
				t.Errorf("Delay(%d) spread only over [%v, %v]", tc.attempt, lo, hi)
			}
		}
	}
	for _, c := range []ErrorClass{ClassRateLimited, ClassBackend, ClassTimeout, ClassCapacity} {
		if !c.Transient() {
			t.Errorf("%s is not transient", c)
		}
	}
	if ClassInvalid.Transient() {
		t.Error("an invalid request is transient")
	}
}
