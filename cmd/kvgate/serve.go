package main

import (
	"context"
	"crypto/tls"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"sync/atomic"
	"text/tabwriter"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"golang.org/x/sync/errgroup"

	"github.com/kvgate/kvgate/bench/vllmsim"
	"github.com/kvgate/kvgate/gateway"
	"github.com/kvgate/kvgate/gpu"
	"github.com/kvgate/kvgate/scheduler"
)

func runServe(ctx context.Context, args []string, getenv func(string) string, stdout, stderr io.Writer) error {
	cfg, log, err := parseConfig("serve", "Serves the OpenAI-compatible API in front of vLLM backends. "+
		"With no backend configured, starts simulated ones in-process.", args, getenv, stderr)
	if err != nil {
		return err
	}
	keys, operators, err := cfg.keyMaps()
	if err != nil {
		return err
	}
	if cfg.Store == "" || cfg.NATS.URL == "" {
		// The embedded store or JetStream keeps its files there.
		lock, err := lockDataDir(cfg.DataDir)
		if err != nil {
			return err
		}
		defer lock.Close()
	}
	// The certificate's reloader lives as long as serve, drain included.
	reloadCtx, stopReload := context.WithCancel(context.WithoutCancel(ctx))
	defer stopReload()
	tlsConf, err := listenerTLS(reloadCtx, cfg, log)
	if err != nil {
		return err
	}
	natsOpts, err := natsOptions(cfg)
	if err != nil {
		return err
	}
	ln, err := net.Listen("tcp", cfg.Addr)
	if err != nil {
		return err
	}
	// The components outlive ctx, the first signal: the drain needs the
	// backends, the scheduler and the broker until the requests and jobs
	// in flight have ended. serveAPI ends them after the drain.
	life, cancel := context.WithCancel(context.WithoutCancel(ctx))
	defer cancel()
	g, gctx := errgroup.WithContext(life)
	// fail undoes a half-started server: the listener, and whatever g runs.
	fail := func(err error) error {
		ln.Close()
		cancel()
		_ = g.Wait()
		return err
	}
	simulated := len(cfg.Backends) == 0
	if simulated {
		urls, err := startSimFleet(gctx, g, cfg, log)
		if err != nil {
			return fail(err)
		}
		for _, u := range urls {
			cfg.Backends = append(cfg.Backends, gpu.BackendConfig{URL: u})
		}
	}

	stopTracing, err := setupTracing(cfg, log)
	if err != nil {
		return fail(err)
	}
	defer func() {
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		if err := stopTracing(sctx); err != nil {
			log.Warn("tracing: spans not flushed at shutdown", "err", err)
		}
	}()

	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	reg.MustRegister(buildInfoCollector())
	nv := openNVML(cfg, log)
	if nv != nil {
		reg.MustRegister(nv.Collector())
		g.Go(func() error { return ignoreCanceled(nv.Run(gctx)) })
	}

	var sched *scheduler.Scheduler
	pool, err := gpu.NewPool(cfg.Backends, gpu.PoolConfig{
		ScrapeInterval: cfg.Metrics.ScrapeInterval, StaleAfter: cfg.Metrics.StaleAfter,
		ProbeInterval: cfg.Metrics.ProbeInterval, NVML: nv, Logger: log,
		OnChange: func() {
			if sched != nil {
				sched.Wake()
			}
		},
	})
	if err != nil {
		return fail(err)
	}
	sched, err = scheduler.New(pool, scheduler.Options{Policy: cfg.Admission, Logger: log})
	if err != nil {
		return fail(err)
	}
	reg.MustRegister(sched.Collectors()...)
	st, loc, applied, err := openStore(gctx, cfg.Store, cfg.DataDir, !cfg.NoMigrate)
	if err != nil {
		return fail(fmt.Errorf("job store: %w", err))
	}
	defer st.Close()
	log.Info("job store open", "kind", loc.Kind, "store", redact(loc), "migrations_applied", applied)
	// The inbox may wake the runner before it exists (it replays the
	// stream's backlog at once): the runner is published atomically.
	var runnerPtr atomic.Pointer[scheduler.Runner]
	wakeRunner := func() {
		if r := runnerPtr.Load(); r != nil {
			r.Wake()
		}
	}
	// The durable path's gauges, read on a period (never per scrape),
	// and the completion histogram, fed by the inbox.
	var sig *scheduler.Broker
	durable := scheduler.NewDurableMetrics(scheduler.DurableMetricsConfig{
		Store: st, Every: cfg.Metrics.BacklogInterval, Logger: log, Tenants: cfg.tenants(),
		Pending: func(ctx context.Context) (uint64, bool, error) { return sig.InboxPending(ctx) },
	})
	sig, err = scheduler.StartBroker(st, sched, scheduler.BrokerConfig{
		OnEvent: durable.ObserveEvent, Options: natsOpts,
		URL: cfg.NATS.URL, DataDir: cfg.DataDir, Replicas: cfg.NATS.Replicas,
		Wake: wakeRunner, ApplyCooldown: pool.CooldownURL, Registerer: reg, Logger: log,
	})
	if err != nil {
		return fail(fmt.Errorf("signals: %w", err))
	}
	g.Go(func() error { return sig.Run(gctx) })
	reg.MustRegister(durable.Collectors()...)
	g.Go(func() error { return ignoreCanceled(durable.Run(gctx)) })
	hooks, guard, err := cfg.webhookDispatcher(st, reg, log) // webhooks.go
	if err != nil {
		return fail(err)
	}
	api, err := gateway.New(gateway.Config{
		Webhooks: gateway.Webhooks{Store: st, Guard: guard, Wake: hooks.Wake},
		APIKeys:  keys, OperatorKeys: operators, MaxBodyBytes: cfg.Gateway.MaxBodyBytes, MaxAnswerBytes: cfg.Gateway.MaxAnswerBytes, TenantFileBytes: cfg.Gateway.TenantFileBytes, DefaultMaxTokens: cfg.Gateway.DefaultMaxTokens,
		TokenCount: cfg.Gateway.TokenCount, Retries: cfg.Gateway.Retries, StreamIdleTimeout: cfg.Gateway.StreamIdleTimeout,
		RequestTimeout: cfg.Gateway.RequestTimeout, OnCooldown: sig.Cooldown,
		AdminKeys: cfg.adminKeys(), AccessLog: cfg.AccessLog, Version: readBuildInfo().Version,
		ConsoleSecret: cfg.Console.SessionSecret, ConsoleSessionTTL: cfg.Console.SessionTTL, ConsoleSecureCookies: cfg.Console.SecureCookies, Backlog: durable.Backlog,
		Dev:    cfg.Dev,
		Models: cfg.aliases(), Prices: cfg.Prices, Currency: cfg.Currency,
		Tenants: gateway.Tenants{Store: st, FailOpen: cfg.Quotas.FailOpen, CacheTTL: cfg.Quotas.CacheTTL},
		Jobs: gateway.Jobs{
			Store: st, MaxAttempts: cfg.Jobs.MaxAttempts, DefaultDeadline: cfg.Jobs.DefaultDeadline,
			Feed: sig.Feed,
			Wake: func() { wakeRunner(); sig.Relay.Wake() },
		},
	}, pool, sched, reg, log)
	if err != nil {
		return fail(err)
	}
	runner := scheduler.NewRunner(st, sched, api, scheduler.RunnerConfig{
		Concurrency: cfg.Jobs.Concurrency, Lease: cfg.Jobs.Lease, Logger: log,
		OnEvents: sig.Relay.Wake,
	})
	runnerPtr.Store(runner)
	reg.MustRegister(runner.Collectors()...)
	pruner := scheduler.NewPruner(st, scheduler.RetentionConfig{Retention: cfg.Jobs.Retention, Logger: log})
	reg.MustRegister(pruner.Collectors()...)

	g.Go(func() error { return ignoreCanceled(pool.Run(gctx)) })
	g.Go(func() error { return ignoreCanceled(sched.Run(gctx)) })
	g.Go(func() error { return ignoreCanceled(pruner.Run(gctx)) })
	g.Go(func() error { hooks.Run(gctx); return nil })
	// The runner's context is its own: the drain ends it, not the signal.
	jobsCtx, stopJobs := context.WithCancel(gctx)
	defer stopJobs()
	jobsDone := make(chan struct{})
	g.Go(func() error {
		defer close(jobsDone)
		return ignoreCanceled(runner.Run(jobsCtx))
	})
	// The batch worker (validation, finalization) is leased work too.
	g.Go(func() error { return ignoreCanceled(api.RunBatches(jobsCtx)) })
	g.Go(func() error {
		err := serveAPI(ctx, gctx, ln, api, drainConfig{
			timeout: cfg.DrainTimeout, unready: *cfg.DrainUnreadyDelay, jobs: runner, stopJobs: stopJobs, jobsDone: jobsDone, log: log,
			tls: tlsConf,
		})
		cancel() // the rest goes with the API
		return err
	})

	addr := ln.Addr().String()
	log.Info("kvgate serving", "addr", addr, "backends", len(cfg.Backends), "auth", len(keys)+len(operators) > 0,
		"admin_key", cfg.AdminKey != "", "quota_fail_open", cfg.Quotas.FailOpen)
	auth := ""
	if !api.DevOpen(ctx) {
		auth = " -H 'Authorization: Bearer YOUR_KEY'"
	}
	scheme, insecure := "http", ""
	if tlsConf != nil {
		scheme, insecure = "https", " --cacert CA.pem"
	}
	fmt.Fprintf(stdout, "kvgate is serving the OpenAI API on %s://%s/v1\n", scheme, addr)
	try := func(model string) {
		if model == "" {
			fmt.Fprintf(stdout, "try: curl -s%s %s://%s/v1/models%s (no backend has listed a model yet)\n", insecure, scheme, addr, auth)
			return
		}
		if p, err := vllmsim.LookupProfile(cfg.Sim.Profile); simulated && err == nil && p.Embedding {
			fmt.Fprintf(stdout, "try: curl -s%s %s://%s/v1/embeddings%s -H 'Content-Type: application/json' "+
				"-d '{\"model\":\"%s\",\"input\":\"Hello\"}'\n", insecure, scheme, addr, auth, model)
			return
		}
		fmt.Fprintf(stdout, "try: curl -s%s %s://%s/v1/chat/completions%s -H 'Content-Type: application/json' "+
			"-d '{\"model\":\"%s\",\"messages\":[{\"role\":\"user\",\"content\":\"Hello\"}],\"max_tokens\":16}'\n", insecure, scheme, addr, auth, model)
	}
	// The example names a model the backends serve: the simulator's, a
	// backend's configured one, or the first the fleet lists once a
	// backend answers.
	if model := tryModel(cfg, simulated); model != "" {
		try(model)
	} else {
		g.Go(func() error {
			t := time.NewTicker(100 * time.Millisecond)
			defer t.Stop()
			for deadline := time.Now().Add(15 * time.Second); time.Now().Before(deadline); {
				if ms := pool.Models(); len(ms) > 0 {
					try(ms[0].ID)
					return nil
				}
				select {
				case <-gctx.Done():
					return nil
				case <-t.C:
				}
			}
			try("")
			return nil
		})
	}
	return g.Wait()
}

