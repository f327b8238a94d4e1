package gateway

import (
	"bytes"
	"context"
	"encoding/json"
	"log/slog"
	"strings"
	"testing"

	"github.com/kvgate/kvgate/scheduler"
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
