// Package eventually is the one wait-until helper of kvgate's tests: it
// polls a condition until it holds, or fails the test once a bound far
// above what the condition needs on a loaded machine has passed. It is
// for tests only; no library package imports it.
package eventually

import (
	"testing"
	"time"
)

// Timeout is True's bound.
const Timeout = 20 * time.Second

// True polls cond until it holds, and fails t with what after Timeout.
// Call it from the test's goroutine.
func True(t testing.TB, what string, cond func() bool) {
	t.Helper()
	Within(t, Timeout, what, cond)
}

// Within is True with its own bound.
func Within(t testing.TB, limit time.Duration, what string, cond func() bool) {
	t.Helper()
	if !Holds(limit, cond) {
		t.Fatalf("timed out after %s waiting for %s", limit, what)
	}
}

// Holds polls cond until it holds or limit has passed, and reports
// whether it held; it fails nothing. The polls start a millisecond apart
// and back off to 20 ms.
func Holds(limit time.Duration, cond func() bool) bool {
	deadline := time.Now().Add(limit)
	for wait := time.Millisecond; ; wait = min(2*wait, 20*time.Millisecond) {
		if cond() {
			return true
		}
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(wait)
	}
}
