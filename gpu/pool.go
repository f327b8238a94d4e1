package gpu

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/url"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// BackendConfig describes one vLLM server.
type BackendConfig struct {
	Name string `yaml:"name" json:"name"`
	URL  string `yaml:"url" json:"url"` // base URL, e.g. http://10.0.0.5:8000
	// Models names the models the server serves: kvgate knows them
	// before the server first answers /v1/models (a request for one while
	// the server is down is answered 503, not 404, and /v1/models lists
	// them), and serves only these of what the server lists. Empty means
	// all of the server's /v1/models, known once it answers.
	Models []string `yaml:"models" json:"models,omitempty"`
	// GPUs are the NVML indexes or UUIDs the server runs on.
	GPUs []string `yaml:"gpus" json:"gpus,omitempty"`
	// MaxNumSeqs is the server's --max-num-seqs, which vLLM does not
	// publish; 256 by default.
	MaxNumSeqs int `yaml:"max_num_seqs" json:"max_num_seqs,omitempty"`
	// CapacityTokens is the KV capacity to assume when the server does not
	// publish vllm:cache_config_info.
	CapacityTokens int `yaml:"capacity_tokens" json:"capacity_tokens,omitempty"`
}

// PoolConfig tunes a Pool. Zero values take the defaults in brackets.
type PoolConfig struct {
	ScrapeInterval   time.Duration // /metrics period [100ms]
	StaleAfter       time.Duration // a snapshot older than this is stale [1s]
	ProbeInterval    time.Duration // /health period [1s]
	ProbeTimeout     time.Duration // how long one /health probe may take [ProbeInterval]
	DiscoverInterval time.Duration // /v1/models period [30s]
	EjectAfter       int           // consecutive failures that eject a backend [3]
	EjectBase        time.Duration // first ejection [2s], doubling per repeat
	EjectMax         time.Duration // longest ejection [1m]
	Client           *http.Client  // for scrapes and probes [a client with no retries]
	NVML             *NVML         // GPU health; nil or disabled means unknown
	Logger           *slog.Logger
	// MaxDecodeRate bounds the per-sequence decode rate that follows
	// non-streaming requests on a server without a step counter, in
	// output tokens per second [DefaultMaxDecodeRate]. A fleet whose
	// clock runs faster (the simulator's speed-up) scales it.
	MaxDecodeRate float64
	// OnChange is called, without locks held, after any snapshot changes;
	// the scheduler uses it to retry admission.
	OnChange func()
}

// Model is a model a backend serves.
type Model struct {
	ID          string
	MaxModelLen int
}

// Snapshot is a backend's state at one instant. It is immutable: the pool
// publishes a new one on each change.
type Snapshot struct {
	Name string
	URL  string

	Models []Model // empty until discovered
	// Configured are the model names the configuration gives the backend
	// (BackendConfig.Models); Discovered says /v1/models has answered.
	// Until it has, the backend may serve its configured models, or, with
	// none configured, any model (see MayServe).
	Configured []string
	Discovered bool

	Metrics   EngineMetrics
	ScrapedAt time.Time // zero: never scraped
	// ScrapeDone is when the page of ScrapedAt had come: the backend
	// wrote it at some moment between the two, so work sent after
	// ScrapedAt may be missing from it, and so may work that ended
	// before ScrapeDone.
	ScrapeDone time.Time
	ScrapeErr  string
	MaxNumSeqs int
	// CapacityTokens is num_gpu_blocks × block_size from the server, or the
	// configured fallback; 0 when neither is known.
	CapacityTokens int
	// PreemptionRate is preemptions per second between the last two scrapes.
	PreemptionRate float64
	// DecodeRate is output tokens per second per running sequence over
	// the last seconds of scrapes (at most a step a token, and at most
	// PoolConfig.MaxDecodeRate); 0 when unknown.
	DecodeRate float64
	// StepRate is engine steps per second, smoothed; 0 when unknown.
	StepRate float64

	Ejected      bool
	EjectedUntil time.Time
	// CoolingUntil is when a cooldown ends: the backend said it was
	// overloaded (429) and asked for a pause, here or on another replica.
	CoolingUntil time.Time
	// Failures counts dispatches in a row that failed, ProbeFailures
	// /health probes in a row. They are kept apart so that a backend that
	// answers /health but fails every request is still ejected.
	Failures      int
	ProbeFailures int
	HealthErr     string

	GPUHealth  Health
	GPUReasons []string
	GPUs       []GPU

	// StaleAfter is the staleness bound the snapshot is judged by.
	StaleAfter time.Duration
}

