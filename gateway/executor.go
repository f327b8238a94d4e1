package gateway

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"sync"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"

	"github.com/kvgate/kvgate/gpu"
	"github.com/kvgate/kvgate/scheduler"
	"github.com/kvgate/kvgate/store"
)

// errUnknownEndpoint: a job's endpoint this replica does not serve; only
// a newer replica can have accepted it.
var errUnknownEndpoint = errors.New("an endpoint this replica does not serve: a newer one accepted the job")

// jobCall parses a job's request and looks up its model: a model no
// backend serves yet stands for itself (the scheduler waits for one).
func (s *Server) jobCall(j store.Job) (*call, gpu.Model, error) {
	ep, ok := jobEndpoints[j.Endpoint]
	if !ok {
		return nil, gpu.Model{}, fmt.Errorf("job %s: %w: %q", j.ID, errUnknownEndpoint, j.Endpoint)
	}
	c, err := parseCall(j.Body, ep)
	if err != nil {
		return nil, gpu.Model{}, fmt.Errorf("job %s: %w", j.ID, err)
	}
	model, err := s.resolveCall(c, "body.model")
	if err != nil {
		model = gpu.Model{ID: c.model}
	}
	return c, model, nil
}

// Prepare implements scheduler.Executor. The job's request is parsed and
// counted once, as it would be on the interactive path, and admitted in
// that path's order: first the tenant's quota (Admit: a permit for its
// reservation, prompt plus output budget, so that jobs count against
// their tenant's rates, concurrency and budgets and land in its usage
// ledger), then, by the runner, a backend's KV grant. A quota that
// refuses the permit fails Admit with scheduler.ClassQuota and the
// quota's reset as RetryAfter; one the job's request alone exceeds fails
// it for good, as does a request that does not parse.
func (s *Server) Prepare(ctx context.Context, j store.Job) (*scheduler.Call, error) {
	c, model, err := s.jobCall(j)
	if err != nil {
		_, span := startAttempt(ctx, j)
		endSpan(span, 0, err)
		class := scheduler.ClassInvalid
		if errors.Is(err, errUnknownEndpoint) {
			class = scheduler.ClassUnknownEndpoint // another replica may run it
		}
		return nil, &scheduler.ExecError{Class: class, Err: err}
	}
	// The attempt's span, in the job's trace: the admission wait (quota,
	// then a backend's KV grant) and the backend call below it.
	actx, attempt := startAttempt(ctx, j)
	_, admission := startAdmission(actx, scheduler.Batch.String())
	var (
		spanOnce sync.Once
		runErr   error
	)
	var backend string
	endAttempt := func() {
		spanOnce.Do(func() {
			endSpan(admission, 0, nil) // a no-op once Run ended it
			endSpan(attempt, 0, runErr)
			s.log.DebugContext(actx, "job attempt ended", "job_id", j.ID, "tenant", j.Tenant, "attempt", j.Attempt+1,
				"fence", j.Fence, "backend", backend, "err", runErr)
		})
	}
	prompt, maxOut, exact := s.reservation(ctx, c, model)
	t := &scheduler.Ticket{Model: model.ID, PromptTokens: prompt, MaxTokens: maxOut, Weight: s.weight(ctx, j.Tenant), Prefix: promptPrefix(c, prompt)}
	if !exact {
		t.PromptEstimate = func() int { return s.est.estimate(model.ID, c.promptBytes) }
	}
	var (
		p    *permit
		once sync.Once
		kept = func() {} // stops the permit's renewal
	)
	price := s.priceOf(model.ID, c.alias)
	release := func(o store.Outcome, attempts int, u *usage) {
		once.Do(func() { kept(); p.release(ctx, o, attempts, 0, u) }) // one backend call an attempt
	}
	call := &scheduler.Call{Ticket: t}
	call.Admit = func(ctx context.Context) error {
		// The runner charges the usage with the attempt's writes.
		if ch := s.carriedCharge(ctx, j.Tenant, prompt, maxOut, price); ch != nil {
			call.Charge = ch
			return nil
		}
		var err error
		if p, err = s.acquireQuotaFor(ctx, j.Tenant, "", store.Limits{}, prompt, maxOut, price); err != nil {
			return jobQuotaError(err)
		}
		kept = p.keep() // the job may wait for a backend longer than a lease
		return nil
	}
	call.Release = func() { release(store.NotSent, 0, nil); endAttempt() }
	call.Run = func(ctx context.Context, g *scheduler.Grant, sending func() error) (scheduler.Outcome, error) {
		admission.SetAttributes(attribute.String("kvgate.backend", g.Backend))
		admission.End()
		ctx, cancel := context.WithTimeout(trace.ContextWithSpan(ctx, attempt), s.cfg.RequestTimeout)
		defer cancel()
		out, sent, err := s.execute(ctx, j, c, g, sending)
		runErr, backend = err, g.Backend
		attempt.SetAttributes(attribute.String("kvgate.backend", g.Backend))
		o, attempts, u := store.NotSent, 0, (*usage)(nil)
		switch {
		case sent == sentNothing:
		case err == nil:
			o, attempts, u = store.Reported, 1, &usage{PromptTokens: out.PromptTokens, CompletionTokens: out.CompletionTokens}
			if !out.reported {
				u = &usage{PromptTokens: prompt, CompletionTokens: maxOut} // served without a report: charge what was reserved
			}
		case sent == sentRefused:
			o, attempts, u = store.Reported, 1, &usage{} // the backend refused it
		default:
			o, attempts = store.Uncertain, 1 // sent, and how much it used is unknown
		}
		if call.Charge != nil {
			chargeEnded(call.Charge, o, attempts, u, price)
		}
		release(o, attempts, u)
		return out.Outcome, err
	}
	return call, nil
}

