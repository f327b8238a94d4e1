package main

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvgate/kvgate/bench/eventually"

	"github.com/kvgate/kvgate/bench"
)

// TestMain lets the test binary act as the kvgate command, so that the
// benchmarks below can run kvgate and the simulator as processes of their
// own, as they are deployed, apart from the load generator.
func TestMain(m *testing.M) {
	if args := os.Getenv("KVGATE_CHILD_ARGS"); args != "" {
		var argv []string
		if err := json.Unmarshal([]byte(args), &argv); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(2)
		}
		if len(argv) > 0 && argv[0] == "bare-proxy" {
			os.Exit(bareProxy(argv[1:], os.Stdout))
		}
		os.Exit(runMain(stopSignals(), argv, os.Getenv, os.Stdout, os.Stderr))
	}
	os.Exit(m.Run())
}

// child runs the test binary as `kvgate args...` and returns the base URL
// it prints; the process stops when the benchmark ends.
func child(tb testing.TB, args ...string) string {
	tb.Helper()
	return childOf(tb, "", args...)
}

// childOf runs bin (a kvgate binary; "" for this test binary) as
// `kvgate args...` and returns the base URL it prints.
func childOf(tb testing.TB, bin string, args ...string) string {
	tb.Helper()
	argv, _ := json.Marshal(args)
	cmd := exec.Command(os.Args[0])
	cmd.Env = append(os.Environ(), "KVGATE_CHILD_ARGS="+string(argv), "GOMAXPROCS=2")
	if bin != "" {
		cmd = exec.Command(bin, args...)
		cmd.Env = append(os.Environ(), "GOMAXPROCS=2")
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		tb.Fatal(err)
	}
	cmd.Stderr = io.Discard
	if err := cmd.Start(); err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() {
		_ = cmd.Process.Signal(os.Interrupt)
		_ = cmd.Wait()
	})
	addr := regexp.MustCompile(`http://(127\.0\.0\.1:\d+)`)
	lines := bufio.NewScanner(out)
	for lines.Scan() {
		if m := addr.FindStringSubmatch(lines.Text()); m != nil {
			go func() { _, _ = io.Copy(io.Discard, out) }()
			childPIDs.Store("http://"+m[1], cmd.Process.Pid)
			return "http://" + m[1]
		}
	}
	tb.Fatalf("kvgate %v printed no address", args)
	return ""
}

// childPIDs maps a child's base URL to its process id.
var childPIDs sync.Map

// childCPU is the CPU time the child serving url has used so far.
func childCPU(tb testing.TB, url string) time.Duration {
	tb.Helper()
	pid, ok := childPIDs.Load(url)
	if !ok {
		tb.Fatalf("no child process serves %s", url)
	}
	d, err := procCPU(pid.(int))
	if err != nil {
		tb.Fatal(err)
	}
	return d
}

func waitReady(tb testing.TB, url string) {
	tb.Helper()
	eventually.True(tb, url+" to become ready", func() bool {
		resp, err := http.Get(url)
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	})
}

// startStack runs an unpaced (zero-delay) simulated backend and a kvgate in
// front of it, each in its own process.
func startStack(tb testing.TB) (direct, via string) {
	sim := child(tb, "sim", "--port", "0", "--speedup", "0", "--max-model-len", "8192")
	return sim, startOverheadGateway(tb, "", sim)
}

// startOverheadGateway runs bin ("" for this test binary) as `kvgate serve` in
// front of the backend sim.
func startOverheadGateway(tb testing.TB, bin, sim string) string {
	gw := childOf(tb, bin, "serve", "--addr", "127.0.0.1:0", "--backend", sim, "--no-nvml", "--dev", "--log-level", "error", "--data-dir", tb.TempDir())
	waitReady(tb, gw+"/readyz")
	return gw
}

const benchModel = "meta-llama/Llama-3.1-8B-Instruct"