// Stale reports whether the snapshot's metrics are older than the
// staleness bound at now (or were never read).
func (s *Snapshot) Stale(now time.Time) bool {
	return s.ScrapedAt.IsZero() || now.Sub(s.ScrapedAt) > s.StaleAfter
}

// Age is how old the metrics are at now.
func (s *Snapshot) Age(now time.Time) time.Duration {
	if s.ScrapedAt.IsZero() {
		return -1
	}
	return now.Sub(s.ScrapedAt)
}

// Serves reports whether the backend serves model.
func (s *Snapshot) Serves(model string) (Model, bool) {
	for _, m := range s.Models {
		if m.ID == model {
			return m, true
		}
	}
	return Model{}, false
}

// MayServe reports whether the backend serves model or may once reached:
// after discovery, whether it serves it; before, whether the model is
// configured for it, or, with none configured, always, since its models
// are not known yet.
func (s *Snapshot) MayServe(model string) bool {
	if s.Discovered || len(s.Models) > 0 {
		_, ok := s.Serves(model)
		return ok
	}
	return len(s.Configured) == 0 || slices.Contains(s.Configured, model)
}

// Cooling reports whether the backend asked for a pause that lasts past now.
func (s *Snapshot) Cooling(now time.Time) bool { return now.Before(s.CoolingUntil) }

// Routable reports whether new work may go to the backend: models known,
// not ejected, GPUs not failed. Staleness is the scheduler's call.
func (s *Snapshot) Routable() bool {
	return len(s.Models) > 0 && !s.Ejected && s.GPUHealth != Failed
}

// Pool watches a fixed set of backends. Its methods are safe for concurrent
// use; Run does the watching.
type Pool struct {
	cfg      PoolConfig
	log      *slog.Logger
	backends []*backend
	byName   map[string]*backend
	models   atomic.Pointer[[]Model] // the union, rebuilt when discovery changes it
	unionMu  sync.Mutex              // serialises rebuilds, so an older union never lands last
	ejectMu  sync.Mutex              // serialises dispatch ejections (fail)
}

type backend struct {
	cfg  BackendConfig
	snap atomic.Pointer[Snapshot]
	mu   sync.Mutex // serialises snapshot updates
	// The fields below are guarded by mu. ejections counts ejections in
	// a row, for the backoff.
	ejections   int
	recoveredAt time.Time
	prevScrape  struct {
		at                             time.Time
		preemptions, generation, steps float64
	}
	decode rateSamples // for the decode rate (progress.go)
	// lastAnswer is when a dispatch last succeeded, in Unix nanoseconds
	// (liveness.go).
	lastAnswer atomic.Int64
	// noKVUsage: the last page had no KV cache usage (logged when it
	// begins).
	noKVUsage atomic.Bool
}

// Check refuses a configuration the pool cannot run well, its defaults
// filled in: scrapes as far apart as a view lasts. A view older than
// StaleAfter counts as saturated (and a scrape may take StaleAfter), so
// every backend would fall stale between two scrapes, and admission
// stall each time.
func (pc PoolConfig) Check() error {
	scrape, stale := cmp.Or(pc.ScrapeInterval, defaultScrapeInterval), cmp.Or(pc.StaleAfter, defaultStaleAfter)
	if scrape >= stale {
		return fmt.Errorf("metrics: scrape_interval %s must be shorter than stale_after %s (a few intervals, to ride out a late scrape)", scrape, stale)
	}
	return nil
}

const (
	defaultScrapeInterval = 100 * time.Millisecond
	defaultStaleAfter     = time.Second
)

