package main

import (
	"bufio"
	"context"
	"io"
	"net/http"
	"os"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"
)

func TestDrainTimeoutConfig(t *testing.T) {
	cfg, err := loadConfig(t, nil, nil)
	if err != nil || cfg.DrainTimeout != time.Minute {
		t.Fatalf("default drain timeout %v (%v), want 1m", cfg.DrainTimeout, err)
	}
	file := t.TempDir() + "/kvgate.yaml"
	if err := os.WriteFile(file, []byte("drain_timeout: 90s\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	env := map[string]string{"KVGATE_CONFIG": file}
	if cfg, err := loadConfig(t, nil, env); err != nil || cfg.DrainTimeout != 90*time.Second {
		t.Errorf("from the file: %v (%v), want 90s", cfg.DrainTimeout, err)
	}
	env["KVGATE_DRAIN_TIMEOUT"] = "2m"
	if cfg, err := loadConfig(t, nil, env); err != nil || cfg.DrainTimeout != 2*time.Minute {
		t.Errorf("from the environment: %v (%v), want 2m", cfg.DrainTimeout, err)
	}
	if cfg, err := loadConfig(t, []string{"--drain-timeout", "5s"}, env); err != nil || cfg.DrainTimeout != 5*time.Second {
		t.Errorf("from the flag: %v (%v), want 5s", cfg.DrainTimeout, err)
	}
	for _, bad := range []map[string]string{{"KVGATE_DRAIN_TIMEOUT": "soon"}, {"KVGATE_DRAIN_TIMEOUT": "0s"}} {
		if _, err := loadConfig(t, nil, bad); err == nil {
			t.Errorf("KVGATE_DRAIN_TIMEOUT=%s accepted", bad["KVGATE_DRAIN_TIMEOUT"])
		}
	}
}

// drain_unready_delay: 1s by default, a quarter of a shorter drain, set
// from the file or the environment, and never as long as the drain.
func TestDrainUnreadyDelayConfig(t *testing.T) {
	for _, tc := range []struct {
		env  map[string]string
		want time.Duration
	}{
		{nil, time.Second},
		{map[string]string{"KVGATE_DRAIN_TIMEOUT": "1s"}, 250 * time.Millisecond},
		{map[string]string{"KVGATE_DRAIN_UNREADY_DELAY": "5s"}, 5 * time.Second},
		{map[string]string{"KVGATE_DRAIN_UNREADY_DELAY": "0s"}, 0},
	} {
		cfg, err := loadConfig(t, nil, tc.env)
		if err != nil || *cfg.DrainUnreadyDelay != tc.want {
			t.Errorf("%v: %v (%v), want %s", tc.env, cfg.DrainUnreadyDelay, err, tc.want)
		}
	}
	for _, bad := range []map[string]string{
		{"KVGATE_DRAIN_UNREADY_DELAY": "2m"}, {"KVGATE_DRAIN_UNREADY_DELAY": "-1s"}, {"KVGATE_DRAIN_UNREADY_DELAY": "later"},
	} {
		if _, err := loadConfig(t, nil, bad); err == nil {
			t.Errorf("%v accepted", bad)
		}
	}
}

// envOf is a getenv over a map.
func envOf(m map[string]string) func(string) string { return func(k string) string { return m[k] } }

var servingAt = regexp.MustCompile(`serving the OpenAI API on (http://127\.0\.0\.1:\d+)/v1`)

// waitOutput waits for a pattern in a command's output and returns its
// first group.
func waitOutput(t *testing.T, what string, out *syncBuffer, re *regexp.Regexp) string {
	t.Helper()
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		if m := re.FindStringSubmatch(out.String()); m != nil {
			return m[len(m)-1]
		}
		if time.Now().After(deadline) {
			t.Fatalf("no %s in the output:\n%s", what, out.String())
		}
	}
}

// longStream starts a chat stream that runs for a good while on a paced
// simulator, and returns its body once the first chunk has come.
func longStream(t *testing.T, base string) (*bufio.Reader, io.Closer) {
	t.Helper()
	// "serving at" comes before the embedded simulator is routable: until
	// /readyz says so, a request is an immediate 503 backend_unavailable.
	waitReady(t, base+"/readyz")
	resp, err := http.Post(base+"/v1/chat/completions", "application/json", strings.NewReader(
		`{"model":"meta-llama/Llama-3.1-8B-Instruct","messages":[{"role":"user","content":"go on"}],"max_tokens":5000,"ignore_eos":true,"stream":true}`))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { resp.Body.Close() })
	br := bufio.NewReader(resp.Body)
	if line, err := br.ReadString('\n'); resp.StatusCode != http.StatusOK || err != nil || !strings.HasPrefix(line, "data: ") {
		t.Fatalf("stream: %d, first line %q, %v", resp.StatusCode, line, err)
	}
	return br, resp.Body
}

