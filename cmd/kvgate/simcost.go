package main

import (
	"bufio"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/kvgate/kvgate/bench/vllmsim"
)

// runSimCost measures what the simulator costs the host: the CPU of idle
// simulated GPUs, and of one simulated GPU at full load at speed-up 1, as a
// separate process driven over HTTP so that the load generator's own CPU is
// not counted.
func runSimCost(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("kvgate sim cost", flag.ContinueOnError)
	fs.SetOutput(stderr)
	idleGPUs := fs.Int("idle-gpus", 8, "simulated GPUs left idle")
	window := fs.Duration("window", 15*time.Second, "measuring window of each scenario")
	seqs := fs.Int("seqs", 256, "concurrent sequences at full load")
	profile := fs.String("profile", "h100-llama-3.1-8b", "simulated deployment")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	p, err := vllmsim.LookupProfile(*profile)
	if err != nil {
		return err
	}
	tw := tabwriter.NewWriter(stdout, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "scenario\tCPU (share of one core)\tbudget\tverdict\tdetail")
	ok := true
	report := func(name string, cpu, budget float64, detail string) {
		verdict := "ok"
		if cpu > budget {
			verdict, ok = "OVER", false
		}
		fmt.Fprintf(tw, "%s\t%.2f%%\t%.0f%%\t%s\t%s\n", name, 100*cpu, 100*budget, verdict, detail)
	}

	cpu, err := idleCost(ctx, p, *idleGPUs, *window)
	if err != nil {
		return err
	}
	report(fmt.Sprintf("%d idle simulated GPUs, one process", *idleGPUs), cpu, 0.05, "engines and HTTP servers up, no requests")

	for _, stream := range []bool{true, false} {
		res, err := loadCost(ctx, p, *seqs, stream, *window)
		if err != nil {
			return err
		}
		mode := "non-streaming"
		if stream {
			mode = "streaming"
		}
		report(fmt.Sprintf("1 simulated GPU, %d %s seqs, speed-up 1", *seqs, mode), res.cpu, 0.5,
			fmt.Sprintf("running %.0f (median), %.0f output tok/s", res.running, res.tokPerSec))
	}
	tw.Flush()
	if !ok {
		return errors.New("the simulator is over its CPU budget")
	}
	return nil
}

func cpuSelf() time.Duration {
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// idleCost runs n simulators with their HTTP servers in this process and
// measures the process's CPU while nothing calls them.
func idleCost(ctx context.Context, p vllmsim.Profile, n int, window time.Duration) (float64, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var wg sync.WaitGroup
	defer wg.Wait()
	defer cancel()
	for range n {
		sim, err := vllmsim.New(vllmsim.Config{Profile: p, Speedup: 1})
		if err != nil {
			return 0, err
		}
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return 0, err
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			_ = serve(ctx, ln, sim, sim.Run)
		}()
	}
	time.Sleep(time.Second) // let start-up work settle before measuring
	c0, t0 := cpuSelf(), time.Now()
	select {
	case <-ctx.Done():
		return 0, ctx.Err()
	case <-time.After(window):
	}
	return float64(cpuSelf()-c0) / float64(time.Since(t0)), nil
}

type loadResult struct {
	cpu, running, tokPerSec float64
}

