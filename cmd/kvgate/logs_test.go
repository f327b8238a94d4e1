package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/kvgate/kvgate/store/postgres/pgtest"
)

// call sends a request with a bearer key and returns its status and body.
func call(t *testing.T, base, method, path, key, body string, header ...string) (int, []byte) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var rd io.Reader
	if body != "" {
		rd = strings.NewReader(body)
	}
	req, _ := http.NewRequestWithContext(ctx, method, base+path, rd)
	req.Header.Set("Content-Type", "application/json")
	if key != "" {
		req.Header.Set("Authorization", "Bearer "+key)
	}
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, path, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, b
}

// TestLogsHoldNoSecrets: serve, logging at debug level from start to
// shutdown, with static user, operator and admin keys, store keys created,
// used, rotated and revoked, wrong and revoked keys tried, a key sent where
// it does not belong, and a store URL with a password, never writes a key
// or the password to its log.
func TestLogsHoldNoSecrets(t *testing.T) {
	t.Run("sqlite", func(t *testing.T) {
		dir := t.TempDir()
		logsHoldNoSecrets(t, "sqlite://"+filepath.Join(dir, "kvgate.db"), "")
	})
	t.Run("postgres", func(t *testing.T) {
		// The local server trusts its clients: the password is sent only
		// if asked for, and is a secret the log must not show all the same.
		u, err := url.Parse(pgtest.FreshDatabase(t))
		if err != nil {
			t.Fatal(err)
		}
		const password = "pg-password-f00d"
		u.User = url.UserPassword(u.User.Username(), password)
		logsHoldNoSecrets(t, u.String(), password)
	})
}

func logsHoldNoSecrets(t *testing.T, storeURL, password string) {
	const (
		staticUser  = "sk-static-user-5ecret"
		staticOp    = "sk-static-op-5ecret"
		staticAdmin = "sk-static-admin-5ecret"
		wrong       = "kvg_wrong-5ecret-key-that-was-never-issued"
	)
	secrets := []string{staticUser, staticOp, staticAdmin, wrong}
	if password != "" {
		secrets = append(secrets, password)
	}
	var log fmt.Stringer
	// Registered first, so it runs last: after serve has stopped and
	// logged its shutdown.
	t.Cleanup(func() {
		if log == nil {
			return // serve did not start
		}
		text := log.String()
		if !strings.Contains(text, "kvgate serving") {
			t.Fatalf("no log captured:\n%s", text)
		}
		var shown []string
		for _, s := range secrets {
			if strings.Contains(text, s) {
				shown = append(shown, s)
			}
		}
		if m := regexp.MustCompile(`kvg_[A-Za-z0-9_-]{20,}`).FindString(text); m != "" {
			shown = append(shown, m)
		}
		if len(shown) > 0 {
			t.Errorf("the log shows the secrets %q:\n%s", shown, text)
		}
	})
	base, stderr := startServe(t, "--data-dir", t.TempDir(), "--store", storeURL, "--log-level", "debug",
		"--api-key", staticUser+"=legacy", "--api-key", staticOp+"=legacy:operator", "--admin-key", staticAdmin)
	log = stderr
	waitReady(t, base+"/readyz") // a first scrape slow under load is no 503 to the first call

	must := func(want int, method, path, key, body string, header ...string) []byte {
		t.Helper()
		status, b := call(t, base, method, path, key, body, header...)
		if status != want {
			t.Fatalf("%s %s: %d %s, want %d", method, path, status, b, want)
		}
		return b
	}
	newKey := func(role string) (id, secret string) {
		var k struct{ ID, Key string }
		if err := json.Unmarshal(must(http.StatusCreated, http.MethodPost, "/v1/admin/keys", staticAdmin,
			`{"tenant":"acme","role":"`+role+`"}`), &k); err != nil {
			t.Fatal(err)
		}
		secrets = append(secrets, k.Key)
		return k.ID, k.Key
	}
	must(http.StatusCreated, http.MethodPost, "/v1/admin/tenants", staticAdmin, `{"name":"acme","rpm":1000}`)
	userID, user := newKey("user")
	opID, op := newKey("operator")
	chat := `{"model":"meta-llama/Llama-3.1-8B-Instruct","messages":[{"role":"user","content":"hi"}],"max_tokens":3}`
	stream := `{"model":"meta-llama/Llama-3.1-8B-Instruct","messages":[{"role":"user","content":"hi"}],"max_tokens":3,"stream":true}`
	for _, key := range []string{user, op, staticUser, staticOp} {
		must(http.StatusOK, http.MethodPost, "/v1/chat/completions", key, chat)
		must(http.StatusOK, http.MethodPost, "/v1/chat/completions", key, stream)
	}
	var job struct{ ID string }
	if err := json.Unmarshal(must(http.StatusAccepted, http.MethodPost, "/v1/jobs", user,
		`{"endpoint":"/v1/completions","body":{"model":"meta-llama/Llama-3.1-8B-Instruct","prompt":"hi","max_tokens":3}}`,
		"Idempotency-Key", "logs"), &job); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		var v struct{ State string }
		_ = json.Unmarshal(must(http.StatusOK, http.MethodGet, "/v1/jobs/"+job.ID, user, ""), &v)
		if v.State == "SUCCEEDED" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("job still %s", v.State)
		}
	}
	must(http.StatusOK, http.MethodGet, "/v1/jobs/"+job.ID+"/attempts", op, "")
	must(http.StatusOK, http.MethodGet, "/v1/usage", staticOp, "")
	must(http.StatusForbidden, http.MethodGet, "/v1/admin/keys", op, "")

	// Rotation, revocation, and keys that do not work.
	var rotated struct{ Key string }
	if err := json.Unmarshal(must(http.StatusCreated, http.MethodPost, "/v1/admin/keys/"+userID+"/rotate", staticAdmin, ""), &rotated); err != nil {
		t.Fatal(err)
	}
	secrets = append(secrets, rotated.Key)
	must(http.StatusOK, http.MethodPost, "/v1/chat/completions", rotated.Key, chat)
	must(http.StatusOK, http.MethodDelete, "/v1/admin/keys/"+opID, staticAdmin, "")
	for _, key := range []string{user, op, wrong, staticUser + "x", staticAdmin[:len(staticAdmin)-1]} {
		must(http.StatusUnauthorized, http.MethodPost, "/v1/chat/completions", key, chat)
	}
	// A key where no key belongs: in the URL, in a bad body, in a header.
	must(http.StatusOK, http.MethodGet, "/v1/models?api_key="+rotated.Key, rotated.Key, "")
	must(http.StatusNotFound, http.MethodGet, "/v1/"+rotated.Key, rotated.Key, "")
	must(http.StatusBadRequest, http.MethodPost, "/v1/chat/completions", rotated.Key, `{"model":"`+rotated.Key+`",`)
	must(http.StatusOK, http.MethodPost, "/v1/chat/completions", rotated.Key, chat, "X-Api-Key", rotated.Key, "OpenAI-Organization", staticAdmin)
}
