package gateway

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/kvgate/kvgate/bench/eventually"
	"github.com/kvgate/kvgate/scheduler"
	"github.com/kvgate/kvgate/store"
)

type sseEvent struct {
	ID    int64
	RawID string // the id as sent, for a client's Last-Event-ID
	Event string
	Data  string
}

type sseStream struct {
	resp   *http.Response
	events chan sseEvent
	cancel context.CancelFunc
}

// openStream opens an event stream; header pairs are set on the request.
func openStream(t *testing.T, url string, header ...string) *sseStream {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		cancel()
		t.Fatal(err)
	}
	s := &sseStream{resp: resp, events: make(chan sseEvent, 1024), cancel: cancel}
	t.Cleanup(func() { cancel(); resp.Body.Close() })
	if resp.StatusCode != http.StatusOK {
		return s
	}
	go func() {
		defer close(s.events)
		sc := bufio.NewScanner(resp.Body)
		var e sseEvent
		for sc.Scan() {
			line := sc.Text()
			switch {
			case line == "":
				if e.Event != "" {
					s.events <- e
				}
				e = sseEvent{}
			case strings.HasPrefix(line, "id: "):
				e.RawID = line[4:]
				e.ID, _ = strconv.ParseInt(line[4:], 10, 64)
			case strings.HasPrefix(line, "event: "):
				e.Event = line[7:]
			case strings.HasPrefix(line, "data: "):
				e.Data = line[6:]
			}
		}
	}()
	return s
}

// next returns the next event, or fails after 20s; ok is false when the
// stream ended.
func (s *sseStream) next(t *testing.T) (sseEvent, bool) {
	t.Helper()
	select {
	case e, ok := <-s.events:
		return e, ok
	case <-time.After(20 * time.Second):
		t.Fatal("no event within 20s")
	}
	return sseEvent{}, false
}

func decodeEvent(t *testing.T, e sseEvent) eventView {
	t.Helper()
	var v eventView
	if err := json.Unmarshal([]byte(e.Data), &v); err != nil {
		t.Fatalf("event %q: %v", e.Data, err)
	}
	return v
}

// A job's stream: a snapshot, then each state change with a rising
// state_version, ending with the final state.
func TestJobEventStream(t *testing.T) {
	f := startFleet(t, fleetOpts{backends: 1, jobs: true, runner: true, signals: true, speedup: 20})
	_, v := submitJob(t, f, "k1", chatJob("stream my states", 4))
	s := openStream(t, f.srv.URL+"/v1/jobs/"+v.ID+"/events")
	if ct := s.resp.Header.Get("Content-Type"); s.resp.StatusCode != 200 || ct != "text/event-stream" {
		t.Fatalf("stream: %d %q", s.resp.StatusCode, ct)
	}
	first, _ := s.next(t)
	var snap jobView
	if first.Event != "snapshot" || json.Unmarshal([]byte(first.Data), &snap) != nil || snap.ID != v.ID {
		t.Fatalf("first event %+v, want the job's snapshot", first)
	}
	last, lastID := snap.StateVersion, first.ID
	var final eventView
	if store.State(snap.State).Final() {
		// The job finished before the stream opened (a loaded machine):
		// the snapshot is the whole stream.
		final = eventView{State: snap.State, Type: "job.succeeded"}
	}
	for {
		e, ok := s.next(t)
		if !ok {
			break
		}
		ev := decodeEvent(t, e)
		if ev.JobID != v.ID || ev.StateVersion <= last || e.ID <= lastID || ev.Type != e.Event {
			t.Errorf("event %+v (id %d) after state_version %d, id %d", ev, e.ID, last, lastID)
		}
		last, lastID, final = ev.StateVersion, e.ID, ev
	}
	if final.State != string(store.Succeeded) || final.Type != "job.succeeded" {
		t.Errorf("stream ended after %+v, want job.succeeded", final)
	}

	// A stream opened on a finished job is its snapshot alone.
	s2 := openStream(t, f.srv.URL+"/v1/jobs/"+v.ID+"/events")
	if e, _ := s2.next(t); e.Event != "snapshot" || !strings.Contains(e.Data, `"SUCCEEDED"`) {
		t.Errorf("finished job's stream starts with %+v", e)
	}
	if e, ok := s2.next(t); ok {
		t.Errorf("finished job's stream went on with %+v", e)
	}
}