// NewPool returns a pool for the given backends. Names default to the
// URL's host; names and URLs must be unique and URLs absolute.
func NewPool(cfgs []BackendConfig, pc PoolConfig) (*Pool, error) {
	pc.ScrapeInterval = cmp.Or(pc.ScrapeInterval, defaultScrapeInterval)
	pc.StaleAfter = cmp.Or(pc.StaleAfter, defaultStaleAfter)
	pc.ProbeInterval = cmp.Or(pc.ProbeInterval, time.Second)
	pc.ProbeTimeout = cmp.Or(pc.ProbeTimeout, pc.ProbeInterval)
	pc.DiscoverInterval = cmp.Or(pc.DiscoverInterval, 30*time.Second)
	pc.MaxDecodeRate = cmp.Or(pc.MaxDecodeRate, DefaultMaxDecodeRate)
	pc.EjectAfter = cmp.Or(pc.EjectAfter, 3)
	pc.EjectBase = cmp.Or(pc.EjectBase, 2*time.Second)
	pc.EjectMax = cmp.Or(pc.EjectMax, time.Minute)
	if err := pc.Check(); err != nil {
		return nil, err
	}
	if pc.Client == nil {
		// No gzip: on a LAN compressing /metrics costs both ends more CPU
		// than the bytes it saves.
		pc.Client = &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 4, IdleConnTimeout: time.Minute, DisableCompression: true}}
	}
	if pc.Logger == nil {
		pc.Logger = slog.New(slog.DiscardHandler)
	}
	p := &Pool{cfg: pc, log: pc.Logger.With("component", "gpu"), byName: map[string]*backend{}}
	urls := map[string]bool{}
	for _, c := range cfgs {
		u, err := url.Parse(c.URL)
		if err != nil || u.Host == "" || (u.Scheme != "http" && u.Scheme != "https") {
			return nil, fmt.Errorf("backend %q: url %q is not an absolute http(s) URL", c.Name, c.URL)
		}
		c.URL = strings.TrimRight(c.URL, "/")
		c.Name = cmp.Or(c.Name, u.Host)
		c.MaxNumSeqs = cmp.Or(c.MaxNumSeqs, 256)
		if p.byName[c.Name] != nil || urls[c.URL] {
			return nil, fmt.Errorf("backend %q (%s) is configured twice", c.Name, c.URL)
		}
		urls[c.URL] = true
		b := &backend{cfg: c}
		b.snap.Store(&Snapshot{
			Name: c.Name, URL: c.URL, MaxNumSeqs: c.MaxNumSeqs, CapacityTokens: c.CapacityTokens,
			StaleAfter: pc.StaleAfter, Configured: slices.Clone(c.Models),
		})
		p.backends = append(p.backends, b)
		p.byName[c.Name] = b
	}
	if len(p.backends) == 0 {
		return nil, errors.New("no backends configured")
	}
	union := p.unionModels()
	p.models.Store(&union)
	return p, nil
}

// Snapshots returns every backend's latest snapshot, in configuration order.
func (p *Pool) Snapshots() []*Snapshot {
	out := make([]*Snapshot, len(p.backends))
	for i, b := range p.backends {
		out[i] = b.snap.Load()
	}
	return out
}

// Snapshot returns one backend's latest snapshot.
func (p *Pool) Snapshot(name string) (*Snapshot, bool) {
	b, ok := p.byName[name]
	if !ok {
		return nil, false
	}
	return b.snap.Load(), true
}

// StaleAfter is the pool's staleness bound.
func (p *Pool) StaleAfter() time.Duration { return p.cfg.StaleAfter }

// Models returns the union of the backends' models, and of the models
// configured for backends not yet discovered (with MaxModelLen 0,
// unknown); a model served by several backends appears once, with the
// smallest known max_model_len. The slice is shared: do not modify it.
func (p *Pool) Models() []Model {
	if m := p.models.Load(); m != nil {
		return *m
	}
	return nil
}

