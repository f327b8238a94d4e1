package gateway

import (
	"bufio"
	"io"
	"sync"
	"time"
)

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

// relayBuffers are a stream relay's read buffer and the event it gathers,
// reused across streams so that a stream allocates neither.
type relayBuffers struct {
	r     *bufio.Reader
	event []byte
}

var relayPool = sync.Pool{New: func() any {
	return &relayBuffers{r: bufio.NewReaderSize(nil, 8<<10), event: make([]byte, 0, 1<<10)}
}}

// getRelayBuffers takes buffers from the pool, reading from body.
func getRelayBuffers(body io.Reader) *relayBuffers {
	rb := relayPool.Get().(*relayBuffers)
	rb.r.Reset(body)
	return rb
}

// put returns the buffers to the pool. An event grown past 64 KiB (a
// long line) is dropped rather than kept for ever.
func (rb *relayBuffers) put() {
	rb.r.Reset(nil)
	if cap(rb.event) > 64<<10 {
		rb.event = make([]byte, 0, 1<<10)
	}
	rb.event = rb.event[:0]
	relayPool.Put(rb)
}
