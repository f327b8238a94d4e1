package deploy

import (
	"bytes"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// proc is a child process the test started, its output in a log file.
type proc struct {
	name string
	cmd  *exec.Cmd
	log  string
	done chan struct{}
}

// start runs bin with args, its stdout and stderr in dir/name.log; the
// test's cleanup stops it (SIGTERM, then SIGKILL after 10 s).
func start(t *testing.T, dir, name, bin string, env []string, args ...string) *proc {
	t.Helper()
	p := &proc{name: name, log: filepath.Join(dir, name+".log"), done: make(chan struct{})}
	f, err := os.OpenFile(p.log, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	p.cmd = exec.Command(bin, args...)
	p.cmd.Stdout, p.cmd.Stderr = f, f
	p.cmd.Env = append(os.Environ(), env...)
	if err := p.cmd.Start(); err != nil {
		f.Close()
		t.Fatalf("start %s: %v", name, err)
	}
	go func() { p.cmd.Wait(); f.Close(); close(p.done) }()
	t.Cleanup(func() {
		p.stop(10 * time.Second)
		if t.Failed() {
			b, _ := os.ReadFile(p.log)
			if len(b) > 4000 {
				b = b[len(b)-4000:]
			}
			t.Logf("--- %s (%s), last lines:\n%s", name, p.log, b)
		}
	})
	return p
}

func (p *proc) exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// stop sends SIGTERM and waits, then kills.
func (p *proc) stop(grace time.Duration) {
	if p.exited() {
		return
	}
	p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
	case <-time.After(grace):
		p.cmd.Process.Kill()
		<-p.done
	}
}

// freePorts returns n distinct free ports: every listener stays open
// until all n are taken, so the system cannot hand out one port twice.
func freePorts(t *testing.T, n int) []int {
	t.Helper()
	ports := make([]int, n)
	for i := range ports {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		defer l.Close()
		ports[i] = l.Addr().(*net.TCPAddr).Port
	}
	return ports
}

var httpClient = &http.Client{Timeout: 10 * time.Second}

// get returns the body of a 200 answer to GET url.
func get(url string) ([]byte, error) {
	resp, err := httpClient.Get(url)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, err
	}
	if resp.StatusCode != http.StatusOK {
		return b, fmt.Errorf("GET %s: %s: %s", url, resp.Status, bytes.TrimSpace(b))
	}
	return b, nil
}

// send makes a request with a JSON body and returns the status and body.
func send(method, url string, body []byte, header ...string) (int, []byte, error) {
	req, err := http.NewRequest(method, url, bytes.NewReader(body))
	if err != nil {
		return 0, nil, err
	}
	req.Header.Set("Content-Type", "application/json")
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	resp, err := httpClient.Do(req)
	if err != nil {
		return 0, nil, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return resp.StatusCode, b, err
}

// families returns the metric families named by # TYPE lines of a
// Prometheus text exposition, with their types.
func families(exposition []byte) map[string]string {
	fams := map[string]string{}
	for _, line := range strings.Split(string(exposition), "\n") {
		if f := strings.Fields(line); len(f) == 4 && f[0] == "#" && f[1] == "TYPE" {
			fams[f[2]] = f[3]
		}
	}
	return fams
}

// exposed reports whether a series name (a family, or a histogram's or
// summary's _bucket, _sum or _count) is in fams.
func exposed(fams map[string]string, name string) bool {
	if _, ok := fams[name]; ok {
		return true
	}
	for _, suf := range []string{"_bucket", "_sum", "_count"} {
		if base, ok := strings.CutSuffix(name, suf); ok {
			if typ := fams[base]; typ == "histogram" || typ == "summary" {
				return true
			}
		}
	}
	return false
}
