package main

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"io"
	"net/http"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"
)

// syncBuffer is a bytes.Buffer safe to write from the command's goroutine
// while the test reads it.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

func noenv(string) string { return "" }

func TestRunCommands(t *testing.T) {
	tests := []struct {
		args    []string
		wantErr bool
		out     string // substring of stdout
	}{
		{args: []string{"sim", "profiles"}, out: "h100x4-llama-3.1-70b"},
		{args: []string{"sim", "calibrate"}, out: "A'   output throughput"},
		{args: []string{"version"}, out: "kvgate"},
		{args: nil, wantErr: true},
		{args: []string{"bogus"}, wantErr: true},
		{args: []string{"sim", "--profile", "nope"}, wantErr: true},
		{args: []string{"sim", "--speedup", "-1", "--port", "0"}, wantErr: true},
		{args: []string{"sim", "--num-gpu-blocks", "10", "--port", "0"}, wantErr: true}, // max_model_len does not fit
	}
	for _, tc := range tests {
		t.Run(strings.Join(tc.args, " "), func(t *testing.T) {
			var stdout, stderr syncBuffer
			err := run(context.Background(), tc.args, noenv, &stdout, &stderr)
			if (err != nil) != tc.wantErr {
				t.Fatalf("err = %v, want error %v; stderr:\n%s", err, tc.wantErr, stderr.String())
			}
			if !strings.Contains(stdout.String(), tc.out) {
				t.Errorf("stdout lacks %q:\n%s", tc.out, stdout.String())
			}
		})
	}
}

func TestSimHelpListsProfiles(t *testing.T) {
	var stdout, stderr syncBuffer
	err := run(context.Background(), []string{"sim", "--help"}, noenv, &stdout, &stderr)
	if !errors.Is(err, flag.ErrHelp) {
		t.Fatalf("err = %v, want flag.ErrHelp", err)
	}
	for _, want := range []string{"--speedup", "--legacy-metrics", "h100-llama-3.1-8b", "h200-llama-3.1-8b", "h100-bge-m3"} {
		if !strings.Contains(stderr.String(), strings.TrimPrefix(want, "-")) {
			t.Errorf("help lacks %q", want)
		}
	}
}

// TestSimServesAndStops starts `kvgate sim` on a free port, calls it, and
// checks that cancelling the context shuts it down cleanly.
func TestSimServesAndStops(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	var stdout, stderr syncBuffer
	done := make(chan error, 1)
	go func() {
		done <- run(ctx, []string{"sim", "--port", "0", "--speedup", "0", "--max-model-len", "4096"}, noenv, &stdout, &stderr)
	}()
	addr := regexp.MustCompile(`http://(127\.0\.0\.1:\d+)/`)
	var base string
	for deadline := time.Now().Add(10 * time.Second); base == ""; {
		if m := addr.FindStringSubmatch(stdout.String()); m != nil {
			base = "http://" + m[1]
			break
		}
		select {
		case err := <-done:
			t.Fatalf("sim exited early: %v\n%s", err, stderr.String())
		case <-time.After(10 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			t.Fatal("sim printed no address")
		}
	}
	resp, err := http.Post(base+"/v1/completions", "application/json",
		strings.NewReader(`{"prompt":"hello","max_tokens":4,"ignore_eos":true}`))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Errorf("completion status %d", resp.StatusCode)
	}
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("sim returned %v after cancel", err)
		}
	case <-time.After(15 * time.Second):
		t.Fatal("sim did not stop")
	}
}

// TestSimDrainsOnShutdown cancels a running `kvgate sim` while a request is
// in flight: the request completes (the engine runs until the server has
// drained) and the command returns cleanly, without waiting out the drain
// timeout.
func TestSimDrainsOnShutdown(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	var stdout, stderr syncBuffer
	done := make(chan error, 1)
	go func() {
		done <- run(ctx, []string{"sim", "--port", "0", "--speedup", "20", "--max-model-len", "4096"}, noenv, &stdout, &stderr)
	}()
	addr := regexp.MustCompile(`http://(127\.0\.0\.1:\d+)/`)
	var base string
	for deadline := time.Now().Add(10 * time.Second); base == ""; time.Sleep(5 * time.Millisecond) {
		if m := addr.FindStringSubmatch(stdout.String()); m != nil {
			base = "http://" + m[1]
		}
		if time.Now().After(deadline) {
			t.Fatal("sim printed no address")
		}
	}
	type answer struct {
		status int
		err    error
	}
	got := make(chan answer, 1)
	go func() {
		// 300 steps of ~6.5 ms at 20x: about 0.1 s of wall time.
		resp, err := http.Post(base+"/v1/completions", "application/json",
			strings.NewReader(`{"prompt":"hello","max_tokens":300,"ignore_eos":true}`))
		if err != nil {
			got <- answer{err: err}
			return
		}
		_, err = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		got <- answer{resp.StatusCode, err}
	}()
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(time.Millisecond) {
		resp, err := http.Get(base + "/load")
		if err == nil {
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if strings.Contains(string(b), `"server_load":1`) {
				break
			}
		}
		if time.Now().After(deadline) {
			t.Fatal("the request never reached the engine")
		}
	}
	start := time.Now()
	cancel()
	if a := <-got; a.err != nil || a.status != http.StatusOK {
		t.Errorf("in-flight request during shutdown: status %d, %v", a.status, a.err)
	}
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("sim returned %v", err)
		}
		if el := time.Since(start); el > 5*time.Second {
			t.Errorf("shutdown took %v: it waited out the drain timeout", el)
		}
	case <-time.After(15 * time.Second):
		t.Fatal("sim did not stop")
	}
}