func (p *Pool) unionModels() []Model {
	byID := map[string]Model{}
	for _, b := range p.backends {
		s := b.snap.Load()
		models := s.Models
		if !s.Discovered {
			models = nil
			for _, id := range s.Configured {
				models = append(models, Model{ID: id})
			}
		}
		for _, m := range models {
			have, ok := byID[m.ID]
			if !ok || have.MaxModelLen == 0 || (m.MaxModelLen > 0 && m.MaxModelLen < have.MaxModelLen) {
				byID[m.ID] = m
			}
		}
	}
	out := make([]Model, 0, len(byID))
	for _, m := range byID {
		out = append(out, m)
	}
	slices.SortFunc(out, func(a, b Model) int { return strings.Compare(a.ID, b.ID) })
	return out
}

// update publishes a changed copy of a backend's snapshot.
func (p *Pool) update(b *backend, change func(s *Snapshot)) {
	p.set(b, change)
	p.changed()
}

// set is update without the notice: the caller calls changed.
func (p *Pool) set(b *backend, change func(s *Snapshot)) {
	b.mu.Lock()
	next := *b.snap.Load()
	change(&next)
	b.snap.Store(&next)
	b.mu.Unlock()
}

func (p *Pool) changed() {
	if p.cfg.OnChange != nil {
		p.cfg.OnChange()
	}
}

// ReportFailure records a failed dispatch to a backend (connection error,
// 5xx, stall). Enough of them in a row eject it, whatever /health says,
// unless it is the last routable backend of one of its models: see fail.
func (p *Pool) ReportFailure(name string, err error) {
	if b, ok := p.byName[name]; ok {
		p.fail(b, err, false)
	}
}

// Cooldown pauses new work to a backend until until, after it answered 429
// (or another replica says it did); a later end wins over an earlier one.
// It reports whether the cooldown was extended.
func (p *Pool) Cooldown(name string, until time.Time) bool {
	b, ok := p.byName[name]
	if !ok || !until.After(b.snap.Load().CoolingUntil) {
		return false
	}
	p.update(b, func(s *Snapshot) {
		if until.After(s.CoolingUntil) {
			s.CoolingUntil = until
		}
	})
	return true
}

// CooldownURL is Cooldown for the backend at url, as replicas whose
// backends have other names know it.
func (p *Pool) CooldownURL(url string, until time.Time) bool {
	for _, b := range p.backends {
		if b.cfg.URL == url {
			return p.Cooldown(b.cfg.Name, until)
		}
	}
	return false
}

// ReportSuccess records a dispatch that worked.
func (p *Pool) ReportSuccess(name string) {
	b, ok := p.byName[name]
	if ok {
		b.noteAnswer(time.Now())
	}
	if !ok || b.snap.Load().Failures == 0 {
		return // the common case costs one atomic load
	}
	p.update(b, func(s *Snapshot) {
		if !s.Ejected {
			s.Failures, s.HealthErr = 0, ""
		}
	})
}

func (p *Pool) fail(b *backend, err error, probe bool) {
	if err == nil {
		err = errors.New("unspecified failure")
	}
	var ejected bool
	spared := ""
	if !probe {
		// One dispatch ejection decision at a time, so that two backends
		// failing together do not each see the other routable and both go.
		p.ejectMu.Lock()
	}
	p.set(b, func(s *Snapshot) {
		n := &s.Failures
		if probe {
			n = &s.ProbeFailures
		}
		*n++
		s.HealthErr = err.Error()
		if !s.Ejected && *n >= p.cfg.EjectAfter && !probe {
			// Dispatch failures never eject the last routable backend of
			// a model. Whether a failed request was the backend's fault or
			// its own is not always known (the gateway tells them apart
			// where it can: requests that fail the same way elsewhere are
			// not reported), and ejecting the last backend cannot route
			// the model's work anywhere better: it would only turn the
			// backend's answers into kvgate's 503s, and let a client's bad
			// requests take a model offline. A backend that stops
			// answering /health is still ejected, by the probes.
			if m := p.lastRoutableFor(b, s.Models); m != "" {
				if *n == p.cfg.EjectAfter {
					spared = m
				}
				return
			}
		}
		if !s.Ejected && *n >= p.cfg.EjectAfter {
			// The backoff doubles per ejection, and starts over once the
			// backend has stayed up for EjectMax since its last recovery.
			if !b.recoveredAt.IsZero() && time.Since(b.recoveredAt) > p.cfg.EjectMax {
				b.ejections = 0
			}
			d := min(p.cfg.EjectBase<<min(b.ejections, 16), p.cfg.EjectMax)
			b.ejections++
			s.Ejected, s.EjectedUntil = true, time.Now().Add(d)
			ejected = true
		}
	})
	if !probe {
		p.ejectMu.Unlock()
	}
	p.changed()
	if ejected {
		s := b.snap.Load()
		p.log.Warn("backend ejected", "backend", b.cfg.Name, "failures", s.Failures, "probe_failures", s.ProbeFailures,
			"until", s.EjectedUntil, "err", err)
	}
	if spared != "" {
		p.log.Warn("backend failing requests, not ejected: the last routable backend of its model", "backend", b.cfg.Name,
			"model", spared, "failures", p.cfg.EjectAfter, "err", err)
	}
}

