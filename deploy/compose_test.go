package deploy

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"sigs.k8s.io/yaml"
)

const composeDir = "compose"

// composeTools are the compose implementations on this machine: Debian's
// docker-compose (v1, which .ci/run installs) and the docker compose plugin
// (v2) where it is installed.
func composeTools(t *testing.T) [][]string {
	t.Helper()
	var tools [][]string
	if p, err := exec.LookPath("docker-compose"); err == nil {
		tools = append(tools, []string{p})
	}
	if p, err := exec.LookPath("docker"); err == nil {
		if exec.Command(p, "compose", "version").Run() == nil {
			tools = append(tools, []string{p, "compose"})
		}
	}
	if len(tools) == 0 {
		msg := "neither docker-compose nor docker compose found: install Debian's docker-compose package (.ci/run does)"
		if inCI() {
			t.Fatal(msg)
		}
		t.Skip(msg)
	}
	return tools
}

// composeConfig runs `compose config` in deploy/compose with env added
// and returns the resolved project.
func composeConfig(t *testing.T, tool []string, env []string, extra ...string) (map[string]any, string, error) {
	t.Helper()
	args := append(slices.Clone(tool[1:]), extra...)
	args = append(args, "config")
	cmd := exec.Command(tool[0], args...)
	cmd.Dir = composeDir
	// A clean environment, so that the caller's KVGATE_* do not leak in.
	cmd.Env = append([]string{"PATH=" + os.Getenv("PATH"), "HOME=" + os.Getenv("HOME")}, env...)
	out, err := cmd.Output()
	if err != nil {
		msg := ""
		if ee, ok := err.(*exec.ExitError); ok {
			msg = string(ee.Stderr)
		}
		return nil, msg, err
	}
	var doc map[string]any
	if err := yaml.Unmarshal(out, &doc); err != nil {
		t.Fatalf("compose config output: %v\n%s", err, out)
	}
	return doc, "", nil
}

func obj(v any) map[string]any { m, _ := v.(map[string]any); return m }

func strs(v any) []string {
	var out []string
	switch v := v.(type) {
	case []any:
		for _, e := range v {
			out = append(out, fmt.Sprint(e))
		}
	case string:
		out = strings.Fields(v)
	}
	return out
}

// flagValue returns the value after flag in args.
func flagValue(args []string, flag string) string {
	if i := slices.Index(args, flag); i >= 0 && i+1 < len(args) {
		return args[i+1]
	}
	return ""
}

// TestComposeConfig has the compose file parsed and resolved by a real
// compose implementation, then checks the topology it describes.
func TestComposeConfig(t *testing.T) {
	for _, tool := range composeTools(t) {
		t.Run(filepath.Base(strings.Join(tool, " ")), func(t *testing.T) {
			if _, stderr, err := composeConfig(t, tool, nil); err == nil || !strings.Contains(stderr, "KVGATE_ADMIN_KEY") {
				t.Errorf("compose config without KVGATE_ADMIN_KEY: err %v, stderr %q; want a refusal naming it", err, stderr)
			}
			doc, stderr, err := composeConfig(t, tool, []string{"KVGATE_ADMIN_KEY=test-admin-key"}, "--profile", "vllm")
			if err != nil {
				t.Fatalf("compose config: %v\n%s", err, stderr)
			}
			checkCompose(t, doc)
		})
	}
}

