package main

import (
	"bufio"
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"
)

// serveArgs are the arguments of a quick kvgate serve on dir.
func serveArgs(dir string) []string {
	return []string{"serve", "--addr", "127.0.0.1:0", "--sim-speedup", "0", "--no-nvml", "--log-level", "error", "--data-dir", dir}
}

// secondServe runs kvgate serve on dir while another holds it, and returns
// its error: it must refuse to start.
func secondServe(t *testing.T, dir string) error {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var stdout, stderr syncBuffer
	done := make(chan error, 1)
	go func() { done <- run(ctx, serveArgs(dir), noenv, &stdout, &stderr) }()
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		select {
		case err := <-done:
			return err
		default:
		}
		if servingAt.MatchString(stdout.String()) {
			cancel()
			<-done
			t.Fatal("a second kvgate serve started on a data directory in use")
		}
		if time.Now().After(deadline) {
			t.Fatal("the second kvgate serve neither started nor refused")
		}
	}
}

// Two gateways on one data directory: the second refuses to start, naming
// the first one's pid, whether the first runs in this process or another;
// and the lock goes with its process, even one killed with SIGKILL.
func TestDataDirLock(t *testing.T) {
	dir := t.TempDir()
	startServe(t, "--data-dir", dir)
	err := secondServe(t, dir)
	if err == nil || !strings.Contains(err.Error(), "in use by another kvgate (pid "+strconv.Itoa(os.Getpid())+",") {
		t.Fatalf("second serve in this process: %v, want a refusal naming pid %d", err, os.Getpid())
	}

	// Another process, which then dies without a word.
	other := t.TempDir()
	argv, _ := json.Marshal(serveArgs(other))
	cmd := exec.Command(os.Args[0])
	cmd.Env = append(os.Environ(), "KVGATE_CHILD_ARGS="+string(argv))
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	lines := bufio.NewScanner(out)
	for lines.Scan() && !servingAt.MatchString(lines.Text()) {
	}
	err = secondServe(t, other)
	if err == nil || !strings.Contains(err.Error(), "(pid "+strconv.Itoa(cmd.Process.Pid)+",") {
		t.Fatalf("second serve beside another process: %v, want a refusal naming pid %d", err, cmd.Process.Pid)
	}
	if err := cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	_ = cmd.Wait()
	// Its lock went with it: the directory is free.
	startServe(t, "--data-dir", other)
}
