package gateway

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/kvgate/kvgate/scheduler"
	"github.com/kvgate/kvgate/store"
)

// everyFew lets a log line through at most once per period.
type everyFew struct {
	period time.Duration
	last   atomic.Int64 // unix nanoseconds of the last let through
}

func (e *everyFew) allow(now time.Time) bool {
	last := e.last.Load()
	return now.UnixNano()-last >= int64(e.period) && e.last.CompareAndSwap(last, now.UnixNano())
}

// storeAwayLogged bounds the log of requests refused for a store out of
// reach to one line every 10 s.
var storeAwayLogged = &everyFew{period: 10 * time.Second}

// apiError is an error that kvgate answers itself, in OpenAI's shape.
type apiError struct {
	status     int
	typ        string // invalid_request_error, authentication_error, server_error, ...
	code       string // model_not_found, invalid_api_key, ...
	param      string
	msg        string
	retryAfter time.Duration
	header     http.Header // more headers to send (x-ratelimit-*)
}

func (e *apiError) Error() string { return e.msg }

func badRequest(param, msg string) *apiError {
	return &apiError{status: http.StatusBadRequest, typ: "invalid_request_error", param: param, msg: msg}
}

// forbidden is a 403: the caller is known and may not do this. OpenAI
// answers a 403 with a type of its own (request_forbidden, as for an
// unsupported region), not invalid_request_error; the SDKs raise it as
// PermissionDeniedError.
func forbidden(code, msg string) *apiError {
	return &apiError{status: http.StatusForbidden, typ: "request_forbidden", code: code, msg: msg}
}

// answerTooLarge refuses a backend's answer over Config.MaxAnswerBytes.
// Asking again would make the same answer: the SDKs are told not to.
func answerTooLarge(limit int64) *apiError {
	return &apiError{status: http.StatusBadGateway, typ: "server_error", code: "answer_too_large",
		msg:    fmt.Sprintf("The backend's answer is over %d bytes, the most kvgate reads for one request: ask for less (fewer inputs or choices, fewer logprobs, a lower max_tokens), stream it, or use encoding_format base64 for embeddings.", limit),
		header: http.Header{"X-Should-Retry": {"false"}}}
}

// upstreamError is a backend's own error response, passed on to the
// client with the backend's status and message.
type upstreamError struct {
	status     int
	msg        string
	param      string // the field the backend named, if any
	retryAfter time.Duration
}

func (e *upstreamError) Error() string { return e.msg }

// writeError answers err in OpenAI's error format. It is the only place
// that maps errors to statuses; internal detail is logged, never sent.
func writeError(w http.ResponseWriter, log *slog.Logger, err error) int {
	e := toAPIError(err)
	switch {
	case e.status >= 500 && e.status != http.StatusServiceUnavailable:
		log.Error("request failed", "status", e.status, "err", err, "request_id", w.Header().Get(RequestIDHeader))
	case errors.Is(err, store.ErrUnavailable) && storeAwayLogged.allow(time.Now()):
		// A 503 is kvgate's to give (draining, no backend, overload), but
		// a store out of reach is the operator's to hear of: once in a
		// while, not once a request.
		log.Warn("the job store is out of reach: answering 503 store_unavailable", "err", err, "request_id", w.Header().Get(RequestIDHeader))
	}
	if e.retryAfter > 0 {
		w.Header().Set("Retry-After", strconv.Itoa(int((e.retryAfter+time.Second-1)/time.Second)))
	}
	if e.status == http.StatusConflict || e.status == http.StatusUnprocessableEntity {
		// The OpenAI SDKs retry a 409 on their own (twice, by default);
		// a conflict with the resource's state or a reused key is not
		// one a retry clears.
		w.Header().Set("x-should-retry", "false")
	}
	for k, v := range e.header {
		w.Header()[k] = v
	}
	writeJSON(w, e.status, e.body())
	return e.status
}

// errorResponse is OpenAI's ErrorResponse: all four keys always present,
// param and code null when empty.
type errorResponse struct {
	Error errorInfo `json:"error"`
}

type errorInfo struct {
	Message string  `json:"message"`
	Type    string  `json:"type"`
	Param   *string `json:"param"`
	Code    *string `json:"code"`
}

