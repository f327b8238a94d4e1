package chaos

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"mime/multipart"
	"net/http"
	"testing"
	"time"
)

// TestBatchKill runs a batch through kvgate serve on PostgreSQL and kills
// kvgate with SIGKILL while its lines run, then starts it again: 50,000
// lines in the full suite, 2,000 in the short one. Every line must appear
// exactly once across the output and error files, every job of the batch
// pass the suite's invariants, and the simulators must have run no line to
// its end twice (their requests run to the end equal the lines that
// succeeded). The validation and bulk acceptance of the batch is timed
// end to end: from POST /v1/batches to in_progress.
func TestBatchKill(t *testing.T) {
	need(t, "short")
	n := 2000
	if suite.mode == "full" {
		n = 50_000
	}
	e := newEnv(t, options{speedup: 20})
	var in bytes.Buffer
	for i := range n {
		fmt.Fprintf(&in, `{"custom_id":"line-%d","method":"POST","url":"/v1/chat/completions","body":{"model":%q,"messages":[{"role":"user","content":"batch line %d"}],"max_tokens":8}}`+"\n",
			i, simModel, i)
	}
	fileID := e.uploadFile("lines.jsonl", in.Bytes())
	e.mark("uploaded %d lines (%d bytes) as %s", n, in.Len(), fileID)

	created := time.Now()
	var b map[string]any
	if err := e.apiJSON(http.MethodPost, "/v1/batches", fmt.Sprintf(`{"input_file_id":%q,"endpoint":"/v1/chat/completions","completion_window":"24h"}`, fileID), &b); err != nil {
		t.Fatal(err)
	}
	id, _ := b["id"].(string)
	status := func() (string, float64) {
		var v map[string]any
		if err := e.apiJSON(http.MethodGet, "/v1/batches/"+id, "", &v); err != nil {
			return err.Error(), 0
		}
		s, _ := v["status"].(string)
		counts, _ := v["request_counts"].(map[string]any)
		done, _ := counts["completed"].(float64)
		return s, done
	}
	eventually(t, 2*time.Minute, 20*time.Millisecond, "batch validated and accepted", func() (bool, string, error) {
		s, _ := status()
		return s != "validating", s, e.gw.alive()
	})
	accepted := time.Since(created)
	if s, _ := status(); s != "in_progress" {
		t.Fatalf("batch %s is %s after validation", id, s)
	}
	e.mark("batch %s: %d lines validated and accepted in %s (POST /v1/batches to in_progress)", id, n, accepted.Round(time.Millisecond))

	eventually(t, 5*time.Minute, 200*time.Millisecond, "a third of the lines done", func() (bool, string, error) {
		_, done := status()
		return done >= float64(n/3), fmt.Sprintf("%.0f done", done), e.gw.alive()
	})
	_, done := status()
	e.gw.kill()
	e.logStates(fmt.Sprintf("kill -9 kvgate (%.0f lines done just before)", done))
	e.gw.start()
	e.mark("kvgate restarted")
	eventually(t, 15*time.Minute, time.Second, "batch ends", func() (bool, string, error) {
		s, done := status()
		return s == "completed" || s == "failed" || s == "expired" || s == "cancelled", fmt.Sprintf("%s, %.0f done", s, done), e.gw.alive()
	})
	var v map[string]any
	if err := e.apiJSON(http.MethodGet, "/v1/batches/"+id, "", &v); err != nil {
		t.Fatal(err)
	}
	e.mark("batch %s ended %v: %v", id, v["status"], v["request_counts"])
	if v["status"] != "completed" {
		t.Fatalf("batch ended %v: %v", v["status"], v)
	}

	// Every line once, across the two files.
	seen := map[string]int{}
	for _, key := range []string{"output_file_id", "error_file_id"} {
		fid, _ := v[key].(string)
		if fid == "" {
			continue
		}
		lines := e.fileLines(fid)
		for _, l := range lines {
			seen[l]++
		}
		e.mark("%s %s: %d lines", key, fid, len(lines))
	}
	missing, twice := 0, 0
	for i := range n {
		switch seen[fmt.Sprintf("line-%d", i)] {
		case 0:
			missing++
		case 1:
		default:
			twice++
		}
	}
	if missing > 0 || twice > 0 || len(seen) != n {
		t.Errorf("of %d lines, %d missing and %d more than once across the output and error files (%d distinct custom ids)", n, missing, twice, len(seen))
	}

	// The batch's lines are jobs the client was given through the batch.
	rows, err := e.db.Query(`SELECT idempotency_key, id FROM jobs WHERE batch_id = $1`, id)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var key, jid string
		if err := rows.Scan(&key, &jid); err != nil {
			t.Fatal(err)
		}
		e.accepted[key] = jid
	}
	rows.Close()
	s := checkInvariants(t, e)
	// A request in flight when kvgate died may still run to its end on
	// its backend, its answer lost with the process: its line runs again,
	// once, after the restart (those attempts end lease_expired). Beyond
	// those, a line the simulators ran to its end twice would be a line
	// kvgate had recorded done and ran again.
	succeeded, cut := 0, 0
	for _, j := range s.jobs {
		if j.state == "SUCCEEDED" {
			succeeded++
		}
		for _, a := range s.attempts[j.id] {
			if a.outcome == "lease_expired" && a.sent {
				cut++
			}
		}
	}
	if s.served > float64(succeeded+cut) {
		t.Errorf("the simulators ran %.0f requests to their end for %d lines that succeeded and %d cut by the kill: a line ran to its end twice (%v)",
			s.served, succeeded, cut, s.perSim)
	}
	figures(t, e, s)
	e.mark("figure: %d-line batch accepted in %s on PostgreSQL; kill -9 mid-run cut %d requests; %d lines succeeded, %.0f requests run to their end",
		n, accepted.Round(time.Millisecond), cut, succeeded, s.served)
}

