package gateway

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvgate/kvgate/bench/eventually"

	"github.com/kvgate/kvgate/scheduler"
	"github.com/kvgate/kvgate/store"
	"github.com/kvgate/kvgate/store/sqlstore"
)

// heldFleet is a fleet whose job events wait in the outbox until the
// test runs the relay: a broker outage, or a relay that lags.
type heldFleet struct {
	*fleet
	st  *sqlstore.Store
	sig *testSignals
	ctx context.Context
	wg  *sync.WaitGroup
}

func startHeldFleet(t *testing.T, cfg Config) *heldFleet {
	t.Helper()
	st := sqliteStore(t)
	sig := startTestSignals(t, st, func() {})
	cfg.Jobs.Feed = sig.feed
	f := startFleet(t, fleetOpts{store: st, gateway: cfg})
	// Registered after the fleet's: runs first, before the store closes.
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	t.Cleanup(func() { cancel(); wg.Wait() })
	wg.Go(func() { _ = scheduler.FollowFeed(ctx, sig.nc, sig.feed) })
	return &heldFleet{fleet: f, st: st, sig: sig, ctx: ctx, wg: &wg}
}

// publish runs the relay until the outbox is empty, and leaves it running
// when keep is set.
func (h *heldFleet) publish(t *testing.T, keep bool) {
	t.Helper()
	ctx, cancel := context.WithCancel(h.ctx)
	done := make(chan struct{})
	go func() { defer close(done); _ = h.sig.relay.Run(ctx) }()
	eventually.True(t, "the outbox to drain", func() bool {
		evs, err := h.st.Unpublished(h.ctx, 10)
		return err == nil && len(evs) == 0
	})
	stop := func() { cancel(); <-done }
	if keep {
		t.Cleanup(stop) // before the store closes
		return
	}
	stop()
}

// claim moves every runnable job to RUNNING, as a runner would; the
// events wait in the outbox.
func (h *heldFleet) claim(t *testing.T, want int) {
	t.Helper()
	jobs, err := h.st.Claim(h.ctx, time.Now(), time.Minute, 100)
	if err != nil || len(jobs) != want {
		t.Fatalf("claimed %d jobs (%v), want %d", len(jobs), err, want)
	}
}

// versions checks, per job, that every state_version a client is shown
// is above the last one it was shown, across connections.
type versions map[string]int64

func (vs versions) see(t *testing.T, where, job string, v int64) {
	t.Helper()
	if last, ok := vs[job]; ok && v <= last {
		t.Errorf("%s: job %s at state_version %d after %d", where, job, v, last)
	}
	vs[job] = max(vs[job], v)
}

// A job's snapshot can show a state whose events still wait in the
// outbox. A client that reconnects with the snapshot's id is never sent
// those older states once they are published.
func TestJobStreamResumeAfterSnapshotAheadOfFeed(t *testing.T) {
	h := startHeldFleet(t, Config{})
	_, v := submitJob(t, h.fleet, "k1", chatJob("ahead of the feed", 4))
	h.claim(t, 1) // READY (1) and RUNNING (2), both unpublished
	url := h.srv.URL + "/v1/jobs/" + v.ID + "/events"

	s := openStream(t, url)
	e, _ := s.next(t)
	var snap jobView
	if e.Event != "snapshot" || json.Unmarshal([]byte(e.Data), &snap) != nil || snap.State != string(store.Running) {
		t.Fatalf("first event %+v, want a RUNNING snapshot", e)
	}
	s.cancel()
	seen := versions{}
	seen.see(t, "snapshot", v.ID, snap.StateVersion)

	h.publish(t, true)
	if resp, b := h.post(t, "/v1/jobs/"+v.ID+"/cancel", ""); resp.StatusCode != http.StatusOK {
		t.Fatalf("cancel: %d %s", resp.StatusCode, b)
	}
	s = openStream(t, url, "Last-Event-ID", e.RawID)
	var last eventView
	lastID := ""
	for {
		e, ok := s.next(t)
		if !ok {
			break
		}
		lastID = e.RawID
		if e.Event == "snapshot" {
			var j jobView
			_ = json.Unmarshal([]byte(e.Data), &j)
			seen.see(t, "resumed snapshot", j.ID, j.StateVersion)
			continue
		}
		last = decodeEvent(t, e)
		seen.see(t, "resumed "+e.Event, last.JobID, last.StateVersion)
	}
	if seen[v.ID] != snap.StateVersion+1 {
		t.Errorf("the resumed stream ended at state_version %d (last event %+v), want the cancellation's, %d",
			seen[v.ID], last, snap.StateVersion+1)
	}
	// A client that reconnects after the final state (a browser's
	// EventSource does, whenever a stream closes) is told nothing new,
	// with 204, the one answer that stops an EventSource reconnecting,
	// rather than waiting forever or being given an empty stream to
	// reconnect after again.
	s = openStream(t, url, "Last-Event-ID", lastID)
	if s.resp.StatusCode != http.StatusNoContent {
		t.Errorf("a stream resumed after the final state: %d, want 204", s.resp.StatusCode)
	}
}