// BenchmarkGatewayOverhead measures the latency kvgate adds over calling the
// backend directly, at 1,000 requests/s, non-streaming and streaming, with
// kvgate, the backend (an unpaced simulator) and the load generator in
// processes of their own. Beside kvgate runs the floor, a bare Go reverse
// proxy in front of the same backend (bareproxy_test.go): what any Go
// gateway adds on this machine. Direct, floor and kvgate traffic take
// turns in one-second slices so all see the same machine; the
// bare-added-* figures are the floor's, and kvgate/bare-added-p50 the
// ratio of the two medians. The same bare proxy runs a second time with
// kvgate's backend client, gateway/hop, in place of net/http's Transport
// (barehop-added-*): what that client alone saves a hop.
//
//	go test -run '^$' -bench GatewayOverhead -benchtime 1x ./cmd/kvgate/
//
// Where nginx is installed (Debian's nginx-light), it runs as a third
// proxy in front of the same backend, in a slice of its own
// (nginxfloor_test.go): the nginx-added-* figures, a floor not written in
// Go.
//
// With KVGATE_OVERHEAD_BEFORE naming another kvgate binary (an older
// build), that one runs too, in front of the same backend, and takes its
// own slice in each round: before-added-p50/p99-ms are its figures, side
// by side with this build's on the same machine.
func BenchmarkGatewayOverhead(b *testing.B) {
	direct, via := startStack(b)
	bare := child(b, "bare-proxy", "--backend", direct)
	waitReady(b, bare+"/readyz")
	bareHop := child(b, "bare-proxy", "--backend", direct, "--hop")
	waitReady(b, bareHop+"/readyz")
	ngx, ngxCPU := startNginx(b, direct)
	before := ""
	if bin := os.Getenv("KVGATE_OVERHEAD_BEFORE"); bin != "" {
		before = startOverheadGateway(b, bin, direct)
	}
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 512}}
	for _, stream := range []bool{false, true} {
		b.Run(fmt.Sprintf("stream=%v", stream), func(b *testing.B) {
			body := fmt.Sprintf(`{"model":"%s","prompt":"hello","max_tokens":4,"ignore_eos":true,"stream":%v}`, benchModel, stream)
			var d, v, f, h, o, n bench.Result
			// Each proxy's CPU over its own slices: a figure the
			// machine's load moves far less than its latency.
			var vCPU, fCPU, hCPU, oCPU, nCPU time.Duration
			sliceOf := func(url string, into *bench.Result, cpu *time.Duration, read func() time.Duration) {
				c0 := read()
				into.Merge(bench.OpenLoop(context.Background(), client, url+"/v1/completions", body, 1000, time.Second))
				*cpu += read() - c0
			}
			slice := func(url string, into *bench.Result, cpu *time.Duration) {
				sliceOf(url, into, cpu, func() time.Duration { return childCPU(b, url) })
			}
			for range 5 {
				d.Merge(bench.OpenLoop(context.Background(), client, direct+"/v1/completions", body, 1000, time.Second))
				slice(via, &v, &vCPU)
				slice(bare, &f, &fCPU)
				slice(bareHop, &h, &hCPU)
				if before != "" {
					slice(before, &o, &oCPU)
				}
				if ngx != "" {
					sliceOf(ngx, &n, &nCPU, ngxCPU)
				}
			}
			// The bare proxy loses a stream now and then (httputil's
			// "use of closed network connection" in its body copy, a few
			// in 5,000): it is the floor's failure, counted, not kvgate's.
			if d.Failed+v.Failed+o.Failed > 0 {
				b.Errorf("%d direct, %d gateway and %d earlier gateway requests failed", d.Failed, v.Failed, o.Failed)
			}
			ms := func(x time.Duration) float64 { return float64(x) / float64(time.Millisecond) }
			perReq := func(cpu time.Duration, r bench.Result) float64 {
				return float64(cpu.Microseconds()) / float64(max(1, len(r.Latencies)+r.Failed))
			}
			added := func(r bench.Result, p float64) float64 { return ms(r.Percentile(p) - d.Percentile(p)) }
			b.ReportMetric(ms(d.Percentile(0.5)), "direct-p50-ms")
			b.ReportMetric(ms(d.Percentile(0.99)), "direct-p99-ms")
			b.ReportMetric(ms(v.Percentile(0.5)), "kvgate-p50-ms")
			b.ReportMetric(ms(v.Percentile(0.99)), "kvgate-p99-ms")
			b.ReportMetric(added(v, 0.5), "added-p50-ms")
			b.ReportMetric(added(v, 0.99), "added-p99-ms")
			b.ReportMetric(perReq(vCPU, v), "kvgate-cpu-us/req")
			b.ReportMetric(added(f, 0.5), "bare-added-p50-ms")
			b.ReportMetric(added(f, 0.99), "bare-added-p99-ms")
			b.ReportMetric(perReq(fCPU, f), "bare-cpu-us/req")
			b.ReportMetric(float64(f.Failed), "bare-failed")
			b.ReportMetric(added(h, 0.5), "barehop-added-p50-ms")
			b.ReportMetric(added(h, 0.99), "barehop-added-p99-ms")
			b.ReportMetric(perReq(hCPU, h), "barehop-cpu-us/req")
			b.ReportMetric(float64(h.Failed), "barehop-failed")
			if a := added(f, 0.5); a > 0 {
				b.ReportMetric(added(v, 0.5)/a, "kvgate/bare-added-p50")
			}
			if ngx != "" {
				b.ReportMetric(added(n, 0.5), "nginx-added-p50-ms")
				b.ReportMetric(added(n, 0.99), "nginx-added-p99-ms")
				b.ReportMetric(perReq(nCPU, n), "nginx-cpu-us/req")
				b.ReportMetric(float64(n.Failed), "nginx-failed")
			}
			if before != "" {
				b.ReportMetric(perReq(oCPU, o), "before-cpu-us/req")
				b.ReportMetric(added(o, 0.5), "before-added-p50-ms")
				b.ReportMetric(added(o, 0.99), "before-added-p99-ms")
			}
		})
	}
}

// BenchmarkGatewayThroughput measures requests per second through one
// kvgate process with 64 clients in a closed loop, against the same
// backend called directly.
//
//	go test -run '^$' -bench GatewayThroughput -benchtime 20000x ./cmd/kvgate/
func BenchmarkGatewayThroughput(b *testing.B) {
	direct, via := startStack(b)
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 512}}
	body := fmt.Sprintf(`{"model":"%s","prompt":"hello","max_tokens":1}`, benchModel)
	for _, target := range []struct{ name, url string }{{"direct", direct}, {"kvgate", via}} {
		b.Run(target.name, func(b *testing.B) {
			const workers = 64
			jobs := make(chan struct{}, b.N)
			for range b.N {
				jobs <- struct{}{}
			}
			close(jobs)
			var wg sync.WaitGroup
			b.ResetTimer()
			start := time.Now()
			for range workers {
				wg.Go(func() {
					for range jobs {
						resp, err := client.Post(target.url+"/v1/completions", "application/json", strings.NewReader(body))
						if err != nil {
							b.Error(err)
							return
						}
						_, _ = io.Copy(io.Discard, resp.Body)
						resp.Body.Close()
						if resp.StatusCode != http.StatusOK {
							b.Errorf("status %d", resp.StatusCode)
							return
						}
					}
				})
			}
			wg.Wait()
			b.ReportMetric(float64(b.N)/time.Since(start).Seconds(), "req/s")
		})
	}
}
