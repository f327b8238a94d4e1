package gateway

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/kvgate/kvgate/store"
)

// errorKeys decodes an error body and checks that it holds exactly
// OpenAI's four keys, with message and type strings and param and code a
// string or null.
func errorKeys(t *testing.T, what string, b []byte) map[string]any {
	t.Helper()
	var outer map[string]map[string]any
	if err := json.Unmarshal(b, &outer); err != nil || len(outer) != 1 || outer["error"] == nil {
		t.Fatalf("%s: not {\"error\":{...}}: %s", what, b)
	}
	e := outer["error"]
	if len(e) != 4 {
		t.Errorf("%s: error has %d keys, want message, type, param, code: %s", what, len(e), b)
	}
	for _, k := range []string{"message", "type", "param", "code"} {
		v, ok := e[k]
		if !ok {
			t.Errorf("%s: no %q key: %s", what, k, b)
			continue
		}
		switch k {
		case "message", "type":
			if s, ok := v.(string); !ok || s == "" {
				t.Errorf("%s: %s = %v, want a non-empty string", what, k, v)
			}
		default:
			if _, ok := v.(string); v != nil && !ok {
				t.Errorf("%s: %s = %v, want a string or null", what, k, v)
			}
		}
	}
	return e
}

// TestErrorBodyShape: every error kvgate answers itself carries all four
// keys of OpenAI's ErrorResponse, param and code null when they have no
// value (never left out); a 403 has OpenAI's request_forbidden type.
func TestErrorBodyShape(t *testing.T) {
	st := sqliteStore(t)
	f := startFleet(t, fleetOpts{store: st, speedup: 50, keysRequired: true, gateway: Config{Tenants: Tenants{Store: st}}})
	user := newTenant(t, st, "acme", store.Limits{}, store.RoleUser)

	cases := []struct {
		name, method, path, key, body string
		status                        int
		typ                           string
		param, code                   any // nil: JSON null
	}{
		{"no key", http.MethodPost, "/v1/chat/completions", "", chatReq(2), http.StatusUnauthorized, "invalid_request_error", nil, nil},
		{"bad key", http.MethodPost, "/v1/chat/completions", "sk-nope", chatReq(2), http.StatusUnauthorized, "invalid_request_error", nil, "invalid_api_key"},
		{"no model", http.MethodPost, "/v1/chat/completions", user, `{"messages":[{"role":"user","content":"x"}]}`, http.StatusBadRequest, "invalid_request_error", "model", nil},
		{"unknown model", http.MethodPost, "/v1/chat/completions", user, `{"model":"nope","messages":[{"role":"user","content":"x"}]}`,
			http.StatusNotFound, "invalid_request_error", "model", "model_not_found"},
		{"bad json", http.MethodPost, "/v1/chat/completions", user, `{`, http.StatusBadRequest, "invalid_request_error", nil, nil},
		{"unknown route", http.MethodGet, "/v1/nothing", user, "", http.StatusNotFound, "invalid_request_error", nil, nil},
		{"admin only", http.MethodGet, "/v1/admin/tenants", user, "", http.StatusForbidden, "request_forbidden", nil, "admin_key_required"},
		{"operators only", http.MethodGet, "/v1/usage", user, "", http.StatusForbidden, "request_forbidden", nil, "operator_key_required"},
		{"operators only: fleet", http.MethodGet, "/v1/fleet", user, "", http.StatusForbidden, "request_forbidden", nil, "operator_key_required"},
		// The backend's own 400 (a chat model asked for embeddings) passes
		// on in OpenAI's shape too.
		{"backend 400", http.MethodPost, "/v1/embeddings", user, `{"model":"` + llama + `","input":"hi"}`, http.StatusBadRequest, "invalid_request_error", nil, nil},
	}
	for _, c := range cases {
		resp, b := send(t, f.srv.URL, c.method, c.path, c.key, c.body)
		if resp.StatusCode != c.status {
			t.Errorf("%s: %d %s, want %d", c.name, resp.StatusCode, b, c.status)
			continue
		}
		if ct := resp.Header.Get("Content-Type"); !strings.HasPrefix(ct, "application/json") {
			t.Errorf("%s: Content-Type %q", c.name, ct)
		}
		e := errorKeys(t, c.name, b)
		if e["type"] != c.typ || e["param"] != c.param || e["code"] != c.code {
			t.Errorf("%s: type %v param %v code %v, want %v %v %v: %s", c.name, e["type"], e["param"], e["code"], c.typ, c.param, c.code, b)
		}
	}
}

