package baseline

import (
	"cmp"
	"context"
	"fmt"
	"net/http"
	"net/http/httputil"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvgate/kvgate/gpu"
)

// ThresholdConfig tunes a Threshold router. Zero values take the defaults
// in brackets, which are the endpoint picker's.
type ThresholdConfig struct {
	// QueueThreshold is the most requests waiting in vLLM's own queue
	// (vllm:num_requests_waiting) that a backend may have and still
	// qualify [5].
	QueueThreshold float64
	// KVThreshold is the highest KV-cache use (vllm:kv_cache_usage_perc,
	// 0..1) at which a backend still qualifies [0.8].
	KVThreshold float64
	// ScrapeInterval is how often each backend's /metrics is read [50ms,
	// llm-d's refresh-metrics-interval].
	ScrapeInterval time.Duration
	// Staleness is the age after which a backend's metrics count as
	// saturated [200ms, the utilization detector's default].
	Staleness time.Duration
	// HealthInterval is how often each backend's /health is probed; a
	// failed probe takes it out of rotation until one succeeds [1s]. It
	// plays the part of the Kubernetes readiness probe that removes a dead
	// pod from the EPP's endpoints.
	HealthInterval time.Duration
	// Now is the clock [time.Now].
	Now func() time.Time
}

func (c *ThresholdConfig) defaults() {
	c.QueueThreshold = cmp.Or(c.QueueThreshold, 5)
	c.KVThreshold = cmp.Or(c.KVThreshold, 0.8)
	c.ScrapeInterval = cmp.Or(c.ScrapeInterval, 50*time.Millisecond)
	c.Staleness = cmp.Or(c.Staleness, 200*time.Millisecond)
	c.HealthInterval = cmp.Or(c.HealthInterval, time.Second)
	if c.Now == nil {
		c.Now = time.Now
	}
}

// Threshold routes each request as the endpoint picker's utilization
// detector and filter do: among the backends whose last scrape is fresh,
// whose vLLM queue is at most QueueThreshold and whose KV-cache use is at
// most KVThreshold, it picks the least loaded; when none qualifies it fails
// open and picks the least loaded of all. It never holds a request back.
//
// Load is the number of requests the router has open on a backend, which
// never lags (the EPP's running-requests and token-load scorers count its
// own in-flight work the same way); ties go to the lower saturation score,
// max(waiting/QueueThreshold, KV/KVThreshold), then in turn.
//
// Threshold is safe for concurrent use. Run keeps its view of the backends
// fresh; without it, Refresh reads them on demand.
type Threshold struct {
	cfg      ThresholdConfig
	backends []*thresholdBackend
	client   *http.Client
	turn     atomic.Uint64
}

type thresholdBackend struct {
	url      string
	proxy    *httputil.ReverseProxy
	inflight atomic.Int64

	mu        sync.Mutex
	metrics   gpu.EngineMetrics
	scrapedAt time.Time // zero: never scraped successfully
	unhealthy bool
}

// NewThreshold returns a threshold router over the backends' base URLs. It
// fails on an empty list or a URL that does not parse.
func NewThreshold(backends []string, cfg ThresholdConfig) (*Threshold, error) {
	cfg.defaults()
	tr := newTransport()
	proxies, err := newProxies(backends, tr)
	if err != nil {
		return nil, err
	}
	t := &Threshold{cfg: cfg, client: &http.Client{Transport: tr, Timeout: 5 * time.Second}}
	for i, b := range backends {
		t.backends = append(t.backends, &thresholdBackend{url: strings.TrimRight(b, "/"), proxy: proxies[i]})
	}
	return t, nil
}

// ServeHTTP relays r to the backend the picker chooses.
func (t *Threshold) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	b := t.backends[t.Pick()]
	b.inflight.Add(1)
	defer b.inflight.Add(-1)
	b.proxy.ServeHTTP(w, r)
}

// Pick returns the index of the backend the next request would go to.
func (t *Threshold) Pick() int {
	now := t.cfg.Now()
	cands := make([]candidate, len(t.backends))
	for i, b := range t.backends {
		b.mu.Lock()
		cands[i] = candidate{
			metrics:   b.metrics,
			fresh:     !b.scrapedAt.IsZero() && now.Sub(b.scrapedAt) <= t.cfg.Staleness,
			unhealthy: b.unhealthy,
			inflight:  b.inflight.Load(),
		}
		b.mu.Unlock()
	}
	return pick(cands, t.cfg.QueueThreshold, t.cfg.KVThreshold, int(t.turn.Add(1)-1))
}