// jobQuotaError turns acquireQuotaFor's refusal into a job attempt's.
func jobQuotaError(err error) error {
	var qe *store.QuotaError
	switch {
	case errors.As(err, &qe) && qe.TooLarge():
		// No reset makes room for it.
		return &scheduler.ExecError{Class: scheduler.ClassInvalid, Status: http.StatusTooManyRequests, Err: err}
	case errors.As(err, &qe):
		reset := qe.Reset
		if !qe.Budget() {
			// A rate window ends within its minute of the replica that
			// opened it; a later reset is clock skew between replicas.
			reset = min(reset, time.Minute)
		}
		return &scheduler.ExecError{Class: scheduler.ClassQuota, Status: http.StatusTooManyRequests, RetryAfter: reset, Err: err}
	case errors.Is(err, errTenantDeleted):
		// Accepted as its tenant was deleted: it fails, not retried.
		return &scheduler.ExecError{Class: scheduler.ClassInvalid, Status: http.StatusUnauthorized, Err: err}
	case errors.Is(err, errQuotaUnavailable):
		// Fail closed, as the interactive path does, and look again as
		// soon as it would.
		return &scheduler.ExecError{Class: scheduler.ClassQuota, Status: http.StatusServiceUnavailable, RetryAfter: time.Second, Err: err}
	}
	return &scheduler.ExecError{Class: scheduler.ClassCapacity, Err: err} // ctx ended
}

// MaxResultBytes is the most a job's result holds (Jobs.MaxAnswerBytes):
// the runner bounds an embeddings job's merged batches by it too.
func (s *Server) MaxResultBytes() int { return s.cfg.Jobs.MaxAnswerBytes }

var _ scheduler.ResultLimiter = (*Server)(nil)

// sendState is how far a job's request got.
type sendState int

const (
	sentNothing  sendState = iota // no backend received it
	sentRefused                   // the backend answered it with an error status
	sentAnswered                  // the backend answered it, or may have
)

// execOutcome is a backend's answer: reported says whether it reported
// usage.
type execOutcome struct {
	scheduler.Outcome
	reported bool
}