// body is the error in OpenAI's shape: the response body, or the data of
// the error event that ends a stream whose status line has gone out.
func (e *apiError) body() errorResponse {
	body := errorResponse{Error: errorInfo{Message: e.msg, Type: e.typ}}
	if e.code != "" {
		body.Error.Code = &e.code
	}
	if e.param != "" {
		body.Error.Param = &e.param
	}
	return body
}

// errStreamCut is what a client hears in a stream whose backend failed
// after the stream began (the status line long gone): the stream's last
// event (endStream).
var errStreamCut = &apiError{status: http.StatusBadGateway, typ: "server_error", code: "upstream_error",
	msg: "The model backend failed mid-stream; the response is incomplete."}

func toAPIError(err error) *apiError {
	var (
		api      *apiError
		up       *upstreamError
		rejected *scheduler.RejectedError
		tooLarge *scheduler.TooLargeError
		down     *scheduler.UnroutableError
		maxBytes *http.MaxBytesError
		quota    *store.QuotaError
		busy     *store.TenantBusyError
	)
	switch {
	case errors.As(err, &api):
		return api
	case errors.As(err, &quota):
		return quotaError(quota)
	case errors.Is(err, errQuotaUnavailable):
		return &apiError{status: http.StatusServiceUnavailable, typ: "server_error", code: "quota_unavailable", retryAfter: time.Second,
			msg: "The gateway cannot check your quota right now; retry after the Retry-After delay."}
	case errors.Is(err, errKeysUnavailable):
		return &apiError{status: http.StatusServiceUnavailable, typ: "server_error", code: "auth_unavailable", retryAfter: time.Second,
			msg: "The gateway cannot check your API key right now; retry after the Retry-After delay."}
	case errors.Is(err, errTenantDeleted):
		return &apiError{status: http.StatusUnauthorized, typ: "invalid_request_error", code: "tenant_deleted",
			msg: "This key's tenant has been deleted; its keys no longer work."}
	case errors.Is(err, store.ErrTenantName):
		return badRequest("name", "A tenant needs a name of 1 to 128 bytes.")
	case errors.Is(err, store.ErrEndpointDeleted):
		return &apiError{status: http.StatusConflict, typ: "invalid_request_error", code: "endpoint_deleted",
			msg: "The webhook endpoint this Idempotency-Key made has been deleted; send a new key to make another."}
	case errors.Is(err, store.ErrTenantNameRetired):
		return &apiError{status: http.StatusConflict, typ: "invalid_request_error", code: "tenant_name_retired",
			msg: "A deleted tenant had this name, and its jobs, files, batches, webhooks and usage stay under it; a new tenant of the name would see them. Choose another name."}
	case errors.As(err, &busy):
		return &apiError{status: http.StatusConflict, typ: "invalid_request_error", code: "tenant_busy",
			msg: fmt.Sprintf("Tenant %s has %d jobs not yet ended and %d batches open; deleted, they would run without its limits. "+
				"Cancel them (POST /v1/jobs/{id}/cancel, POST /v1/batches/{id}/cancel) or let them end, then delete it.", busy.Tenant, busy.Jobs, busy.Batches)}
	case errors.Is(err, store.ErrExists):
		return &apiError{status: http.StatusConflict, typ: "invalid_request_error", code: "already_exists", msg: "It already exists."}
	case errors.As(err, &maxBytes):
		return &apiError{status: http.StatusRequestEntityTooLarge, typ: "invalid_request_error",
			msg: "Request body is larger than the " + strconv.FormatInt(maxBytes.Limit, 10) + " bytes this gateway accepts."}
	case errors.As(err, &tooLarge):
		e := &apiError{status: http.StatusBadRequest, typ: "invalid_request_error", code: "context_length_exceeded",
			param: "max_tokens", msg: tooLarge.Error() + ". Reduce the prompt or max_tokens."}
		var named *tooLargeCall
		switch {
		case !errors.As(err, &named):
		case named.input:
			e.param, e.msg = named.param, tooLarge.Error()+". Reduce "+named.param+"."
		default:
			e.param, e.msg = named.param, tooLarge.Error()+". Reduce the prompt or "+named.param+"."
		}
		return e
	case errors.As(err, &rejected):
		return &apiError{status: http.StatusServiceUnavailable, typ: "server_error", code: "server_overloaded",
			retryAfter: rejected.RetryAfter,
			msg:        "The gateway is at capacity (" + rejected.Reason + "); retry after the Retry-After delay."}
	case errors.Is(err, store.ErrNotFound):
		return &apiError{status: http.StatusNotFound, typ: "invalid_request_error", code: "not_found", msg: "No such job."}
	case errors.Is(err, store.ErrConflict):
		// 422, as the idempotency-key draft and Stripe have it: the same
		// request again cannot succeed (and 409 is one the SDKs retry).
		return &apiError{status: http.StatusUnprocessableEntity, typ: "invalid_request_error", code: "idempotency_key_reused",
			msg: "This Idempotency-Key was used for a different request; use a new key for a new request."}
	case errors.Is(err, store.ErrPolicyNotFound):
		return &apiError{status: http.StatusNotFound, typ: "invalid_request_error", code: "policy_not_found", param: "validation.policy",
			msg: "No such validation policy (or version of it) for your tenant."}
	case errors.Is(err, store.ErrEntityVersionExists):
		return &apiError{status: http.StatusConflict, typ: "invalid_request_error", code: "entity_version_exists", param: "entity.version",
			msg: "Another job already has this version of the entity: a version of an entity is one job."}
	case errors.Is(err, store.ErrWrongState):
		return &apiError{status: http.StatusConflict, typ: "invalid_request_error", code: "job_state",
			msg: "The job's state does not allow this: a review needs REVIEW_REQUIRED, a replay FAILED_TERMINAL or REVIEW_REQUIRED."}
	case errors.Is(err, store.ErrBatchClosed):
		return &apiError{status: http.StatusConflict, typ: "invalid_request_error", code: "batch_not_in_progress",
			msg: "This job is a line of a batch that is no longer in progress: the batch's files hold it as it ended, and a replay would reach neither."}
	case errors.Is(err, store.ErrFinal):
		return &apiError{status: http.StatusConflict, typ: "invalid_request_error", code: "job_final", msg: "The job has already ended."}
	case errors.Is(err, store.ErrUnavailable):
		return &apiError{status: http.StatusServiceUnavailable, typ: "server_error", code: "store_unavailable", retryAfter: time.Second,
			msg: "The job store cannot be reached right now. Retry with the same Idempotency-Key: if this request was recorded after all, the same job comes back, never a second one."}
	case errors.Is(err, store.ErrFailed):
		// The statement's text is the log's (writeError), not the client's.
		return &apiError{status: http.StatusInternalServerError, typ: "server_error", code: "store_error",
			msg: "kvgate's store failed this request; if it persists, tell the gateway's operators."}
	case errors.As(err, &down):
		// Which backends and why is the scheduler's log line, not the
		// client's business.
		return &apiError{status: http.StatusServiceUnavailable, typ: "server_error", code: "backend_unavailable", retryAfter: down.RetryAfter,
			msg: fmt.Sprintf("No backend serving model `%s` is reachable now; retry after the Retry-After delay.", down.Model)}
	case errors.Is(err, scheduler.ErrNoBackend):
		return &apiError{status: http.StatusNotFound, typ: "invalid_request_error", code: "model_not_found", param: "model",
			msg: "No backend serves this model."}
	case errors.As(err, &up):
		e := &apiError{status: up.status, msg: up.msg, param: up.param, retryAfter: up.retryAfter}
		switch {
		case up.status == http.StatusBadRequest && contextTooLong(up.msg):
			e.typ, e.code = "invalid_request_error", "context_length_exceeded"
		case up.status == http.StatusTooManyRequests:
			e.typ, e.code = "rate_limit_error", "rate_limit_exceeded"
		case up.status == http.StatusNotFound && modelMissing(up.msg):
			// The last backend tried did not serve it after all (an
			// adapter unloaded since the last scrape): kvgate's own answer.
			e.typ, e.code, e.param = "invalid_request_error", "model_not_found", "model"
		case up.status < 500:
			e.typ = "invalid_request_error"
		default:
			e.typ = "server_error"
		}
		return e
	case errors.Is(err, context.Canceled):
		// The client went away; nobody reads this, but the metrics do.
		return &apiError{status: 499, typ: "invalid_request_error", code: "client_closed_request", msg: "The client closed the request."}
	case errors.Is(err, context.DeadlineExceeded), errors.Is(err, errStalled):
		return &apiError{status: http.StatusGatewayTimeout, typ: "server_error", code: "timeout", msg: "The backend did not answer in time."}
	}
	return &apiError{status: http.StatusBadGateway, typ: "server_error", code: "upstream_error",
		msg: "The model backend failed; the request may be retried."}
}