// uploadFile posts content to /v1/files (purpose batch) and returns its id.
func (e *env) uploadFile(name string, content []byte) string {
	e.t.Helper()
	var body bytes.Buffer
	mw := multipart.NewWriter(&body)
	fw, _ := mw.CreateFormFile("file", name)
	fw.Write(content)
	mw.WriteField("purpose", "batch")
	mw.Close()
	req, _ := http.NewRequest(http.MethodPost, e.gw.base()+"/v1/files", &body)
	req.Header.Set("Content-Type", mw.FormDataContentType())
	req.Header.Set("Authorization", "Bearer "+staticKey)
	c := &http.Client{Timeout: 2 * time.Minute}
	resp, err := c.Do(req)
	if err != nil {
		e.t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	var f struct {
		ID string `json:"id"`
	}
	if resp.StatusCode != http.StatusOK || json.Unmarshal(b, &f) != nil || f.ID == "" {
		e.t.Fatalf("upload: %s %s", resp.Status, b)
	}
	return f.ID
}

// apiJSON sends a request with the static key and decodes a 200's body.
func (e *env) apiJSON(method, path, body string, v any) error {
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	var rd io.Reader
	if body != "" {
		rd = bytes.NewReader([]byte(body))
	}
	req, _ := http.NewRequestWithContext(ctx, method, e.gw.base()+path, rd)
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer "+staticKey)
	resp, err := e.client.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("%s %s: %s %s", method, path, resp.Status, b)
	}
	return json.Unmarshal(b, v)
}

// fileLines downloads a file and returns the custom_id of each line.
func (e *env) fileLines(id string) []string {
	e.t.Helper()
	req, _ := http.NewRequest(http.MethodGet, e.gw.base()+"/v1/files/"+id+"/content", nil)
	req.Header.Set("Authorization", "Bearer "+staticKey)
	c := &http.Client{Timeout: 2 * time.Minute}
	resp, err := c.Do(req)
	if err != nil {
		e.t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		e.t.Fatalf("file %s: %s", id, resp.Status)
	}
	var out []string
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(nil, 4<<20)
	for sc.Scan() {
		var l struct {
			CustomID string `json:"custom_id"`
		}
		if err := json.Unmarshal(sc.Bytes(), &l); err != nil {
			e.t.Fatalf("file %s: line %q: %v", id, sc.Text(), err)
		}
		out = append(out, l.CustomID)
	}
	if err := sc.Err(); err != nil {
		e.t.Fatal(err)
	}
	return out
}