// Last-Event-ID replays exactly what came after it, on the tenant's
// stream; without it the stream starts from a snapshot and follows live.
func TestTenantEventStreamReplay(t *testing.T) {
	f := startFleet(t, fleetOpts{backends: 1, jobs: true, runner: true, signals: true, speedup: 20,
		gateway: Config{APIKeys: map[string]string{"ka": "acme", "kg": "globex"}, Jobs: Jobs{MaxReplay: 4}}})
	auth := func(k string) []string { return []string{"Authorization", "Bearer " + k} }
	_, a := submitJob(t, f, "k1", chatJob("one", 2), auth("ka")...)
	eventually.True(t, "job to succeed", func() bool { _, v := getJob(t, f, a.ID, auth("ka")...); return v.State == "SUCCEEDED" })
	// Every event of the job, from the start of the feed.
	var all []sseEvent
	s := openStream(t, f.srv.URL+"/v1/events", append(auth("ka"), "Last-Event-ID", "0")...)
	for len(all) < 3 {
		e, ok := s.next(t)
		if !ok {
			t.Fatal("stream ended")
		}
		all = append(all, e)
	}
	if all[0].Event != "job.accepted" || all[1].Event != "job.running" || all[2].Event != "job.succeeded" {
		t.Fatalf("replayed %v %v %v", all[0].Event, all[1].Event, all[2].Event)
	}
	s.cancel()
	// Resuming after the first: the other two, in order.
	s = openStream(t, f.srv.URL+"/v1/events", append(auth("ka"), "Last-Event-ID", strconv.FormatInt(all[0].ID, 10))...)
	for _, want := range all[1:] {
		if e, _ := s.next(t); e.ID != want.ID || e.Event != want.Event {
			t.Errorf("resumed: %+v, want %+v", e, want)
		}
	}
	s.cancel()
	// No cursor: a snapshot at the head, then live events of a new job.
	s = openStream(t, f.srv.URL+"/v1/events", auth("ka")...)
	snap, _ := s.next(t)
	if snap.Event != "snapshot" || snap.ID != all[2].ID || !strings.Contains(snap.Data, a.ID) {
		t.Fatalf("fresh stream starts with %+v, want a snapshot at cursor %d", snap, all[2].ID)
	}
	_, b := submitJob(t, f, "k2", chatJob("two", 2), auth("ka")...)
	for _, want := range []string{"job.accepted", "job.running", "job.succeeded"} {
		e, _ := s.next(t)
		if ev := decodeEvent(t, e); e.Event != want || ev.JobID != b.ID {
			t.Errorf("live: %s for %s, want %s for %s", e.Event, ev.JobID, want, b.ID)
		}
	}
	// Too far behind (6 events after cursor 0, replay bounded at 4): a
	// fresh snapshot instead of a replay.
	eventually.True(t, "the second job's events published", func() bool {
		evs, _ := f.store.Events(t.Context(), "acme", "", 0, 100)
		return len(evs) == 6
	})
	s.cancel()
	s = openStream(t, f.srv.URL+"/v1/events", append(auth("ka"), "Last-Event-ID", "0")...)
	if e, _ := s.next(t); e.Event != "snapshot" || !strings.Contains(e.Data, b.ID) {
		t.Errorf("a cursor too far behind got %+v, want a fresh snapshot", e)
	}
	// Another tenant sees none of it, and not the job either.
	g := openStream(t, f.srv.URL+"/v1/events", auth("kg")...)
	if e, _ := g.next(t); e.Event != "snapshot" || e.ID != 0 || strings.Contains(e.Data, a.ID) {
		t.Errorf("globex's stream: %+v", e)
	}
	if s := openStream(t, f.srv.URL+"/v1/jobs/"+a.ID+"/events", auth("kg")...); s.resp.StatusCode != http.StatusNotFound {
		t.Errorf("another tenant's job stream: %d, want 404", s.resp.StatusCode)
	}
	if s := openStream(t, f.srv.URL+"/v1/events", append(auth("ka"), "Last-Event-ID", "x")...); s.resp.StatusCode != http.StatusBadRequest {
		t.Errorf("malformed Last-Event-ID: %d, want 400", s.resp.StatusCode)
	}
}

