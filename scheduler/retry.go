package scheduler

import (
	"math/rand/v2"
	"time"
)

// ErrorClass is how a failed attempt is treated.
type ErrorClass string

// Error classes. Transient ones retry; the rest end the job.
const (
	ClassRateLimited ErrorClass = "rate_limited"    // 429 from the backend
	ClassBackend     ErrorClass = "backend_error"   // 5xx, a cut connection, a malformed answer
	ClassTimeout     ErrorClass = "timeout"         // the backend stalled
	ClassCapacity    ErrorClass = "no_capacity"     // kvgate's own queue timed out
	ClassInvalid     ErrorClass = "invalid_request" // 4xx: the request itself is wrong
	// ClassQuota: the job's tenant is over its own rate, concurrency or
	// budget quota; RetryAfter is when the quota resets (0: when work in
	// flight ends). The runner waits in place for a short reset rather
	// than spending an attempt on it.
	ClassQuota ErrorClass = "quota_wait"
)

// Transient reports whether an attempt that failed so may succeed later.
func (c ErrorClass) Transient() bool { return c != ClassInvalid }

// Backoff is the retry delay policy: full jitter over an exponential cap,
// never sooner than the backend's Retry-After.
type Backoff struct {
	Base time.Duration // cap of the first retry [1s]
	Max  time.Duration // largest cap [1m]
}

// Delay returns how long to wait before the attempt after attempt (1-based)
// failed, given the backend's Retry-After (0 when none).
func (b Backoff) Delay(attempt int, retryAfter time.Duration, rng *rand.Rand) time.Duration {
	base, limit := b.Base, b.Max
	if base <= 0 {
		base = time.Second
	}
	if limit <= 0 {
		limit = time.Minute
	}
	ceiling := limit
	if attempt < 31 {
		ceiling = min(limit, base<<(attempt-1))
	}
	d := time.Duration(rng.Int64N(int64(ceiling) + 1))
	return max(d, retryAfter)
}