func checkCompose(t *testing.T, doc map[string]any) {
	services := obj(doc["services"])
	for _, name := range []string{"postgres", "nats-1", "nats-2", "nats-3", "kvgate-1", "kvgate-2", "sim-1", "sim-2",
		"vllm-1", "vllm-2", "prometheus", "grafana"} {
		if services[name] == nil {
			t.Errorf("no service %s", name)
		}
	}

	// A three-node JetStream cluster: each node routes to the two others.
	natsNodes := []string{"nats-1", "nats-2", "nats-3"}
	for _, n := range natsNodes {
		args := strs(obj(services[n])["command"])
		if !slices.Contains(args, "--jetstream") || flagValue(args, "--cluster_name") == "" || flagValue(args, "--store_dir") == "" {
			t.Errorf("%s: %q lacks --jetstream, --cluster_name or --store_dir", n, args)
		}
		routes := flagValue(args, "--routes")
		for _, other := range natsNodes {
			if other != n && !strings.Contains(routes, "nats://"+other+":6222") {
				t.Errorf("%s: routes %q miss %s", n, routes, other)
			}
		}
		if len(obj(services[n])["volumes"].([]any)) == 0 {
			t.Errorf("%s keeps JetStream's files in no volume", n)
		}
	}

	// Two kvgate replicas on PostgreSQL and the whole NATS cluster, with
	// the streams replicated on all three nodes.
	cfgFile := filepath.Join(composeDir, "kvgate.yaml")
	var kcfg struct {
		DrainTimeout string `json:"drain_timeout"`
		NATS         struct {
			Replicas int `json:"replicas"`
		} `json:"nats"`
	}
	raw, err := os.ReadFile(cfgFile)
	if err != nil {
		t.Fatal(err)
	}
	if err := yaml.Unmarshal(raw, &kcfg); err != nil {
		t.Fatal(err)
	}
	if kcfg.NATS.Replicas != 3 {
		t.Errorf("%s: nats.replicas %d, want 3", cfgFile, kcfg.NATS.Replicas)
	}
	drain, err := time.ParseDuration(kcfg.DrainTimeout)
	if err != nil {
		t.Fatalf("%s: drain_timeout %q: %v", cfgFile, kcfg.DrainTimeout, err)
	}
	for _, n := range []string{"kvgate-1", "kvgate-2"} {
		s := obj(services[n])
		env := obj(s["environment"])
		if st := fmt.Sprint(env["KVGATE_STORE"]); !strings.HasPrefix(st, "postgres://") || !strings.Contains(st, "@postgres:5432/") {
			t.Errorf("%s: KVGATE_STORE %q, want the postgres service", n, st)
		}
		for _, node := range natsNodes {
			if !strings.Contains(fmt.Sprint(env["KVGATE_NATS_URL"]), "nats://"+node+":4222") {
				t.Errorf("%s: KVGATE_NATS_URL %q misses %s", n, env["KVGATE_NATS_URL"], node)
			}
		}
		for _, b := range strings.Split(fmt.Sprint(env["KVGATE_BACKENDS"]), ",") {
			host := strings.TrimPrefix(strings.Split(strings.TrimPrefix(b, "http://"), ":")[0], "")
			if services[host] == nil {
				t.Errorf("%s: backend %q is no service", n, b)
			}
		}
		if env["KVGATE_ADMIN_KEY"] != "test-admin-key" {
			t.Errorf("%s: KVGATE_ADMIN_KEY %v, want the caller's", n, env["KVGATE_ADMIN_KEY"])
		}
		grace, err := time.ParseDuration(fmt.Sprint(s["stop_grace_period"]))
		if err != nil || grace <= drain {
			t.Errorf("%s: stop_grace_period %v (%v), want longer than drain_timeout %s", n, s["stop_grace_period"], err, drain)
		}
		if b := obj(s["build"]); b == nil || !strings.HasSuffix(fmt.Sprint(b["dockerfile"]), "deploy/docker/Dockerfile") {
			t.Errorf("%s: build %v, want deploy/docker/Dockerfile", n, s["build"])
		}
	}
	// Simulators by default, real vLLM on GPUs behind the vllm profile.
	for _, n := range []string{"sim-1", "sim-2"} {
		s := obj(services[n])
		if s["profiles"] != nil {
			t.Errorf("%s has profiles %v: the simulators run by default", n, s["profiles"])
		}
		if args := strs(s["command"]); len(args) == 0 || args[0] != "sim" || flagValue(args, "--host") != "0.0.0.0" {
			t.Errorf("%s: command %q, want kvgate sim on 0.0.0.0", n, args)
		}
	}
	for _, n := range []string{"vllm-1", "vllm-2"} {
		s := obj(services[n])
		if !slices.Contains(strs(s["profiles"]), "vllm") {
			t.Errorf("%s: profiles %v, want vllm", n, s["profiles"])
		}
		devs, _ := obj(obj(obj(s["deploy"])["resources"])["reservations"])["devices"].([]any)
		if len(devs) == 0 || !slices.Contains(strs(obj(devs[0])["capabilities"]), "gpu") {
			t.Errorf("%s reserves no GPU: %v", n, s["deploy"])
		}
	}

	// Bind mounts name files that exist.
	for name, sv := range services {
		vols, _ := obj(sv)["volumes"].([]any)
		for _, v := range vols {
			src := ""
			switch v := v.(type) {
			case string:
				src = strings.Split(v, ":")[0]
			case map[string]any:
				if v["type"] == "bind" {
					src = fmt.Sprint(v["source"])
				}
			}
			if filepath.IsAbs(src) {
				if _, err := os.Stat(src); err != nil {
					t.Errorf("%s mounts %s: %v", name, src, err)
				}
			}
		}
	}
	checkPrometheusTargets(t, services)
}

// checkPrometheusTargets: Prometheus scrapes every service with metrics,
// and every target it names is a service.
func checkPrometheusTargets(t *testing.T, services map[string]any) {
	raw, err := os.ReadFile(filepath.Join(composeDir, "prometheus.yml"))
	if err != nil {
		t.Fatal(err)
	}
	var prom struct {
		ScrapeConfigs []struct {
			StaticConfigs []struct {
				Targets []string `json:"targets"`
			} `json:"static_configs"`
		} `json:"scrape_configs"`
	}
	if err := yaml.Unmarshal(raw, &prom); err != nil {
		t.Fatal(err)
	}
	scraped := map[string]bool{}
	for _, sc := range prom.ScrapeConfigs {
		for _, st := range sc.StaticConfigs {
			for _, tg := range st.Targets {
				host := strings.Split(tg, ":")[0]
				if host != "localhost" && services[host] == nil {
					t.Errorf("prometheus.yml scrapes %s: no such service", tg)
				}
				scraped[host] = true
			}
		}
	}
	for name := range services {
		if name == "postgres" || name == "grafana" || strings.HasPrefix(name, "nats-") && !strings.HasPrefix(name, "nats-exporter") {
			continue // seen through their exporters, or not a metrics source
		}
		if name != "prometheus" && !scraped[name] {
			t.Errorf("prometheus.yml does not scrape %s", name)
		}
	}
	if p, err := exec.LookPath("promtool"); err == nil {
		if out, err := exec.Command(p, "check", "config", "--syntax-only", filepath.Join(composeDir, "prometheus.yml")).CombinedOutput(); err != nil {
			t.Errorf("promtool check config: %v\n%s", err, out)
		}
	}
}