// The tenant's snapshot, too, may not run ahead of its cursor: a client
// that reconnects with it is sent only newer states of every job, even
// of jobs whose events waited in the outbox when it took the snapshot.
func TestTenantStreamResumeAfterSnapshotAheadOfFeed(t *testing.T) {
	h := startHeldFleet(t, Config{})
	_, b := submitJob(t, h.fleet, "kb", chatJob("published", 4))
	h.publish(t, false) // b's job.accepted is in the feed
	_, a := submitJob(t, h.fleet, "ka", chatJob("held", 4))
	h.claim(t, 2) // a: accepted and running, b: running, all held

	s := openStream(t, h.srv.URL+"/v1/events")
	e, _ := s.next(t)
	var snap struct {
		Cursor int64     `json:"cursor"`
		Data   []jobView `json:"data"`
	}
	if e.Event != "snapshot" || json.Unmarshal([]byte(e.Data), &snap) != nil {
		t.Fatalf("first event %+v, want a snapshot", e)
	}
	s.cancel()
	seen := versions{}
	for _, j := range snap.Data {
		seen.see(t, "snapshot", j.ID, j.StateVersion)
	}

	h.publish(t, true)
	for _, id := range []string{a.ID, b.ID} {
		if resp, body := h.post(t, "/v1/jobs/"+id+"/cancel", ""); resp.StatusCode != http.StatusOK {
			t.Fatalf("cancel: %d %s", resp.StatusCode, body)
		}
	}
	s = openStream(t, h.srv.URL+"/v1/events", "Last-Event-ID", e.RawID)
	cancelled := map[string]bool{}
	for len(cancelled) < 2 {
		e, ok := s.next(t)
		if !ok {
			t.Fatal("the resumed stream ended")
		}
		ev := decodeEvent(t, e)
		seen.see(t, "resumed "+e.Event, ev.JobID, ev.StateVersion)
		if ev.State == string(store.Cancelled) {
			cancelled[ev.JobID] = true
		}
	}
}

// eventsDown is the store with its job events unreadable while down is
// set: the rest answers.
type eventsDown struct {
	*sqlstore.Store
	down atomic.Bool
}

func (e *eventsDown) Events(ctx context.Context, tenant, jobID string, after int64, limit int) ([]store.Event, error) {
	if e.down.Load() {
		return nil, fmt.Errorf("read events: %w", store.ErrUnavailable)
	}
	return e.Store.Events(ctx, tenant, jobID, after, limit)
}

