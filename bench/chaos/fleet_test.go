package chaos

import (
	"bytes"
	"context"
	"database/sql"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"go.yaml.in/yaml/v3"

	"github.com/kvgate/kvgate/bench/vllmsim"
)

// The model the simulators serve (their default profile's) and the
// static key every scenario's client uses.
const (
	simModel   = "meta-llama/Llama-3.1-8B-Instruct"
	staticKey  = "chaos-static-key"
	userTenant = "chaos"
)

// options shape a scenario's fleet. Zero values take the defaults in
// brackets.
type options struct {
	sims        int     // simulated backends [2]
	speedup     float64 // the simulators' --speedup [1]
	maxNumSeqs  int     // the simulators' --max-num-seqs, told to kvgate too [the profile's]
	coldStart   bool    // the simulators are not started with the fleet (startSims starts them)
	maxAttempts int     // jobs.max_attempts [5]
	// lease is jobs.lease [15s]: short, so that the kill -9 scenarios
	// do not wait long for the reaper, yet renewed often enough (every
	// third of it) that a loaded CI machine does not let a live
	// worker's lease expire (5 s did, on two shared cores).
	lease time.Duration
	// requestTimeout is gateway.request_timeout: how long a job's request
	// may run [kvgate's default].
	requestTimeout time.Duration
	drainTimeout   time.Duration // drain_timeout: the drain at shutdown [kvgate's default]
	// webhooks, when set, is kvgate's webhooks section (webhooks_test.go).
	webhooks *webhooksConfig
}

// env is one scenario's world: a database on the private cluster, a
// nats-server, the simulators and kvgate, each a process of its own.
type env struct {
	t      *testing.T
	dir    string
	dbURL  string
	db     *sql.DB
	nats   *natsServer
	sims   []*sim
	gw     *gateway
	opts   options
	client *http.Client
	start  time.Time
	marks  []string // the scenario's timeline, for its figures

	accepted map[string]string // idempotency key -> job id; only the test goroutine writes it
}

func newEnv(t *testing.T, opts options) *env {
	t.Helper()
	if opts.sims == 0 {
		opts.sims = 2
	}
	if opts.speedup == 0 {
		opts.speedup = 1
	}
	if opts.maxAttempts == 0 {
		opts.maxAttempts = 5
	}
	if opts.lease == 0 {
		opts.lease = 15 * time.Second
	}
	dir := filepath.Join(suite.dir, strings.ReplaceAll(t.Name(), "/", "_"))
	os.RemoveAll(dir)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	e := &env{t: t, dir: dir, opts: opts, client: &http.Client{Timeout: 15 * time.Second},
		start: time.Now(), accepted: map[string]string{}}
	// Cleanups run last-registered first: this one runs after every
	// process of the scenario has been killed.
	t.Cleanup(func() {
		if t.Failed() || suite.keep {
			t.Logf("logs of this scenario: %s", dir)
			return
		}
		os.RemoveAll(dir)
	})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var err error
	if e.dbURL, err = suite.pg.createDB(ctx, dbName(t.Name())); err != nil {
		t.Fatal(err)
	}
	if e.db, err = sql.Open("pgx", e.dbURL); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.db.Close() })
	e.nats = startNATS(t, dir)
	for i := range opts.sims {
		e.sims = append(e.sims, &sim{e: e, name: fmt.Sprintf("sim%d", i), port: freePort(t), seed: i + 1})
	}
	if !opts.coldStart {
		e.startSims()
	}
	e.gw = newGateway(e)
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("last lines of kvgate's log:\n%s", tailFile(e.gw.log(), 40))
		}
	})
	e.gw.start()
	if !opts.coldStart {
		e.waitModel()
	}
	return e
}

// mark records a step of the scenario's timeline.
func (e *env) mark(format string, args ...any) {
	m := fmt.Sprintf("%5.1fs %s", time.Since(e.start).Seconds(), fmt.Sprintf(format, args...))
	e.marks = append(e.marks, m)
	e.t.Log(m)
}

// startSims starts every simulator and waits until each answers /health.
func (e *env) startSims() {
	e.t.Helper()
	for _, s := range e.sims {
		s.start()
	}
}

