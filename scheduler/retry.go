package scheduler

import (
	"math/rand/v2"
	"time"
)

// ErrorClass is how a failed attempt is treated.
type ErrorClass string

// Error classes. An attempt of a spending class counts against the job's
// attempts (its request reached a backend and failed there, or the job's
// input is invalid); the others are waits, which hand the job back
// without spending one. Transient classes are retried.
const (
	ClassBackend ErrorClass = "backend_error"   // 5xx, a cut connection, a malformed answer
	ClassTimeout ErrorClass = "timeout"         // the backend stalled
	ClassInvalid ErrorClass = "invalid_request" // 4xx: the request itself is wrong

	// ClassRateLimited: the backend answered 429; it ran nothing, so the
	// job waits for its Retry-After.
	ClassRateLimited ErrorClass = "rate_limited"
	ClassCapacity    ErrorClass = "no_capacity"        // kvgate's own queue timed out
	ClassNoBackend   ErrorClass = "no_backend"         // no routable backend serves the model
	ClassRefused     ErrorClass = "connection_refused" // the request never left: the backend is down
	// ClassQuota: the job's tenant is over its own rate, concurrency or
	// budget quota; RetryAfter is when the quota resets (0: when work in
	// flight ends). The runner waits in place for a short reset.
	ClassQuota ErrorClass = "quota_wait"
	// ClassShutdown: kvgate itself stopped the attempt (a drain ended).
	ClassShutdown ErrorClass = "shutdown"
	// ClassStore: the job store could not be reached before the request
	// left; it was not sent.
	ClassStore ErrorClass = "store_unavailable"
	// ClassUnknownEndpoint: this replica does not know the job's endpoint,
	// which a newer one accepted (a rolling upgrade, a rollback): a wait
	// for a replica that knows it, until the job's deadline.
	ClassUnknownEndpoint ErrorClass = "unknown_endpoint"
)

// Transient reports whether an attempt that failed so may succeed later.
func (c ErrorClass) Transient() bool { return c != ClassInvalid }

// Spends reports whether an attempt that ended so counts against the
// job's attempts.
func (c ErrorClass) Spends() bool {
	switch c {
	case ClassBackend, ClassTimeout, ClassInvalid:
		return true
	}
	return false
}

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
