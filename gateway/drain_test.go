package gateway

import (
	"bufio"
	"context"
	"encoding/json"
	"io"
	"mime/multipart"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvgate/kvgate/bench/eventually"
	"github.com/kvgate/kvgate/scheduler"
	"github.com/kvgate/kvgate/store"
)

// A drain fails /readyz and refuses new requests at once while the
// requests in flight run on; a job event stream ends at once, telling its
// client to reconnect; at the deadline, a stream still running ends with
// an error event and a request not answered yet gets 503.
func TestDrain(t *testing.T) {
	f := startFleet(t, fleetOpts{speedup: 1, jobs: true})
	long := func(stream bool) *http.Request {
		body := `{"model":"` + llama + `","messages":[{"role":"user","content":"go on"}],"max_tokens":5000,"ignore_eos":true,"stream":` +
			map[bool]string{true: "true", false: "false"}[stream] + `}`
		req, _ := http.NewRequest(http.MethodPost, f.srv.URL+"/v1/chat/completions", strings.NewReader(body))
		req.Header.Set("Content-Type", "application/json")
		return req
	}
	streamResp, err := http.DefaultClient.Do(long(true))
	if err != nil {
		t.Fatal(err)
	}
	defer streamResp.Body.Close()
	br := bufio.NewReader(streamResp.Body)
	if line, err := br.ReadString('\n'); err != nil || !strings.HasPrefix(line, "data: ") {
		t.Fatalf("stream's first line %q, %v", line, err)
	}
	type answer struct {
		status int
		body   string
	}
	plain := make(chan answer, 1)
	go func() {
		resp, err := http.DefaultClient.Do(long(false))
		if err != nil {
			plain <- answer{}
			return
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		plain <- answer{resp.StatusCode, string(b)}
	}()
	eventually.True(t, "both requests at the backend", func() bool { return f.sims[0].Engine().Load() == 2 })
	_, job := submitJob(t, f, "k1", chatJob("watched", 4))
	events := openStream(t, f.srv.URL+"/v1/jobs/"+job.ID+"/events")
	if e, _ := events.next(t); e.Event != "snapshot" {
		t.Fatalf("job stream starts with %+v", e)
	}
	// The console's live view (the fleet stream) ends at the drain's
	// start too: one open tab must not hold a shutdown to its deadline.
	fleetEvents := openStream(t, f.srv.URL+"/v1/fleet/events")
	if e, _ := fleetEvents.next(t); e.Event != "fleet" {
		t.Fatalf("fleet stream starts with %+v", e)
	}

	deadline, cut := context.WithCancel(context.Background())
	defer cut()
	drained := make(chan int, 1)
	go func() { drained <- f.api.Drain(deadline) }()

	waitUnready(t, f.srv.URL)
	resp, b := f.post(t, "/v1/completions", `{"model":"`+llama+`","prompt":"x","max_tokens":4}`)
	if resp.StatusCode != http.StatusServiceUnavailable || resp.Header.Get("Retry-After") == "" ||
		!strings.Contains(string(b), `"code":"server_shutting_down"`) {
		t.Errorf("a request while draining: %d, Retry-After %q: %s", resp.StatusCode, resp.Header.Get("Retry-After"), b)
	}
	e, _ := events.next(t)
	var eb errorBody
	if e.Event != "error" || json.Unmarshal([]byte(e.Data), &eb) != nil || eb.Error.Code == nil || *eb.Error.Code != "server_shutting_down" {
		t.Errorf("job stream at the drain: %+v, want an error event", e)
	}
	if e, ok := events.next(t); ok {
		t.Errorf("job stream went on after its error event: %+v", e)
	}
	for {
		e, ok := fleetEvents.next(t)
		if !ok {
			t.Fatal("fleet stream ended at the drain without an error event")
		}
		if e.Event == "fleet" {
			continue // one sent before the drain began
		}
		if json.Unmarshal([]byte(e.Data), &eb) != nil || e.Event != "error" || eb.Error.Code == nil || *eb.Error.Code != "server_shutting_down" {
			t.Errorf("fleet stream at the drain: %+v, want an error event", e)
		}
		break
	}
	if e, ok := fleetEvents.next(t); ok {
		t.Errorf("fleet stream went on after its error event: %+v", e)
	}
	select {
	case n := <-drained:
		t.Fatalf("Drain returned (%d ended) with two requests in flight", n)
	default:
	}
	// The requests in flight still run.
	if line, err := br.ReadString('\n'); err != nil {
		t.Fatalf("the stream in flight broke when the drain began: %q, %v", line, err)
	}

	cut() // the drain's deadline
	rest, _ := io.ReadAll(br)
	if !strings.Contains(string(rest), `"code":"server_shutting_down"`) || strings.Contains(string(rest), "[DONE]") {
		t.Errorf("the stream at the deadline ended with ...%s, want an error event", tail(rest))
	}
	if a := <-plain; a.status != http.StatusServiceUnavailable || !strings.Contains(a.body, `"code":"server_shutting_down"`) {
		t.Errorf("the request in flight at the deadline: %d %s, want 503", a.status, a.body)
	}
	if n := <-drained; n != 2 {
		t.Errorf("Drain ended %d requests, want 2", n)
	}
	eventually.True(t, "the backend requests to be aborted", func() bool { return f.sims[0].Engine().Load() == 0 })
	eventually.True(t, "the reservations to be freed", func() bool { return f.inflight() == 0 })
}

// Unready, a drain's first step, fails /readyz while requests are still
// served: a load balancer moves away before anything is refused.
func TestUnreadyBeforeDrain(t *testing.T) {
	f := startFleet(t, fleetOpts{})
	status := func(method, path, body string) int {
		resp, _ := send(t, f.srv.URL, method, path, "", body)
		return resp.StatusCode
	}
	if c := status(http.MethodGet, "/readyz", ""); c != http.StatusOK {
		t.Fatalf("/readyz before: %d", c)
	}
	f.api.Unready()
	if c := status(http.MethodGet, "/readyz", ""); c != http.StatusServiceUnavailable {
		t.Errorf("/readyz once unready: %d, want 503", c)
	}
	body := `{"model":"` + llama + `","messages":[{"role":"user","content":"still served"}],"max_tokens":2}`
	if c := status(http.MethodPost, "/v1/chat/completions", body); c != http.StatusOK {
		t.Errorf("a request while unready: %d, want 200: not refused until the drain", c)
	}
}

// TestUploadCutByTheDrain: an upload still sending at the drain's
// deadline is answered 503 server_shutting_down (to retry on another
// replica), not 499 as if its client had left, and leaves no file.
func TestUploadCutByTheDrain(t *testing.T) {
	st := sqliteStore(t)
	f := startFleet(t, fleetOpts{store: st})
	pr, pw := io.Pipe()
	mw := multipart.NewWriter(pw)
	more := make(chan struct{})
	go func() {
		defer pw.Close()
		mw.WriteField("purpose", "user_data")
		fw, _ := mw.CreateFormFile("file", "big.bin")
		if _, err := fw.Write(make([]byte, 3<<20)); err != nil {
			return
		}
		<-more
		if _, err := fw.Write(make([]byte, 3<<20)); err != nil {
			return
		}
		mw.Close()
	}()
	req, _ := http.NewRequest(http.MethodPost, f.srv.URL+"/v1/files", pr)
	req.Header.Set("Content-Type", mw.FormDataContentType())
	type answer struct {
		status int
		body   string
	}
	got := make(chan answer, 1)
	go func() {
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			got <- answer{body: err.Error()}
			return
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		got <- answer{resp.StatusCode, string(b)}
	}()
	eventually.True(t, "the upload's first chunks stored", func() bool {
		var n int
		return st.DB().QueryRow(`SELECT count(*) FROM file_chunks`).Scan(&n) == nil && n >= 2
	})
	deadline, cut := context.WithCancel(context.Background())
	cut() // the deadline has passed
	go f.api.Drain(deadline)
	waitUnready(t, f.srv.URL)
	close(more) // the client sends on
	a := <-got
	if a.status != http.StatusServiceUnavailable || !strings.Contains(a.body, `"code":"server_shutting_down"`) {
		t.Errorf("the upload cut by the drain: %d %s, want 503 server_shutting_down", a.status, a.body)
	}
	eventually.True(t, "no file left", func() bool {
		var n int
		return st.DB().QueryRow(`SELECT count(*) FROM files`).Scan(&n) == nil && n == 0
	})
}

// waitUnready waits for the gateway at base to fail /readyz.
func waitUnready(t *testing.T, base string) {
	t.Helper()
	eventually.True(t, "/readyz to fail", func() bool {
		resp, err := http.Get(base + "/readyz")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusServiceUnavailable
	})
}

// drainAtMark is a store whose sent marks, once written, start the
// runner's drain: the drain comes between a job's mark and its send.
type drainAtMark struct {
	store.Store
	drain func()
}

func (s drainAtMark) MarkSent(ctx context.Context, id string, fence int64, now time.Time, lease time.Duration, ch *store.Charge) error {
	err := s.Store.MarkSent(ctx, id, fence, now, lease, ch)
	s.drain()
	return err
}

// TestDrainBetweenMarkAndSend: a job whose attempt the drain stops after
// its sent mark is written but before its request leaves sends nothing,
// spends nothing, and costs its tenant nothing (it was charged its whole
// reservation as uncertain, as if the request had gone).
func TestDrainBetweenMarkAndSend(t *testing.T) {
	st := sqliteStore(t)
	var calls atomic.Int64
	f := startFleet(t, fleetOpts{store: st, gateway: Config{Tenants: Tenants{Store: st}},
		wrap: countChats(&calls)})
	key := newTenant(t, st, "acme", store.Limits{MaxConcurrency: 10}, store.RoleUser)
	var runner *scheduler.Runner
	runner = scheduler.NewRunner(drainAtMark{Store: st, drain: func() { runner.Drain() }}, f.sched, f.api,
		scheduler.RunnerConfig{Concurrency: 4, Lease: 10 * time.Second, Poll: 10 * time.Millisecond})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { _ = runner.Run(ctx); close(done) }()
	t.Cleanup(func() { cancel(); <-done })

	_, job := submitJob(t, f, "k1", chatJob("hello", 4), "Authorization", "Bearer "+key)
	eventually.True(t, "the attempt to be handed back", func() bool {
		as, _ := st.Attempts(context.Background(), job.ID)
		return len(as) == 1
	})
	j, _ := st.Get(context.Background(), "acme", job.ID)
	if calls.Load() != 0 || j.Attempt != 0 || j.State.Final() {
		t.Errorf("after the drain: %d backend calls, job %s with %d attempts spent; want none sent, none spent", calls.Load(), j.State, j.Attempt)
	}
	if u := ledgerOf(t, st, "acme"); u.Uncertain != 0 || u.UncertainTokens != 0 {
		t.Errorf("ledger %+v: the request never left, yet is charged", u)
	}
}