// parseConfig parses the flags that serve and gpus share and builds the
// configuration and the logger.
func parseConfig(cmd, about string, args []string, getenv func(string) string, stderr io.Writer) (*config, *slog.Logger, error) {
	fs := flag.NewFlagSet("kvgate "+cmd, flag.ContinueOnError)
	fs.SetOutput(stderr)
	var cf configFlags
	cf.register(fs)
	fs.Usage = func() {
		fmt.Fprintf(stderr, "Usage: kvgate %s [flags]\n\n%s\n\nFlags:\n", cmd, about)
		fs.PrintDefaults()
	}
	if err := parseFlags(fs, args); err != nil {
		return nil, nil, err
	}
	cfg, err := cf.load(fs, getenv)
	if err != nil {
		return nil, nil, err
	}
	log, err := newLogger(stderr, cfg.LogLevel, cfg.LogFormat)
	if err != nil {
		return nil, nil, err
	}
	for _, n := range cf.notices {
		log.Warn("configuration: " + n)
	}
	return cfg, log, nil
}

// drainConfig is what serveAPI needs for the drain.
type drainConfig struct {
	timeout  time.Duration
	unready  time.Duration        // /readyz fails this long before requests are refused
	jobs     interface{ Drain() } // the runner: stops claiming new jobs
	stopJobs func()               // ends the runner's context
	jobsDone <-chan struct{}      // closed once the runner has returned
	log      *slog.Logger
	tls      *tls.Config // HTTPS when set
}