// execute sends the job's request (c, parsed by Prepare) to the granted
// backend, once sending allowed it, and reads its answer whole.
func (s *Server) execute(ctx context.Context, j store.Job, c *call, g *scheduler.Grant, sending func() error) (execOutcome, sendState, error) {
	fail := func(sent sendState, class scheduler.ErrorClass, status int, retryAfter time.Duration, err error) (execOutcome, sendState, error) {
		return execOutcome{}, sent, &scheduler.ExecError{Class: class, Status: status, RetryAfter: retryAfter, Err: err}
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, g.URL+j.Endpoint, bytes.NewReader(c.body))
	if err != nil {
		return fail(sentNothing, scheduler.ClassInvalid, 0, 0, err)
	}
	req.Header.Set("Content-Type", "application/json")
	nameBackendCall(req, j.ID)
	if err := sending(); err != nil {
		return execOutcome{}, sentNothing, err // the claim lost the job: send nothing
	}
	if ctx.Err() != nil {
		// Stopped while the mark was written (a drain, the lease given
		// up): the request has not left, and costs the tenant nothing.
		return fail(sentNothing, scheduler.ClassShutdown, 0, 0, context.Cause(ctx))
	}
	span := startBackendSpan(req, g)
	var spanStatus int
	var spanErr error
	defer func() { endSpan(span, spanStatus, spanErr) }()
	// One classification of a backend's answer, the interactive path's
	// (upstream.go). A job's attempt is tried on one backend only, so its
	// ambiguous failures count against that backend (reportAlone).
	resp, err := s.client.Do(req)
	spanErr = err
	if err == nil {
		spanStatus = resp.StatusCode
	}
	stopped := func() bool { return errors.Is(ctx.Err(), context.Canceled) }
	if err != nil && stopped() {
		// kvgate itself stopped the attempt: the backend did nothing wrong.
		return fail(sentAnswered, scheduler.ClassShutdown, 0, 0, err)
	}
	if err != nil {
		u := classifyTransport(err, errors.Is(ctx.Err(), context.DeadlineExceeded))
		reportAlone(s.pool, g.Backend, u)
		sent := sentAnswered
		if !u.class.sent() {
			sent = sentNothing // refused: the backend is down, and the job waits
		}
		return fail(sent, u.class.errorClass(), 0, 0, err)
	}
	defer resp.Body.Close()
	limit := s.cfg.Jobs.MaxAnswerBytes
	body, err := io.ReadAll(io.LimitReader(resp.Body, int64(limit)+1))
	if err != nil && stopped() {
		return fail(sentAnswered, scheduler.ClassShutdown, resp.StatusCode, 0, err)
	}
	if err != nil {
		u := classifyTransport(err, errors.Is(ctx.Err(), context.DeadlineExceeded))
		reportAlone(s.pool, g.Backend, u)
		return fail(sentAnswered, u.class.errorClass(), resp.StatusCode, 0, err)
	}
	if len(body) > limit && resp.StatusCode < 300 {
		// The backend did its work; the answer is more than a job keeps,
		// and would be again on any backend: the request's own failure.
		reportAlone(s.pool, g.Backend, upstream{class: upstreamOK, status: resp.StatusCode})
		return fail(sentAnswered, scheduler.ClassInvalid, 0, 0, fmt.Errorf(
			"the backend's answer is over %d bytes, the most a job's result holds: split the work into smaller jobs (for embeddings, fewer inputs, or encoding_format base64)", limit))
	}
	u := classifyResponse(resp.StatusCode, resp.Header, body)
	var answered *usage
	if u.class == upstreamOK {
		if body, answered, err = answerOf(c.ep, body); err != nil {
			u = malformedAnswer(resp.StatusCode, err)
		}
	}
	if u.class == upstreamRateLimited {
		s.cooldown(g, u.retryAfter)
	}
	reportAlone(s.pool, g.Backend, u)
	if u.class != upstreamOK {
		sent := sentRefused
		if u.status < 400 {
			sent = sentAnswered // a malformed 2xx: the work was done
		}
		return fail(sent, u.class.errorClass(), u.status, u.retryAfter, lineError(j, u.status, body, u.err))
	}
	out := execOutcome{Outcome: scheduler.Outcome{Body: body}}
	if answered != nil {
		out.reported = true
		out.PromptTokens, out.CompletionTokens = answered.PromptTokens, answered.CompletionTokens
		if c.promptBytes > 0 && c.media == 0 {
			s.est.observe(j.Model, c.promptBytes, out.PromptTokens)
		}
	}
	return out, sentAnswered, nil
}