// A client resuming with an id that does not say which state it was shown
// (an after= of the feed's place alone) when the store cannot read that
// place's event is refused (503, to retry), not sent the job's states
// again from the start as if it had seen none.
func TestJobStreamResumeFailsWhileEventsAreUnreadable(t *testing.T) {
	st := sqliteStore(t)
	ev := &eventsDown{Store: st}
	sig := startTestSignals(t, st, func() {})
	f := startFleet(t, fleetOpts{store: st, gateway: Config{Jobs: Jobs{Store: ev, Feed: sig.feed}}})
	_, v := submitJob(t, f, "k1", chatJob("resume", 4))
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = sig.relay.Run(ctx) }()
	defer func() { cancel(); <-done }()
	var place int64
	eventually.True(t, "the job's first event published", func() bool {
		evs, err := st.Events(context.Background(), "default", v.ID, 0, 10)
		if err != nil || len(evs) == 0 {
			return false
		}
		place = evs[0].Cursor
		return true
	})
	url := f.srv.URL + "/v1/jobs/" + v.ID + "/events?after=" + strconv.FormatInt(place, 10)
	ev.down.Store(true)
	s := openStream(t, url)
	if s.resp.StatusCode != http.StatusServiceUnavailable {
		t.Errorf("a resume whose place cannot be read: %d, want 503", s.resp.StatusCode)
	}
	s.cancel()
	ev.down.Store(false)
	if jobs, err := st.Claim(context.Background(), time.Now(), time.Minute, 10); err != nil || len(jobs) != 1 { // a newer state
		t.Fatalf("claimed %d (%v), want the job", len(jobs), err)
	}
	s = openStream(t, url)
	defer s.cancel()
	// Its next state, as an event or (its event not yet published) a
	// snapshot; never READY, the state at the place, again.
	e, ok := s.next(t)
	var got struct {
		StateVersion int64 `json:"state_version"`
	}
	if !ok || json.Unmarshal([]byte(e.Data), &got) != nil || got.StateVersion != 2 {
		t.Errorf("the same resume with the store back: %+v, want state_version 2 (RUNNING) first", e)
	}
}

// deadlineRecorder is a ResponseWriter that keeps the write deadline
// last set on it, as http.ResponseController sets it.
type deadlineRecorder struct {
	httptest.ResponseRecorder
	deadline time.Time
}

func (d *deadlineRecorder) SetWriteDeadline(t time.Time) error { d.deadline = t; return nil }

// TestSSEDeadlineOnlyWhileWriting: an event stream's write deadline
// bounds a write in progress and is lifted once it is flushed, so that a
// quiet stream outlives an idle timeout shorter than its keepalive (over
// HTTP/2 a deadline left to pass resets the stream).
func TestSSEDeadlineOnlyWhileWriting(t *testing.T) {
	w := &deadlineRecorder{ResponseRecorder: *httptest.NewRecorder()}
	e, err := startSSE(w, 2*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if !w.deadline.IsZero() {
		t.Errorf("after the headers, a write deadline of %s stands", w.deadline)
	}
	for _, write := range []func() error{
		func() error { return e.send("1", "job.state", map[string]string{"a": "b"}) },
		func() error { return e.comment("keepalive") },
	} {
		if err := write(); err != nil {
			t.Fatal(err)
		}
		if !w.deadline.IsZero() {
			t.Errorf("after a write, a write deadline of %s stands", w.deadline)
		}
	}
}

// A job stream resumed from a place the feed never reached (a client's
// bug, another deployment's id, a restored database) starts afresh, as
// the tenant's stream does: a snapshot placed on the feed, then the
// job's events, rather than a wait below events it would never be sent.
func TestJobStreamResumeBeyondTheFeed(t *testing.T) {
	h := startHeldFleet(t, Config{})
	_, v := submitJob(t, h.fleet, "kf", chatJob("beyond the feed", 4))
	h.publish(t, true)
	s := openStream(t, h.srv.URL+"/v1/jobs/"+v.ID+"/events", "Last-Event-ID", "999999999")
	e, ok := s.next(t)
	if !ok || e.Event != "snapshot" || strings.HasPrefix(e.RawID, "999999999") {
		t.Fatalf("first event %+v, want a snapshot placed on the feed", e)
	}
	if resp, b := h.post(t, "/v1/jobs/"+v.ID+"/cancel", ""); resp.StatusCode != http.StatusOK {
		t.Fatalf("cancel: %d %s", resp.StatusCode, b)
	}
	for {
		e, ok := s.next(t)
		if !ok {
			t.Fatal("the stream ended before the cancellation's event")
		}
		if e.Event == "snapshot" {
			continue
		}
		if ev := decodeEvent(t, e); ev.State == string(store.Cancelled) {
			if strings.Contains(e.RawID, ".") {
				t.Errorf("the cancellation's id %q, want a place of the feed", e.RawID)
			}
			return
		}
	}
}