// serveAPI serves the API on ln until ctx ends (the first signal), then
// drains: it logs "draining" with the timeout, the gateway refuses new
// requests with 503 and fails /readyz (see gateway.Server.Drain), the
// runner stops claiming jobs, and the requests and streams in flight get
// until the timeout to finish; at the timeout they are ended, each with an
// error its client can read. Then the runner's context ends (a job still
// running is handed back for another process, without spending an
// attempt) and serveAPI returns once the runner has. When life ends first
// (a component failed), it stops at once.
func serveAPI(ctx, life context.Context, ln net.Listener, api *gateway.Server, d drainConfig) error {
	srv := &http.Server{Handler: api, ReadHeaderTimeout: 10 * time.Second, TLSConfig: d.tls,
		// Failed handshakes and the like: the client's trouble, at debug.
		ErrorLog: slog.NewLogLogger(d.log.Handler(), slog.LevelDebug)}
	served := make(chan error, 1)
	go func() {
		if d.tls != nil {
			served <- srv.ServeTLS(ln, "", "") // the certificate comes from TLSConfig.GetCertificate
			return
		}
		served <- srv.Serve(ln)
	}()
	select {
	case err := <-served:
		d.stopJobs()
		return err
	case <-life.Done():
		_ = srv.Close()
		<-served
		d.stopJobs()
		return nil
	case <-ctx.Done():
	}
	start := time.Now()
	d.log.Info("draining", "timeout", d.timeout, "unready_first", d.unready)
	srv.SetKeepAlivesEnabled(false) // each answer closes its connection: clients reconnect elsewhere
	d.jobs.Drain()
	drainCtx, cancel := context.WithTimeout(life, d.timeout)
	defer cancel()
	// /readyz fails first, while requests are still served, so that a
	// load balancer moves away before this replica refuses anything.
	api.Unready()
	select {
	case <-time.After(d.unready):
	case <-drainCtx.Done():
	}
	if n := api.Drain(drainCtx); n > 0 {
		d.log.Warn("drain timeout: ended requests still running", "requests", n, "timeout", d.timeout)
	}
	// Jobs in flight get what is left of the drain: the runner returns by
	// itself once its last one has ended; at the deadline the rest go back
	// to the store, spending no attempt.
	select {
	case <-d.jobsDone:
	case <-drainCtx.Done():
		d.log.Warn("drain timeout: handing the jobs still running back to the store")
	}
	d.stopJobs()
	<-d.jobsDone
	// Long enough for the last permits' releases, written behind their
	// requests, to end by their own bound (10 s) before the store closes:
	// cut sooner, they failed on a closed store, the usage unrecorded.
	shut, cancelShut := context.WithTimeout(context.WithoutCancel(ctx), 11*time.Second)
	defer cancelShut()
	api.SettleUsage(shut) // the last attempts' permits, written behind them
	if err := srv.Shutdown(shut); err != nil {
		_ = srv.Close()
	}
	<-served
	d.log.Info("drained", "took", time.Since(start).Round(time.Millisecond))
	return nil
}

