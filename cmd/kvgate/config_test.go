package main

import (
	"bufio"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/kvgate/kvgate/bench/eventually"

	"github.com/nats-io/nats-server/v2/server"

	"github.com/kvgate/kvgate/bench/vllmsim"
	"github.com/kvgate/kvgate/store/postgres/pgtest"
)

func loadConfig(t *testing.T, args []string, env map[string]string) (*config, error) {
	t.Helper()
	fs := flag.NewFlagSet("test", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	var cf configFlags
	cf.register(fs)
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	return cf.load(fs, func(k string) string { return env[k] })
}

func TestConfigPrecedence(t *testing.T) {
	file := filepath.Join(t.TempDir(), "kvgate.yaml")
	yaml := `addr: 0.0.0.0:9000
api_keys:
  - {key: sk-file, tenant: filetenant}
backends:
  - {name: gpu0, url: "http://10.0.0.5:8000", gpus: ["0"], max_num_seqs: 128}
admission:
  kv_target: 0.8
  max_queue_wait: 5s
gateway:
  token_count: tokenize
metrics: {scrape_interval: 250ms}
`
	if err := os.WriteFile(file, []byte(yaml), 0o600); err != nil {
		t.Fatal(err)
	}

	cfg, err := loadConfig(t, []string{"--config", file}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Addr != "0.0.0.0:9000" || len(cfg.Backends) != 1 || cfg.Backends[0].MaxNumSeqs != 128 ||
		cfg.Admission.KVTarget != 0.8 || cfg.Admission.MaxQueueWait != 5*time.Second ||
		cfg.Gateway.TokenCount != "tokenize" || cfg.Metrics.ScrapeInterval != 250*time.Millisecond ||
		len(cfg.APIKeys) != 1 || cfg.APIKeys[0].Tenant != "filetenant" {
		t.Errorf("from the file: %+v", cfg)
	}

	// The environment overrides the file; flags override both.
	env := map[string]string{"KVGATE_CONFIG": file, "KVGATE_ADDR": "127.0.0.1:7000",
		"KVGATE_BACKENDS": "http://a:8000, http://b:8000", "KVGATE_API_KEYS": "sk-env=envtenant", "KVGATE_KV_TARGET": "0.85"}
	cfg, err = loadConfig(t, nil, env)
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Addr != "127.0.0.1:7000" || len(cfg.Backends) != 2 || cfg.Backends[1].URL != "http://b:8000" ||
		cfg.APIKeys[0].Tenant != "envtenant" || cfg.Admission.KVTarget != 0.85 {
		t.Errorf("from the environment: %+v", cfg)
	}
	// What replaced the file's lists is said, for the log.
	fs := flag.NewFlagSet("test", flag.ContinueOnError)
	var cf configFlags
	cf.register(fs)
	if _, err := cf.load(fs, func(k string) string { return env[k] }); err != nil {
		t.Fatal(err)
	}
	if len(cf.notices) != 2 || !strings.Contains(cf.notices[0], "KVGATE_BACKENDS replaces the 1 entries of backends in "+file) ||
		!strings.Contains(cf.notices[1], "KVGATE_API_KEYS replaces the 1 entries of api_keys") {
		t.Errorf("notices %q, want the backends and the keys the environment replaced", cf.notices)
	}
	if _, err := cf.load(fs, func(k string) string { return map[string]string{"KVGATE_CONFIG": file}[k] }); err != nil || len(cf.notices) != 0 {
		t.Errorf("the file alone: notices %q, %v", cf.notices, err)
	}
	cfg, err = loadConfig(t, []string{"--addr", "127.0.0.1:6000", "--backend", "http://c:8000", "--api-key", "sk-flag=flagtenant", "--kv-target", "0.9"}, env)
	if err != nil {
		t.Fatal(err)
	}
	if cfg.Addr != "127.0.0.1:6000" || len(cfg.Backends) != 1 || cfg.Backends[0].URL != "http://c:8000" ||
		cfg.APIKeys[0].Tenant != "flagtenant" || cfg.Admission.KVTarget != 0.9 {
		t.Errorf("from the flags: %+v", cfg)
	}
}

func TestConfigErrors(t *testing.T) {
	dir := t.TempDir()
	write := func(name, body string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(body), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	for _, tc := range []struct {
		name string
		args []string
		env  map[string]string
		want string
	}{
		{"missing file", []string{"--config", filepath.Join(dir, "nope.yaml")}, nil, "read config"},
		{"unknown field", []string{"--config", write("bad.yaml", "adress: x\n")}, nil, "adress"},
		{"bad key flag", []string{"--api-key", "novalue"}, nil, "TOKEN=TENANT"},
		{"key without tenant", nil, map[string]string{"KVGATE_API_KEYS": "sk-a=acme,sk-live-SECRET"}, "entry 2 of 2"},
		{"bad key env", nil, map[string]string{"KVGATE_API_KEYS": "=x"}, "TOKEN=TENANT"},
		{"bad target", []string{"--kv-target", "1.5"}, nil, "kv_target"},
		{"scrapes further apart than the view lasts", []string{"--config", write("slow.yaml", "metrics: {scrape_interval: 2s}\n")}, nil, "scrape_interval 2s must be shorter than stale_after 1s"},
		{"bad target env", nil, map[string]string{"KVGATE_KV_TARGET": "high"}, "KVGATE_KV_TARGET"},
		{"replicas without a cluster", []string{"--config", write("replicas.yaml", "nats: {replicas: 3}\n")}, nil, "nats.replicas 3 needs a NATS cluster"},
		{"a default deadline no job may ask for", []string{"--config", write("deadline.yaml", "jobs: {default_deadline: 240h}\n")}, nil, "jobs.default_deadline 240h0m0s"},
		{"revocations spread too slowly", []string{"--config", write("ttl.yaml", "quotas: {cache_ttl: 1h}\n")}, nil, "quotas.cache_ttl 1h0m0s"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := loadConfig(t, tc.args, tc.env)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("err = %v, want one mentioning %q", err, tc.want)
			}
			if err != nil && strings.Contains(err.Error(), "SECRET") {
				t.Errorf("err = %v: it shows the key", err)
			}
		})
	}
	if cfg, err := loadConfig(t, []string{"--config", write("empty.yaml", "")}, nil); err != nil || cfg.Addr != "127.0.0.1:8080" {
		t.Errorf("an empty file: %v, %+v", err, cfg)
	}
}

// TestGPUsCommand prints the GPU and backend tables against a simulated
// backend on a machine without NVML.
func TestGPUsCommand(t *testing.T) {
	p, _ := vllmsim.LookupProfile("h100-llama-3.1-8b")
	_, srv := vllmsim.NewTestServer(t, vllmsim.Config{Profile: p})
	var stdout, stderr syncBuffer
	if err := run(t.Context(), []string{"gpus", "--backend", srv.URL}, noenv, &stdout, &stderr); err != nil {
		t.Fatalf("%v\n%s", err, stderr.String())
	}
	out := stdout.String()
	for _, want := range []string{"NVML is not available", "BACKEND", srv.URL, "meta-llama/Llama-3.1-8B-Instruct (131072)", "439904 tokens", "ok"} {
		if !strings.Contains(out, want) {
			t.Errorf("output lacks %q:\n%s", want, out)
		}
	}
	var none syncBuffer
	if err := run(t.Context(), []string{"gpus"}, noenv, &none, &stderr); err != nil || !strings.Contains(none.String(), "none configured") {
		t.Errorf("without backends: %v\n%s", err, none.String())
	}
	// Unnamed backends show the GPUs the file gives them, and "-" where
	// it gives none; with NVML turned off the GPUs table says so.
	_, other := vllmsim.NewTestServer(t, vllmsim.Config{Profile: p})
	cfg := writeConfig(t, "backends:\n  - {url: "+srv.URL+", gpus: [\"0\", \"1\"]}\n  - {url: "+other.URL+"}\n")
	var named syncBuffer
	if err := run(t.Context(), []string{"gpus", "--config", cfg, "--no-nvml"}, noenv, &named, &stderr); err != nil {
		t.Fatalf("%v\n%s", err, stderr.String())
	}
	lines := strings.Split(named.String(), "\n")
	if !strings.Contains(lines[0], "nvml.disabled is set") {
		t.Errorf("with --no-nvml the GPUs line is %q", lines[0])
	}
	var rows []string
	for _, l := range lines {
		if strings.Contains(l, srv.URL) || strings.Contains(l, other.URL) {
			rows = append(rows, strings.Join(strings.Fields(l), " "))
		}
	}
	if len(rows) != 2 || !strings.HasSuffix(rows[0], " 0,1 (healthy)") || !strings.HasSuffix(rows[1], " -") {
		t.Errorf("the backends' GPUS column:\n%s", strings.Join(rows, "\n"))
	}
}

func TestMigrateCommand(t *testing.T) {
	path := filepath.Join(t.TempDir(), "jobs.db")
	// The first run applies every migration (later ones than 7 too).
	for i, want := range []string{`applied migrations \[1 2 3 4 5 6 7( \d+)*\]`, "is up to date"} {
		var stdout, stderr syncBuffer
		if err := run(t.Context(), []string{"migrate", "--store", "sqlite://" + path}, noenv, &stdout, &stderr); err != nil {
			t.Fatalf("run %d: %v\n%s", i, err, stderr.String())
		}
		if !regexp.MustCompile(want).MatchString(stdout.String()) {
			t.Errorf("run %d: %q lacks %q", i, stdout.String(), want)
		}
	}
	var stdout, stderr syncBuffer
	if err := run(t.Context(), []string{"migrate", "--store", "mysql://x"}, noenv, &stdout, &stderr); err == nil {
		t.Error("migrate accepted a mysql:// store")
	}
}

// TestServeRunsJobs starts `kvgate serve` on its embedded defaults (SQLite
// under --data-dir, simulated backends) and runs one durable job through it.
// TestServeRunsJobs: kvgate serve on the embedded defaults (SQLite and an
// in-process NATS server under the data directory) accepts a job, runs
// it, and relays its events.
func TestServeRunsJobs(t *testing.T) {
	dir := t.TempDir()
	serveRunsJob(t, dir)
	if _, err := os.Stat(filepath.Join(dir, "kvgate.db")); err != nil {
		t.Errorf("no SQLite store under the data directory: %v", err)
	}
	if _, err := os.Stat(filepath.Join(dir, "nats", "jetstream")); err != nil {
		t.Errorf("no JetStream files under the data directory: %v", err)
	}
}

// TestServeOnPostgresAndExternalNATS: the production shape, --store
// postgres://... and --nats-url nats://...; nothing goes under the data
// directory.
func TestServeOnPostgresAndExternalNATS(t *testing.T) {
	ns, err := server.NewServer(&server.Options{Host: "127.0.0.1", Port: server.RANDOM_PORT, JetStream: true,
		StoreDir: t.TempDir(), NoLog: true, NoSigs: true})
	if err != nil {
		t.Fatal(err)
	}
	ns.Start()
	defer ns.Shutdown()
	if !ns.ReadyForConnections(10 * time.Second) {
		t.Fatal("nats server did not start")
	}
	dir := t.TempDir()
	serveRunsJob(t, dir, "--store", pgtest.FreshDatabase(t), "--nats-url", ns.ClientURL())
	if entries, _ := os.ReadDir(dir); len(entries) != 0 {
		t.Errorf("data directory holds %d entries, want none", len(entries))
	}
	if jsz, err := ns.Jsz(nil); err != nil || jsz.Messages == 0 {
		t.Errorf("the external NATS server stored no events (%v)", err)
	}
}

func serveRunsJob(t *testing.T, dir string, args ...string) {
	t.Helper()
	base, _ := startServe(t, append([]string{"--data-dir", dir}, args...)...)
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		if r, err := http.Get(base + "/readyz"); err == nil {
			r.Body.Close()
			if r.StatusCode == 200 {
				break
			}
		}
		if time.Now().After(deadline) {
			t.Fatal("never ready")
		}
	}
	submitAndWait(t, base, "one")
	// The job's events went through the embedded NATS server: published
	// (so in the feed, replayed from cursor 0) and recorded by the inbox.
	client := &http.Client{Timeout: 10 * time.Second}
	req, _ := http.NewRequest(http.MethodGet, base+"/v1/events", nil)
	req.Header.Set("Last-Event-ID", "0")
	resp, err := client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	first, _ := bufio.NewReader(resp.Body).ReadString('\n')
	resp.Body.Close()
	if !strings.HasPrefix(first, "id: ") {
		t.Errorf("event stream began with %q, want a replayed event", first)
	}
	waitInboxRecorded(t, base, 10*time.Second)
}

