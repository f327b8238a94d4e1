package gateway

import (
	"bytes"
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/kvgate/kvgate/store"
)

// TestBodyLimit: a body over MaxBodyBytes gets 413 in OpenAI's shape on
// every route that reads one, whether its Content-Length says so or not,
// and a client that never stops sending is answered as soon as it passes
// the limit, not when it ends.
func TestBodyLimit(t *testing.T) {
	const limit = 4 << 10
	st := sqliteStore(t)
	f := startFleet(t, fleetOpts{store: st, speedup: 50, keysRequired: true,
		gateway: Config{MaxBodyBytes: limit, Tenants: Tenants{Store: st}}})
	admin := newTenant(t, st, "acme", store.Limits{}, store.RoleAdmin)
	big := `{"model":"` + llama + `","prompt":"` + strings.Repeat("a", limit) + `","max_tokens":2}`
	for _, path := range []string{"/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/jobs", "/v1/admin/tenants", "/v1/admin/keys"} {
		for _, chunked := range []bool{false, true} {
			var body io.Reader = strings.NewReader(big)
			if chunked {
				body = io.MultiReader(body) // no length known: sent chunked
			}
			req, _ := http.NewRequest(http.MethodPost, f.srv.URL+path, body)
			req.Header.Set("Authorization", "Bearer "+admin)
			req.Header.Set("Idempotency-Key", "big")
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			var e errorBody
			if resp.StatusCode != http.StatusRequestEntityTooLarge || json.Unmarshal(b, &e) != nil || e.Error.Type != "invalid_request_error" {
				t.Errorf("POST %s with %d bytes (chunked %v): %d %s, want 413", path, len(big), chunked, resp.StatusCode, b)
			}
		}
	}

	// A body without end: the answer comes once the limit is passed.
	pr, pw := io.Pipe()
	sent := make(chan int64, 1)
	go func() {
		chunk := bytes.Repeat([]byte("a"), 1024)
		var n int64
		for {
			m, err := pw.Write(chunk)
			n += int64(m)
			if err != nil {
				sent <- n
				return
			}
		}
	}()
	req, _ := http.NewRequest(http.MethodPost, f.srv.URL+"/v1/chat/completions", io.MultiReader(strings.NewReader(`{"model":"`), pr))
	req.Header.Set("Authorization", "Bearer "+admin)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	pr.CloseWithError(io.ErrClosedPipe)
	if n := <-sent; resp.StatusCode != http.StatusRequestEntityTooLarge {
		t.Errorf("an endless body: %d after %d bytes, want 413", resp.StatusCode, n)
	}
}
