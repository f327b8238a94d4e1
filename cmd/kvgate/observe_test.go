package main

import (
	"bufio"
	"encoding/json"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/kvgate/kvgate/bench/eventually"
)

// jsonLines decodes serve's JSON log, one object a line; a line that is
// not JSON fails the test.
func jsonLines(t *testing.T, log string) []map[string]any {
	t.Helper()
	var out []map[string]any
	sc := bufio.NewScanner(strings.NewReader(log))
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		if sc.Text() == "" {
			continue
		}
		var m map[string]any
		if err := json.Unmarshal(sc.Bytes(), &m); err != nil {
			t.Fatalf("log line is not JSON: %q: %v", sc.Text(), err)
		}
		out = append(out, m)
	}
	return out
}

func writeConfig(t *testing.T, yaml string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "kvgate.yaml")
	if err := os.WriteFile(p, []byte(yaml), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// TestRequestIDsAndAccessLog: every response carries X-Request-Id (the
// caller's when valid, else a fresh req_ id); with log_format json and
// access_log info each request has one JSON access line with its route,
// status, tenant, model, backend, tokens and id; a job's attempt logs
// job_id, attempt, fence and tenant; /metrics has the durable path's
// metrics.
func TestRequestIDsAndAccessLog(t *testing.T) {
	cfg := writeConfig(t, "log_format: json\nlog_level: debug\naccess_log: info\nmetrics: {backlog_interval: 50ms}\n")
	base, stderr := startServe(t, "--config", cfg, "--data-dir", t.TempDir())

	get := func(path, id string) *http.Response {
		req, _ := http.NewRequest(http.MethodGet, base+path, nil)
		if id != "" {
			req.Header.Set("X-Request-Id", id)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		return resp
	}
	generated := regexp.MustCompile(`^req_[0-9a-f]{32}$`)
	if got := get("/v1/models", "caller-id-1").Header.Get("X-Request-Id"); got != "caller-id-1" {
		t.Errorf("caller's id not echoed: %q", got)
	}
	for _, path := range []string{"/healthz", "/metrics", "/no/such/route"} {
		if got := get(path, "").Header.Get("X-Request-Id"); !generated.MatchString(got) {
			t.Errorf("%s: request id %q, want a generated req_ id", path, got)
		}
	}
	if got := get("/healthz", `bad id "with" spaces`).Header.Get("X-Request-Id"); !generated.MatchString(got) {
		t.Errorf("an invalid caller id was kept: %q", got)
	}

	status, body := call(t, base, http.MethodPost, "/v1/chat/completions", "",
		`{"model":"meta-llama/Llama-3.1-8B-Instruct","messages":[{"role":"user","content":"hi"}],"max_tokens":4}`, "X-Request-Id", "chat-42")
	if status != http.StatusOK {
		t.Fatalf("chat: %d %s", status, body)
	}
	submitAndWait(t, base, "obs-job-1")

	var lines []map[string]any
	eventually.True(t, "the access line of the chat request and the job's attempt line", func() bool {
		lines = jsonLines(t, stderr.String())
		var chat, attempt bool
		for _, l := range lines {
			chat = chat || l["msg"] == "request" && l["request_id"] == "chat-42"
			attempt = attempt || l["msg"] == "job attempt ended"
		}
		return chat && attempt
	})
	for _, l := range lines {
		switch {
		case l["msg"] == "request" && l["request_id"] == "chat-42":
			if l["level"] != "INFO" || l["route"] != "/v1/chat/completions" || l["status"] != 200.0 || l["tenant"] != "default" ||
				l["model"] != "meta-llama/Llama-3.1-8B-Instruct" || !strings.HasPrefix(l["backend"].(string), "127.0.0.1:") ||
				l["prompt_tokens"].(float64) <= 0 || l["completion_tokens"] != 4.0 || l["duration_ms"] == nil {
				t.Errorf("chat's access line: %v", l)
			}
		case l["msg"] == "request" && l["route"] == "/v1/jobs" && l["method"] == "POST":
			if l["status"] != 202.0 || l["job_id"] == nil {
				t.Errorf("job submission's access line: %v", l)
			}
		case l["msg"] == "request" && l["route"] == "/healthz":
			if l["method"] != "GET" || strings.Count(stderr.String(), `"request_id":"`+l["request_id"].(string)+`"`) != 1 {
				t.Errorf("healthz access line: %v (the request id once)", l)
			}
		case l["msg"] == "job attempt ended":
			for _, k := range []string{"job_id", "tenant", "attempt", "fence", "backend"} {
				if l[k] == nil || l[k] == "" {
					t.Errorf("attempt line lacks %s: %v", k, l)
				}
			}
		}
	}

	// The durable path's metrics, as agreed with the dashboards.
	eventually.True(t, "the completion histogram to count the job", func() bool {
		resp, err := http.Get(base + "/metrics")
		if err != nil {
			return false
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		m := string(b)
		for _, want := range []string{
			`kvgate_jobs_runnable{class="batch",tenant="default"} 0`, `kvgate_jobs_runnable_tokens{class="batch",tenant="default"} 0`,
			`kvgate_jobs_oldest_runnable_age_seconds{class="batch"} 0`, "kvgate_outbox_oldest_unpublished_age_seconds 0",
			"kvgate_inbox_pending 0", "kvgate_job_acceptance_seconds_count 1", "kvgate_job_completion_seconds_count 1",
		} {
			if !strings.Contains(m, want) {
				return false
			}
		}
		return true
	})
	if testing.Verbose() {
		t.Log(stderr.String())
	}
}