// Retry details need an operator key of the job's tenant.
func TestJobAttemptsNeedOperator(t *testing.T) {
	f := startFleet(t, fleetOpts{backends: 1, jobs: true, runner: true, speedup: 20,
		gateway: Config{APIKeys: map[string]string{"ka": "acme"}, OperatorKeys: map[string]string{"oa": "acme", "og": "globex"}}})
	auth := func(k string) []string { return []string{"Authorization", "Bearer " + k} }
	_, j := submitJob(t, f, "k1", chatJob("details", 2), auth("ka")...)
	eventually.True(t, "job to succeed", func() bool { _, v := getJob(t, f, j.ID, auth("ka")...); return v.State == "SUCCEEDED" })
	get := func(key string) (int, string) {
		req, _ := http.NewRequest(http.MethodGet, f.srv.URL+"/v1/jobs/"+j.ID+"/attempts", nil)
		req.Header.Set("Authorization", "Bearer "+key)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var b strings.Builder
		_, _ = bufio.NewReader(resp.Body).WriteTo(&b)
		return resp.StatusCode, b.String()
	}
	if code, body := get("ka"); code != http.StatusForbidden || !strings.Contains(body, "operator_key_required") {
		t.Errorf("tenant key: %d %s, want 403", code, body)
	}
	if code, _ := get("og"); code != http.StatusNotFound {
		t.Errorf("another tenant's operator: %d, want 404", code)
	}
	code, body := get("oa")
	if code != http.StatusOK || !strings.Contains(body, `"outcome":"succeeded"`) || !strings.Contains(body, `"backend":"sim0"`) {
		t.Errorf("operator: %d %s", code, body)
	}
}

// Without published events (no relay: a broker outage), a job's stream
// still follows the job's row and ends on its final state.
func TestJobEventStreamWithoutBroker(t *testing.T) {
	f := startFleet(t, fleetOpts{backends: 1, jobs: true, runner: true, speedup: 20})
	_, v := submitJob(t, f, "k1", chatJob("no broker", 4))
	s := openStream(t, f.srv.URL+"/v1/jobs/"+v.ID+"/events")
	var last jobView
	for {
		e, ok := s.next(t)
		if !ok {
			break
		}
		if e.Event != "snapshot" || json.Unmarshal([]byte(e.Data), &last) != nil {
			t.Fatalf("event %+v, want snapshots only", e)
		}
	}
	if last.State != string(store.Succeeded) {
		t.Errorf("stream ended on %s, want SUCCEEDED", last.State)
	}
}

// TestSSEClientThatStopsReadingIsLetGo: an event stream whose client
// keeps its connection but stops reading ends once a write has waited the
// idle time, instead of holding the stream (and the drain) until the
// connection is closed.
func TestSSEClientThatStopsReadingIsLetGo(t *testing.T) {
	ended := make(chan error, 1)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		sse, err := startSSE(w, 300*time.Millisecond)
		if err != nil {
			ended <- err
			return
		}
		big := strings.Repeat("x", 64<<10)
		for i := 0; ; i++ {
			if err := sse.send(strconv.Itoa(i), "e", big); err != nil {
				ended <- err
				return
			}
		}
	}))
	defer srv.Close()
	conn := dialSmallWindow(t, srv.URL)
	if _, err := fmt.Fprintf(conn, "GET /events HTTP/1.1\r\nHost: kvgate\r\n\r\n"); err != nil {
		t.Fatal(err)
	}
	// It reads nothing.
	select {
	case err := <-ended:
		if err == nil {
			t.Error("the stream ended without an error")
		}
	case <-time.After(20 * time.Second):
		t.Fatal("the stream of a client that stopped reading is still held")
	}
}

// TestJobStreamWaitsForTheReview: a job in review keeps its stream open,
// and a client resumed there is followed on (not told 204), until the
// reviewer's decision, the stream's last event.
func TestJobStreamWaitsForTheReview(t *testing.T) {
	f := startFleet(t, fleetOpts{backends: 1, jobs: true, signals: true})
	ctx := context.Background()
	_, v := submitJob(t, f, "in-review", chatJob("review me", 4))
	held, err := f.store.Claim(ctx, time.Now(), time.Minute, 1)
	if err != nil || len(held) != 1 {
		t.Fatalf("claimed %d: %v", len(held), err)
	}
	j, now := held[0], time.Now()
	if err := f.store.Complete(ctx, store.Completion{JobID: j.ID, Fence: j.Fence, State: store.ReviewRequired,
		Result:  []byte(`{"id":"c","object":"chat.completion","choices":[]}`),
		Attempt: store.Attempt{JobID: j.ID, Attempt: j.Attempt + 1, Fence: j.Fence, Outcome: store.OutcomeSucceeded, StartedAt: now, EndedAt: now},
		EventID: uuid.Must(uuid.NewV7()).String(), Now: now}); err != nil {
		t.Fatal(err)
	}
	url := f.srv.URL + "/v1/jobs/" + v.ID + "/events"
	// The snapshot shows the review; the stream does not end there.
	s := openStream(t, url)
	first, _ := s.next(t)
	if first.Event != "snapshot" || !strings.Contains(first.Data, `"REVIEW_REQUIRED"`) {
		t.Fatalf("first event %+v, want the snapshot in review", first)
	}
	// A client that reconnects from there is followed on, as it would be
	// from any state before the job's end.
	s2 := openStream(t, url, "Last-Event-ID", first.RawID)
	if s2.resp.StatusCode != http.StatusOK {
		t.Fatalf("resumed in review: %d, want 200 and the stream", s2.resp.StatusCode)
	}
	if resp, b := f.post(t, "/v1/jobs/"+v.ID+"/review", `{"decision":"approve"}`); resp.StatusCode != http.StatusOK {
		t.Fatalf("approve: %d %s", resp.StatusCode, b)
	}
	for _, st := range []*sseStream{s, s2} {
		var last string
		for {
			e, ok := st.next(t)
			if !ok {
				break
			}
			last = e.Data
		}
		if !strings.Contains(last, `"SUCCEEDED"`) {
			t.Errorf("the stream ended on %s, want the decision, SUCCEEDED", last)
		}
	}
}

