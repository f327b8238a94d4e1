package gateway

import (
	"bufio"
	"io"
	"net/http"
	"sync"
	"sync/atomic"
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

// clientWrites bounds how long a proxied response's writes may wait for
// its client. A client that stops reading, its connection left open,
// would otherwise hold the write (and so the request's grant: its
// backend's KV reservation and sequence slot) for as long as the
// connection lives, and the backend, read no more meanwhile, would be
// cut as stalled and counted as failed for a fault that is not its own.
// A client that accepts no byte for StreamIdleTimeout (the backend's own
// allowance for silence) fails the write instead, and the request ends as
// the client's (499). The deadline moves with the response's progress, at
// most once per idle/64, as petWatchdog moves the backend's; end clears
// it, because without a server-wide WriteTimeout net/http would carry it
// into the connection's next request.
type clientWrites struct {
	rc   *http.ResponseController
	idle time.Duration
	last time.Time // when the deadline was last moved
	// state says whether a write to the client is under way, and whether
	// the backend's watchdog fired meanwhile: it then leaves the backend
	// be, and the writer, once its write returns, arms it again.
	state atomic.Int32
}

const (
	notWriting = iota
	writing
	firedWhileWriting
)

// begin marks a write to the client as under way.
func (cw *clientWrites) begin() { cw.state.Store(writing) }

// finish marks the write as done; it reports whether the watchdog fired
// during it (and must be armed again).
func (cw *clientWrites) finish() (fired bool) {
	return cw.state.Swap(notWriting) == firedWhileWriting
}

// stall reports whether the backend's watchdog, firing, should cut the
// backend: not while the relay waits on its client.
func (cw *clientWrites) stall() bool {
	return !cw.state.CompareAndSwap(writing, firedWhileWriting)
}

// extend moves the deadline to idle and a slack after now, unless it was
// moved at now already.
func (cw *clientWrites) extend(now time.Time) {
	if now.Equal(cw.last) || cw.idle <= 0 {
		return
	}
	cw.last = now
	_ = cw.rc.SetWriteDeadline(now.Add(cw.idle + cw.idle/64)) // ErrNotSupported: no deadline, as before
}

// end clears the deadline, if one was set.
func (cw *clientWrites) end() {
	if !cw.last.IsZero() {
		_ = cw.rc.SetWriteDeadline(time.Time{})
	}
}

// write writes b in pieces, moving the deadline before each: a client
// reading slowly but steadily gets a large answer whole, one that stops
// reading is let go of.
func (cw *clientWrites) write(w io.Writer, b []byte) error {
	cw.begin()
	defer cw.finish() // the backend is done: no watchdog to arm again
	const piece = 64 << 10
	for len(b) > 0 {
		n := min(len(b), piece)
		cw.extend(time.Now())
		if _, err := w.Write(b[:n]); err != nil {
			return err
		}
		b = b[n:]
	}
	return nil
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