func status(url string) int {
	resp, err := http.Get(url)
	if err != nil {
		return 0
	}
	resp.Body.Close()
	return resp.StatusCode
}

// kvgate serve stopped by a signal logs its drain, fails /readyz, refuses
// new requests with 503 while a stream in flight runs on, ends that stream
// with an error event at the drain timeout, and returns cleanly.
func TestServeDrains(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var stdout, stderr syncBuffer
	done := make(chan error, 1)
	go func() {
		done <- run(ctx, []string{"serve", "--dev", "--addr", "127.0.0.1:0", "--sim-speedup", "1", "--no-nvml", "--data-dir", t.TempDir()},
			envOf(map[string]string{"KVGATE_DRAIN_TIMEOUT": "1s", "KVGATE_DRAIN_UNREADY_DELAY": "0s"}), &stdout, &stderr)
	}()
	base := waitOutput(t, "address", &stdout, servingAt)
	stream, _ := longStream(t, base)

	cancel() // the first signal
	waitOutput(t, "draining line", &stderr, regexp.MustCompile(`msg=draining timeout=1s`))
	if code := status(base + "/readyz"); code != http.StatusServiceUnavailable {
		t.Errorf("/readyz while draining: %d, want 503", code)
	}
	resp, err := http.Post(base+"/v1/completions", "application/json", strings.NewReader(
		`{"model":"meta-llama/Llama-3.1-8B-Instruct","prompt":"x","max_tokens":4}`))
	if err != nil {
		t.Fatalf("a request while draining: %v, want a 503", err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusServiceUnavailable || resp.Header.Get("Retry-After") == "" || !strings.Contains(string(b), "server_shutting_down") {
		t.Errorf("a request while draining: %d, Retry-After %q: %s", resp.StatusCode, resp.Header.Get("Retry-After"), b)
	}
	rest, _ := io.ReadAll(stream)
	if !strings.Contains(string(rest), `"code":"server_shutting_down"`) {
		t.Errorf("the stream in flight ended with ...%s, want an error event", rest[max(0, len(rest)-300):])
	}
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("serve returned %v", err)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("serve did not return after its drain")
	}
	if !strings.Contains(stderr.String(), "drain timeout: ended requests still running") || !strings.Contains(stderr.String(), "msg=drained") {
		t.Errorf("the drain's end is not logged:\n%s", stderr.String())
	}
}

// A second signal ends the process at once, while the drain still waits
// for a stream in flight.
func TestSecondSignalForcesExit(t *testing.T) {
	sigs := make(chan os.Signal, 2)
	var stdout, stderr syncBuffer
	code := make(chan int, 1)
	dir := t.TempDir()
	go func() {
		code <- runMain(sigs, []string{"serve", "--dev", "--addr", "127.0.0.1:0", "--sim-speedup", "1", "--no-nvml", "--data-dir", dir},
			envOf(map[string]string{"KVGATE_DRAIN_TIMEOUT": "10m"}), &stdout, &stderr)
	}()
	base := waitOutput(t, "address", &stdout, servingAt)
	stream, body := longStream(t, base)

	sigs <- syscall.SIGTERM
	waitOutput(t, "draining line", &stderr, regexp.MustCompile(`msg=draining timeout=10m0s`))
	if _, err := stream.ReadString('\n'); err != nil {
		t.Fatalf("the stream broke at the first signal: %v", err)
	}
	select {
	case c := <-code:
		t.Fatalf("exited with %d at the first signal, with a stream in flight", c)
	default:
	}
	sigs <- syscall.SIGINT
	select {
	case c := <-code:
		if c == 0 || !strings.Contains(stderr.String(), "exiting now") {
			t.Errorf("forced exit: status %d, output:\n%s", c, stderr.String())
		}
	case <-time.After(20 * time.Second):
		t.Fatal("a second signal did not force the exit")
	}
	// In a process the exit ends it all; here, the command goes on in the
	// background: let its drain finish, and wait for its data directory
	// lock, its last act, before the test's directory goes.
	body.Close()
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		if lock, err := lockDataDir(dir); err == nil {
			lock.Close()
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the drain in the background never ended")
		}
	}
}
