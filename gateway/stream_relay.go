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

// After its [DONE] (or a Responses stream's final event), a backend's
// HTTP/1.1 response still has its end to send: the last, empty chunk,
// which vLLM and the simulator write after the flushed event, often in a
// packet of its own. A body closed before its end closes its connection,
// so every stream cost a new connection to the backend (a dial, an
// accept and a close on both sides, 4% of a gateway's CPU at a thousand
// streams a second). The relay reads that end, at most streamTail bytes
// and for at most streamTailWait (the watchdog then cuts the read, as it
// cuts a stall), and the connection goes back to the pool.
const (
	streamTail     = 4 << 10
	streamTailWait = 100 * time.Millisecond
)

// readTail reads what is left of a stream that ended, as above.
func readTail(br *bufio.Reader, watchdog *time.Timer) {
	watchdog.Reset(streamTailWait)
	_, _ = io.CopyN(io.Discard, br, streamTail)
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
