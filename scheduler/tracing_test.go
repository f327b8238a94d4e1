package scheduler

import (
	"testing"
	"time"

	"github.com/google/uuid"
	"go.opentelemetry.io/otel"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/kvgate/kvgate/store"
)

// jobEvents are a job's accepted and succeeded events, as the relay
// publishes them and the inbox receives them.
func jobEvents(t *testing.T) ([]store.Event, []Event) {
	t.Helper()
	job := uuid.Must(uuid.NewV7()).String()
	now := time.Now()
	var evs []store.Event
	var got []Event
	for i, ev := range []struct {
		typ string
		st  store.State
	}{{"job.accepted", store.Ready}, {"job.succeeded", store.Succeeded}} {
		e := store.Event{ID: uuid.Must(uuid.NewV7()).String(), JobID: job, Tenant: "t1", Type: ev.typ,
			State: ev.st, StateVersion: int64(i + 1), CreatedAt: now}
		evs = append(evs, e)
		got = append(got, Event{ID: e.ID, JobID: e.JobID, Tenant: e.Tenant, Type: e.Type, State: e.State, StateVersion: e.StateVersion, CreatedAt: now})
	}
	return evs, got
}

// Without a provider the job trace's spans cost nothing: no allocation,
// where building them took a few an event.
func TestJobSpansUntraced(t *testing.T) {
	if tracing() {
		t.Fatal("a tracer provider is installed before the test")
	}
	evs, got := jobEvents(t)
	now := time.Now()
	if n := testing.AllocsPerRun(100, func() {
		tracePublished(evs, now)
		for _, e := range got {
			traceReceived(e, now, now)
		}
	}); n != 0 {
		t.Errorf("the job's spans allocated %.0f times with no provider installed", n)
	}
}

// With a provider installed, the same calls record the job's spans in its
// trace, the root ended by the final event.
func TestJobSpansTraced(t *testing.T) {
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec), sdktrace.WithIDGenerator(IDGenerator()))
	prev := otel.GetTracerProvider()
	otel.SetTracerProvider(tp)
	t.Cleanup(func() { otel.SetTracerProvider(prev); _ = tp.Shutdown(t.Context()) })

	evs, got := jobEvents(t)
	now := time.Now()
	tracePublished(evs, now)
	for _, e := range got {
		traceReceived(e, now, now)
	}
	want := map[string]bool{"outbox.publish job.accepted": true, "outbox.publish job.succeeded": true,
		"inbox.receive job.accepted": true, "inbox.receive job.succeeded": true, "job": true}
	root, _ := JobSpanContext(evs[0].JobID)
	for _, s := range rec.Ended() {
		if s.SpanContext().TraceID() != root.TraceID() {
			t.Errorf("span %q is outside the job's trace", s.Name())
		}
		if !want[s.Name()] {
			t.Errorf("unexpected span %q", s.Name())
		}
		delete(want, s.Name())
	}
	for name := range want {
		t.Errorf("no span %q", name)
	}
}
