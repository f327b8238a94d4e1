package gateway

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/kvgate/kvgate/bench/eventually"

	"github.com/kvgate/kvgate/bench/vllmsim"
	"github.com/kvgate/kvgate/store"
)

func submitJob(t *testing.T, f *fleet, key, body string, header ...string) (*http.Response, jobView) {
	t.Helper()
	h := append([]string{"Idempotency-Key", key}, header...)
	if key == "" {
		h = header
	}
	resp, b := f.post(t, "/v1/jobs", body, h...)
	var v jobView
	_ = json.Unmarshal(b, &v)
	return resp, v
}

func chatJob(prompt string, maxTokens int) string {
	return fmt.Sprintf(`{"endpoint":"/v1/chat/completions","metadata":{"doc":"d1"},"body":{"model":"%s","messages":[{"role":"user","content":%q}],"max_tokens":%d}}`,
		llama, prompt, maxTokens)
}

func getJob(t *testing.T, f *fleet, id string, header ...string) (int, jobView) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodGet, f.srv.URL+"/v1/jobs/"+id, nil)
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var v jobView
	_ = json.NewDecoder(resp.Body).Decode(&v)
	return resp.StatusCode, v
}

func waitState(t *testing.T, f *fleet, id string, want store.State) jobView {
	t.Helper()
	var v jobView
	eventually.True(t, "job "+id+" to reach "+string(want), func() bool {
		_, v = getJob(t, f, id)
		return v.State == string(want)
	})
	return v
}

func TestJobRunsToCompletion(t *testing.T) {
	f := startFleet(t, fleetOpts{backends: 2, jobs: true, runner: true})
	resp, v := submitJob(t, f, "k1", chatJob("summarise this", 8))
	if resp.StatusCode != http.StatusAccepted || resp.Header.Get("Location") != "/v1/jobs/"+v.ID || v.State != "READY" {
		t.Fatalf("submit: %d %q %+v", resp.StatusCode, resp.Header.Get("Location"), v)
	}
	done := waitState(t, f, v.ID, store.Succeeded)
	if done.ResultURL == "" || done.StateVersion < 3 || string(done.Metadata) != `{"doc":"d1"}` {
		t.Errorf("finished job %+v", done)
	}
	r, err := http.Get(f.srv.URL + done.ResultURL)
	if err != nil {
		t.Fatal(err)
	}
	var result struct {
		Object string `json:"object"`
		Usage  usage  `json:"usage"`
	}
	_ = json.NewDecoder(r.Body).Decode(&result)
	r.Body.Close()
	if r.StatusCode != 200 || result.Object != "chat.completion" || result.Usage.CompletionTokens == 0 {
		t.Errorf("result: %d %+v", r.StatusCode, result)
	}
	as, _ := f.store.Attempts(t.Context(), v.ID)
	if len(as) != 1 || as[0].Outcome != "succeeded" || as[0].Backend == "" || as[0].CompletionTokens == 0 {
		t.Errorf("attempts %+v", as)
	}
	if f.inflight() != 0 {
		t.Errorf("%d reservations held", f.inflight())
	}
}

