package gateway

import (
	"context"
	"net/http"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/kvgate/kvgate/scheduler"
	"github.com/kvgate/kvgate/store"
)

// Spans follow the W3C Trace Context: a caller's traceparent is the
// parent of its request's span, and kvgate sends one to the backend of
// each call, so that vLLM (--otlp-traces-endpoint) adds its spans below.
// With no OTLP endpoint configured the global provider is a no-op and
// none of this costs more than a few calls.
var propagator = propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{})

// startServerSpan starts a request's span, a child of the caller's
// traceparent if it sent one.
func (s *Server) startServerSpan(ctx context.Context, r *http.Request, requestID string) (context.Context, trace.Span) {
	ctx = propagator.Extract(ctx, propagation.HeaderCarrier(r.Header))
	return scheduler.Tracer().Start(ctx, r.Method+" "+r.URL.Path, trace.WithSpanKind(trace.SpanKindServer),
		trace.WithAttributes(attribute.String("http.request.method", r.Method), attribute.String("url.path", r.URL.Path),
			attribute.String("kvgate.request_id", requestID)))
}

// endServerSpan names the span by its route and ends it with what the
// access log says.
func endServerSpan(span trace.Span, i *reqInfo, status int) {
	if !span.IsRecording() {
		span.End()
		return
	}
	if i.route != "" {
		span.SetName(i.route)
		span.SetAttributes(attribute.String("http.route", i.route))
	}
	span.SetAttributes(attribute.Int("http.response.status_code", status))
	for _, kv := range []struct{ k, v string }{{"kvgate.tenant", i.tenant}, {"kvgate.model", i.model}, {"kvgate.backend", i.backend}, {"kvgate.job_id", i.jobID}} {
		if kv.v != "" {
			span.SetAttributes(attribute.String(kv.k, kv.v))
		}
	}
	if i.promptTokens > 0 || i.completionTokens > 0 {
		span.SetAttributes(attribute.Int("gen_ai.usage.input_tokens", i.promptTokens), attribute.Int("gen_ai.usage.output_tokens", i.completionTokens))
	}
	if status >= 500 {
		span.SetStatus(codes.Error, http.StatusText(status))
	}
	span.End()
}

// traceIDs returns the trace and span of ctx, when it is traced.
func traceIDs(ctx context.Context) (traceID, spanID string, ok bool) {
	sc := trace.SpanContextFromContext(ctx)
	if !sc.IsValid() {
		return "", "", false
	}
	return sc.TraceID().String(), sc.SpanID().String(), true
}

// startBackendSpan starts the span of one call to a backend, a child of
// the request's context, and puts its traceparent on the request.
func startBackendSpan(req *http.Request, g *scheduler.Grant) trace.Span {
	ctx, span := scheduler.Tracer().Start(req.Context(), "backend "+req.URL.Path, trace.WithSpanKind(trace.SpanKindClient),
		trace.WithAttributes(attribute.String("kvgate.backend", g.Backend), attribute.String("server.address", req.URL.Host),
			attribute.String("url.path", req.URL.Path)))
	propagator.Inject(ctx, propagation.HeaderCarrier(req.Header))
	*req = *req.WithContext(ctx)
	return span
}

// endSpan ends a span with the error, if any.
func endSpan(span trace.Span, status int, err error) {
	if status > 0 {
		span.SetAttributes(attribute.Int("http.response.status_code", status))
	}
	if err != nil {
		span.SetStatus(codes.Error, err.Error())
	}
	span.End()
}

// startAdmission starts the span of a wait for kvgate's admission.
func startAdmission(ctx context.Context, class string) (context.Context, trace.Span) {
	return scheduler.Tracer().Start(ctx, "admission", trace.WithAttributes(attribute.String("kvgate.class", class)))
}

// startAttempt starts the span of one attempt of a job, in the job's
// trace, from its claim (the job's last update: the claim's) to its end.
func startAttempt(ctx context.Context, j store.Job) (context.Context, trace.Span) {
	start := j.UpdatedAt
	if start.IsZero() || start.After(time.Now()) {
		start = time.Now()
	}
	ctx = scheduler.JobContext(ctx, j.ID)
	ctx, span := scheduler.Tracer().Start(ctx, "attempt", trace.WithTimestamp(start),
		trace.WithAttributes(append(scheduler.JobAttrs(j.ID, j.Tenant, j.Attempt+1, j.Fence), attribute.String("kvgate.model", j.Model))...))
	span.AddEvent("claimed", trace.WithTimestamp(start))
	return ctx, span
}

// linkJob links the submitting request's span and the job's trace both
// ways, and traces the acceptance in the job's trace.
func linkJob(ctx context.Context, j store.Job, start time.Time) {
	req := trace.SpanFromContext(ctx)
	sc, ok := scheduler.JobSpanContext(j.ID)
	if !ok || !req.IsRecording() {
		return
	}
	req.AddLink(trace.Link{SpanContext: sc, Attributes: []attribute.KeyValue{attribute.String("kvgate.link", "job")}})
	_, span := scheduler.Tracer().Start(scheduler.JobContext(context.Background(), j.ID), "accept",
		trace.WithTimestamp(start), trace.WithLinks(trace.LinkFromContext(ctx, attribute.String("kvgate.link", "request"))),
		trace.WithAttributes(append(scheduler.JobAttrs(j.ID, j.Tenant, 0, 0), attribute.String("kvgate.request_id", RequestID(ctx)))...))
	span.End()
}

// firstToken marks the first streamed token on the backend call's span.
func firstToken(ctx context.Context, ttft time.Duration) {
	span := trace.SpanFromContext(ctx)
	if span.IsRecording() {
		span.AddEvent("first_token")
		span.SetAttributes(attribute.Float64("kvgate.ttft_seconds", ttft.Seconds()))
	}
}

// traceDelivery adds a result's delivery to its caller to the job's trace
// (linked to the fetching request's span), each time the result is
// fetched; webhook deliveries will add theirs the same way.
func traceDelivery(ctx context.Context, j store.Job, bytes int) {
	if !trace.SpanFromContext(ctx).IsRecording() {
		return
	}
	if i := infoOf(ctx); i != nil {
		i.jobID = j.ID
	}
	_, span := scheduler.Tracer().Start(scheduler.JobContext(context.Background(), j.ID), "delivery result",
		trace.WithTimestamp(requestStart(ctx)), trace.WithSpanKind(trace.SpanKindProducer),
		trace.WithLinks(trace.LinkFromContext(ctx, attribute.String("kvgate.link", "request"))),
		trace.WithAttributes(append(scheduler.JobAttrs(j.ID, j.Tenant, 0, 0), attribute.String("kvgate.request_id", RequestID(ctx)),
			attribute.Int("kvgate.result_bytes", bytes))...))
	span.End()
}