// startServe runs kvgate serve (on a free port, simulated backends at
// full speed, no NVML) with the extra args until the test ends, and
// returns its base URL and its log.
func startServe(t *testing.T, args ...string) (string, *syncBuffer) {
	t.Helper()
	return startServeEnv(t, nil, args...)
}

// startServeEnv is startServe with environment variables.
func startServeEnv(t *testing.T, env map[string]string, args ...string) (string, *syncBuffer) {
	t.Helper()
	ctx, cancel := context.WithCancel(t.Context())
	var stdout, stderr syncBuffer
	done := make(chan error, 1)
	go func() {
		done <- run(ctx, append([]string{"serve", "--addr", "127.0.0.1:0", "--sim-speedup", "0", "--no-nvml", "--dev"}, args...),
			func(k string) string { return env[k] }, &stdout, &stderr)
	}()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("serve: %v", err)
		}
	})
	addr := regexp.MustCompile(`(https?://127\.0\.0\.1:\d+)/v1`)
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		if m := addr.FindStringSubmatch(stdout.String()); m != nil {
			return m[1], &stderr
		}
		if time.Now().After(deadline) {
			t.Fatalf("serve printed no address:\n%s", stderr.String())
		}
	}
}

// submitAndWait submits a small completion job under key and waits for it
// to succeed.
func submitAndWait(t *testing.T, base, key string) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodPost, base+"/v1/jobs", strings.NewReader(
		`{"endpoint":"/v1/completions","body":{"model":"meta-llama/Llama-3.1-8B-Instruct","prompt":"hi","max_tokens":3}}`))
	req.Header.Set("Idempotency-Key", key)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	loc := resp.Header.Get("Location")
	resp.Body.Close()
	if resp.StatusCode != http.StatusAccepted || loc == "" {
		t.Fatalf("submit: %d %q", resp.StatusCode, loc)
	}
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		r, err := http.Get(base + loc)
		if err != nil {
			t.Fatal(err)
		}
		var v struct{ State string }
		_ = json.NewDecoder(r.Body).Decode(&v)
		r.Body.Close()
		if v.State == "SUCCEEDED" {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("job still %s", v.State)
		}
	}
}