func TestJobIdempotencyAndScoping(t *testing.T) {
	f := startFleet(t, fleetOpts{jobs: true, gateway: Config{APIKeys: map[string]string{"sk-a": "acme", "sk-g": "globex"}}})
	acme, globex := []string{"Authorization", "Bearer sk-a"}, []string{"Authorization", "Bearer sk-g"}
	_, first := submitJob(t, f, "k", chatJob("hello", 4), acme...)
	resp, again := submitJob(t, f, "k", chatJob("hello", 4), acme...)
	if resp.StatusCode != http.StatusAccepted || again.ID != first.ID || resp.Header.Get("Idempotent-Replayed") != "true" {
		t.Errorf("same key, same request: %d, %s vs %s", resp.StatusCode, again.ID, first.ID)
	}
	// Whitespace does not make a different request.
	resp, _ = submitJob(t, f, "k", strings.ReplaceAll(chatJob("hello", 4), ",", " , "), acme...)
	if resp.StatusCode != http.StatusAccepted {
		t.Errorf("same request, other whitespace: %d", resp.StatusCode)
	}
	if resp, _ := submitJob(t, f, "k", chatJob("goodbye", 4), acme...); resp.StatusCode != http.StatusUnprocessableEntity ||
		resp.Header.Get("x-should-retry") != "false" {
		t.Errorf("same key, different request: %d (x-should-retry %q), want 422, not to be retried", resp.StatusCode, resp.Header.Get("x-should-retry"))
	}
	// A key that is there but is not one is said to be so, not missing.
	for _, bad := range []string{strings.Repeat("k", 256), "\xff\xfe"} {
		resp, b := f.post(t, "/v1/jobs", chatJob("hello", 4), append([]string{"Idempotency-Key", bad}, acme...)...)
		if resp.StatusCode != http.StatusBadRequest || !strings.Contains(string(b), "invalid_idempotency_key") {
			t.Errorf("Idempotency-Key %.20q: %d %s, want 400 invalid_idempotency_key", bad, resp.StatusCode, b)
		}
	}
	if resp, _ := submitJob(t, f, "", chatJob("hello", 4), acme...); resp.StatusCode != http.StatusBadRequest {
		t.Errorf("no key: %d, want 400", resp.StatusCode)
	}
	// A batch line's key is not a client's to take.
	if resp, _ := submitJob(t, f, batchKeyPrefix+"batch_x/0", chatJob("hello", 4), acme...); resp.StatusCode != http.StatusBadRequest {
		t.Errorf("a batch line's key: %d, want 400", resp.StatusCode)
	}
	// Another tenant: the same key is its own, and the job is not found.
	if resp, other := submitJob(t, f, "k", chatJob("hello", 4), globex...); resp.StatusCode != http.StatusAccepted || other.ID == first.ID {
		t.Errorf("other tenant, same key: %d %s", resp.StatusCode, other.ID)
	}
	if code, _ := getJob(t, f, first.ID, globex...); code != http.StatusNotFound {
		t.Errorf("another tenant's job: %d, want 404", code)
	}
	if code, v := getJob(t, f, first.ID, acme...); code != 200 || v.ID != first.ID {
		t.Errorf("own job: %d", code)
	}
	completion := `"body":{"model":"` + llama + `","prompt":"x"}`
	for _, tc := range []struct{ name, body, param string }{
		{"unknown endpoint", `{"endpoint":"/v1/images","body":{}}`, ""},
		{"invalid inner body", `{"endpoint":"/v1/chat/completions","body":{"model":"` + llama + `"}}`, ""},
		{"streaming", `{"endpoint":"/v1/completions","body":{"model":"` + llama + `","prompt":"x","stream":true}}`, ""},
		{"deadline in the past", `{"endpoint":"/v1/completions","deadline_seconds":-5,` + completion + `}`, "deadline_seconds"},
		// An argument the job API does not have is refused, not ignored.
		{"misspelled field", `{"endpoint":"/v1/completions","deadline_second":60,` + completion + `}`, "deadline_second"},
		{"unsupported field", `{"endpoint":"/v1/completions","priority":1,` + completion + `}`, "priority"},
		{"two deadlines", `{"endpoint":"/v1/completions","deadline_seconds":60,"deadline":"2099-01-01T00:00:00Z",` + completion + `}`, "deadline_seconds"},
		{"two values", `{"endpoint":"/v1/completions",` + completion + `} {}`, ""},
	} {
		resp, b := f.post(t, "/v1/jobs", tc.body, append([]string{"Idempotency-Key", "bad-" + tc.name}, acme...)...)
		var e errorBody
		_ = json.Unmarshal(b, &e)
		if resp.StatusCode != http.StatusBadRequest || (tc.param != "" && (e.Error.Param == nil || *e.Error.Param != tc.param)) {
			t.Errorf("%s: %d %s, want 400 naming %q", tc.name, resp.StatusCode, b, tc.param)
		}
	}
	if resp, _ := submitJob(t, f, "nomodel", `{"endpoint":"/v1/completions","body":{"model":"nope","prompt":"x"}}`, acme...); resp.StatusCode != http.StatusNotFound {
		t.Errorf("unknown model: %d, want 404", resp.StatusCode)
	}

	// No runner here: the job waits, and can be cancelled once.
	resp, b := f.post(t, "/v1/jobs/"+first.ID+"/cancel", "", acme...)
	if resp.StatusCode != 200 || !strings.Contains(string(b), `"CANCELLED"`) {
		t.Errorf("cancel: %d %s", resp.StatusCode, b)
	}
	if resp, _ := f.post(t, "/v1/jobs/"+first.ID+"/cancel", "", acme...); resp.StatusCode != http.StatusConflict ||
		resp.Header.Get("x-should-retry") != "false" {
		t.Errorf("cancel twice: %d (x-should-retry %q), want 409, not to be retried", resp.StatusCode, resp.Header.Get("x-should-retry"))
	}
	req, _ := http.NewRequest(http.MethodGet, f.srv.URL+"/v1/jobs/"+first.ID+"/result", nil)
	req.Header.Set("Authorization", "Bearer sk-a")
	if r, err := http.DefaultClient.Do(req); err != nil || r.StatusCode != http.StatusConflict {
		t.Errorf("result of a cancelled job: %v %v", r.StatusCode, err)
	}
}