// TestComposeKvgateConfig loads the compose project's kvgate.yaml with
// kvgate's own configuration loader (kvgate gpus reads the same file as
// serve), so that a key kvgate does not know, or a wrong form, fails here.
func TestComposeKvgateConfig(t *testing.T) {
	bin := kvgateBinary(t)
	// With the NATS URL the compose file gives kvgate (its streams'
	// replicas need the cluster).
	raw, err := os.ReadFile(filepath.Join(composeDir, "docker-compose.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var doc map[string]any
	if err := yaml.Unmarshal(raw, &doc); err != nil {
		t.Fatal(err)
	}
	natsURL := fmt.Sprint(obj(obj(doc["x-kvgate"])["environment"])["KVGATE_NATS_URL"])
	if !strings.HasPrefix(natsURL, "nats://") {
		t.Fatalf("x-kvgate's KVGATE_NATS_URL is %q", natsURL)
	}
	cmd := exec.Command(bin, "gpus", "--config", filepath.Join(composeDir, "kvgate.yaml"))
	cmd.Env = []string{"PATH=" + os.Getenv("PATH"), "KVGATE_NATS_URL=" + natsURL}
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("kvgate gpus --config compose/kvgate.yaml: %v\n%s", err, out)
	}
}

// TestComposeNATSCommand starts nats-server (Debian's, where installed)
// with each compose node's own arguments, its ports and store moved to
// free ones on loopback (later flags win), so that a flag the server does
// not know fails here rather than in a container. It never binds 4222.
func TestComposeNATSCommand(t *testing.T) {
	bin, err := exec.LookPath("nats-server")
	if err != nil {
		if _, serr := os.Stat("/usr/sbin/nats-server"); serr != nil {
			t.Skip("nats-server not installed (Debian's nats-server package)")
		}
		bin = "/usr/sbin/nats-server"
	}
	tools := composeTools(t)
	doc, stderr, err := composeConfig(t, tools[0], []string{"KVGATE_ADMIN_KEY=x"})
	if err != nil {
		t.Fatalf("compose config: %v\n%s", err, stderr)
	}
	services := obj(doc["services"])
	args := strs(obj(services["nats-1"])["command"])
	if len(args) == 0 {
		t.Fatal("nats-1 has no command")
	}
	dir := t.TempDir()
	ports := freePorts(t, 4)
	client, monitor, cluster, other := ports[0], ports[1], ports[2], ports[3]
	args = append(args, "-a", "127.0.0.1", "-p", fmt.Sprint(client), "--http_port", fmt.Sprint(monitor),
		"--store_dir", filepath.Join(dir, "js"), "--cluster", fmt.Sprintf("nats://127.0.0.1:%d", cluster),
		"--routes", fmt.Sprintf("nats://127.0.0.1:%d", other))
	p := start(t, dir, "nats-1", bin, nil, args...)
	// /varz, not /healthz: a clustered JetStream node alone has no meta
	// leader and never reports healthy.
	health := fmt.Sprintf("http://127.0.0.1:%d/varz", monitor)
	deadline := time.Now().Add(30 * time.Second)
	for {
		if p.exited() {
			b, _ := os.ReadFile(p.log)
			t.Fatalf("nats-server with nats-1's arguments %q exited:\n%s", args, b)
		}
		if _, err := get(health); err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("nats-server with nats-1's arguments does not answer /varz after 30s")
		}
		time.Sleep(100 * time.Millisecond)
	}
	vz, err := get(fmt.Sprintf("http://127.0.0.1:%d/varz", monitor))
	if err != nil {
		t.Fatal(err)
	}
	var v struct {
		ServerName string `json:"server_name"`
		JetStream  struct {
			Config struct {
				StoreDir string `json:"store_dir"`
			} `json:"config"`
		} `json:"jetstream"`
		Cluster struct {
			Name string `json:"name"`
		} `json:"cluster"`
	}
	if err := yaml.Unmarshal(vz, &v); err != nil {
		t.Fatal(err)
	}
	if v.ServerName != "nats-1" || v.JetStream.Config.StoreDir == "" || v.Cluster.Name != "kvgate" {
		t.Errorf("nats-server with nats-1's arguments: name %q, JetStream store %q, cluster %q; want nats-1, a store, kvgate",
			v.ServerName, v.JetStream.Config.StoreDir, v.Cluster.Name)
	}
}