// TestTenantStreamThroughBrokerOutage: with the broker gone, a tenant's
// event stream goes on showing its jobs' states: the relay, failing to
// publish, places the events in the feed unpublished.
func TestTenantStreamThroughBrokerOutage(t *testing.T) {
	f := startFleet(t, fleetOpts{backends: 1, jobs: true, runner: true, signals: true, speedup: 20})
	s := openStream(t, f.srv.URL+"/v1/events")
	if snap, _ := s.next(t); snap.Event != "snapshot" {
		t.Fatalf("first event %+v, want the snapshot", snap)
	}
	f.sig.ns.Shutdown()
	f.sig.ns.WaitForShutdown()
	_, v := submitJob(t, f, "in-the-outage", chatJob("no broker", 4))
	var seen []string
	for !slices.Contains(seen, "job.succeeded") {
		e, ok := s.next(t)
		if !ok {
			t.Fatalf("the stream ended after %v", seen)
		}
		if ev := decodeEvent(t, e); ev.JobID == v.ID {
			seen = append(seen, e.Event)
		}
	}
	if seen[0] != "job.accepted" {
		t.Errorf("the outage's job showed %v, want job.accepted first", seen)
	}
	if evs, err := f.store.Unpublished(context.Background(), 100); err != nil || len(evs) < 3 {
		t.Errorf("%d events unpublished (%v): the stream's events should still wait for the broker", len(evs), err)
	}
}

// countingEvents counts the event reads of a job store.
type countingEvents struct {
	jobStore
	reads atomic.Int64
}

func (c *countingEvents) Events(ctx context.Context, tenant, jobID string, after int64, limit int) ([]store.Event, error) {
	c.reads.Add(1)
	return c.jobStore.Events(ctx, tenant, jobID, after, limit)
}

// TestStreamReadsAtMostEveryGap: notices come with every batch the relay
// publishes, every few milliseconds for a busy tenant; an open stream
// reads the store at most once per followGap however many come, and still
// reads after the last.
func TestStreamReadsAtMostEveryGap(t *testing.T) {
	st := sqliteStore(t)
	feed := scheduler.NewFeed()
	jobs := &countingEvents{jobStore: st}
	f := startFleet(t, fleetOpts{store: st, gateway: Config{Jobs: Jobs{Store: jobs, Feed: feed}}})
	s := openStream(t, f.srv.URL+"/v1/events")
	if e, _ := s.next(t); e.Event != "snapshot" {
		t.Fatalf("stream starts with %+v", e)
	}
	time.Sleep(50 * time.Millisecond) // the stream waits for notices
	before := jobs.reads.Load()
	const notices = 50
	start := time.Now()
	for range notices {
		feed.Notify()
		time.Sleep(time.Millisecond)
	}
	took := time.Since(start)
	eventually.True(t, "a read after the last notice", func() bool { return jobs.reads.Load() > before })
	time.Sleep(2 * followGap)
	// One read a gap over the notices' span, one for the first and one
	// for the last (and one each for a slow start and the periodic look).
	if n, most := jobs.reads.Load()-before, int64(took/followGap)+4; n > most {
		t.Errorf("%d notices over %v made %d reads, want at most %d", notices, took.Round(time.Millisecond), n, most)
	}
}