func ignoreCanceled(err error) error {
	if errors.Is(err, context.Canceled) {
		return nil
	}
	return err
}

// openNVML opens NVML unless configured off (nil then). Without the
// library it comes back disabled, having said so once in the log.
func openNVML(cfg *config, log *slog.Logger) *gpu.NVML {
	if cfg.NVML.Disabled {
		return nil
	}
	return gpu.OpenNVML(nil, gpu.NVMLConfig{Interval: cfg.NVML.Interval, Logger: log})
}

// startSimFleet starts the development fleet: simulated vLLM servers on
// loopback ports, run by g until its context ends.
func startSimFleet(ctx context.Context, g *errgroup.Group, cfg *config, log *slog.Logger) ([]string, error) {
	p, err := vllmsim.LookupProfile(cfg.Sim.Profile)
	if err != nil {
		return nil, err
	}
	var urls []string
	for range max(cfg.Sim.Count, 1) {
		// One seed for all: the same model answers the same prompt alike
		// on every backend, as real replicas of one model do.
		sim, err := vllmsim.New(vllmsim.Config{Profile: p, Speedup: cfg.Sim.Speedup, Logger: log})
		if err != nil {
			return nil, err
		}
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, err
		}
		g.Go(func() error { return serve(ctx, ln, sim, sim.Run) })
		urls = append(urls, "http://"+ln.Addr().String())
	}
	log.Info("no backend configured: started simulated vLLM servers", "count", len(urls), "profile", p.Name,
		"speedup", cfg.Sim.Speedup, "urls", strings.Join(urls, ","))
	return urls, nil
}