// candidate is what the picker knows of one backend.
type candidate struct {
	metrics   gpu.EngineMetrics
	fresh     bool // scraped within the staleness bound
	unhealthy bool // its last health probe failed
	inflight  int64
}

// saturation is the utilization detector's per-endpoint score: 1 or more
// means saturated; stale metrics count as saturated.
func (c candidate) saturation(queue, kv float64) float64 {
	if !c.fresh {
		return 1
	}
	return max(c.metrics.Waiting/queue, c.metrics.KVUsage/kv)
}

func (c candidate) qualifies(queue, kv float64) bool {
	return c.fresh && !c.unhealthy && c.metrics.Waiting <= queue && c.metrics.KVUsage <= kv
}

// pick chooses among cands: the least loaded of those that qualify, else of
// the healthy ones, else of all. turn rotates the order ties are broken in.
func pick(cands []candidate, queue, kv float64, turn int) int {
	n := len(cands)
	for _, eligible := range []func(candidate) bool{
		func(c candidate) bool { return c.qualifies(queue, kv) },
		func(c candidate) bool { return !c.unhealthy },
		func(candidate) bool { return true },
	} {
		best := -1
		for k := range n {
			i := (turn + k) % n
			c := cands[i]
			if !eligible(c) {
				continue
			}
			if best < 0 || c.inflight < cands[best].inflight ||
				(c.inflight == cands[best].inflight && c.saturation(queue, kv) < cands[best].saturation(queue, kv)) {
				best = i
			}
		}
		if best >= 0 {
			return best
		}
	}
	return 0
}

// Run scrapes every backend's /metrics each ScrapeInterval and probes its
// /health each HealthInterval until ctx ends. It returns ctx's error after
// its goroutines have exited.
func (t *Threshold) Run(ctx context.Context) error {
	var wg sync.WaitGroup
	for _, b := range t.backends {
		wg.Go(func() { t.loop(ctx, t.cfg.ScrapeInterval, func() { t.scrape(ctx, b) }) })
		wg.Go(func() { t.loop(ctx, t.cfg.HealthInterval, func() { t.probe(ctx, b) }) })
	}
	wg.Wait()
	return ctx.Err()
}

func (t *Threshold) loop(ctx context.Context, every time.Duration, f func()) {
	tick := time.NewTicker(every)
	defer tick.Stop()
	for {
		f()
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
	}
}

// Refresh reads every backend's /metrics and /health once, now. It
// returns the first error met; the backends it could read are updated.
func (t *Threshold) Refresh(ctx context.Context) error {
	var (
		wg    sync.WaitGroup
		mu    sync.Mutex
		first error
	)
	for _, b := range t.backends {
		wg.Go(func() {
			err := t.probe(ctx, b)
			if err == nil {
				err = t.scrape(ctx, b)
			}
			mu.Lock()
			defer mu.Unlock()
			if first == nil {
				first = err
			}
		})
	}
	wg.Wait()
	return first
}

func (t *Threshold) scrape(ctx context.Context, b *thresholdBackend) error {
	at := t.cfg.Now()
	m, err := t.fetch(ctx, b.url+"/metrics")
	if err != nil {
		return err
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if at.After(b.scrapedAt) {
		b.metrics, b.scrapedAt = m, at
	}
	return nil
}

func (t *Threshold) fetch(ctx context.Context, url string) (gpu.EngineMetrics, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return gpu.EngineMetrics{}, err
	}
	resp, err := t.client.Do(req)
	if err != nil {
		return gpu.EngineMetrics{}, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return gpu.EngineMetrics{}, fmt.Errorf("scrape %s: status %d", url, resp.StatusCode)
	}
	m, err := gpu.ParseEngineMetrics(resp.Body)
	if err != nil {
		return gpu.EngineMetrics{}, fmt.Errorf("scrape %s: %w", url, err)
	}
	return m, nil
}

func (t *Threshold) probe(ctx context.Context, b *thresholdBackend) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, b.url+"/health", nil)
	if err == nil {
		var resp *http.Response
		if resp, err = t.client.Do(req); err == nil {
			resp.Body.Close()
			if resp.StatusCode != http.StatusOK {
				err = fmt.Errorf("probe %s: status %d", b.url, resp.StatusCode)
			}
		}
	}
	if ctx.Err() != nil {
		return ctx.Err() // shutting down says nothing about the backend
	}
	b.mu.Lock()
	b.unhealthy = err != nil
	b.mu.Unlock()
	return err
}
