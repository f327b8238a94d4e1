package gateway

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"sync"
	"sync/atomic"
	"time"
)

// Draining. When kvgate is asked to stop, Drain fails /readyz at once,
// so that a load balancer takes this replica out, and answers every new
// API request 503 with Retry-After. The job event streams end at once
// with an error event: their clients reconnect, with Last-Event-ID, to a
// replica that stays. Requests in flight, inference streams among them,
// run on until they finish or the drain's deadline; at the deadline a
// stream still running ends with an OpenAI-shaped error event, and a
// request not answered yet gets 503.

var (
	// errDraining refuses a request that comes during the drain.
	errDraining = &apiError{status: http.StatusServiceUnavailable, typ: "server_error", code: "server_shutting_down",
		retryAfter: time.Second,
		msg:        "This kvgate is shutting down and takes no new requests; retry after the Retry-After delay."}
	// errDrainDeadline ends a request still running at the drain's
	// deadline.
	errDrainDeadline = &apiError{status: http.StatusServiceUnavailable, typ: "server_error", code: "server_shutting_down",
		retryAfter: time.Second,
		msg:        "This kvgate shut down before the request finished; the response is incomplete. Retry the request."}
	// errStreamDrained ends a job event stream when the drain begins.
	errStreamDrained = &apiError{status: http.StatusServiceUnavailable, typ: "server_error", code: "server_shutting_down",
		retryAfter: time.Second,
		msg:        "This kvgate is shutting down; reconnect with the last event's id as Last-Event-ID to resume where this stream ended."}
	// errViewDrained ends the fleet's live view when the drain begins.
	errViewDrained = &apiError{status: http.StatusServiceUnavailable, typ: "server_error", code: "server_shutting_down",
		retryAfter: time.Second,
		msg:        "This kvgate is shutting down; reconnect to watch the fleet from another replica."}
)

// drainGrace is how long Drain waits, after its deadline, for the requests
// it ended to write their error and return.
const drainGrace = 5 * time.Second

// drainState counts the API requests in flight and holds the drain's
// signals.
type drainState struct {
	active   atomic.Int64
	flag     atomic.Bool
	unready  atomic.Bool   // /readyz fails; requests are still served
	idle     chan struct{} // a token when active drops to 0 while draining
	once     sync.Once
	begun    chan struct{}   // closed when the drain begins
	deadline context.Context // done at the drain's deadline
	cut      context.CancelFunc
}

func newDrainState() *drainState {
	ctx, cancel := context.WithCancel(context.Background())
	return &drainState{idle: make(chan struct{}, 1), begun: make(chan struct{}), deadline: ctx, cut: cancel}
}

// enter counts a request in, unless the drain has begun.
func (d *drainState) enter() bool {
	d.active.Add(1)
	if d.flag.Load() {
		d.leave()
		return false
	}
	return true
}

// leave counts a request out.
func (d *drainState) leave() {
	if d.active.Add(-1) == 0 && d.flag.Load() {
		select {
		case d.idle <- struct{}{}:
		default:
		}
	}
}

func (d *drainState) draining() bool { return d.flag.Load() }

// Unready fails /readyz from now on, while requests are still served: a
// drain's first step, so that load balancers stop sending before the
// replica starts refusing. Drain implies it.
func (s *Server) Unready() { s.drain.unready.Store(true) }

// wait waits for no request to be in flight; false if ctx ended first.
func (d *drainState) wait(ctx context.Context) bool {
	for d.active.Load() > 0 {
		select {
		case <-d.idle:
		case <-ctx.Done():
			return d.active.Load() == 0
		}
	}
	return true
}

// Drain begins the shutdown (see above) and returns once no API request is
// in flight, or when ctx ends: it then ends the requests still running and
// returns once they have, or after a few seconds' grace; the permits
// written behind the requests then commit (quota.go). It returns how
// many requests it had to end. Calling it again waits again; it is safe
// for concurrent use.
func (s *Server) Drain(ctx context.Context) (ended int) {
	d := s.drain
	d.once.Do(func() {
		d.flag.Store(true)
		close(d.begun)
	})
	if d.wait(ctx) {
		s.permitsBehind.settle(ctx)
		return 0
	}
	ended = int(d.active.Load())
	d.cut()
	grace, cancel := context.WithTimeout(context.Background(), drainGrace)
	defer cancel()
	d.wait(grace)
	s.permitsBehind.settle(grace)
	return ended
}

// endStream ends a relayed stream that has begun and cannot go on, with
// e, in the stream's own shape: a chat or completions stream with an
// error chunk, the way OpenAI ends one that fails; a Responses stream
// with response.failed (its response as trail last saw it, failed), or
// the API's error event when it showed no response.
func endStream(w http.ResponseWriter, rc *http.ResponseController, ep endpoint, trail *responsesTrail, e *apiError) {
	var ev []byte
	if ep == epResponses {
		if ev = trail.failedEvent(e); ev == nil {
			ev = trail.errorEvent(e)
		}
	} else if b, err := json.Marshal(e.body()); err == nil {
		ev = fmt.Appendf(nil, "data: %s\n\n", b)
	}
	// A deadline of its own: the one the stream's events kept moving
	// (clientWrites) runs out with the backend's watchdog, so a stream
	// cut as stalled would drop its connection mid-chunk instead. A
	// client that reads nothing more still lets go of this write soon.
	_ = rc.SetWriteDeadline(time.Now().Add(endStreamWrite))
	_, _ = w.Write(ev)
	_ = rc.Flush()
	_ = rc.SetWriteDeadline(time.Time{}) // net/http would carry it into the connection's next request
}

// endStreamWrite bounds the write of a stream's last event.
const endStreamWrite = 5 * time.Second
