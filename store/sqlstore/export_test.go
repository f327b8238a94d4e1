package sqlstore

import "time"

// Hooks for the package's external tests (package sqlstore_test), which
// open real stores through store/sqlite and store/postgres.

// SetQuotaWait sets how long a limiter call waits for its batch.
func SetQuotaWait(s *Store, d time.Duration) { s.quotaWait = d }

// HoldQuotaSlots takes every slot of the limiter's group of calls that
// requests wait for, so that the next batch waits; release gives them back.
func HoldQuotaSlots(s *Store) (release func()) {
	n := cap(s.quotas.slots)
	for range n {
		s.quotas.slots <- struct{}{}
	}
	return func() {
		for range n {
			<-s.quotas.slots
		}
	}
}

// QuotaPending counts the calls in the limiter's open batch.
func QuotaPending(s *Store) int {
	g := s.quotas
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.pending == nil {
		return 0
	}
	return len(g.pending.calls)
}

// SetBatchLinesBytes sets the result bytes that end a page of BatchLines.
func SetBatchLinesBytes(s *Store, n int) { s.batchLinesBytes = n }
