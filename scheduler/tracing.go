package scheduler

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"time"

	"github.com/google/uuid"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"

	"github.com/kvgate/kvgate/store"
	"go.opentelemetry.io/otel/trace"
)

// TracerName names kvgate's tracer.
const TracerName = "github.com/kvgate/kvgate"

// Tracer is kvgate's tracer, from the global provider: a no-op until
// kvgate serve installs an OTLP exporter (tracing.otlp_endpoint).
func Tracer() trace.Tracer { return otel.Tracer(TracerName) }

// untraced is the global provider before one is installed, which records
// nothing.
var untraced = otel.GetTracerProvider()

// tracing reports whether a provider is installed. The spans only a job's
// trace holds (its events' ways through the outbox and the inbox, its
// root) are not built without one: with no caller's trace to carry, they
// would be a few allocations an event for nothing (about 7% of the
// process's allocations in the acceptance test).
func tracing() bool { return otel.GetTracerProvider() != untraced }

// A durable job's trace is named by the job: its trace id is the job id's
// 16 bytes and its root span's id is derived from it, so that every
// process that touches the job (the replica that accepted it, the relay
// that published its events, the inbox that received them, the workers
// of each attempt) adds its spans to the one trace without storing a
// trace context anywhere. The caller's own trace, when it sent a
// traceparent, links to it from the submitting request's span.

// JobSpanContext is the job's root span, as a remote parent; ok false when
// the id is not a UUID.
func JobSpanContext(jobID string) (trace.SpanContext, bool) {
	id, err := uuid.Parse(jobID)
	if err != nil {
		return trace.SpanContext{}, false
	}
	sum := sha256.Sum256(append([]byte("kvgate-job-root:"), id[:]...))
	var sid trace.SpanID
	copy(sid[:], sum[:8])
	return trace.NewSpanContext(trace.SpanContextConfig{
		TraceID: trace.TraceID(id), SpanID: sid, TraceFlags: trace.FlagsSampled, Remote: true,
	}), true
}

// JobContext returns ctx with the job's root span as the parent of the
// spans started from it.
func JobContext(ctx context.Context, jobID string) context.Context {
	if sc, ok := JobSpanContext(jobID); ok {
		return trace.ContextWithRemoteSpanContext(ctx, sc)
	}
	return ctx
}

// JobAttrs are a job's span attributes; attempt and fence only where an
// attempt is meant (attempt > 0).
func JobAttrs(jobID, tenant string, attempt int, fence int64) []attribute.KeyValue {
	kv := []attribute.KeyValue{attribute.String("kvgate.job_id", jobID)}
	if tenant != "" {
		kv = append(kv, attribute.String("kvgate.tenant", tenant))
	}
	if attempt > 0 {
		kv = append(kv, attribute.Int("kvgate.attempt", attempt), attribute.Int64("kvgate.fence", fence))
	}
	return kv
}

// EndJobTrace emits the job's root span, from its acceptance (the job
// id's UUIDv7 time) to its final state, once: the inbox calls it on the
// job's final event, which it receives once fleet-wide. The root's id is
// JobSpanContext's when the provider was built with IDGenerator.
func EndJobTrace(e Event) {
	if !tracing() {
		return
	}
	sc, ok := JobSpanContext(e.JobID)
	id, err := uuid.Parse(e.JobID)
	if !ok || err != nil || id.Version() != 7 || !e.State.Final() {
		return
	}
	sec, nsec := id.Time().UnixTime()
	accepted := time.Unix(sec, nsec)
	ctx := context.WithValue(context.Background(), rootIDsKey{}, sc)
	_, span := Tracer().Start(ctx, "job", trace.WithNewRoot(), trace.WithTimestamp(accepted),
		trace.WithAttributes(append(JobAttrs(e.JobID, e.Tenant, 0, 0), attribute.String("kvgate.final_state", string(e.State)))...))
	span.End(trace.WithTimestamp(e.CreatedAt))
}

type rootIDsKey struct{}

// IDGenerator returns the span id generator kvgate's provider uses:
// random ids, except for a job's root span, whose ids are the job's.
func IDGenerator() sdktrace.IDGenerator { return jobIDs{} }

type jobIDs struct{}

func (jobIDs) NewIDs(ctx context.Context) (trace.TraceID, trace.SpanID) {
	if sc, ok := ctx.Value(rootIDsKey{}).(trace.SpanContext); ok {
		return sc.TraceID(), sc.SpanID()
	}
	var tid trace.TraceID
	var sid trace.SpanID
	randomID(tid[:])
	randomID(sid[:])
	return tid, sid
}

func (jobIDs) NewSpanID(ctx context.Context, _ trace.TraceID) trace.SpanID {
	var sid trace.SpanID
	randomID(sid[:])
	return sid
}

func randomID(b []byte) {
	for {
		_, _ = rand.Read(b)
		for _, c := range b {
			if c != 0 {
				return
			}
		}
	}
}

// tracePublished adds to each event's job trace the event's way through
// the outbox: from its commit to the broker's acknowledgement.
func tracePublished(evs []store.Event, at time.Time) {
	if !tracing() {
		return
	}
	for _, e := range evs {
		_, span := Tracer().Start(JobContext(context.Background(), e.JobID), "outbox.publish "+e.Type,
			trace.WithTimestamp(e.CreatedAt), trace.WithSpanKind(trace.SpanKindProducer),
			trace.WithAttributes(append(JobAttrs(e.JobID, e.Tenant, 0, 0),
				attribute.String("kvgate.event_id", e.ID), attribute.String("kvgate.event_type", e.Type),
				attribute.String("kvgate.state", string(e.State)))...))
		span.End(trace.WithTimestamp(at))
	}
}

// traceReceived adds the inbox's receipt of an event (recorded once,
// fleet-wide) to its job's trace, from the broker's ingestion (stored) to
// the inbox's record: the broker lag of that event. A final event also
// ends the job's root span.
func traceReceived(e Event, stored, at time.Time) {
	if !tracing() {
		return
	}
	start := stored
	if start.IsZero() || start.After(at) {
		start = at
	}
	_, span := Tracer().Start(JobContext(context.Background(), e.JobID), "inbox.receive "+e.Type,
		trace.WithTimestamp(start), trace.WithSpanKind(trace.SpanKindConsumer),
		trace.WithAttributes(append(JobAttrs(e.JobID, e.Tenant, 0, 0),
			attribute.String("kvgate.event_id", e.ID), attribute.String("kvgate.event_type", e.Type),
			attribute.String("kvgate.state", string(e.State)))...))
	span.End(trace.WithTimestamp(at))
	EndJobTrace(e)
}