// loadCost starts `kvgate sim` as a child process, keeps seqs requests in
// flight against it, and measures the child's CPU over the window.
func loadCost(ctx context.Context, p vllmsim.Profile, seqs int, stream bool, window time.Duration) (loadResult, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	exe, err := os.Executable()
	if err != nil {
		return loadResult{}, err
	}
	port, err := freePort()
	if err != nil {
		return loadResult{}, err
	}
	cmd := exec.Command(exe, "sim", "--profile", p.Name, "--port", strconv.Itoa(port), "--speedup", "1")
	cmd.Stdout, cmd.Stderr = io.Discard, io.Discard
	if err := cmd.Start(); err != nil {
		return loadResult{}, err
	}
	defer func() {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		_ = cmd.Wait()
	}()
	base := fmt.Sprintf("http://127.0.0.1:%d", port)
	if err := waitHealthy(ctx, base); err != nil {
		return loadResult{}, err
	}

	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: seqs, MaxConnsPerHost: seqs}}
	var wg sync.WaitGroup
	defer wg.Wait()
	defer cancel()
	for i := range seqs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for n := 0; ctx.Err() == nil; n++ {
				// Distinct ~500-token prompts, 1,024 output tokens each:
				// 256 of them hold ~390k of the H100's 440k KV tokens.
				prompt := strings.Repeat(fmt.Sprintf(" seq%d run%d abc def", i, n), 100)
				body := fmt.Sprintf(`{"prompt":%q,"max_tokens":1024,"ignore_eos":true,"stream":%v}`, prompt, stream)
				req, _ := http.NewRequestWithContext(ctx, http.MethodPost, base+"/v1/completions", strings.NewReader(body))
				req.Header.Set("Content-Type", "application/json")
				resp, err := client.Do(req)
				if err != nil {
					continue
				}
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
			}
		}()
	}

	// Ramp up: wait until the batch is full.
	for deadline := time.Now().Add(30 * time.Second); ; {
		if r, _ := scrapeValue(ctx, base, "vllm:num_requests_running"); r >= float64(seqs)*0.95 {
			break
		}
		if time.Now().After(deadline) {
			return loadResult{}, errors.New("the simulator never reached full load")
		}
		time.Sleep(100 * time.Millisecond)
	}
	gen0, _ := scrapeValue(ctx, base, "vllm:generation_tokens_total")
	c0, err := procCPU(cmd.Process.Pid)
	if err != nil {
		return loadResult{}, err
	}
	t0 := time.Now()
	var running []float64
	for time.Since(t0) < window {
		time.Sleep(250 * time.Millisecond)
		if r, err := scrapeValue(ctx, base, "vllm:num_requests_running"); err == nil {
			running = append(running, r)
		}
	}
	c1, err := procCPU(cmd.Process.Pid)
	if err != nil {
		return loadResult{}, err
	}
	el := time.Since(t0)
	gen1, _ := scrapeValue(ctx, base, "vllm:generation_tokens_total")
	slices.Sort(running)
	res := loadResult{cpu: float64(c1-c0) / float64(el), tokPerSec: (gen1 - gen0) / el.Seconds()}
	if len(running) > 0 {
		res.running = running[len(running)/2]
	}
	return res, nil
}

func freePort() (int, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port, nil
}

func waitHealthy(ctx context.Context, base string) error {
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, base+"/health", nil)
		if resp, err := http.DefaultClient.Do(req); err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
		}
	}
	return fmt.Errorf("simulator at %s did not become healthy", base)
}

// scrapeValue reads the first sample of a metric from a /metrics page; it
// is enough for the simulator's single-series gauges and counters.
func scrapeValue(ctx context.Context, base, name string) (float64, error) {
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, base+"/metrics", nil)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		line := sc.Text()
		if strings.HasPrefix(line, name+"{") || strings.HasPrefix(line, name+" ") {
			f := strings.Fields(line)
			return strconv.ParseFloat(f[len(f)-1], 64)
		}
	}
	return 0, fmt.Errorf("no %s in /metrics", name)
}

// procCPU reads a process's user plus system CPU time from /proc.
func procCPU(pid int) (time.Duration, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, fmt.Errorf("read process CPU (Linux /proc needed): %w", err)
	}
	// Fields after the command name, which is in parentheses and may hold spaces.
	f := strings.Fields(string(b[strings.LastIndexByte(string(b), ')')+2:]))
	utime, _ := strconv.ParseInt(f[11], 10, 64)
	stime, _ := strconv.ParseInt(f[12], 10, 64)
	const clkTck = 100 // USER_HZ on Linux
	return time.Duration(utime+stime) * time.Second / clkTck, nil
}