func TestJobList(t *testing.T) {
	f := startFleet(t, fleetOpts{jobs: true})
	var ids []string
	for i := range 5 {
		_, v := submitJob(t, f, fmt.Sprint("k", i), chatJob(fmt.Sprint("p", i), 4))
		ids = append(ids, v.ID)
	}
	var got []string
	url := f.srv.URL + "/v1/jobs?limit=2&state=READY"
	for range 5 {
		resp, err := http.Get(url)
		if err != nil {
			t.Fatal(err)
		}
		var page struct {
			Data       []jobView `json:"data"`
			HasMore    bool      `json:"has_more"`
			NextCursor string    `json:"next_cursor"`
		}
		_ = json.NewDecoder(resp.Body).Decode(&page)
		resp.Body.Close()
		for _, v := range page.Data {
			got = append(got, v.ID)
		}
		if !page.HasMore {
			break
		}
		url = f.srv.URL + "/v1/jobs?limit=2&state=READY&after=" + page.NextCursor
	}
	if len(got) != 5 || got[0] != ids[4] || got[4] != ids[0] {
		t.Errorf("listed %v, want newest first %v", got, ids)
	}
	if resp, err := http.Get(f.srv.URL + "/v1/jobs?state=DONE"); err != nil || resp.StatusCode != 400 {
		t.Errorf("bad state filter: %v", resp.StatusCode)
	}
}

// TestJobRetriesThroughBackendErrors: 503s from every backend are retried
// with backoff, and the job completes once the backends recover; its
// attempts explain its history.
func TestJobRetriesThroughBackendErrors(t *testing.T) {
	f := startFleet(t, fleetOpts{jobs: true, runner: true})
	f.sims[0].SetFaults(vllmsim.Faults{UnavailableRate: 1})
	_, v := submitJob(t, f, "k", chatJob("retry me", 4))
	eventually.True(t, "two failed attempts", func() bool {
		as, _ := f.store.Attempts(t.Context(), v.ID)
		return len(as) >= 2
	})
	f.sims[0].SetFaults(vllmsim.Faults{})
	waitState(t, f, v.ID, store.Succeeded)
	as, _ := f.store.Attempts(t.Context(), v.ID)
	last := as[len(as)-1]
	if last.Outcome != "succeeded" || as[0].Outcome != store.OutcomeFailed || !as[0].Spent || as[0].ErrorClass != "backend_error" {
		t.Errorf("attempts %+v", as)
	}
}

