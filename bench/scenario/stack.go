package scenario

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvgate/kvgate/bench/baseline"
	"github.com/kvgate/kvgate/bench/vllmsim"
	"github.com/kvgate/kvgate/gateway"
	"github.com/kvgate/kvgate/gpu"
	"github.com/kvgate/kvgate/scheduler"
	"github.com/kvgate/kvgate/store/sqlite"
)

// The targets every scenario compares, in the order the verdict shows them.
const (
	TargetKVGate     = "kvgate"
	TargetRoundRobin = "round-robin"
	TargetThreshold  = "threshold"
	// TargetPrefix is the llm-d-style router: approximate prefix scorer
	// plus load scorers, max-score pick, no queueing (baseline.Prefix).
	TargetPrefix = "prefix"
)

// Targets are the names of the compared targets.
var Targets = []string{TargetKVGate, TargetRoundRobin, TargetThreshold, TargetPrefix}

// baselines are the targets kvgate's ratios are taken against.
var baselines = []string{TargetRoundRobin, TargetThreshold, TargetPrefix}

// fleetSpec is the simulated fleet a scenario runs on.
type fleetSpec struct {
	profile  vllmsim.Profile
	backends int
	speedup  float64
	seed     uint64
}

// stack is one target in front of a fleet of its own: every target gets a
// fresh fleet (empty caches, zeroed counters, no leftover requests), so no
// run can disturb the next one. Runs are sequential: on a small machine,
// two fleets at once would take CPU from each other.
type stack struct {
	target  string
	url     string   // base URL clients call, without /v1
	metrics []string // /metrics URLs a run's report follows
	// gatewayMetrics is kvgate's own /metrics, or "".
	gatewayMetrics string
	backends       []string // the simulated servers' base URLs
	sims           []*vllmsim.Sim
	jobs           bool                 // the target serves POST /v1/jobs
	sched          *scheduler.Scheduler // kvgate's, or nil

	// isReady reports whether the target can route to every backend.
	isReady func(ctx context.Context) bool

	runCtx  context.Context
	cancel  context.CancelFunc
	wg      sync.WaitGroup
	servers []*http.Server
	closers []io.Closer
	mu      sync.Mutex
	errs    []error
}

// wall turns a duration meant in real time into the wall time it takes on
// a fleet whose clock runs speedup times faster, never under floor: every
// timer of a target (scrapes, probes, queue waits) keeps its real-time
// meaning against the simulated GPUs.
func wall(d time.Duration, speedup float64, floor time.Duration) time.Duration {
	if speedup > 1 {
		d = time.Duration(float64(d) / speedup)
	}
	return max(d, floor)
}

// startStack starts a fresh fleet and target in front of it. keys maps API
// keys to tenants for kvgate (the baselines pass the header through).
func startStack(ctx context.Context, target string, spec fleetSpec, keys map[string]string, dataDir string, log *slog.Logger) (_ *stack, err error) {
	ctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	s := &stack{target: target, runCtx: ctx, cancel: cancel}
	s.isReady = s.answersModels
	defer func() {
		if err != nil {
			_ = s.stop()
		}
	}()
	for i := range spec.backends {
		// One seed for all backends: replicas of one model answer one
		// prompt alike.
		sim, err := vllmsim.New(vllmsim.Config{Profile: spec.profile, Speedup: spec.speedup, Seed: spec.seed})
		if err != nil {
			return nil, err
		}
		url, err := s.serve(sim)
		if err != nil {
			return nil, err
		}
		s.run(fmt.Sprintf("sim%d", i), sim.Run)
		s.sims, s.backends = append(s.sims, sim), append(s.backends, url)
	}
	var h http.Handler
	switch target {
	case TargetKVGate:
		h, err = s.startKVGate(ctx, spec, keys, dataDir, log)
		s.jobs = true
	case TargetRoundRobin:
		h, err = baseline.NewRoundRobin(s.backends)
	case TargetThreshold:
		var th *baseline.Threshold
		th, err = baseline.NewThreshold(s.backends, baseline.ThresholdConfig{
			ScrapeInterval: wall(50*time.Millisecond, spec.speedup, 5*time.Millisecond),
			Staleness:      200 * time.Millisecond, // see startKVGate's StaleAfter
			HealthInterval: wall(time.Second, spec.speedup, 20*time.Millisecond),
		})
		if err == nil {
			if err = th.Refresh(ctx); err == nil {
				s.run("threshold", th.Run)
			}
		}
		h = th
	case TargetPrefix:
		var pr *baseline.Prefix
		pr, err = baseline.NewPrefix(s.backends, baseline.PrefixConfig{Threshold: baseline.ThresholdConfig{
			ScrapeInterval: wall(50*time.Millisecond, spec.speedup, 5*time.Millisecond),
			Staleness:      200 * time.Millisecond,
			HealthInterval: wall(time.Second, spec.speedup, 20*time.Millisecond),
		}})
		if err == nil {
			if err = pr.Refresh(ctx); err == nil {
				s.run("prefix", pr.Run)
			}
		}
		h = pr
	default:
		err = fmt.Errorf("unknown target %q (have %v)", target, Targets)
	}
	if err != nil {
		return nil, err
	}
	if s.url, err = s.serve(h); err != nil {
		return nil, err
	}
	for _, b := range s.backends {
		s.metrics = append(s.metrics, b+"/metrics")
	}
	if target == TargetKVGate {
		s.gatewayMetrics = s.url + "/metrics"
		s.metrics = append(s.metrics, s.gatewayMetrics)
	}
	return s, s.ready(ctx)
}

