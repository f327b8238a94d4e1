package gateway

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/kvgate/kvgate/scheduler"
)

func TestClassifyResponse(t *testing.T) {
	for _, tc := range []struct {
		status     int
		retryAfter string
		body       string
		class      upstreamClass
		errClass   scheduler.ErrorClass
		msg        string
		wait       time.Duration
	}{
		{200, "", `{"usage":{}}`, upstreamOK, "", "", 0},
		{429, "7", `{"error":{"message":"slow down"}}`, upstreamRateLimited, scheduler.ClassRateLimited, "slow down", 7 * time.Second},
		{500, "", `{"message":"boom"}`, upstreamBackendError, scheduler.ClassBackend, "boom", 0},
		{503, "2", `not json`, upstreamBackendError, scheduler.ClassBackend, "The backend answered 503.", 2 * time.Second},
		{400, "", `{"error":{"message":"maximum context length is 8192"}}`, upstreamRequestError, scheduler.ClassInvalid, "maximum context length is 8192", 0},
		// The backend does not serve the model now: a wait, not the request's fault.
		{404, "", `{"error":{"message":"The model ` + "`m`" + ` does not exist."}}`, upstreamModelMissing, scheduler.ClassNoBackend, "The model `m` does not exist.", 0},
		// Another 404 is the request's: what it named is not there.
		{404, "", `{"error":{"message":"Response with id 'resp_1' not found."}}`, upstreamRequestError, scheduler.ClassInvalid, "Response with id 'resp_1' not found.", 0},
		{422, "", `{"error":{"message":"bad field"}}`, upstreamRequestError, scheduler.ClassInvalid, "bad field", 0},
	} {
		t.Run(fmt.Sprint(tc.status), func(t *testing.T) {
			h := http.Header{}
			if tc.retryAfter != "" {
				h.Set("Retry-After", tc.retryAfter)
			}
			u := classifyResponse(tc.status, h, []byte(tc.body))
			if u.class != tc.class || u.status != tc.status || u.retryAfter != tc.wait {
				t.Errorf("classified %v status %d retry after %v, want %v %d %v", u.class, u.status, u.retryAfter, tc.class, tc.status, tc.wait)
			}
			if tc.class == upstreamOK {
				if u.err != nil {
					t.Errorf("ok with error %v", u.err)
				}
				return
			}
			if got := u.class.errorClass(); got != tc.errClass {
				t.Errorf("error class %s, want %s", got, tc.errClass)
			}
			var ue *upstreamError
			if !errors.As(u.err, &ue) || ue.msg != tc.msg || ue.status != tc.status || ue.retryAfter != tc.wait {
				t.Errorf("err %#v, want the backend's status and message %q", u.err, tc.msg)
			}
		})
	}
}

func TestClassifyTransport(t *testing.T) {
	_, err := http.Post(downURL(t)+"/v1/completions", "application/json", strings.NewReader("{}"))
	if err == nil {
		t.Fatal("a closed port answered")
	}
	if u := classifyTransport(err, false); u.class != upstreamNotSent || u.class.sent() || u.class.errorClass() != scheduler.ClassRefused {
		t.Errorf("connection refused: %v (sent %v)", u.class, u.class.sent())
	}
	if u := classifyTransport(io.ErrUnexpectedEOF, false); u.class != upstreamBackendError || !u.class.sent() {
		t.Errorf("cut answer: %v", u.class)
	}
	if u := classifyTransport(errStalled, true); u.class != upstreamTimeout || u.class.errorClass() != scheduler.ClassTimeout {
		t.Errorf("stall: %v", u.class)
	}
	// A dial that kvgate's timeout cut (a host dropping connection
	// attempts) sent nothing.
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := (&net.Dialer{}).DialContext(ctx, "tcp", "127.0.0.1:9"); err == nil {
		t.Fatal("a cancelled dial connected")
	} else if u := classifyTransport(err, true); u.class != upstreamNotSent || u.class.sent() {
		t.Errorf("a dial cut by the timeout (%v): %v (sent %v), want not sent", err, u.class, u.class.sent())
	}
	if u := malformedAnswer(200, errors.New("unexpected end of JSON input")); u.class != upstreamBackendError || u.status != 200 {
		t.Errorf("malformed: %v %d", u.class, u.status)
	}
}

// reports records what requestHealth tells the pool.
type reports []string

