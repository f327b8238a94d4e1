package gateway

import (
	"bytes"
	"encoding/json"
	"math"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"
	"unicode/utf8"
)

// FuzzSubmitJob posts arbitrary bodies and Idempotency-Keys to POST
// /v1/jobs on a gateway with a SQLite job store. FuzzSubmitJobPostgres
// does the same on PostgreSQL, whose column types are stricter.
func FuzzSubmitJob(f *testing.F) {
	fuzzSubmitJob(f, startFleet(f, fleetOpts{jobs: true, gateway: fuzzAuth}))
}

// FuzzSubmitJobPostgres is FuzzSubmitJob on a fresh PostgreSQL database;
// without a server it skips (in CI it fails, as every PostgreSQL test).
func FuzzSubmitJobPostgres(f *testing.F) {
	fuzzSubmitJob(f, startFleet(f, fleetOpts{jobs: true, pg: true, gateway: fuzzAuth}))
}

// fuzzSubmitJob checks the job submission's contract: every request is
// answered 202 or an OpenAI-shaped 4xx, never a 5xx or a panic; a
// request valid by the API's rules (tested here independently of the
// handler) is accepted (or 422 when its key already named another
// request), and its job holds what was asked: the deadline, the
// metadata, a positive token estimate; the same key and body again
// return the same job.
func fuzzSubmitJob(f *testing.F, fl *fleet) {
	chat := `{"model":"` + llama + `","messages":[{"role":"user","content":"hi"}],"max_tokens":4}`
	for _, s := range []struct{ key, body string }{
		{"k1", chatJob("summarise this", 8)},
		{"k2", `{"endpoint":"/v1/completions","body":{"model":"` + llama + `","prompt":"x"},"deadline_seconds":60}`},
		{"k3", `{"endpoint":"/v1/embeddings","body":{"model":"` + llama + `","input":["a","b"]},"metadata":{"doc":[1,2]}}`},
		{"k4", `{"endpoint":"/v1/chat/completions","body":` + chat + `,"deadline":"2030-01-01T00:00:00Z"}`},
		{"k5", `{"endpoint":"/v1/chat/completions","body":` + chat + `,"deadline_seconds":604800}`},
		{"k6", `{"endpoint":"/v1/chat/completions","body":` + chat + `,"deadline_seconds":-5}`},
		{"k7", `{"endpoint":"/v1/images","body":{}}`},
		{"k8", `{"endpoint":"/v1/completions","body":{"model":"` + llama + `","prompt":"x","stream":true}}`},
		{"k9", `{"endpoint":"/v1/completions","body":{"model":"nope","prompt":"x"}}`},
		{"k10", `{"endpoint":"/v1/chat/completions","body":null}`},
		{"k11", `{"endpoint":"/v1/chat/completions","metadata":"` + strings.Repeat("m", 17<<10) + `","body":` + chat + `}`},
		{"", chatJob("no key", 4)},
		{"k1", chatJob("same key, another request", 8)},
		{"k12", `{"endpoint":`},
		// A retry of an accepted job whose deadline is no longer valid.
		{"k13", `{"endpoint":"/v1/chat/completions","body":` + chat + `,"deadline_seconds":60}`},
		{"k13", `{"endpoint":"/v1/chat/completions","body":` + chat + `,"deadline_seconds":-5}`},
	} {
		f.Add(s.key, []byte(s.body))
	}
	seen := map[string]string{} // key -> request hash, of the jobs this process created
	f.Fuzz(func(t *testing.T, key string, body []byte) {
		if !validHeaderValue(key) {
			return // no HTTP server hands such a header to a handler
		}
		key = strings.Trim(key, " \t") // as the server's header parser does
		before := time.Now()
		rec := postJob(fl, key, body)
		after := time.Now()
		want, req := expectJob(fl.api, key, body, before, after)
		switch {
		case rec.Code >= 500:
			t.Fatalf("%d for a job submission: %s", rec.Code, rec.Body.Bytes())
		case want == reject && rec.Code == http.StatusAccepted && !replayOfSeen(rec, seen, key, req):
			// A refused request whose key already made a job of the same
			// request gets that job back (a client retrying a lost 202,
			// whatever refuses a new job now): only that is allowed.
			t.Fatalf("an invalid submission was accepted: %s", rec.Body.Bytes())
		case want == accept && rec.Code != http.StatusAccepted && rec.Code != http.StatusUnprocessableEntity:
			t.Fatalf("a valid submission got %d: %s", rec.Code, rec.Body.Bytes())
		case rec.Code == http.StatusUnprocessableEntity && want == accept:
			if h := requestHash(req.Endpoint, req.Body); seen[key] == "" || seen[key] == h {
				t.Fatalf("422 for key %q, which named no other request: %s", key, rec.Body.Bytes())
			}
		}
		if rec.Code != http.StatusAccepted {
			checkOpenAIError(t, rec.Code, rec.Header(), rec.Body.Bytes())
			return
		}
		var v jobView
		if err := json.Unmarshal(rec.Body.Bytes(), &v); err != nil || v.ID == "" || v.Object != "job" {
			t.Fatalf("202 without a job (%v): %s", err, rec.Body.Bytes())
		}
		if loc := rec.Header().Get("Location"); loc != "/v1/jobs/"+v.ID {
			t.Fatalf("Location %q for job %s", loc, v.ID)
		}
		h := requestHash(req.Endpoint, req.Body)
		replayed := rec.Header().Get("Idempotent-Replayed") == "true"
		if prev, ok := seen[key]; replayed != ok || (ok && prev != h) {
			t.Fatalf("key %q: replayed %v, but this process created it: %v", key, replayed, ok)
		}
		seen[key] = h
		if !replayed {
			checkJob(t, fl, v, req, before, after)
		}
		again := postJob(fl, key, body)
		var w jobView
		_ = json.Unmarshal(again.Body.Bytes(), &w)
		if again.Code != http.StatusAccepted || w.ID != v.ID || again.Header().Get("Idempotent-Replayed") != "true" {
			t.Fatalf("the same submission again: %d, job %q, want job %s replayed: %s", again.Code, w.ID, v.ID, again.Body.Bytes())
		}
	})
}

