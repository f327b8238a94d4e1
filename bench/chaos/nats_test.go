package chaos

import (
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"strconv"
	"testing"
	"time"
)

// findNATS finds nats-server: KVGATE_CHAOS_NATS_SERVER, PATH, or
// /usr/sbin/nats-server.
func findNATS() (string, error) {
	if p := os.Getenv("KVGATE_CHAOS_NATS_SERVER"); p != "" {
		return exec.LookPath(p)
	}
	if p, err := exec.LookPath("nats-server"); err == nil {
		return p, nil
	}
	if _, err := os.Stat("/usr/sbin/nats-server"); err == nil {
		return "/usr/sbin/nats-server", nil
	}
	return "", fmt.Errorf("no nats-server on PATH or at /usr/sbin/nats-server; set KVGATE_CHAOS_NATS_SERVER")
}

// natsServer is a scenario's own nats-server with JetStream: a port and a
// store directory that outlive its restarts.
type natsServer struct {
	t       testing.TB
	dir     string
	port    int
	monitor int
	p       *proc
}

func startNATS(t testing.TB, dir string) *natsServer {
	t.Helper()
	n := &natsServer{t: t, dir: dir, port: freePort(t), monitor: freePort(t)}
	n.start()
	return n
}

// url is the client URL kvgate is given.
func (n *natsServer) url() string { return fmt.Sprintf("nats://127.0.0.1:%d", n.port) }

// start starts the server (again) on its port and store, and waits until
// JetStream answers its health check.
func (n *natsServer) start() {
	n.t.Helper()
	n.p = startProc(n.t, n.dir, "nats", suite.nats, "-a", "127.0.0.1", "-p", strconv.Itoa(n.port),
		"-m", strconv.Itoa(n.monitor), "-js", "-sd", n.dir+"/jetstream")
	health := fmt.Sprintf("http://127.0.0.1:%d/healthz?js-enabled-only=true", n.monitor)
	eventually(n.t, 30*time.Second, 100*time.Millisecond, "nats-server healthy", func() (bool, string, error) {
		if n.p.exited() {
			return false, "", fmt.Errorf("%w: nats-server exited: %v\n%s", errStop, n.p.err, n.p.tail(20))
		}
		resp, err := http.Get(health)
		if err != nil {
			return false, err.Error(), nil
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK, resp.Status, nil
	})
}

// kill is the fault: kill -9 of the server.
func (n *natsServer) kill() { n.p.kill() }
