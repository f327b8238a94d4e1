package main

import (
	"context"
	"encoding/json"
	"io"
	"math"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvgate/kvgate/bench"
	"github.com/kvgate/kvgate/bench/vllmsim"
)

func benchSim(t *testing.T) (*vllmsim.Sim, string) {
	t.Helper()
	p, err := vllmsim.LookupProfile("h100-llama-3.1-8b")
	if err != nil {
		t.Fatal(err)
	}
	sim, srv := vllmsim.NewTestServer(t, vllmsim.Config{Profile: p, Speedup: 50})
	return sim, srv.URL
}

func readJSONMap(t *testing.T, path string) map[string]any {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var m map[string]any
	if err := json.Unmarshal(b, &m); err != nil {
		t.Fatal(err)
	}
	return m
}

func TestBenchRunWritesReports(t *testing.T) {
	_, url := benchSim(t)
	out := t.TempDir()
	var stdout, stderr syncBuffer
	err := run(context.Background(), []string{"bench", "run", "--target", url + "/v1", "--model", benchModel, "--out", out,
		"--num-prompts", "20", "--request-rate", "200", "--burstiness", "0.5", "--random-input-len", "32", "--random-output-len", "8",
		"--goodput", "ttft:60000", "e2el:60000", "--scrape", url + "/metrics", "--scrape-interval", "20ms", "--seed", "3",
		"--metadata", "gpu=simulated", "--label", "smoke"}, noenv, &stdout, &stderr)
	if err != nil {
		t.Fatalf("%v\n%s", err, stderr.String())
	}
	for _, name := range []string{bench.FileJSON, bench.FileSummaryCSV, bench.FileRequestsCSV, bench.FileMarkdown, bench.FileHTML} {
		if st, err := os.Stat(filepath.Join(out, name)); err != nil || st.Size() == 0 {
			t.Errorf("%s: %v", name, err)
		}
	}
	m := readJSONMap(t, filepath.Join(out, bench.FileJSON))
	if m["completed"] != 20.0 || m["request_rate"] != 200.0 || m["burstiness"] != 0.5 || m["label"] != "smoke" ||
		m["request_goodput"] != m["request_throughput"] || m["total_output_tokens"] != 160.0 {
		t.Errorf("report: completed %v rate %v burstiness %v label %v goodput %v/%v output %v", m["completed"], m["request_rate"],
			m["burstiness"], m["label"], m["request_goodput"], m["request_throughput"], m["total_output_tokens"])
	}
	if ts, _ := m["time_series"].([]any); len(ts) == 0 {
		t.Error("no scraped time series")
	}
	if slo := m["goodput_slo_ms"].(map[string]any); slo["ttft"] != 60000.0 || slo["e2el"] != 60000.0 {
		t.Errorf("goodput SLOs %v", slo)
	}
	if md := m["metadata"].(map[string]any); md["gpu"] != "simulated" {
		t.Errorf("metadata %v", md)
	}
	if !strings.Contains(stdout.String(), "| Successful requests | 20 |") || !strings.Contains(stdout.String(), "report.html") {
		t.Errorf("stdout:\n%s", stdout.String())
	}
	if !strings.Contains(stderr.String(), "point 0: 20 done (0 failed)") {
		t.Errorf("progress on stderr: %q", stderr.String())
	}
}