// lastRoutableFor returns one of models that no routable backend but b
// serves, or "" when every one has another.
func (p *Pool) lastRoutableFor(b *backend, models []Model) string {
	for _, m := range models {
		other := false
		for _, o := range p.backends {
			if o == b {
				continue
			}
			if s := o.snap.Load(); s.Routable() {
				if _, ok := s.Serves(m.ID); ok {
					other = true
					break
				}
			}
		}
		if !other {
			return m.ID
		}
	}
	return ""
}

// Run scrapes, probes and discovers every backend until ctx is done. It
// returns after its goroutines have exited.
func (p *Pool) Run(ctx context.Context) error {
	var wg sync.WaitGroup
	for _, b := range p.backends {
		wg.Go(func() { p.scrapeLoop(ctx, b) })
		wg.Go(func() { p.probeLoop(ctx, b) })
		wg.Go(func() { p.discoverLoop(ctx, b) })
	}
	wg.Wait()
	return ctx.Err()
}

func (p *Pool) scrapeLoop(ctx context.Context, b *backend) {
	t := time.NewTicker(p.cfg.ScrapeInterval)
	defer t.Stop()
	for {
		p.scrape(ctx, b)
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// Scrape reads every backend's metrics once now; Run does it on a ticker.
func (p *Pool) Scrape(ctx context.Context) {
	for _, b := range p.backends {
		p.scrape(ctx, b)
	}
}

func (p *Pool) scrape(ctx context.Context, b *backend) {
	ctx, cancel := context.WithTimeout(ctx, p.cfg.StaleAfter)
	defer cancel()
	// The page shows the backend at some moment during the fetch: stamp
	// it with the start, so that work sent during the fetch counts as
	// not yet in it.
	now := time.Now()
	m, err := p.fetchMetrics(ctx, b.cfg.URL)
	done := time.Now()
	if err != nil {
		if ctx.Err() != nil && errors.Is(err, context.Canceled) {
			return
		}
		// The GPUs' health does not wait for the page: a GPU that fails
		// while it is down takes the backend out of routing at once.
		health, reasons, gpus := p.gpuHealth(b)
		excused := b.excused(err, now) // a busy host, not a failed backend: the view is only late (liveness.go)
		p.update(b, func(s *Snapshot) {
			if !excused {
				s.ScrapeErr = err.Error()
			}
			s.GPUHealth, s.GPUReasons, s.GPUs = health, reasons, gpus
		})
		return
	}
	if !m.HasKVUsage && !b.noKVUsage.Swap(true) {
		p.log.Warn("backend publishes no KV cache usage (vllm:kv_cache_usage_perc): admission there sees only kvgate's own requests, not other clients'",
			"backend", b.cfg.Name)
	} else if m.HasKVUsage {
		b.noKVUsage.Store(false)
	}
	health, reasons, gpus := p.gpuHealth(b)
	p.update(b, func(s *Snapshot) {
		// Rates between this scrape and the previous one; b.mu is held,
		// so concurrent scrapes of one backend stay paired.
		if now.Before(s.ScrapedAt) {
			return // a later scrape already landed
		}
		prev := &b.prevScrape
		s.PreemptionRate = 0
		if !prev.at.IsZero() && m.Preemptions >= prev.preemptions && m.Generation >= prev.generation && m.Steps >= prev.steps && now.After(prev.at) {
			dt := now.Sub(prev.at).Seconds()
			s.PreemptionRate = (m.Preemptions - prev.preemptions) / dt
			if m.Steps > prev.steps {
				s.StepRate = smooth(s.StepRate, (m.Steps-prev.steps)/dt)
			}
		}
		// The decode rate spans seconds of scrapes, and is bounded by the
		// step rate and what is physically possible (progress.go).
		b.decode.add(now, m.Generation, m.Running)
		if r := b.decode.rate(s.StepRate, p.cfg.MaxDecodeRate); r > 0 {
			s.DecodeRate = r
		}
		prev.at, prev.preemptions, prev.generation, prev.steps = now, m.Preemptions, m.Generation, m.Steps
		s.Metrics, s.ScrapedAt, s.ScrapeDone, s.ScrapeErr = m, now, done, ""
		s.CapacityTokens = cmp.Or(m.CapacityTokens(), b.cfg.CapacityTokens)
		s.GPUHealth, s.GPUReasons, s.GPUs = health, reasons, gpus
	})
}

// smooth folds a new rate into a running one (first value as is), so that
// one short scrape interval does not swing estimates built on it.
func smooth(old, cur float64) float64 {
	if old == 0 {
		return cur
	}
	return 0.7*old + 0.3*cur
}

// StepsAt extrapolates the backend's engine step counter to t, from the
// last scrape and the step rate, no further than the staleness bound past
// the scrape (a backend that stopped stepping must not seem to go on);
// ok is false when the server does not publish steps.
func (s *Snapshot) StepsAt(t time.Time) (steps float64, ok bool) {
	if !s.Metrics.HasSteps || s.ScrapedAt.IsZero() {
		return 0, false
	}
	ahead := max(0, t.Sub(s.ScrapedAt))
	if s.StaleAfter > 0 {
		ahead = min(ahead, s.StaleAfter)
	}
	return s.Metrics.Steps + s.StepRate*ahead.Seconds(), true
}

func (p *Pool) fetchMetrics(ctx context.Context, base string) (EngineMetrics, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, base+"/metrics", nil)
	if err != nil {
		return EngineMetrics{}, err
	}
	resp, err := p.cfg.Client.Do(req)
	if err != nil {
		return EngineMetrics{}, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		_, _ = io.Copy(io.Discard, resp.Body)
		return EngineMetrics{}, fmt.Errorf("GET /metrics: status %d", resp.StatusCode)
	}
	return ParseEngineMetrics(io.LimitReader(resp.Body, 16<<20))
}

func (p *Pool) gpuHealth(b *backend) (Health, []string, []GPU) {
	n := p.cfg.NVML
	if n == nil || !n.Enabled() || len(b.cfg.GPUs) == 0 {
		return Healthy, nil, nil
	}
	worst := Healthy
	var reasons []string
	var gpus []GPU
	for _, id := range b.cfg.GPUs {
		g, ok := n.Lookup(id)
		if !ok {
			// Not found is a configuration to check, unless a GPU NVML
			// cannot read (its UUID unknown) may be the one: then it
			// counts as that GPU, failed.
			if i, unreadable := n.unreadable(); unreadable {
				worst = Failed
				reasons = append(reasons, fmt.Sprintf("GPU %s not found by NVML, and GPU %d cannot be read: it may be that one", id, i))
				continue
			}
			worst = max(worst, Degraded)
			reasons = append(reasons, fmt.Sprintf("GPU %s not found by NVML", id))
			continue
		}
		gpus = append(gpus, g)
		worst = max(worst, g.Health)
		for _, r := range g.Reasons {
			reasons = append(reasons, fmt.Sprintf("GPU %d: %s", g.Index, r))
		}
	}
	return worst, reasons, gpus
}

func (p *Pool) probeLoop(ctx context.Context, b *backend) {
	t := time.NewTicker(p.cfg.ProbeInterval)
	defer t.Stop()
	for {
		p.probe(ctx, b)
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// discoverLoop reads a backend's models: every probe interval until it
// has some, then every DiscoverInterval, a failed read included (the
// models it has stay). It runs beside the probes, never before them: a
// backend that hangs would otherwise hold each probe behind a read of its
// models (up to 5 s) and put off its ejection by as much each time.
func (p *Pool) discoverLoop(ctx context.Context, b *backend) {
	var next time.Time
	t := time.NewTicker(p.cfg.ProbeInterval)
	defer t.Stop()
	for {
		if len(b.snap.Load().Models) == 0 || time.Now().After(next) {
			if err := p.discover(ctx, b); err == nil || len(b.snap.Load().Models) > 0 {
				next = time.Now().Add(p.cfg.DiscoverInterval)
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// Probe checks every backend's /health once now; Run does it on a ticker.
func (p *Pool) Probe(ctx context.Context) {
	for _, b := range p.backends {
		if len(b.snap.Load().Models) == 0 {
			_ = p.discover(ctx, b)
		}
		p.probe(ctx, b)
	}
}

func (p *Pool) probe(ctx context.Context, b *backend) {
	ctx, cancel := context.WithTimeout(ctx, p.cfg.ProbeTimeout)
	defer cancel()
	sent := time.Now()
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, b.cfg.URL+"/health", nil)
	resp, err := p.cfg.Client.Do(req)
	if err == nil {
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			err = fmt.Errorf("GET /health: status %d", resp.StatusCode)
		}
	}
	if ctx.Err() != nil && errors.Is(err, context.Canceled) {
		return
	}
	if err != nil && b.excused(err, sent) {
		return // the backend answers kvgate: a timeout is the host's (liveness.go)
	}
	if err != nil {
		p.fail(b, err, true)
		return
	}
	if s := b.snap.Load(); s.ProbeFailures == 0 && !s.Ejected {
		return // the common case: no update, no wake-up
	}
	recovered := false
	p.update(b, func(s *Snapshot) {
		s.ProbeFailures = 0
		if !s.Ejected {
			if s.Failures == 0 {
				s.HealthErr = ""
			}
			return // dispatch failures stand until a dispatch succeeds
		}
		if time.Now().Before(s.EjectedUntil) {
			return // healthy again, but it waits out its ejection
		}
		recovered = true
		b.recoveredAt = time.Now()
		s.Failures, s.Ejected, s.HealthErr = 0, false, ""
	})
	if recovered {
		p.log.Info("backend recovered", "backend", b.cfg.Name)
	}
}

func (p *Pool) discover(ctx context.Context, b *backend) error {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, b.cfg.URL+"/v1/models", nil)
	resp, err := p.cfg.Client.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("GET /v1/models: status %d", resp.StatusCode)
	}
	var list struct {
		Data []struct {
			ID          string `json:"id"`
			MaxModelLen int    `json:"max_model_len"`
		} `json:"data"`
	}
	if err := json.NewDecoder(io.LimitReader(resp.Body, 4<<20)).Decode(&list); err != nil {
		return fmt.Errorf("GET /v1/models: %w", err)
	}
	var models []Model
	for _, d := range list.Data {
		if len(b.cfg.Models) > 0 && !slices.Contains(b.cfg.Models, d.ID) {
			continue
		}
		models = append(models, Model{ID: d.ID, MaxModelLen: d.MaxModelLen})
	}
	old := b.snap.Load()
	if !old.Discovered || !slices.Equal(old.Models, models) {
		p.update(b, func(s *Snapshot) { s.Models, s.Discovered = models, true })
		p.unionMu.Lock()
		union := p.unionModels()
		p.models.Store(&union)
		p.unionMu.Unlock()
		p.log.Info("backend models", "backend", b.cfg.Name, "models", len(models))
		for _, id := range b.cfg.Models {
			if !slices.ContainsFunc(models, func(m Model) bool { return m.ID == id }) {
				p.log.Warn("configured model not served by backend", "backend", b.cfg.Name, "model", id)
			}
		}
	}
	return nil
}