// startKVGate wires kvgate as `kvgate serve` does: a backend pool, the
// scheduler, the API with durable jobs on SQLite, and the job runner.
func (s *stack) startKVGate(ctx context.Context, spec fleetSpec, keys map[string]string, dataDir string, log *slog.Logger) (http.Handler, error) {
	var cfgs []gpu.BackendConfig
	for i, u := range s.backends {
		cfgs = append(cfgs, gpu.BackendConfig{Name: fmt.Sprintf("sim%d", i), URL: u, MaxNumSeqs: spec.profile.MaxNumSeqs})
	}
	var (
		sched  *scheduler.Scheduler
		runner *scheduler.Runner
	)
	pool, err := gpu.NewPool(cfgs, gpu.PoolConfig{
		ScrapeInterval: wall(100*time.Millisecond, spec.speedup, 10*time.Millisecond),
		// Staleness bounds keep their wall-clock defaults: scaled down,
		// a busy host's scheduling jitter would read as dead metrics.
		StaleAfter: time.Second,
		// A fleet sped up decodes that much faster per wall second.
		MaxDecodeRate: gpu.DefaultMaxDecodeRate * max(1, spec.speedup),
		ProbeInterval: wall(time.Second, spec.speedup, 20*time.Millisecond),
		EjectBase:     wall(2*time.Second, spec.speedup, 50*time.Millisecond),
		EjectMax:      wall(time.Minute, spec.speedup, time.Second),
		Logger:        log,
		OnChange: func() {
			if sched != nil {
				sched.Wake()
			}
		},
	})
	if err != nil {
		return nil, err
	}
	sched, err = scheduler.New(pool, scheduler.Options{Logger: log, Policy: scheduler.Policy{
		MaxQueueWait:    wall(30*time.Second, spec.speedup, time.Second),
		StarvationGuard: wall(2*time.Second, spec.speedup, 50*time.Millisecond),
	}})
	if err != nil {
		return nil, err
	}
	s.sched = sched
	if err := os.MkdirAll(dataDir, 0o750); err != nil {
		return nil, err
	}
	st, err := sqlite.Open(ctx, filepath.Join(dataDir, "jobs.db"))
	if err != nil {
		return nil, err
	}
	s.closers = append(s.closers, st)
	if _, err := sqlite.Migrate(ctx, st); err != nil {
		return nil, err
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(sched.Collectors()...)
	api, err := gateway.New(gateway.Config{
		APIKeys: keys, Dev: len(keys) == 0,
		Jobs: gateway.Jobs{Store: st, Wake: func() {
			if runner != nil {
				runner.Wake()
			}
		}},
	}, pool, sched, reg, log)
	if err != nil {
		return nil, err
	}
	runner = scheduler.NewRunner(st, sched, api, scheduler.RunnerConfig{
		Concurrency: 256,
		Lease:       wall(time.Minute, spec.speedup, 5*time.Second),
		Poll:        wall(500*time.Millisecond, spec.speedup, 20*time.Millisecond),
		ReapEvery:   wall(5*time.Second, spec.speedup, 100*time.Millisecond),
		Backoff:     scheduler.Backoff{Base: wall(time.Second, spec.speedup, 20*time.Millisecond), Max: wall(30*time.Second, spec.speedup, 200*time.Millisecond)},
		Logger:      log,
	})
	reg.MustRegister(runner.Collectors()...)
	s.isReady = func(context.Context) bool {
		now := time.Now()
		for _, sn := range pool.Snapshots() {
			if !sn.Routable() || sn.Stale(now) || len(sn.Models) == 0 {
				return false
			}
		}
		return true
	}
	s.run("pool", pool.Run)
	s.run("scheduler", sched.Run)
	s.run("runner", runner.Run)
	s.run("batches", api.RunBatches)
	return api, nil
}

// serve serves h on a loopback port until the stack stops.
func (s *stack) serve(h http.Handler) (string, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second}
	s.servers = append(s.servers, srv)
	s.wg.Go(func() {
		if err := srv.Serve(ln); !errors.Is(err, http.ErrServerClosed) {
			s.fail(err)
		}
	})
	return "http://" + ln.Addr().String(), nil
}

// run runs a component until the stack stops.
func (s *stack) run(name string, f func(context.Context) error) {
	s.wg.Go(func() {
		if err := f(s.runCtx); err != nil && !errors.Is(err, context.Canceled) {
			s.fail(fmt.Errorf("%s: %w", name, err))
		}
	})
}

func (s *stack) fail(err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.errs = append(s.errs, err)
}

// ready waits until the target can route to its backends.
func (s *stack) ready(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	for !s.isReady(ctx) {
		select {
		case <-ctx.Done():
			return fmt.Errorf("%s never became ready", s.target)
		case <-tick.C:
		}
	}
	return nil
}

// answersModels reports whether the target answers GET /v1/models.
func (s *stack) answersModels(ctx context.Context) bool {
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, s.url+"/v1/models", nil)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return false
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return resp.StatusCode == http.StatusOK
}

// stop stops the target and its fleet (open connections are cut) and
// returns what failed while they ran.
func (s *stack) stop() error {
	for _, srv := range s.servers {
		_ = srv.Close()
	}
	s.cancel()
	s.wg.Wait()
	for _, c := range s.closers {
		if err := c.Close(); err != nil {
			s.fail(err)
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return errors.Join(s.errs...)
}