func TestBenchRunConfigFile(t *testing.T) {
	_, url := benchSim(t)
	dir := t.TempDir()
	cfgPath := filepath.Join(dir, "bench.yaml")
	yaml := `target: ` + url + `
model: ` + benchModel + `
endpoint: /v1/chat/completions
num_prompts: 16
request_rate: 400
random_input_len: 40
random_output_len: 6
random_range_ratio: 0.5
metric_percentiles: "50,99"
quiet: true
tenants:
  - {name: acme, key: sk-a, weight: 2}
  - {name: globex, key: sk-g, rate: 100, random_output_len: 3, random_range_ratio: 0, num_prompts: 4}
`
	if err := os.WriteFile(cfgPath, []byte(yaml), 0o644); err != nil {
		t.Fatal(err)
	}
	out := filepath.Join(dir, "out")
	var stdout, stderr syncBuffer
	// The flag overrides the file's num_prompts, which acme, the one
	// tenant without a count of its own, takes whole.
	if err := run(context.Background(), []string{"bench", "run", "--config", cfgPath, "--out", out, "--num-prompts", "10"}, noenv, &stdout, &stderr); err != nil {
		t.Fatalf("%v\n%s", err, stderr.String())
	}
	rep, err := bench.ReadReport(filepath.Join(out, bench.FileJSON))
	if err != nil {
		t.Fatal(err)
	}
	if rep.Backend != "openai-chat" || len(rep.Tenants) != 2 {
		t.Fatalf("backend %s, tenants %+v", rep.Backend, rep.Tenants)
	}
	acme, globex := rep.Tenants[0], rep.Tenants[1]
	if acme.Name != "acme" || acme.Weight != 2 || acme.Summary.Completed != 10 || globex.Summary.Completed != 4 || globex.Summary.TotalOutputTokens != 12 {
		t.Errorf("acme %+v, globex %+v", acme, globex)
	}
	for _, r := range rep.Requests {
		if r.Tenant == "acme" && (r.OutputTokens < 3 || r.OutputTokens > 9) {
			t.Errorf("acme output %d outside 6 ± 50%%", r.OutputTokens)
		}
	}
	if _, ok := rep.Summary.TTFT.Percentiles[99]; !ok || len(rep.Summary.TTFT.Percentiles) != 2 {
		t.Errorf("percentiles %v, want p50 and p99", rep.Summary.TTFT.Percentiles)
	}
	if stderr.String() != "" {
		t.Errorf("--quiet still printed progress: %q", stderr.String())
	}
}

func TestBenchCompare(t *testing.T) {
	_, url := benchSim(t)
	dir := t.TempDir()
	a := filepath.Join(dir, "a")
	var stdout, stderr syncBuffer
	if err := run(context.Background(), []string{"bench", "run", "--target", url, "--model", benchModel, "--out", a, "--quiet",
		"--num-prompts", "20", "--random-input-len", "16", "--random-output-len", "4"}, noenv, &stdout, &stderr); err != nil {
		t.Fatalf("%v\n%s", err, stderr.String())
	}
	rep, err := bench.ReadReport(filepath.Join(a, bench.FileJSON))
	if err != nil {
		t.Fatal(err)
	}
	// B: half the throughput, the same latencies.
	rep.Summary.RequestThroughput /= 2
	rep.Summary.OutputThroughput /= 2
	b := filepath.Join(dir, "b.json")
	f, err := os.Create(b)
	if err != nil {
		t.Fatal(err)
	}
	if err := rep.WriteJSON(f); err != nil {
		t.Fatal(err)
	}
	f.Close()

	stdout = syncBuffer{}
	if err := run(context.Background(), []string{"bench", "compare", a, b}, noenv, &stdout, &stderr); err != nil {
		t.Fatal(err)
	}
	out := stdout.String()
	for _, want := range []string{"| request_throughput |", "| 0.500 |", "WORSE"} {
		if !strings.Contains(out, want) {
			t.Errorf("compare output lacks %q:\n%s", want, out)
		}
	}
	for _, line := range strings.Split(out, "\n") {
		if strings.HasPrefix(line, "| mean_ttft_ms ") && strings.Contains(line, "WORSE") {
			t.Errorf("unchanged latency flagged: %s", line)
		}
	}
	err = run(context.Background(), []string{"bench", "compare", a, b, "--fail-on-worse"}, noenv, &stdout, &stderr)
	if err == nil || !strings.Contains(err.Error(), "request_throughput") {
		t.Errorf("--fail-on-worse: %v", err)
	}
	if err := run(context.Background(), []string{"bench", "compare", "--fail-on-worse", a, a}, noenv, &stdout, &stderr); err != nil {
		t.Errorf("a report against itself: %v", err)
	}
}

