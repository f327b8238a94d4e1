package gateway

import (
	"errors"
	"fmt"
	"net"
	"net/http"
	"strings"
	"time"

	"github.com/kvgate/kvgate/scheduler"
)

// The one classification of a backend's answer to one request, shared by
// the interactive path (forward, proxy) and the job executor, and what it
// means for the backend's health.

// upstreamClass is how one backend handled one request.
type upstreamClass uint8

const (
	// upstreamNone: nothing to judge the backend by; kvgate or its client
	// ended the call first. Not a failure class: errorClass does not
	// apply.
	upstreamNone upstreamClass = iota
	upstreamOK
	// upstreamNotSent: no connection (refused, unreachable, no such
	// host): the backend never saw the request.
	upstreamNotSent
	// upstreamRateLimited: 429, the backend asks for a pause.
	upstreamRateLimited
	// upstreamBackendError: 5xx, a 2xx whose body does not parse, or a
	// connection that failed after the request went out.
	upstreamBackendError
	// upstreamTimeout: the backend went silent past kvgate's timeout.
	upstreamTimeout
	// upstreamRequestError: 4xx but 401, 403, 404 and 429; the request
	// itself is wrong.
	upstreamRequestError
	// upstreamModelMissing: a 404 that says the backend does not serve the model
	// (now): kvgate's view of it is stale (a restart with another model,
	// a LoRA adapter unloaded). Another backend, or this one later, may.
	upstreamModelMissing
	// upstreamRefused: 401 or 403. kvgate sends a backend no credentials,
	// so one that wants them (a vLLM started with --api-key) refuses
	// every request before running it, whoever the caller: the backend's
	// failure, never the request's, and nothing done.
	upstreamRefused
)

func (c upstreamClass) String() string {
	return [...]string{"none", "ok", "not_sent", "rate_limited", "backend_error", "timeout", "request_error", "model_missing", "refused"}[c]
}

// errorClass maps the class to a job attempt's: a request that never
// left is ClassRefused, a wait that spends no attempt.
func (c upstreamClass) errorClass() scheduler.ErrorClass {
	switch c {
	case upstreamNotSent, upstreamRefused:
		return scheduler.ClassRefused
	case upstreamRateLimited:
		return scheduler.ClassRateLimited
	case upstreamTimeout:
		return scheduler.ClassTimeout
	case upstreamRequestError:
		return scheduler.ClassInvalid
	case upstreamModelMissing:
		return scheduler.ClassNoBackend // a wait: no backend serves it now
	}
	return scheduler.ClassBackend
}

// sent reports whether the backend may have received the request (and
// may have done the work).
func (c upstreamClass) sent() bool { return c != upstreamNotSent && c != upstreamRefused }

// retryElsewhere reports whether another backend may do better with a
// request that failed so, nothing having reached the client.
func (c upstreamClass) retryElsewhere() bool {
	return c == upstreamNotSent || c == upstreamRefused || c == upstreamRateLimited || c == upstreamBackendError || c == upstreamTimeout ||
		c == upstreamModelMissing
}

// ambiguous reports whether a failure so may be the request's own doing
// rather than the backend's: a request can crash a server, make it answer
// 500, or run past the timeout, on every backend alike. See
// requestHealth for how such failures are charged.
func (c upstreamClass) ambiguous() bool {
	return c == upstreamBackendError || c == upstreamTimeout
}

// upstream is a classified answer.
type upstream struct {
	class upstreamClass
	// status is the backend's HTTP status; 0 when it sent none.
	status int
	// retryAfter is the backend's Retry-After; 0 when it sent none.
	retryAfter time.Duration
	// err is nil for upstreamOK; an *upstreamError (the backend's status
	// and message, for the client) when the backend answered, else the
	// transport's error.
	err error
}

// classifyResponse classifies a backend's answer from its status, headers
// and (error) body. A status below 400 is upstreamOK: whether its body is
// what was asked for is the caller's to check (malformedAnswer).
func classifyResponse(status int, h http.Header, body []byte) upstream {
	if status < 400 {
		return upstream{class: upstreamOK, status: status}
	}
	msg, param := errorMessage(body)
	if msg == "" {
		msg = fmt.Sprintf("The backend answered %d.", status)
	}
	u := upstream{status: status, retryAfter: parseRetryAfter(h.Get("Retry-After"))}
	u.err = &upstreamError{status: status, msg: msg, param: param, retryAfter: u.retryAfter}
	switch {
	case status == http.StatusUnauthorized || status == http.StatusForbidden:
		// The backend's failure, a 502, never the caller's 401.
		u.class = upstreamRefused
		u.err = &upstreamError{status: http.StatusBadGateway, msg: fmt.Sprintf(
			"The model backend refused kvgate's request (%d: %s); it may expect an API key kvgate does not send.", status, msg)}
	case status == http.StatusTooManyRequests:
		u.class = upstreamRateLimited
	case status >= 500:
		u.class = upstreamBackendError
	case status == http.StatusNotFound && modelMissing(msg):
		u.class = upstreamModelMissing
	default:
		u.class = upstreamRequestError
	}
	return u
}

