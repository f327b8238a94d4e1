package gateway

import "time"

// petWatchdog resets a stream's idle watchdog at most once per idle/64 (a
// timer reset takes a lock on the runtime's timer heap, and a stream
// reaches here on every line), each time for idle plus that slack: the
// watchdog then fires between idle and idle×65/64 after the last line,
// never earlier. It returns when it last reset.
func petWatchdog(t *time.Timer, idle time.Duration, last time.Time) time.Time {
	now := time.Now()
	if !last.IsZero() && now.Sub(last) < idle/64 {
		return last
	}
	t.Reset(idle + idle/64)
	return now
}
