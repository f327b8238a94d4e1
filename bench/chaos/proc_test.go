package chaos

import (
	"bytes"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// proc is a child process the suite started. The suite ends only its own
// processes, each by its pid.
type proc struct {
	name string
	cmd  *exec.Cmd
	log  string // its output, appended to across restarts
	done chan struct{}
	err  error // its exit, set before done closes
}

// startProc starts argv with its output appended to dir/name.log. The
// process is killed, if it still runs, when the test ends.
func startProc(t testing.TB, dir, name string, argv ...string) *proc {
	t.Helper()
	path := dir + "/" + name + ".log"
	f, err := os.OpenFile(path, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	fmt.Fprintf(f, "=== %s start: %s\n", time.Now().Format(time.RFC3339Nano), strings.Join(argv, " "))
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Stdout, cmd.Stderr = f, f
	if err := cmd.Start(); err != nil {
		f.Close()
		t.Fatalf("start %s: %v", name, err)
	}
	p := &proc{name: name, cmd: cmd, log: path, done: make(chan struct{})}
	go func() {
		p.err = cmd.Wait()
		fmt.Fprintf(f, "=== %s exit: %v\n", time.Now().Format(time.RFC3339Nano), p.err)
		f.Close()
		close(p.done)
	}()
	t.Cleanup(func() { p.kill() })
	return p
}

// exited reports whether the process has ended.
func (p *proc) exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// kill sends SIGKILL (kill -9) and waits for the process to end.
func (p *proc) kill() {
	if p.exited() {
		return
	}
	_ = p.cmd.Process.Signal(syscall.SIGKILL)
	<-p.done
}

// terminate sends SIGTERM and waits up to timeout for the process to end;
// it reports an error (and kills the process) if it did not.
func (p *proc) terminate(timeout time.Duration) error {
	if p.exited() {
		return fmt.Errorf("%s had already exited: %v", p.name, p.err)
	}
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
		return nil
	case <-time.After(timeout):
		p.kill()
		return fmt.Errorf("%s did not exit within %s of SIGTERM", p.name, timeout)
	}
}

// tail returns the last n lines of the process's log.
func (p *proc) tail(n int) string { return tailFile(p.log, n) }

func tailFile(path string, n int) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return err.Error()
	}
	lines := bytes.Split(bytes.TrimRight(b, "\n"), []byte("\n"))
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return string(bytes.Join(lines, []byte("\n")))
}

// freePort returns a loopback port nothing listens on now, and never one
// it has returned before in this process (the system may hand a port
// just closed out again, and two of a process's ports must differ).
// Another process could take it before the caller does; the suite's own
// processes are started one at a time, which keeps that unlikely.
func freePort(t testing.TB) int {
	t.Helper()
	for {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		port := ln.Addr().(*net.TCPAddr).Port
		ln.Close()
		if _, taken := handedPorts.LoadOrStore(port, true); !taken {
			return port
		}
	}
}

var handedPorts sync.Map // of int: the ports freePort has returned

// errStop ends an eventually early: the condition can no longer be met.
var errStop = errors.New("stop")

// eventually polls cond every interval until it reports done, and fails
// the test after timeout with cond's last word. cond returning an error
// wrapping errStop fails at once.
func eventually(t testing.TB, timeout, interval time.Duration, what string, cond func() (bool, string, error)) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	var last string
	for {
		ok, msg, err := cond()
		if err != nil && errors.Is(err, errStop) {
			t.Fatalf("%s: %v", what, err)
		}
		if ok {
			return
		}
		if err != nil {
			msg = err.Error()
		}
		last = msg
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within %s (last: %s)", what, timeout, last)
		}
		time.Sleep(interval)
	}
}

// hold lets d pass with the fault in place, checking every second that
// check still passes (a process that must stay up, say); it fails at once
// when check fails.
func hold(t testing.TB, d time.Duration, what string, check func() error) {
	t.Helper()
	end := time.Now().Add(d)
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	for time.Now().Before(end) {
		if err := check(); err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		select {
		case <-tick.C:
		case <-time.After(time.Until(end)):
		}
	}
}