// TestUnreadableBodyIs400: a request body that cannot be read (here a
// chunked encoding broken mid-body) is the client's fault on every route
// that reads one: 400 in OpenAI's shape, never the 502 of a backend that
// failed.
func TestUnreadableBodyIs400(t *testing.T) {
	st := sqliteStore(t)
	f := startFleet(t, fleetOpts{store: st, speedup: 50, jobs: true, keysRequired: true, gateway: Config{Tenants: Tenants{Store: st}}})
	user := newTenant(t, st, "acme", store.Limits{}, store.RoleUser)
	operator := newTenant(t, st, "ops", store.Limits{}, store.RoleOperator)
	admin := newTenant(t, st, "root", store.Limits{}, store.RoleAdmin)
	for _, c := range []struct{ path, key string }{
		{"/v1/chat/completions", user},
		{"/v1/jobs", user},
		{"/v1/batches", user},
		{"/v1/validation-policies", operator},
		{"/v1/admin/tenants", admin},
		{"/tokenize", user},
	} {
		conn, err := net.Dial("tcp", f.srv.Listener.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		// The first chunk is whole; the second's size is not hex.
		fmt.Fprintf(conn, "POST %s HTTP/1.1\r\nHost: kvgate\r\nAuthorization: Bearer %s\r\nIdempotency-Key: k\r\n"+
			"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n5\r\n{\"a\":\r\nzz\r\n1}\r\n0\r\n\r\n", c.path, c.key)
		resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
		if err != nil {
			t.Fatalf("%s: %v", c.path, err)
		}
		b, _ := io.ReadAll(resp.Body)
		conn.Close()
		if resp.StatusCode != http.StatusBadRequest {
			t.Errorf("%s: %d %s, want 400", c.path, resp.StatusCode, b)
			continue
		}
		if e := errorKeys(t, c.path, b); e["type"] != "invalid_request_error" {
			t.Errorf("%s: %s", c.path, b)
		}
	}
}

// TestStaticKeyRateLimitHeaders: a static key (--api-key) of a tenant the
// store holds limits for is limited as the tenant's stored keys are, and
// carries the same x-ratelimit-* headers, admitted and refused.
func TestStaticKeyRateLimitHeaders(t *testing.T) {
	st := sqliteStore(t)
	clock := &testClock{now: quotaT0} // 10 s into a minute
	f := startFleet(t, fleetOpts{store: st, speedup: 50, keysRequired: true,
		gateway: Config{APIKeys: map[string]string{"sk-static": "acme"}, Tenants: Tenants{Store: st, Now: clock.Now}}})
	newTenant(t, st, "acme", store.Limits{RPM: 2, TPM: 5000}, store.RoleUser)

	for i, want := range []string{"1", "0"} {
		resp, b := send(t, f.srv.URL, http.MethodPost, "/v1/chat/completions", "sk-static", chatReq(4))
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("request %d: %d %s", i, resp.StatusCode, b)
		}
		for h, v := range map[string]string{"x-ratelimit-limit-requests": "2", "x-ratelimit-remaining-requests": want,
			"x-ratelimit-reset-requests": "50s", "x-ratelimit-limit-tokens": "5000", "x-ratelimit-reset-tokens": "50s"} {
			if got := resp.Header.Get(h); got != v {
				t.Errorf("request %d: %s = %q, want %q", i, h, got, v)
			}
		}
		if resp.Header.Get("x-ratelimit-remaining-tokens") == "" {
			t.Errorf("request %d: no x-ratelimit-remaining-tokens", i)
		}
	}
	resp, b := send(t, f.srv.URL, http.MethodPost, "/v1/chat/completions", "sk-static", chatReq(4))
	e := errorKeys(t, "over RPM", b)
	if resp.StatusCode != http.StatusTooManyRequests || e["code"] != "rate_limit_exceeded" ||
		resp.Header.Get("x-ratelimit-remaining-requests") != "0" || resp.Header.Get("Retry-After") != "50" {
		t.Errorf("over RPM: %d %v %s", resp.StatusCode, resp.Header, b)
	}
}

// TestStoreFailureIs500: the store's own failure is a 500 of kvgate's,
// not a 502 blaming the model backend.
func TestStoreFailureIs500(t *testing.T) {
	e := toAPIError(fmt.Errorf("create file: %w: %w", store.ErrFailed, errors.New("disk full")))
	if e.status != http.StatusInternalServerError || e.typ != "server_error" || e.code != "store_error" || strings.Contains(e.msg, "disk full") {
		t.Errorf("%+v: want a 500 store_error without the statement's text", e)
	}
}

// TestStoreAwayIsLogged: a request refused because the job store is out of
// reach (503 store_unavailable) is logged at Warn, once in a while rather
// than once a request: the 503s kvgate gives for its own reasons are not.
func TestStoreAwayIsLogged(t *testing.T) {
	var buf bytes.Buffer
	log := slog.New(slog.NewTextHandler(&buf, &slog.HandlerOptions{Level: slog.LevelWarn}))
	storeAwayLogged.last.Store(0)
	away := fmt.Errorf("submit job: %w: connection refused", store.ErrUnavailable)
	for range 3 {
		if status := writeError(httptest.NewRecorder(), log, away); status != http.StatusServiceUnavailable {
			t.Fatalf("a store out of reach: %d, want 503", status)
		}
	}
	writeError(httptest.NewRecorder(), log, errDraining)
	if n := strings.Count(buf.String(), "level=WARN"); n != 1 || !strings.Contains(buf.String(), "store_unavailable") {
		t.Errorf("logged %d warnings, want one for the store:\n%s", n, buf.String())
	}
}