func (r *reports) ReportFailure(name string, err error) { *r = append(*r, "fail "+name) }
func (r *reports) ReportSuccess(name string)            { *r = append(*r, "ok "+name) }

// TestRequestHealth: which backends a request's failures count against.
func TestRequestHealth(t *testing.T) {
	e500 := classifyResponse(500, http.Header{}, nil)
	e503 := classifyResponse(503, http.Header{}, nil)
	bad := classifyResponse(400, http.Header{}, nil)
	ok := upstream{class: upstreamOK, status: 200}
	refused := upstream{class: upstreamNotSent, err: errors.New("connection refused")}
	stall := classifyTransport(errStalled, true)
	limited := classifyResponse(429, http.Header{}, nil)
	type step struct {
		backend string
		u       upstream
	}
	for _, tc := range []struct {
		name      string
		steps     []step
		sameTwice bool // after the last step
		want      []string
	}{
		{"500 then success elsewhere: the first backend's", []step{{"a", e500}, {"b", ok}}, false, []string{"ok b", "fail a"}},
		{"500 on two backends: the request's", []step{{"a", e500}, {"b", e500}}, true, nil},
		{"stall on two backends: the request's", []step{{"a", stall}, {"b", stall}}, true, nil},
		{"500 then 503: not the same, both charged", []step{{"a", e500}, {"b", e503}}, false, []string{"fail a", "fail b"}},
		{"500 alone: charged", []step{{"a", e500}}, false, []string{"fail a"}},
		{"500 then 400 elsewhere: the request is bad", []step{{"a", e500}, {"b", bad}}, false, []string{"ok b"}},
		{"refused: charged at once", []step{{"a", refused}, {"b", ok}}, false, []string{"fail a", "ok b"}},
		{"429 charges nobody", []step{{"a", limited}, {"b", ok}}, false, []string{"ok b"}},
		{"500, refused, 500: the request's", []step{{"a", e500}, {"b", refused}, {"c", e500}}, true, []string{"fail b"}},
		{"client left: nothing known", []step{{"a", upstream{}}}, false, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var r reports
			var h requestHealth
			same := false
			for _, s := range tc.steps {
				same = h.observe(&r, s.backend, s.u)
			}
			h.settle(&r)
			if same != tc.sameTwice || !slices.Equal(r, tc.want) {
				t.Errorf("same twice %v, reports %q; want %v, %q", same, r, tc.sameTwice, tc.want)
			}
		})
	}
}

func TestReportAlone(t *testing.T) {
	for _, tc := range []struct {
		u    upstream
		want string
	}{
		{upstream{class: upstreamOK, status: 200}, "ok a"},
		{classifyResponse(500, http.Header{}, nil), "fail a"},
		{classifyResponse(400, http.Header{}, nil), "ok a"},
		{classifyResponse(429, http.Header{}, nil), ""},
		{classifyTransport(errStalled, true), "fail a"},
	} {
		var r reports
		reportAlone(&r, "a", tc.u)
		if strings.Join(r, ",") != tc.want {
			t.Errorf("%v: reports %q, want %q", tc.u.class, r, tc.want)
		}
	}
}

// TestBackendErrorKeepsItsParam: a backend's 4xx that names the field at
// fault reaches the client with it, as the SDKs' errors expose param.
func TestBackendErrorKeepsItsParam(t *testing.T) {
	for body, want := range map[string]string{
		`{"error":{"message":"temperature must be at least 0","type":"BadRequestError","param":"temperature","code":400}}`: "temperature",
		`{"object":"error","message":"bad top_p","type":"BadRequestError","param":"top_p","code":400}`:                     "top_p",
		`{"error":{"message":"no field named","param":null}}`:                                                              "",
	} {
		u := classifyResponse(http.StatusBadRequest, http.Header{}, []byte(body))
		if e := toAPIError(u.err); e.param != want || e.status != http.StatusBadRequest || e.typ != "invalid_request_error" {
			t.Errorf("%s: param %q, status %d, type %q; want param %q, 400 invalid_request_error", body, e.param, e.status, e.typ, want)
		}
	}
}

