package webhook

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
)

// nodeCase is one message for gateway/testdata/node/webhooks.test.mjs.
type nodeCase struct {
	Name         string `json:"name"`
	ID           string `json:"id"`
	Timestamp    string `json:"timestamp"`
	Signature    string `json:"signature"`
	Body         string `json:"body"` // base64 of the exact bytes
	VerifiesWith []int  `json:"verifiesWith"`
	Reason       string `json:"reason,omitempty"`
}

// TestStandardWebhooksNode checks Sign against the reference Standard
// Webhooks verifier, the npm standardwebhooks package, run unchanged by
// `node --test` on gateway/testdata/node/webhooks.test.mjs: payloads signed
// with one secret, and with two during rotation, verify with every secret
// that signed them and with no other; a tampered body, a changed id and
// timestamps outside the five-minute tolerance are refused.
//
// Without node on PATH the test skips, unless CI is "true": CI requires it.
func TestStandardWebhooksNode(t *testing.T) {
	if testing.Short() {
		t.Skip("Node.js test: skipped with -short")
	}
	ci := os.Getenv("CI") == "true"
	need := func(tool string) string {
		p, err := exec.LookPath(tool)
		if err == nil {
			return p
		}
		if ci {
			t.Fatalf("%s is not on PATH; CI=true requires Node.js (>= 20) and npm for the Standard Webhooks verifier test", tool)
		}
		t.Skipf("%s is not on PATH: skipping the Standard Webhooks verifier test (install Node.js >= 20 and npm to run it; with CI=true this fails)", tool)
		return ""
	}
	node := need("node")
	dir, err := filepath.Abs(filepath.Join("..", "testdata", "node"))
	if err != nil {
		t.Fatal(err)
	}
	installStandardWebhooks(t, dir, need, ci)

	var secrets []string
	var keys [][]byte
	for range 3 { // 0: the old secret, 1: the new one, 2: another endpoint's
		s, err := NewSecret()
		if err != nil {
			t.Fatal(err)
		}
		k, err := ParseSecret(s)
		if err != nil {
			t.Fatal(err)
		}
		secrets, keys = append(secrets, s), append(keys, k)
	}
	now := time.Now()
	bodies := map[string][]byte{
		"job.succeeded": []byte(`{"type":"job.succeeded","timestamp":"2026-12-01T12:00:00Z","data":{"job_id":"job_01JDXKQ4Y5Z6","state":"SUCCEEDED","state_version":3,"result_url":"/v1/jobs/job_01JDXKQ4Y5Z6/result"}}`),
		"non-ASCII":     []byte(`{"type":"job.review_required","data":{"note":"Rechnung für Müller — 請求書 ✓ \u2028 </script>"}}`),
		"empty object":  []byte(`{}`),
		"20 kB inline":  []byte(`{"type":"job.succeeded","data":{"result":"` + strings.Repeat("0123456789", 2000) + `"}}`),
		"pretty JSON":   []byte("{\n  \"type\": \"webhook.test\",\n  \"data\": {}\n}\n"),
	}
	var cases []nodeCase
	add := func(name, id string, ts time.Time, signWith []int, body []byte, verifies []int, reason string) {
		var ks [][]byte
		for _, i := range signWith {
			ks = append(ks, keys[i])
		}
		cases = append(cases, nodeCase{
			Name: name, ID: id, Timestamp: strconv.FormatInt(ts.Unix(), 10),
			Signature: Sign(ks, id, ts, body), Body: base64.StdEncoding.EncodeToString(body),
			VerifiesWith: verifies, Reason: reason,
		})
	}
	n := 0
	for name, body := range bodies {
		n++
		id := fmt.Sprintf("whd_%04d", n)
		add(name+", one secret", id, now, []int{1}, body, []int{1}, "")
		add(name+", two secrets (rotation)", id, now, []int{0, 1}, body, []int{0, 1}, "")
	}
	body := bodies["job.succeeded"]
	// Tampered: the signature is over the original body, the body changed.
	tampered := func(ts time.Time, id string, b []byte) nodeCase {
		c := nodeCase{
			ID: id, Timestamp: strconv.FormatInt(ts.Unix(), 10),
			Signature: Sign(keys[:2], "whd_orig", now, body), Body: base64.StdEncoding.EncodeToString(b),
			VerifiesWith: []int{}, Reason: "No matching signature",
		}
		return c
	}
	c := tampered(now, "whd_orig", bytes.Replace(body, []byte(`"state_version":3`), []byte(`"state_version":4`), 1))
	c.Name = "tampered body"
	cases = append(cases, c)
	c = tampered(now, "whd_other", body)
	c.Name = "webhook-id changed"
	cases = append(cases, c)
	c = tampered(now.Add(time.Second), "whd_orig", body)
	c.Name = "webhook-timestamp changed"
	cases = append(cases, c)
	add("timestamp 10 minutes old", "whd_old", now.Add(-10*time.Minute), []int{0, 1}, body, []int{}, "too old")
	add("timestamp 10 minutes ahead", "whd_new", now.Add(10*time.Minute), []int{0, 1}, body, []int{}, "too new")
	add("timestamp 2 minutes old still verifies", "whd_late", now.Add(-2*time.Minute), []int{1}, body, []int{1}, "")

	file := filepath.Join(t.TempDir(), "cases.json")
	raw, err := json.Marshal(map[string]any{"secrets": secrets, "messages": cases})
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(file, raw, 0o600); err != nil {
		t.Fatal(err)
	}

	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, node, "--test", "--test-reporter=spec", "webhooks.test.mjs")
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "KVGATE_WEBHOOK_CASES="+file, "NO_COLOR=1")
	cmd.WaitDelay = 5 * time.Second
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Logf("node --test output:\n%s", out)
		t.Fatalf("node --test webhooks.test.mjs failed: %v", err)
	}
	want := fmt.Sprintf("ℹ pass %d", len(cases)+1)
	if !strings.Contains(string(out), "ℹ fail 0") || !strings.Contains(string(out), want) {
		t.Logf("node --test output:\n%s", out)
		t.Fatalf("node --test exited 0 but did not report `fail 0` and %q", want)
	}
}

// installStandardWebhooks runs npm ci in dir unless the standardwebhooks
// package is already installed there.
func installStandardWebhooks(t *testing.T, dir string, need func(string) string, ci bool) {
	t.Helper()
	if _, err := os.Stat(filepath.Join(dir, "node_modules", "standardwebhooks", "package.json")); err == nil {
		return
	}
	npm := need("npm")
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, npm, "ci", "--no-audit", "--no-fund")
	cmd.Dir = dir
	cmd.WaitDelay = 5 * time.Second
	out, err := cmd.CombinedOutput()
	if err == nil {
		return
	}
	t.Logf("npm ci output:\n%s", out)
	msg := fmt.Sprintf("npm ci in %s failed: %v", dir, err)
	if ci {
		t.Fatal(msg)
	}
	t.Skip(msg + " (is the npm registry reachable? with CI=true this fails)")
}