func TestBenchDeferredThroughKvgate(t *testing.T) {
	g := startGateway(t)
	waitForModel(t, g, "", benchModel)
	// none: each record ends with its job's acceptance, and carries no
	// tokens; the jobs run on.
	for _, follow := range []string{"sse", "poll", "none"} {
		t.Run(follow, func(t *testing.T) {
			out := t.TempDir()
			streams := eventStreamsServed(t, g.base)
			var stdout, stderr syncBuffer
			if err := run(context.Background(), []string{"bench", "run", "--target", g.base + "/v1", "--model", benchModel, "--out", out, "--quiet",
				"--deferred", "--job-follow", follow, "--num-prompts", "6", "--request-rate", "100", "--random-input-len", "16", "--random-output-len", "5",
				"--scrape", g.base + "/metrics", "--scrape-interval", "50ms"}, noenv, &stdout, &stderr); err != nil {
				t.Fatalf("%v\n%s", err, stderr.String())
			}
			rep, err := bench.ReadReport(filepath.Join(out, bench.FileJSON))
			if err != nil {
				t.Fatal(err)
			}
			wantTokens := 30
			if follow == "none" {
				wantTokens = 0
			}
			if rep.Summary.Completed != 6 || rep.Summary.TotalOutputTokens != wantTokens || rep.Tenants[0].Class != "batch" {
				t.Fatalf("completed %d, output tokens %d, class %s; errors %v", rep.Summary.Completed, rep.Summary.TotalOutputTokens, rep.Tenants[0].Class, rep.Summary.Errors)
			}
			for _, r := range rep.Requests {
				if r.JobID == "" || r.E2EL <= 0 {
					t.Errorf("record %+v", r)
				}
			}
			if len(rep.TimeSeries) == 0 {
				t.Fatal("kvgate's /metrics gave no samples")
			}
			for _, k := range []string{"kv_usage", "queue_depth", "inflight"} {
				if _, ok := rep.TimeSeries[0].Values[k]; !ok {
					t.Errorf("kvgate's samples lack %s: %v", k, rep.TimeSeries[0].Values)
				}
			}
			if rep.Provenance.Servers[g.base+"/metrics"]["capacity_tokens.sim0"] == "" && len(rep.Provenance.Servers) == 0 {
				t.Errorf("no provenance from kvgate's /metrics")
			}
			if n := eventStreamsServed(t, g.base) - streams; (follow == "sse") != (n >= 6) {
				t.Errorf("following by %s, kvgate served %v job event streams for 6 jobs", follow, n)
			}
		})
	}
}

// eventStreamsServed reads from kvgate's /metrics how many job event
// streams it has answered 200.
func eventStreamsServed(t *testing.T, base string) float64 {
	t.Helper()
	resp, err := http.Get(base + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	n := 0.0
	for _, line := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(line, "kvgate_gateway_requests_total{") && strings.Contains(line, `route="/v1/jobs/{id}/events"`) && strings.Contains(line, `status="200"`) {
			f := strings.Fields(line)
			v, _ := strconv.ParseFloat(f[len(f)-1], 64)
			n += v
		}
	}
	return n
}

func TestBenchDispatchesScenario(t *testing.T) {
	var stdout, stderr syncBuffer
	if err := run(context.Background(), []string{"bench", "scenario", "list"}, noenv, &stdout, &stderr); err != nil {
		t.Fatalf("%v\n%s", err, stderr.String())
	}
	if !strings.Contains(stdout.String(), "overload") {
		t.Errorf("bench scenario list:\n%s", stdout.String())
	}
}