// waitInboxRecorded waits until serve's inbox has recorded an event.
func waitInboxRecorded(t *testing.T, base string, limit time.Duration) {
	t.Helper()
	recorded := regexp.MustCompile(`(?m)^kvgate_scheduler_inbox_recorded_total (\d+)`)
	eventually.Within(t, limit, "the inbox to record an event", func() bool {
		r, err := http.Get(base + "/metrics")
		if err != nil {
			return false
		}
		b, _ := io.ReadAll(r.Body)
		r.Body.Close()
		m := recorded.FindSubmatch(b)
		return m != nil && string(m[1]) != "0"
	})
}

func TestKeyRoles(t *testing.T) {
	keys, err := parseKeys([]string{"u1=acme", "o1=acme:operator", "u2=globex:user"})
	if err != nil {
		t.Fatal(err)
	}
	cfg := &config{APIKeys: keys}
	users, ops, err := cfg.keyMaps()
	if err != nil || users["u1"] != "acme" || users["u2"] != "globex" || ops["o1"] != "acme" || users["o1"] != "" {
		t.Errorf("users %v operators %v err %v", users, ops, err)
	}
	for _, bad := range [][]apiKey{
		{{Key: "k", Tenant: "t", Role: "admin?"}},
		{{Key: "k", Tenant: "t"}, {Key: "k", Tenant: "u", Role: "operator"}},
		{{Key: "", Tenant: "t"}},
	} {
		if _, _, err := (&config{APIKeys: bad}).keyMaps(); err == nil {
			t.Errorf("keys %+v accepted", bad)
		}
	}
}

// TestServeStartsWithNATSDown: an external NATS server that is down at
// start does not stop kvgate serve: a job is accepted and runs meanwhile,
// and its events reach the inbox once the server is up.
func TestServeStartsWithNATSDown(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := ln.Addr().(*net.TCPAddr).Port
	ln.Close() // nothing listens there yet
	base, _ := startServe(t, "--data-dir", t.TempDir(), "--nats-url", fmt.Sprintf("nats://127.0.0.1:%d", port))
	submitAndWait(t, base, "while-nats-is-down")
	ns, err := server.NewServer(&server.Options{Host: "127.0.0.1", Port: port, JetStream: true, StoreDir: t.TempDir(), NoLog: true, NoSigs: true})
	if err != nil {
		t.Fatal(err)
	}
	ns.Start()
	t.Cleanup(ns.Shutdown)
	waitInboxRecorded(t, base, 30*time.Second)
}