// TestBackendModelMissing: the last backend's 404 for a model it does not
// serve after all reaches the client as kvgate's own answer for an unknown
// model, model_not_found naming model; another 404 keeps its own.
func TestBackendModelMissing(t *testing.T) {
	for body, want := range map[string][2]string{
		`{"error":{"message":"The model ` + "`sql-lora`" + ` does not exist.","type":"NotFoundError","code":404}}`: {"model_not_found", "model"},
		`{"error":{"message":"Response with id resp_1 not found.","type":"NotFoundError","code":404}}`:             {"", ""},
	} {
		u := classifyResponse(http.StatusNotFound, http.Header{}, []byte(body))
		if e := toAPIError(u.err); e.status != http.StatusNotFound || e.code != want[0] || e.param != want[1] {
			t.Errorf("%s: %d code %q param %q, want 404 %q %q", body, e.status, e.code, e.param, want[0], want[1])
		}
	}
}

// TestBackendContextErrors: both of vLLM's ways of saying a request does
// not fit the model's context reach the client as context_length_exceeded,
// the code the SDKs' callers branch on.
func TestBackendContextErrors(t *testing.T) {
	for _, msg := range []string{
		"This model's maximum context length is 8192 tokens. However, you requested 9000 tokens.",
		"The decoder prompt (length 9000) is longer than the maximum model length of 8192. Make sure that `max_model_len` is no smaller than the number of text tokens plus multimodal tokens.",
	} {
		body, _ := json.Marshal(map[string]any{"error": map[string]any{"message": msg, "type": "BadRequestError", "code": 400}})
		u := classifyResponse(http.StatusBadRequest, http.Header{}, body)
		if e := toAPIError(u.err); e.code != "context_length_exceeded" || e.status != http.StatusBadRequest {
			t.Errorf("%q: %d %q, want 400 context_length_exceeded", msg, e.status, e.code)
		}
	}
}

// refusingTransport refuses the connections of inference calls to one
// host, as a backend whose server is down between two scrapes would.
type refusingTransport struct {
	next http.RoundTripper
	host *atomic.Pointer[string]
}

func (rt refusingTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	if h := rt.host.Load(); h != nil && r.URL.Host == *h && r.Method == http.MethodPost {
		return nil, &net.OpError{Op: "dial", Net: "tcp", Err: errors.New("connection refused")}
	}
	return rt.next.RoundTrip(r)
}

// TestAnswerOfTheSentAttempt: a request one backend failed (a 500 with
// its message) and whose retry found the other backend's door shut ends
// with what the first backend said, not with the refused connection.
func TestAnswerOfTheSentAttempt(t *testing.T) {
	var refused atomic.Pointer[string]
	f := startFleet(t, fleetOpts{backends: 2, wrap: func(i int, h http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.Method == http.MethodPost && strings.HasSuffix(r.URL.Path, "/completions") {
				_, _ = io.Copy(io.Discard, r.Body)
				w.Header().Set("Content-Type", "application/json")
				w.WriteHeader(http.StatusInternalServerError)
				_, _ = w.Write([]byte(`{"error":{"message":"the engine fell over","type":"InternalServerError","code":500}}`))
				return
			}
			h.ServeHTTP(w, r)
		})
	}, server: func(s *Server) {
		s.client.Transport = refusingTransport{next: s.client.Transport, host: &refused}
	}})
	host := strings.TrimPrefix(f.urls[1], "http://")
	refused.Store(&host)
	for i := range 4 {
		resp, body := f.post(t, "/v1/chat/completions", chatReq(2+i))
		if resp.StatusCode != http.StatusInternalServerError || !strings.Contains(string(body), "the engine fell over") {
			t.Errorf("request %d: %d %s, want the first backend's 500", i, resp.StatusCode, body)
		}
	}
}