func TestBenchErrors(t *testing.T) {
	for _, args := range [][]string{
		{"bench"},
		{"bench", "bogus"},
		{"bench", "run", "--model", "m"},
		{"bench", "run", "--target", "http://x", "--model", "m", "--request-rate", "-3"},
		{"bench", "run", "--target", "http://x", "--model", "m", "--goodput", "ttft"},
		{"bench", "run", "--target", "http://x", "--model", "m", "--goodput", "itl:5"},
		{"bench", "run", "--target", "http://x", "--model", "m", "--endpoint", "/v1/embeddings"},
		{"bench", "run", "--target", "http://x", "--model", "m", "--tenant", "name"},
		{"bench", "run", "--target", "http://x", "--model", "m", "--tenant", "name=a,color=red"},
		{"bench", "run", "--target", "http://x", "--model", "m", "--dataset-name", "sonnet"},
		{"bench", "run", "--target", "http://x", "--model", "m", "--dataset-name", "sharegpt"},
		{"bench", "run", "--target", "http://x", "--model", "m", "--input-dist", "uniform"},
		{"bench", "run", "--target", "http://x", "--model", "m", "--sweep-rates", "1,x"},
		{"bench", "run", "--config", "/nonexistent/bench.yaml"},
		{"bench", "compare", "only-one.json"},
	} {
		var stdout, stderr syncBuffer
		if err := run(context.Background(), args, noenv, &stdout, &stderr); err == nil {
			t.Errorf("%s: no error", strings.Join(args, " "))
		}
	}
	dir := t.TempDir()
	bad := filepath.Join(dir, "bad.yaml")
	_ = os.WriteFile(bad, []byte("target: http://x\nmodel: m\ncolour: red\n"), 0o644)
	var stdout, stderr syncBuffer
	if err := run(context.Background(), []string{"bench", "run", "--config", bad}, noenv, &stdout, &stderr); err == nil || !strings.Contains(err.Error(), "colour") {
		t.Errorf("unknown config key: %v", err)
	}
}

func TestJoinGoodput(t *testing.T) {
	for _, tc := range []struct{ in, want string }{
		{"--goodput ttft:500 tpot:50 --num-prompts 3", "--goodput|ttft:500 tpot:50|--num-prompts|3"},
		{"-goodput e2el:9 x", "-goodput|e2el:9|x"},
		{"--goodput=ttft:5 tpot:1", "--goodput=ttft:5|tpot:1"},
		{"--goodput", "--goodput"},
		{"--model goodput ttft:1", "--model|goodput|ttft:1"},
	} {
		if got := strings.Join(joinGoodput(strings.Fields(tc.in)), "|"); got != tc.want {
			t.Errorf("%q: %q, want %q", tc.in, got, tc.want)
		}
	}
}

func TestBenchAPIKeyFromEnvironment(t *testing.T) {
	sim, _ := benchSim(t)
	var mu sync.Mutex
	auth := map[string]int{}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/v1/completions" {
			mu.Lock()
			auth[r.Header.Get("Authorization")]++
			mu.Unlock()
		}
		sim.ServeHTTP(w, r)
	}))
	defer srv.Close()
	env := func(k string) string {
		if k == "OPENAI_API_KEY" {
			return "sk-from-env"
		}
		return ""
	}
	var stdout, stderr syncBuffer
	out := t.TempDir()
	if err := run(context.Background(), []string{"bench", "run", "--target", srv.URL, "--model", benchModel, "--out", out, "--quiet",
		"--num-prompts", "4", "--random-input-len", "8", "--random-output-len", "2", "--tenant", "name=t,key=sk-tenant-key", "--tenant", "name=u"}, env, &stdout, &stderr); err != nil {
		t.Fatalf("%v\n%s", err, stderr.String())
	}
	for _, name := range []string{bench.FileJSON, bench.FileMarkdown, bench.FileHTML, bench.FileSummaryCSV, bench.FileRequestsCSV} {
		b, err := os.ReadFile(filepath.Join(out, name))
		if err != nil {
			t.Fatal(err)
		}
		if strings.Contains(string(b), "sk-") {
			t.Errorf("%s contains an API key", name)
		}
	}
	mu.Lock()
	if auth["Bearer sk-tenant-key"] != 2 || auth["Bearer sk-from-env"] != 2 {
		t.Errorf("authorizations %v, want 2 with the tenant's key and 2 with $OPENAI_API_KEY", auth)
	}
	mu.Unlock()
	stderr = syncBuffer{}
	_ = run(context.Background(), []string{"bench", "run", "--help"}, env, &stdout, &stderr)
	if strings.Contains(stderr.String(), "sk-from-env") || !strings.Contains(stderr.String(), "-num-prompts") {
		t.Errorf("help shows the key or lacks the flags:\n%s", stderr.String())
	}
}

