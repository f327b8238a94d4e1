package gateway

import (
	"bytes"
	"context"
	"encoding/json"
	"log/slog"
	"net/http"
	"regexp"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/kvgate/kvgate/scheduler"
	"github.com/kvgate/kvgate/store"
)

func TestValidRequestID(t *testing.T) {
	for id, want := range map[string]bool{
		"req_0123": true, "0b1c2d3e-aaaa-bbbb-cccc-000000000000": true, "caller/trace:7=x+y": true,
		"": false, "has space": false, `quo"te`: false, `back\slash`: false, "tab\there": false, "é": false,
		strings.Repeat("a", 128): true, strings.Repeat("a", 129): false,
	} {
		if got := validRequestID(id); got != want {
			t.Errorf("validRequestID(%q) = %v, want %v", id, got, want)
		}
	}
	if id := newRequestID(); !validRequestID(id) || len(id) != 36 || !strings.HasPrefix(id, "req_") || id == newRequestID() {
		t.Errorf("generated id %q", id)
	}
}

// TestLogHandler: a record logged with a request's context gets its
// request_id, and a job's trace ids inside its trace.
func TestLogHandler(t *testing.T) {
	var buf bytes.Buffer
	log := slog.New(LogHandler(slog.NewJSONHandler(&buf, nil))).With("component", "x")
	ctx := context.WithValue(context.Background(), reqInfoKey{}, &reqInfo{id: "req-1"})
	log.InfoContext(ctx, "hello")
	log.InfoContext(scheduler.JobContext(context.Background(), "01a23162-10be-7ce5-b695-d8ec2773469c"), "job")
	log.Info("plain")
	var lines []map[string]any
	for _, l := range strings.Split(strings.TrimSpace(buf.String()), "\n") {
		var m map[string]any
		if err := json.Unmarshal([]byte(l), &m); err != nil {
			t.Fatal(err)
		}
		lines = append(lines, m)
	}
	if lines[0]["request_id"] != "req-1" || lines[0]["component"] != "x" {
		t.Errorf("request line %v", lines[0])
	}
	if lines[1]["trace_id"] != "01a2316210be7ce5b695d8ec2773469c" || lines[1]["span_id"] == nil {
		t.Errorf("job line %v", lines[1])
	}
	if _, ok := lines[2]["request_id"]; ok {
		t.Errorf("plain line %v", lines[2])
	}
	for v, want := range map[string]bool{"": true, "debug": true, "info": true, "off": true, "warn": false} {
		if _, ok := parseAccessLog(v); ok != want {
			t.Errorf("parseAccessLog(%q) ok %v", v, ok)
		}
	}
}

// TestBackendCallsCarryTheRequestID: each call to a backend is named after
// its request (the caller's X-Request-Id) or its job, with a suffix of its
// own, and vLLM (the simulator, as vLLM does) builds its answer's id from
// that name. Two calls under one client id get two names.
func TestBackendCallsCarryTheRequestID(t *testing.T) {
	var counted atomic.Value // the name of the last /tokenize call
	f := startFleet(t, fleetOpts{jobs: true, runner: true, speedup: 50, gateway: Config{TokenCount: "tokenize"},
		wrap: func(_ int, h http.Handler) http.Handler {
			return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if r.URL.Path == "/tokenize" {
					counted.Store(r.Header.Get(RequestIDHeader))
				}
				h.ServeHTTP(w, r)
			})
		}})
	chat := `{"model":"` + llama + `","messages":[{"role":"user","content":"hi"}],"max_tokens":2}`
	answerID := func() string {
		resp, b := f.post(t, "/v1/chat/completions", chat, RequestIDHeader, "client-7")
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("chat: %d %s", resp.StatusCode, b)
		}
		return decode[struct{ ID string }](t, b).ID
	}
	named := regexp.MustCompile(`^chatcmpl-client-7-[0-9a-f]{8}$`)
	first, second := answerID(), answerID()
	if !named.MatchString(first) || !named.MatchString(second) || first == second {
		t.Errorf("answer ids %q and %q, want chatcmpl-client-7- and a suffix of each call's own", first, second)
	}
	if got, _ := counted.Load().(string); !regexp.MustCompile(`^client-7-[0-9a-f]{8}$`).MatchString(got) {
		t.Errorf("the prompt's /tokenize call was named %q, want client-7- and a suffix", got)
	}
	_, j := submitJob(t, f, "named-job", `{"endpoint":"/v1/chat/completions","body":`+chat+`}`)
	waitJob(t, f, "default", j.ID, store.Succeeded)
	resp, b := send(t, f.srv.URL, http.MethodGet, "/v1/jobs/"+j.ID+"/result", "", "")
	if id := decode[struct{ ID string }](t, b).ID; resp.StatusCode != http.StatusOK ||
		!regexp.MustCompile(`^chatcmpl-`+regexp.QuoteMeta(j.ID)+`-[0-9a-f]{8}$`).MatchString(id) {
		t.Errorf("job result: %d, id %q, want chatcmpl-%s- and a suffix", resp.StatusCode, id, j.ID)
	}
}