// TestBackendWantingCredentials: a backend that answers 401 (a vLLM
// started with --api-key, which kvgate does not send) fails kvgate, not
// the caller: the request goes to the other backend, the refusing one
// counts a failure, and alone it is a 502, never a 401 that would tell the
// caller its own key is wrong.
func TestBackendWantingCredentials(t *testing.T) {
	refuse := func(i int, h http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if i == 0 && r.Method == http.MethodPost {
				_, _ = io.Copy(io.Discard, r.Body)
				w.Header().Set("Content-Type", "application/json")
				w.WriteHeader(http.StatusUnauthorized)
				_, _ = io.WriteString(w, `{"error":"Unauthorized"}`)
				return
			}
			h.ServeHTTP(w, r)
		})
	}
	f := startFleet(t, fleetOpts{backends: 2, wrap: refuse})
	for i := range 4 {
		if resp, body := f.post(t, "/v1/chat/completions", chatReq(2+i)); resp.StatusCode != http.StatusOK {
			t.Errorf("request %d beside a backend wanting credentials: %d %s", i, resp.StatusCode, body)
		}
	}
	// Every backend refusing: each counts a failure (the request is not
	// to blame, however alike the two answers), and the caller gets 502.
	both := startFleet(t, fleetOpts{backends: 2, wrap: func(_ int, h http.Handler) http.Handler { return refuse(0, h) }})
	if resp, body := both.post(t, "/v1/chat/completions", chatReq(2)); resp.StatusCode != http.StatusBadGateway {
		t.Errorf("every backend wanting credentials: %d %s, want 502", resp.StatusCode, body)
	}
	for _, sn := range both.pool.Snapshots() {
		if sn.Failures == 0 {
			t.Errorf("backend %s refused the request and counted no failure", sn.Name)
		}
	}
	alone := startFleet(t, fleetOpts{wrap: refuse})
	resp, body := alone.post(t, "/v1/chat/completions", chatReq(2))
	if resp.StatusCode != http.StatusBadGateway || !strings.Contains(string(body), "API key kvgate does not send") {
		t.Errorf("the only backend wanting credentials: %d %s, want 502 saying so", resp.StatusCode, body)
	}
	if sn := alone.pool.Snapshots()[0]; sn.Failures == 0 {
		t.Error("the backend refusing every request counted no failure")
	}
	// The operator sees why in the metrics, not only in an ejection.
	if n := testutil.ToFloat64(alone.api.m.upstream.WithLabelValues("sim0", "refused")); n < 1 {
		t.Errorf("kvgate_gateway_upstream_errors_total{kind=refused} %v after a refusal", n)
	}
}

// TestEchoScoringCompletion: a completion that echoes its prompt with
// max_tokens 0 (scoring a text by its logprobs, as vLLM allows) reaches
// the backend as sent; max_tokens 0 without echo, or on chat, stays a 400.
// The simulator has no echo: this backend answers as vLLM would.
func TestEchoScoringCompletion(t *testing.T) {
	var got atomic.Pointer[string]
	f := startFleet(t, fleetOpts{wrap: func(_ int, h http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.Method != http.MethodPost || r.URL.Path != "/v1/completions" {
				h.ServeHTTP(w, r)
				return
			}
			b, _ := io.ReadAll(r.Body)
			s := string(b)
			got.Store(&s)
			w.Header().Set("Content-Type", "application/json")
			_, _ = io.WriteString(w, `{"id":"cmpl-1","object":"text_completion","created":1,"model":"`+llama+
				`","choices":[{"index":0,"text":"the cat sat","logprobs":null,"finish_reason":"length"}],`+
				`"usage":{"prompt_tokens":3,"completion_tokens":0,"total_tokens":3}}`)
		})
	}})
	body := `{"model":"` + llama + `","prompt":"the cat sat","max_tokens":0,"echo":true,"logprobs":1}`
	if resp, b := f.post(t, "/v1/completions", body); resp.StatusCode != http.StatusOK {
		t.Fatalf("an echo-only completion: %d %s", resp.StatusCode, b)
	}
	if s := got.Load(); s == nil || !strings.Contains(*s, `"max_tokens":0`) || !strings.Contains(*s, `"echo":true`) {
		sent := "nothing"
		if s != nil {
			sent = *s
		}
		t.Errorf("the backend got %s, want the request as sent", sent)
	}
	// vLLM reads echo as a Python bool, leniently: so does kvgate.
	for _, echo := range []string{`1`, `"true"`} {
		if resp, b := f.post(t, "/v1/completions", strings.Replace(body, `"echo":true`, `"echo":`+echo, 1)); resp.StatusCode != http.StatusOK {
			t.Errorf("echo %s: %d %s", echo, resp.StatusCode, b)
		}
	}
	for _, c := range []struct{ path, body string }{
		{"/v1/completions", `{"model":"` + llama + `","prompt":"a","max_tokens":0}`},
		{"/v1/completions", `{"model":"` + llama + `","prompt":"a","max_tokens":0,"echo":false}`},
		{"/v1/chat/completions", `{"model":"` + llama + `","messages":[{"role":"user","content":"a"}],"max_tokens":0,"echo":true}`},
	} {
		if resp, b := f.post(t, c.path, c.body); resp.StatusCode != http.StatusBadRequest || !strings.Contains(string(b), `"param":"max_tokens"`) {
			t.Errorf("%s %s: %d %s, want 400 naming max_tokens", c.path, c.body, resp.StatusCode, b)
		}
	}
}