func TestBenchFlagsToConfig(t *testing.T) {
	parse := func(args ...string) bench.Config {
		t.Helper()
		var f benchFlags
		var stderr syncBuffer
		fs := benchFlagSet(&stderr, &f)
		if err := fs.Parse(joinGoodput(append([]string{"--target", "http://x", "--model", "m"}, args...))); err != nil {
			t.Fatal(err)
		}
		cfg, err := f.config()
		if err != nil {
			t.Fatalf("%v: %v", args, err)
		}
		return cfg
	}
	c := parse("--endpoint", "/v1/chat/completions", "--request-rate", "12.5", "--burstiness", "0.25", "--random-input-len", "100",
		"--random-output-len", "10", "--random-range-ratio", "0.2", "--goodput", "ttft:250", "tpot:20", "--sweep-rates", "1, 2,4")
	if c.Endpoint != bench.EndpointChat || c.Arrival.Rate != 12.5 || c.Arrival.Burstiness != 0.25 ||
		c.Workload.Input != (bench.Dist{Kind: bench.DistUniform, Mean: 100, Min: 80, Max: 120}) ||
		c.Workload.Output != (bench.Dist{Kind: bench.DistUniform, Mean: 10, Min: 8, Max: 12}) ||
		c.SLO != (bench.SLO{TTFT: 250 * time.Millisecond, TPOT: 20 * time.Millisecond}) || len(c.Sweep.Rates) != 3 || c.Sweep.Rates[2] != 4 {
		t.Errorf("config %+v", c)
	}
	c = parse("--dataset-name", "sharegpt", "--dataset-path", "../../bench/testdata/sharegpt-sample.json", "--ignore-eos",
		"--sharegpt-output-len", "64", "--input-dist", "lognormal", "--input-stddev", "30", "--concurrency", "8", "--stream=false")
	if !c.Workload.IgnoreEOS || c.Workload.FixedOutput != 64 || c.Workload.Input.Kind != bench.DistLogNormal || c.Workload.Input.StdDev != 30 ||
		c.Arrival.Concurrency != 8 || c.Stream {
		t.Errorf("config %+v", c)
	}
	if c := parse(); !math.IsInf(c.Arrival.Rate, 1) || c.NumPrompts != 1000 || c.Workload.Input.Mean != 1024 || c.Workload.Output.Mean != 128 ||
		!c.Stream || c.Endpoint != bench.EndpointCompletions || c.MaxConnections != bench.DefaultMaxConnections {
		t.Errorf("defaults %+v", c)
	}
	c = parse("--tenant", "name=a,key=k1,rate=inf,random-output-len=7,deferred=true,weight=3", "--tenant", "name=b,concurrency=2")
	a, b := c.Tenants[0], c.Tenants[1]
	if a.APIKey != "k1" || !math.IsInf(a.Arrival.Rate, 1) || a.Workload.Output.Mean != 7 || !a.Deferred || a.Weight != 3 ||
		b.Arrival.Concurrency != 2 || b.Workload.Output.Mean != 128 {
		t.Errorf("tenants %+v", c.Tenants)
	}
	// --request-rate is over all tenants: those without a rate of their
	// own share it, whether they change its shape or not.
	c = parse("--request-rate", "12", "--tenant", "name=a", "--tenant", "name=b,burstiness=0.5", "--tenant", "name=c,rate=4")
	if r := []float64{c.Tenants[0].Arrival.Rate, c.Tenants[1].Arrival.Rate, c.Tenants[2].Arrival.Rate}; r[0] != 6 || r[1] != 6 || r[2] != 4 ||
		c.Tenants[1].Arrival.Burstiness != 0.5 {
		t.Errorf("--request-rate 12 over a, b and c (rate=4): %v, want 6, 6 and 4", r)
	}
	c = parse("--concurrency", "5", "--tenant", "name=a", "--tenant", "name=b")
	if n := []int{c.Tenants[0].Arrival.Concurrency, c.Tenants[1].Arrival.Concurrency}; n[0] != 3 || n[1] != 2 {
		t.Errorf("--concurrency 5 over two tenants: %v, want 3 and 2", n)
	}
}