// runGPUs prints the machine's GPUs and the configured backends with their
// live capacity.
func runGPUs(ctx context.Context, args []string, getenv func(string) string, stdout, stderr io.Writer) error {
	cfg, log, err := parseConfig("gpus", "Prints the GPUs (through NVML) and the configured backends with their live KV capacity.",
		args, getenv, stderr)
	if err != nil {
		return err
	}
	nv := openNVML(cfg, log) // its first read, bounded
	tw := tabwriter.NewWriter(stdout, 0, 0, 2, ' ', 0)
	switch {
	case !gpu.NVMLBuilt:
		fmt.Fprintln(tw, "GPUs: NVML is not available: this kvgate was built without cgo (make build has it)")
	case nv == nil:
		fmt.Fprintln(tw, "GPUs: not read (nvml.disabled is set)")
	case !nv.Enabled():
		fmt.Fprintln(tw, "GPUs: NVML is not available on this machine")
	case nv.GPUs() == nil:
		fmt.Fprintf(tw, "GPUs (driver %s): the driver has not answered the first read; a GPU may be hung (see the log)\n", nv.Driver())
	default:
		fmt.Fprintf(tw, "GPUs (driver %s)\n", nv.Driver())
		fmt.Fprintln(tw, "INDEX\tNAME\tUUID\tMEMORY USED/TOTAL\tUTIL\tTEMP\tPOWER/LIMIT\tTHROTTLE\tECC (CORR/UNCORR)\tHEALTH")
		for _, g := range nv.GPUs() {
			health := g.Health.String()
			if len(g.Reasons) > 0 {
				health += " (" + strings.Join(g.Reasons, "; ") + ")"
			}
			fmt.Fprintf(tw, "%d\t%s\t%s\t%.1f/%.1f GiB\t%d%%\t%d C\t%.0f/%.0f W\t%s\t%d/%d\t%s\n",
				g.Index, g.Name, g.UUID, gib(g.MemoryUsed), gib(g.MemoryTotal), g.UtilGPU, g.TemperatureC,
				g.PowerW, g.PowerLimitW, strings.Join(g.Throttle, ","), g.ECCCorrected, g.ECCUncorrected, health)
		}
	}
	fmt.Fprintln(tw)
	if len(cfg.Backends) == 0 {
		fmt.Fprintln(tw, "Backends: none configured (kvgate serve would start simulated ones)")
		return tw.Flush()
	}
	pool, err := gpu.NewPool(cfg.Backends, gpu.PoolConfig{NVML: nv, Logger: log, StaleAfter: 5 * time.Second})
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	pool.Probe(ctx)
	pool.Scrape(ctx)
	fmt.Fprintln(tw, "BACKEND\tURL\tMODELS\tKV CAPACITY\tKV USED\tRUNNING\tWAITING\tHEALTH\tGPUS")
	now := time.Now()
	for i, s := range pool.Snapshots() { // in the configuration's order
		var models []string
		for _, m := range s.Models {
			models = append(models, fmt.Sprintf("%s (%d)", m.ID, m.MaxModelLen))
		}
		health := "ok"
		switch {
		case s.Stale(now):
			health = "unreachable: " + s.ScrapeErr
		case !s.Routable():
			health = "not routable " + s.HealthErr
		}
		used := "-" // not published
		if s.Metrics.HasKVUsage {
			used = fmt.Sprintf("%.1f%%", 100*s.Metrics.KVUsage)
		}
		gpus := "-" // none named: their health is not read
		if ids := cfg.Backends[i].GPUs; len(ids) > 0 {
			gpus = fmt.Sprintf("%s (%s)", strings.Join(ids, ","), s.GPUHealth)
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%d tokens\t%s\t%.0f\t%.0f\t%s\t%s\n", s.Name, s.URL, strings.Join(models, ", "),
			s.CapacityTokens, used, s.Metrics.Running, s.Metrics.Waiting, health, gpus)
	}
	return tw.Flush()
}

func gib(b uint64) float64 { return float64(b) / (1 << 30) }

var _ http.Handler = (*gateway.Server)(nil)

// tryModel is the model of start-up's example request when it is known
// before any backend answers: the simulator profile's, or the first a
// configured backend lists.
func tryModel(cfg *config, simulated bool) string {
	if simulated {
		if p, err := vllmsim.LookupProfile(cfg.Sim.Profile); err == nil {
			return p.Model
		}
		return ""
	}
	for _, b := range cfg.Backends {
		if len(b.Models) > 0 {
			return b.Models[0]
		}
	}
	return ""
}