// waitModel waits until kvgate lists the simulators' model, so that jobs
// for it are accepted.
func (e *env) waitModel() {
	e.t.Helper()
	eventually(e.t, 60*time.Second, 200*time.Millisecond, "kvgate lists "+simModel, func() (bool, string, error) {
		if err := e.gw.alive(); err != nil {
			return false, "", err
		}
		req, _ := http.NewRequest(http.MethodGet, e.gw.base()+"/v1/models", nil)
		req.Header.Set("Authorization", "Bearer "+staticKey)
		resp, err := e.client.Do(req)
		if err != nil {
			return false, err.Error(), nil
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK && bytes.Contains(b, []byte(simModel)), string(b), nil
	})
}

// sim is a `kvgate sim` process on a port chosen before it starts, so
// that kvgate can be configured with it while it is not yet listening.
type sim struct {
	e    *env
	name string
	port int
	seed int
	p    *proc
}

func (s *sim) url() string { return fmt.Sprintf("http://127.0.0.1:%d", s.port) }

func (s *sim) start() {
	s.e.t.Helper()
	args := []string{suite.bin, "sim", "--host", "127.0.0.1", "--port", strconv.Itoa(s.port),
		"--speedup", strconv.FormatFloat(s.e.opts.speedup, 'g', -1, 64), "--seed", strconv.Itoa(s.seed)}
	if s.e.opts.maxNumSeqs > 0 {
		args = append(args, "--max-num-seqs", strconv.Itoa(s.e.opts.maxNumSeqs))
	}
	s.p = startProc(s.e.t, s.e.dir, s.name, args...)
	eventually(s.e.t, 30*time.Second, 50*time.Millisecond, s.name+" healthy", func() (bool, string, error) {
		if s.p.exited() {
			return false, "", fmt.Errorf("%w: %s exited: %v\n%s", errStop, s.name, s.p.err, s.p.tail(20))
		}
		resp, err := http.Get(s.url() + "/health")
		if err != nil {
			return false, err.Error(), nil
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK, resp.Status, nil
	})
}

// setFaults replaces the simulator's injected faults (PUT /admin/faults).
func (s *sim) setFaults(f vllmsim.Faults) error {
	b, err := json.Marshal(f)
	if err != nil {
		return err
	}
	req, _ := http.NewRequest(http.MethodPut, s.url()+"/admin/faults", bytes.NewReader(b))
	resp, err := s.e.client.Do(req)
	if err != nil {
		return fmt.Errorf("%s: set faults: %w", s.name, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		body, _ := io.ReadAll(resp.Body)
		return fmt.Errorf("%s: set faults: %s: %s", s.name, resp.Status, body)
	}
	return nil
}

// engineCounters are what a simulator's engine reports having seen.
type engineCounters struct {
	finished         map[string]float64 // vllm:request_success_total by finished_reason
	running, waiting float64            // vllm:num_requests_running, _waiting
}

// calls is every request the engine took in: finished (stopped, at its
// length, or aborted) or still in it.
func (c engineCounters) calls() float64 {
	n := c.running + c.waiting
	for _, v := range c.finished {
		n += v
	}
	return n
}

// served is the requests the engine ran to their end.
func (c engineCounters) served() float64 {
	return c.finished[vllmsim.FinishStop] + c.finished[vllmsim.FinishLength]
}

// counters reads the simulator's /metrics.
func (s *sim) counters() (engineCounters, error) {
	c := engineCounters{finished: map[string]float64{}}
	if s.p == nil {
		return c, nil // never started: it saw nothing
	}
	resp, err := s.e.client.Get(s.url() + "/metrics")
	if err != nil {
		return c, fmt.Errorf("%s: metrics: %w", s.name, err)
	}
	defer resp.Body.Close()
	parser := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := parser.TextToMetricFamilies(resp.Body)
	if err != nil {
		return c, fmt.Errorf("%s: metrics: %w", s.name, err)
	}
	found := false
	if f := fams["vllm:request_success_total"]; f != nil {
		found = true
		for _, m := range f.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "finished_reason" {
					c.finished[l.GetValue()] += m.GetCounter().GetValue()
				}
			}
		}
	}
	for name, dst := range map[string]*float64{"vllm:num_requests_running": &c.running, "vllm:num_requests_waiting": &c.waiting} {
		if f := fams[name]; f != nil {
			for _, m := range f.GetMetric() {
				*dst += m.GetGauge().GetValue()
			}
		}
	}
	if !found {
		return c, fmt.Errorf("%s: no vllm:request_success_total on its /metrics", s.name)
	}
	return c, nil
}

// gateway is kvgate serve, started and stopped as the scenario says, on
// one address and one configuration throughout.
type gateway struct {
	e      *env
	addr   string
	config string
	p      *proc
	starts int
}

// gatewayConfig is the part of kvgate serve's YAML configuration the
// suite sets (cmd/kvgate/config.go; unknown keys are refused there).
type gatewayConfig struct {
	Addr     string          `yaml:"addr"`
	Store    string          `yaml:"store"`
	DataDir  string          `yaml:"data_dir"`
	LogLevel string          `yaml:"log_level"`
	Backends []backendConfig `yaml:"backends"`
	APIKeys  []apiKeyConfig  `yaml:"api_keys"`
	NATS     struct {
		URL      string `yaml:"url"`
		Replicas int    `yaml:"replicas,omitempty"`
	} `yaml:"nats"`
	NVML struct {
		Disabled bool `yaml:"disabled"`
	} `yaml:"nvml"`
	Jobs struct {
		MaxAttempts int           `yaml:"max_attempts"`
		Lease       time.Duration `yaml:"lease"`
	} `yaml:"jobs"`
	DrainTimeout time.Duration `yaml:"drain_timeout,omitempty"`
	Gateway      struct {
		RequestTimeout time.Duration `yaml:"request_timeout,omitempty"`
	} `yaml:"gateway"`
	Webhooks *webhooksConfig `yaml:"webhooks,omitempty"` // webhooks_test.go
}

type backendConfig struct {
	Name       string   `yaml:"name"`
	URL        string   `yaml:"url"`
	Models     []string `yaml:"models"`
	MaxNumSeqs int      `yaml:"max_num_seqs,omitempty"`
}

type apiKeyConfig struct {
	Key    string `yaml:"key"`
	Tenant string `yaml:"tenant"`
}

func newGateway(e *env) *gateway {
	e.t.Helper()
	g := &gateway{e: e, addr: fmt.Sprintf("127.0.0.1:%d", freePort(e.t)), config: filepath.Join(e.dir, "kvgate.yaml")}
	var c gatewayConfig
	c.Addr, c.Store, c.DataDir, c.LogLevel = g.addr, e.dbURL, filepath.Join(e.dir, "data"), "info"
	for _, s := range e.sims {
		// The model is named, so that kvgate knows it before the
		// backend first answers /v1/models.
		c.Backends = append(c.Backends, backendConfig{Name: s.name, URL: s.url(), Models: []string{simModel}, MaxNumSeqs: e.opts.maxNumSeqs})
	}
	c.APIKeys = []apiKeyConfig{{Key: staticKey, Tenant: userTenant}}
	c.NATS.URL = e.nats.url()
	c.NVML.Disabled = true
	c.Jobs.MaxAttempts, c.Jobs.Lease = e.opts.maxAttempts, e.opts.lease
	c.Gateway.RequestTimeout, c.DrainTimeout = e.opts.requestTimeout, e.opts.drainTimeout
	c.Webhooks = e.opts.webhooks
	b, err := yaml.Marshal(c)
	if err != nil {
		e.t.Fatal(err)
	}
	if err := os.WriteFile(g.config, b, 0o644); err != nil {
		e.t.Fatal(err)
	}
	return g
}

func (g *gateway) base() string { return "http://" + g.addr }
func (g *gateway) log() string  { return filepath.Join(g.e.dir, "kvgate.log") }

// start starts kvgate serve and waits until it answers /healthz.
func (g *gateway) start() {
	g.e.t.Helper()
	g.starts++
	g.p = startProc(g.e.t, g.e.dir, "kvgate", suite.bin, "serve", "--config", g.config)
	eventually(g.e.t, 60*time.Second, 100*time.Millisecond, "kvgate healthy", func() (bool, string, error) {
		if err := g.alive(); err != nil {
			return false, "", err
		}
		resp, err := http.Get(g.base() + "/healthz")
		if err != nil {
			return false, err.Error(), nil
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK, resp.Status, nil
	})
}

// alive reports an errStop error once kvgate has exited.
func (g *gateway) alive() error {
	if g.p != nil && g.p.exited() {
		return fmt.Errorf("%w: kvgate exited: %v\n%s", errStop, g.p.err, g.p.tail(30))
	}
	return nil
}

// kill is the fault: kill -9 of kvgate.
func (g *gateway) kill() { g.p.kill() }

// terminate sends SIGTERM and waits for kvgate to drain and exit.
func (g *gateway) terminate(timeout time.Duration) error { return g.p.terminate(timeout) }

// kvgateCmd runs a kvgate subcommand against the scenario's store (kvgate
// tenants, kvgate keys) and returns its standard output.
func (e *env) kvgateCmd(args ...string) string {
	e.t.Helper()
	args = append(args, "--store", e.dbURL)
	cmd := exec.Command(suite.bin, args...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		e.t.Fatalf("kvgate %s: %v\n%s", strings.Join(args, " "), err, stderr.String())
	}
	return stdout.String()
}