// readBody reads a request's body. A body over the route's limit keeps
// its *http.MaxBytesError (413 in toAPIError); any other failure to read
// it (a broken chunked encoding, a connection cut mid-body) is the
// client's: 400, never a backend's failure.
func readBody(r *http.Request) ([]byte, error) {
	b, err := io.ReadAll(r.Body)
	if err != nil {
		var maxBytes *http.MaxBytesError
		if errors.As(err, &maxBytes) {
			return nil, err
		}
		return nil, badRequest("", "Could not read the request body.")
	}
	return b, nil
}

// quotaError answers a tenant quota's refusal as OpenAI does: 429 with
// rate_limit_exceeded for a rate (retry after the window resets) or
// insufficient_quota for a spent budget (do not retry: x-should-retry
// false), with Retry-After and the x-ratelimit-* headers.
func quotaError(q *store.QuotaError) *apiError {
	e := &apiError{status: http.StatusTooManyRequests, typ: "rate_limit_error", code: "rate_limit_exceeded",
		retryAfter: max(q.Reset, time.Second), header: http.Header{}}
	what := map[string]string{
		"requests": "requests per min (RPM)", "tokens": "tokens per min (TPM)", "concurrency": "concurrent requests",
		"daily_tokens": "tokens per day", "monthly_tokens": "tokens per month",
		"pending_jobs": "pending jobs", "pending_tokens": "tokens of pending jobs",
	}[q.Limit]
	e.msg = fmt.Sprintf("Rate limit reached for your %s on %s: Limit %d, Used %d, Requested %d.", q.Scope, what, q.Max, q.Used, q.Asked)
	switch {
	case q.Spend():
		e.typ, e.code = "insufficient_quota", "insufficient_quota"
		period := map[string]string{"daily_spend": "spending per day", "monthly_spend": "spending per month"}[q.Limit]
		e.msg = fmt.Sprintf("You exceeded your current quota of %s: Limit %s, Used %s, Requested %s. It resets in %s.",
			period, money(q.Max), money(q.Used), money(q.Asked), q.Reset.Round(time.Second))
		e.header.Set("x-should-retry", "false")
	case q.Budget():
		e.typ, e.code = "insufficient_quota", "insufficient_quota"
		e.msg = fmt.Sprintf("You exceeded your current quota of %s: Limit %d, Used %d, Requested %d. It resets in %s.",
			what, q.Max, q.Used, q.Asked, q.Reset.Round(time.Second))
		e.header.Set("x-should-retry", "false")
	case q.TooLarge():
		// As OpenAI answers a request over the whole TPM: no wait helps.
		e.msg = fmt.Sprintf("Request too large for your %s on %s: Limit %d, Requested %d. Ask for less (a shorter prompt, a lower max_tokens) to run it.",
			q.Scope, what, q.Max, q.Asked)
		e.retryAfter = 0
		e.header.Set("x-should-retry", "false")
	case q.Reset > 0:
		e.msg += fmt.Sprintf(" Please try again in %s.", q.Reset.Round(time.Millisecond))
	default:
		e.msg += " Please try again when a request in flight ends."
	}
	rateLimitHeaders(e.header, q.Window)
	if e.retryAfter > 0 {
		e.header.Set("retry-after-ms", strconv.FormatInt(e.retryAfter.Milliseconds(), 10))
	}
	return e
}

// contextTooLong reports whether a backend's 400 says the prompt and
// output do not fit the model's context: the OpenAI server's check
// ("maximum context length") or the engine's own, which catches what the
// server could not count (an image's placeholders: "longer than the
// maximum model length").
func contextTooLong(msg string) bool {
	m := strings.ToLower(msg)
	return strings.Contains(m, "maximum context length") || strings.Contains(m, "longer than the maximum model length")
}