// modelMissing reports whether a backend's 404 says the model is not
// served there ("The model `x` does not exist."), rather than something
// the request named (a previous_response_id, a route).
func modelMissing(msg string) bool {
	m := strings.ToLower(msg)
	return strings.Contains(m, "model") && (strings.Contains(m, "does not exist") || strings.Contains(m, "not found"))
}

// classifyTransport classifies a round trip or body read that failed
// with err; stalled says kvgate's own timeout cut it. A connection never
// made sent nothing, even when the timeout cut its dial (a host that drops
// connection attempts): no attempt spent.
func classifyTransport(err error, stalled bool) upstream {
	var op *net.OpError
	switch {
	case errors.As(err, &op) && op.Op == "dial":
		return upstream{class: upstreamNotSent, err: err}
	case stalled:
		return upstream{class: upstreamTimeout, err: err}
	}
	return upstream{class: upstreamBackendError, err: err}
}

// malformedAnswer classifies a 2xx answer whose body did not parse.
func malformedAnswer(status int, err error) upstream {
	return upstream{class: upstreamBackendError, status: status, err: fmt.Errorf("malformed response: %w", err)}
}

// sameWay reports whether two failures look alike enough to blame the
// request that met both: the same class and status.
func (u upstream) sameWay(o upstream) bool { return u.class == o.class && u.status == o.status }

// healthReporter is what requestHealth tells of backends; *gpu.Pool
// satisfies it.
type healthReporter interface {
	ReportFailure(name string, err error)
	ReportSuccess(name string)
}

// requestHealth decides, for one request tried on one backend after
// another, which backends its failures count against.
//
// A failure that may be the request's own (upstreamClass.ambiguous: a
// 5xx, a malformed or cut answer, a stall) is held, not reported, until
// the request shows whose it was. If the request then fails the same way
// (sameWay) on another backend, it is the request's problem: neither
// failure is reported, and the request is not tried further (observe
// returns true). If it succeeds elsewhere, the held failures were the
// backends' own and are reported. If it fails elsewhere in another way,
// or is not tried elsewhere, nothing tells them apart and settle reports
// them as failures, as before. So a backend is charged for what other
// backends do not share, and a client whose requests fail everywhere
// cannot eject the fleet; the pool, for its part, never ejects a model's
// last routable backend for dispatch failures (gpu.Pool.ReportFailure),
// which bounds the harm of a failure charged wrongly.
//
// Failures that are never the request's are reported at once: a
// connection refused (upstreamNotSent). An answer that says the request
// is wrong (upstreamRequestError) is a healthy backend's, and drops the
// held failures: the request was bad. A 429 is neither: the caller starts
// a cooldown. Not safe for concurrent use; one per request.
type requestHealth struct {
	held []heldFailure
}

type heldFailure struct {
	backend string
	u       upstream
}

// observe records how backend answered the request, and reports whether
// the request has now failed the same way on two backends.
func (h *requestHealth) observe(pool healthReporter, backend string, u upstream) (sameTwice bool) {
	switch c := u.class; {
	case c == upstreamOK:
		pool.ReportSuccess(backend)
		h.settle(pool)
	case c == upstreamRequestError:
		pool.ReportSuccess(backend)
		h.held = nil
	case c == upstreamNotSent || c == upstreamRefused:
		pool.ReportFailure(backend, u.err)
	case c.ambiguous():
		for _, f := range h.held {
			if f.backend != backend && f.u.sameWay(u) {
				h.held = nil
				return true
			}
		}
		h.held = append(h.held, heldFailure{backend, u})
	}
	return false
}

// settle reports the failures still held: nothing showed them to be the
// request's.
func (h *requestHealth) settle(pool healthReporter) {
	for _, f := range h.held {
		pool.ReportFailure(f.backend, f.u.err)
	}
	h.held = nil
}

// reportAlone tells the pool how backend answered a request that is tried
// on no other backend now, such as a job's attempt: requestHealth with
// nothing to compare, so an ambiguous failure counts against the backend.
func reportAlone(pool healthReporter, backend string, u upstream) {
	var h requestHealth
	h.observe(pool, backend, u)
	h.settle(pool)
}