// TestJobInvalidRequestFailsAtOnce: a request the backend rejects as
// invalid is not retried.
func TestJobInvalidRequestFailsAtOnce(t *testing.T) {
	f := startFleet(t, fleetOpts{jobs: true, runner: true})
	_, v := submitJob(t, f, "k", chatJob("too long", 200_000))
	waitState(t, f, v.ID, store.FailedTerminal)
	as, _ := f.store.Attempts(t.Context(), v.ID)
	if len(as) != 1 || as[0].ErrorClass != "invalid_request" {
		t.Errorf("attempts %+v", as)
	}
}

// TestJobWaitsOutAModelMissing: a backend that answers 404 for the model
// kvgate routed to it (restarted with another model, an adapter unloaded)
// does not end the job as an invalid request: the attempt is a wait that
// spends nothing, and the job runs once the model is served again.
func TestJobWaitsOutAModelMissing(t *testing.T) {
	var missing atomic.Int64
	missing.Store(2)
	f := startFleet(t, fleetOpts{backends: 1, jobs: true, runner: true, speedup: 50, wrap: func(_ int, h http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.Method == http.MethodPost && strings.HasSuffix(r.URL.Path, "/completions") && missing.Add(-1) >= 0 {
				w.Header().Set("Content-Type", "application/json")
				w.WriteHeader(http.StatusNotFound)
				_, _ = w.Write([]byte(`{"object":"error","message":"The model does not exist.","type":"NotFoundError","param":null,"code":404}`))
				return
			}
			h.ServeHTTP(w, r)
		})
	}})
	_, v := submitJob(t, f, "model-missing", chatJob("still there?", 2))
	waitJob(t, f, "default", v.ID, store.Succeeded)
	j, err := f.store.Get(context.Background(), "default", v.ID)
	if err != nil || j.Attempt != 1 {
		t.Errorf("attempts spent %d (%v), want 1: the 404s spend none", j.Attempt, err)
	}
	as, _ := f.store.Attempts(context.Background(), v.ID)
	if len(as) < 3 || as[0].Spent || as[0].ErrorClass != "no_backend" {
		t.Errorf("attempts %+v: want unspent no_backend waits first", as)
	}
}

// TestJobOfANewerEndpointWaits: a job whose endpoint this replica does
// not serve (a newer replica accepted it, mid rolling upgrade) is handed
// back without spending an attempt, for a replica that serves it, rather
// than failed for good as an invalid request.
func TestJobOfANewerEndpointWaits(t *testing.T) {
	f := startFleet(t, fleetOpts{backends: 1, jobs: true, runner: true})
	now := time.Now()
	j, _, err := f.store.Accept(context.Background(), store.NewJob{ID: uuid.Must(uuid.NewV7()).String(), EventID: uuid.Must(uuid.NewV7()).String(),
		Tenant: "default", IdempotencyKey: "newer", RequestHash: "h", Endpoint: "/v1/from-the-future", Model: llama,
		Body: []byte(`{"model":"` + llama + `"}`), MaxAttempts: 1, Deadline: now.Add(time.Hour), Now: now})
	if err != nil {
		t.Fatal(err)
	}
	var as []store.Attempt
	eventually.True(t, "the job tried", func() bool {
		as, _ = f.store.Attempts(context.Background(), j.ID)
		return len(as) > 0
	})
	got, _ := f.store.Get(context.Background(), "default", j.ID)
	if got.State.Final() || got.Attempt != 0 || as[0].Spent || as[0].ErrorClass != "unknown_endpoint" {
		t.Errorf("job %s with %d attempts spent, first attempt %+v: want it waiting, nothing spent", got.State, got.Attempt, as[0])
	}
}