// replayOfSeen reports whether rec replays the job this process made for
// key from the same request.
func replayOfSeen(rec *httptest.ResponseRecorder, seen map[string]string, key string, req jobRequest) bool {
	prev, ok := seen[key]
	return ok && rec.Header().Get("Idempotent-Replayed") == "true" && prev == requestHash(req.Endpoint, req.Body)
}

func postJob(fl *fleet, key string, body []byte) *httptest.ResponseRecorder {
	req := httptest.NewRequest(http.MethodPost, "/v1/jobs", bytes.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer "+fuzzKey)
	if key != "" {
		req.Header.Set("Idempotency-Key", key)
	}
	rec := httptest.NewRecorder()
	fl.api.ServeHTTP(rec, req)
	return rec
}

type verdict int

const (
	reject verdict = iota // some 4xx
	accept                // 202, or 409 for a key that named another request
	either                // too close to a limit to tell
)

// expectJob judges a submission by the API's documented rules, made
// between before and after to s; req is the body as parsed, if it parses.
func expectJob(s *Server, key string, body []byte, before, after time.Time) (verdict, jobRequest) {
	var req jobRequest
	if key == "" || len(key) > 255 || !utf8.ValidString(key) || json.Unmarshal(body, &req) != nil {
		return reject, req
	}
	// Only the job API's arguments, one JSON value, one deadline.
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.DisallowUnknownFields()
	if dec.Decode(new(jobRequest)) != nil || dec.More() || (req.Deadline != nil && req.DeadlineSeconds != nil) {
		return reject, req
	}
	ep, ok := jobEndpoints[req.Endpoint]
	if !ok || len(req.Metadata) > 16<<10 {
		return reject, req
	}
	c, err := parseCall(req.Body, ep)
	if err != nil || c.f.Stream || c.model != llama {
		return reject, req
	}
	model, _ := s.lookupModel(llama)
	if total, _ := s.reservationWith(c, model, s.est.estimate(llama, c.promptBytes)); total > math.MaxInt32 {
		return reject, req // more than a job may reserve
	}
	const maxDeadline = 7 * 24 * time.Hour
	var lo, hi time.Time // the deadline the job gets, as early and as late as it can be
	switch {
	case req.Deadline != nil:
		lo, hi = *req.Deadline, *req.Deadline
	case req.DeadlineSeconds != nil:
		d := *req.DeadlineSeconds
		if d <= 0 || d > int(maxDeadline/time.Second) {
			return reject, req
		}
		lo, hi = before.Add(time.Duration(d)*time.Second), after.Add(time.Duration(d)*time.Second)
	default:
		return accept, req
	}
	switch {
	case !lo.After(after) && hi.After(before), // now, give or take the call
		lo.After(before.Add(maxDeadline)) && !hi.After(after.Add(maxDeadline)):
		return either, req
	case !hi.After(before) || lo.After(after.Add(maxDeadline)):
		return reject, req
	}
	return accept, req
}

// checkJob fails t unless the job v that a submission created holds what
// req asked for, as the API shows it and as the store keeps it.
func checkJob(t *testing.T, fl *fleet, v jobView, req jobRequest, before, after time.Time) {
	t.Helper()
	if v.State != "READY" || v.Endpoint != req.Endpoint || v.Model != llama {
		t.Fatalf("new job %+v for %s", v, req.Endpoint)
	}
	if meta := bytes.TrimSpace(req.Metadata); len(meta) > 0 && string(meta) != "null" && !jsonEqual(v.Metadata, meta) {
		t.Fatalf("metadata %s, asked %s", v.Metadata, meta)
	}
	lo, hi := before.Add(24*time.Hour).Unix(), after.Add(24*time.Hour).Unix()
	switch {
	case req.Deadline != nil:
		lo, hi = req.Deadline.Unix(), req.Deadline.Unix()
	case req.DeadlineSeconds != nil:
		lo, hi = before.Unix()+int64(*req.DeadlineSeconds), after.Unix()+int64(*req.DeadlineSeconds)
	}
	if v.Deadline < lo || v.Deadline > hi {
		t.Fatalf("deadline %d, want %d..%d", v.Deadline, lo, hi)
	}
	j, err := fl.store.Get(t.Context(), fuzzTenant, v.ID)
	if err != nil {
		t.Fatalf("the accepted job %s is not in the store: %v", v.ID, err)
	}
	if j.TokenEstimate < 1 || j.TokenEstimate > math.MaxInt32 || !bytes.Equal(j.Body, req.Body) {
		t.Fatalf("stored job: estimate %d, body %q; submitted %q", j.TokenEstimate, clip(j.Body), clip(req.Body))
	}
}

func jsonEqual(a, b []byte) bool {
	var x, y any
	if json.Unmarshal(a, &x) != nil || json.Unmarshal(b, &y) != nil {
		return false
	}
	xa, _ := json.Marshal(x)
	ya, _ := json.Marshal(y)
	return bytes.Equal(xa, ya)
}

// validHeaderValue reports whether an HTTP server would pass v on as a
// header value: no control characters but tab.
func validHeaderValue(v string) bool {
	for i := range len(v) {
		if c := v[i]; (c < ' ' && c != '\t') || c == 0x7f {
			return false
		}
	}
	return true
}
