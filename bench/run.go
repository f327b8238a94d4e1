package bench

import (
	"context"
	"fmt"
	"math"
	"net/http"
	"os"
	"runtime"
	"runtime/debug"
	"slices"
	"sync"
	"sync/atomic"
	"time"
)

// Run sends cfg's load to its target and returns what it measured: one
// load point, or one per rate of a sweep. It returns an error for a bad
// config or an unreadable dataset; failed requests are measurements, not
// errors. When ctx ends, Run stops sending, cancels what is in flight and
// returns the report so far with ctx's error. It is safe to call
// concurrently; every goroutine it starts has exited when it returns.
func Run(ctx context.Context, cfg Config) (*Report, error) {
	cfg, err := cfg.Validate()
	if err != nil {
		return nil, err
	}
	client := cfg.HTTPClient
	if client == nil {
		var conns *connTracker
		client, conns = newTrackedClient(cfg.MaxConnections)
		// Every request has ended when Run returns: close what it opened.
		defer conns.closeAll()
	}
	rq := &requester{client: client, base: baseURL(cfg.Target), chat: cfg.Endpoint == EndpointChat,
		stream: cfg.Stream, model: cfg.Model, timeout: cfg.RequestTimeout, pollEvery: cfg.JobPollInterval,
		jobSSE: cfg.JobFollow == JobFollowSSE, jobAccept: cfg.JobFollow == JobFollowNone}
	// Datasets are read once, before any load, so a bad file fails fast.
	for _, t := range cfg.Tenants {
		if _, err := newSource(t.Workload, newRNG(cfg.Seed, "check")); err != nil {
			return nil, err
		}
	}

	start := time.Now()
	rep := &Report{
		Date: start.Format("20060102-150405"), EndpointType: "openai", Backend: "openai",
		Label: cfg.Label, ModelID: cfg.Model, TokenizerID: cfg.Model, Burstiness: Rate(cfg.Arrival.Burstiness),
		Metadata: cfg.Metadata, Config: cfg, Knee: -1,
	}
	if rq.chat {
		rep.EndpointType, rep.Backend = "openai-chat", "openai-chat"
	}
	if cfg.MaxConcurrency > 0 {
		rep.MaxConcurrency = &cfg.MaxConcurrency
	}
	if slo := sloMs(cfg.SLO); len(slo) > 0 {
		rep.SLO = slo
	}
	rep.Provenance = provenance(ctx, rq, cfg, start)

	var sc *scraper
	if len(cfg.Scrape) > 0 || cfg.GPUs != nil {
		sc = newScraper(client, cfg.Scrape, cfg.GPUs, cfg.ScrapeInterval, start)
		sc.start()
	}
	prog := newProgress(cfg.Progress)

	runID := start.UnixNano()
	plan := planPoints(cfg)
	for i := 0; i < len(plan) && ctx.Err() == nil; i++ {
		tenants := plan[i]
		p := LoadPoint{Index: i, Start: time.Since(start).Seconds(), RequestRate: Rate(offered(tenants))}
		for _, t := range tenants {
			p.Concurrency += t.Arrival.Concurrency
		}
		recs, dur := runPoint(ctx, cfg, rq, tenants, i, runID, prog)
		p.Summary = Summarize(recs, dur, cfg.SLO, cfg.Percentiles)
		shares := make([]float64, 0, len(tenants))
		for _, t := range tenants {
			var own []Record
			for _, r := range recs {
				if r.Tenant == t.Name {
					own = append(own, r)
				}
			}
			ts := TenantSummary{Name: t.Name, Class: t.Class, Weight: t.Weight, Summary: Summarize(own, dur, cfg.SLO, cfg.Percentiles)}
			p.Tenants = append(p.Tenants, ts)
			shares = append(shares, ts.Summary.OutputThroughput/t.Weight)
		}
		p.JainIndex = JainIndex(shares)
		rep.LoadPoints = append(rep.LoadPoints, p)
		rep.Requests = append(rep.Requests, recs...)
		if i == 0 && cfg.Sweep != nil && len(cfg.Sweep.Rates) == 0 {
			// The first point ran at full speed; spread the rest up to what it reached.
			plan = append(plan[:1], sweepFromSaturation(cfg, p, cfg.Sweep.Points)[1:]...)
		}
	}
	prog.finish()
	if sc != nil {
		rep.TimeSeries = sc.stop()
	}
	if len(rep.LoadPoints) == 0 {
		return rep, ctx.Err()
	}
	byRate := sortedByRate(rep.LoadPoints)
	if k := findKnee(byRate, len(rep.SLO) > 0); k >= 0 {
		rep.Knee = byRate[k].Index
	}
	rep.Headline = len(rep.LoadPoints) - 1
	if cfg.Sweep != nil && rep.Knee >= 0 {
		rep.Headline = rep.Knee
	}
	h := rep.LoadPoints[rep.Headline]
	rep.Summary, rep.Tenants, rep.JainIndex, rep.RequestRate = h.Summary, h.Tenants, h.JainIndex, h.RequestRate
	for _, r := range rep.Requests {
		if r.Point != rep.Headline {
			continue
		}
		rep.NumPrompts++
		rep.InputLens = append(rep.InputLens, r.InputTokens)
		rep.OutputLens = append(rep.OutputLens, r.OutputTokens)
		rep.TTFTs = append(rep.TTFTs, r.TTFT.Seconds())
		itls := make([]float64, len(r.ITLs))
		for i, g := range r.ITLs {
			itls[i] = g.Seconds()
		}
		rep.ITLs = append(rep.ITLs, itls)
		rep.Errors = append(rep.Errors, r.Error)
	}
	return rep, ctx.Err()
}

func sloMs(s SLO) map[string]float64 {
	m := map[string]float64{}
	for k, d := range map[string]time.Duration{"ttft": s.TTFT, "tpot": s.TPOT, "e2el": s.E2EL} {
		if d > 0 {
			m[k] = ms(d)
		}
	}
	return m
}

// sortedByRate returns the points in increasing offered rate (inf last).
func sortedByRate(pts []LoadPoint) []LoadPoint {
	s := slices.Clone(pts)
	slices.SortStableFunc(s, func(a, b LoadPoint) int {
		switch {
		case a.RequestRate < b.RequestRate:
			return -1
		case a.RequestRate > b.RequestRate:
			return 1
		}
		return 0
	})
	return s
}

// offered is the sum of the tenants' open-loop rates (inf if any is).
func offered(ts []Tenant) float64 {
	sum := 0.0
	for _, t := range ts {
		switch t.Arrival.Kind {
		case ArrivalConcurrency, ArrivalTrace:
			return math.Inf(1)
		}
		sum += t.Arrival.Rate
	}
	return sum
}

// planPoints returns each load point's tenants. Without a sweep there is
// one; a sweep scales every tenant's rate so that their sum is the point's
// rate, keeping their proportions (by rate, or by weight when a rate is
// infinite).
func planPoints(cfg Config) [][]Tenant {
	if cfg.Sweep == nil {
		return [][]Tenant{cfg.Tenants}
	}
	rates := cfg.Sweep.Rates
	if len(rates) == 0 {
		rates = []float64{math.Inf(1)}
	}
	var plan [][]Tenant
	for _, r := range rates {
		plan = append(plan, scaleTenants(cfg.Tenants, r))
	}
	return plan
}

func scaleTenants(ts []Tenant, total float64) []Tenant {
	out := slices.Clone(ts)
	sum, finite := 0.0, true
	for _, t := range ts {
		sum += t.Arrival.Rate
		finite = finite && !math.IsInf(t.Arrival.Rate, 1)
	}
	wsum := 0.0
	for _, t := range ts {
		wsum += t.Weight
	}
	for i := range out {
		a := &out[i].Arrival
		if a.Kind == ArrivalConcurrency || a.Kind == ArrivalTrace || a.Kind == "" {
			a.Kind = ArrivalPoisson
			a.Burstiness = 1
		}
		share := out[i].Weight / wsum
		if finite && sum > 0 {
			share = ts[i].Arrival.Rate / sum
		}
		a.Rate = total * share
	}
	return out
}

// sweepFromSaturation plans the rest of an automatic sweep: n-1 rates
// evenly spaced up to the throughput the full-speed point reached.
func sweepFromSaturation(cfg Config, first LoadPoint, n int) [][]Tenant {
	plan := [][]Tenant{nil}
	top := first.Summary.RequestThroughput
	if !(top > 0) {
		return plan
	}
	for k := 1; k < n; k++ {
		plan = append(plan, scaleTenants(cfg.Tenants, top*float64(k)/float64(n-1)))
	}
	return plan
}

// point is one load point being run.
type point struct {
	cfg     Config
	rq      *requester
	index   int
	runID   int64
	start   time.Time
	sem     chan struct{}
	prog    *progress
	mu      sync.Mutex
	recs    []Record
	lastEnd atomic.Int64 // nanoseconds from start
}

// runPoint sends every tenant's load for one point and returns the records
// and the point's duration (from its start to the last answer).
func runPoint(ctx context.Context, cfg Config, rq *requester, tenants []Tenant, index int, runID int64, prog *progress) ([]Record, time.Duration) {
	p := &point{cfg: cfg, rq: rq, index: index, runID: runID, start: time.Now(), prog: prog}
	if cfg.MaxConcurrency > 0 {
		p.sem = make(chan struct{}, cfg.MaxConcurrency)
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	total := 0
	for _, t := range tenants {
		if t.NumPrompts > 0 {
			total += t.NumPrompts
		}
	}
	prog.startPoint(index, total, cfg.Duration)
	var wg sync.WaitGroup
	for _, t := range tenants {
		wg.Go(func() { p.tenant(ctx, t) })
	}
	wg.Wait()
	slices.SortFunc(p.recs, func(a, b Record) int { return int(a.Intended - b.Intended) })
	return p.recs, time.Duration(p.lastEnd.Load())
}

// tenant dispatches one tenant's requests and waits for them to end.
func (p *point) tenant(ctx context.Context, t Tenant) {
	rng := newRNG(p.cfg.Seed, fmt.Sprintf("arrivals/%s/%d", t.Name, p.index))
	// Each load point draws its own prompts, so that a later point does not
	// find an earlier one's in the server's prefix cache.
	src, err := newSource(t.Workload, newRNG(p.cfg.Seed, fmt.Sprintf("workload/%s/%d", t.Name, p.index)))
	if err != nil {
		return // checked before the run started
	}
	n := t.NumPrompts
	if t.Arrival.Kind == ArrivalTrace && (n == 0 || n > src.len()) {
		n = src.len() // a trace is replayed once
	}
	if t.Batch {
		p.batch(ctx, t, src, n)
		return
	}
	var wg sync.WaitGroup
	defer wg.Wait()
	if t.Arrival.Kind == ArrivalConcurrency {
		var next atomic.Int64
		var srcMu sync.Mutex
		for range t.Arrival.Concurrency {
			wg.Go(func() {
				for ctx.Err() == nil {
					i := int(next.Add(1)) - 1
					if n > 0 && i >= n || p.cfg.Duration > 0 && time.Since(p.start) >= p.cfg.Duration {
						return
					}
					srcMu.Lock()
					it := src.draw()
					srcMu.Unlock()
					if p.sem != nil {
						select {
						case p.sem <- struct{}{}:
						case <-ctx.Done():
							return
						}
					}
					p.one(ctx, t, i, it, time.Now())
					if p.sem != nil {
						<-p.sem
					}
				}
			})
		}
		return
	}
	g := newGaps(t.Arrival, rng)
	var sched []time.Duration
	if n > 0 && t.Arrival.Kind != ArrivalTrace {
		sched = g.schedule(n)
	}
	var at time.Duration
	for i := 0; n == 0 || i < n; i++ {
		it := src.draw()
		switch {
		case t.Arrival.Kind == ArrivalTrace:
			at = time.Duration(float64(it.at) * t.Arrival.TimeScale)
		case sched != nil:
			at = sched[i]
		default:
			at += time.Duration(g.next() * float64(time.Second))
		}
		if p.cfg.Duration > 0 && at >= p.cfg.Duration {
			return
		}
		intended := p.start.Add(at)
		if d := time.Until(intended); d > 0 {
			timer := time.NewTimer(d)
			select {
			case <-ctx.Done():
				timer.Stop()
				return
			case <-timer.C:
			}
		} else if ctx.Err() != nil {
			return
		}
		if p.sem != nil {
			// The client's own cap: the request is timed from when it gets a slot.
			select {
			case p.sem <- struct{}{}:
			case <-ctx.Done():
				return
			}
			wg.Go(func() {
				defer func() { <-p.sem }()
				p.one(ctx, t, i, it, time.Now())
			})
			continue
		}
		wg.Go(func() { p.one(ctx, t, i, it, intended) })
	}
}

// one sends request i of a tenant, timed from intended, and records it.
func (p *point) one(ctx context.Context, t Tenant, i int, it item, intended time.Time) {
	rec := Record{Tenant: t.Name, Point: p.index, Intended: intended.Sub(p.start)}
	p.prog.sent()
	if t.Deferred {
		key := fmt.Sprintf("kvgate-bench-%x-%s-%d-%d", p.runID, t.Name, p.index, i)
		p.rq.submitJob(ctx, t.APIKey, key, it, t.Workload.IgnoreEOS, intended, &rec)
	} else {
		p.rq.send(ctx, t.APIKey, it, t.Workload.IgnoreEOS, intended, &rec)
	}
	if rec.ErrorClass == "" && rec.InputTokens == 0 {
		rec.InputTokens = it.inputLen
	}
	end := int64(rec.Intended + rec.E2EL)
	for {
		old := p.lastEnd.Load()
		if end <= old || p.lastEnd.CompareAndSwap(old, end) {
			break
		}
	}
	p.prog.done(rec.ErrorClass != "")
	p.mu.Lock()
	p.recs = append(p.recs, rec)
	p.mu.Unlock()
}

// provenance records the harness and what the target says of itself.
func provenance(ctx context.Context, rq *requester, cfg Config, start time.Time) Provenance {
	pv := Provenance{Harness: "kvgate bench", GoVersion: runtime.Version(), NumCPU: runtime.NumCPU(),
		Target: cfg.Target, Seed: cfg.Seed, Start: start.UTC()}
	pv.Host, _ = os.Hostname()
	if info, ok := debug.ReadBuildInfo(); ok {
		for _, s := range info.Settings {
			if s.Key == "vcs.revision" {
				pv.Harness += " " + s.Value
			}
		}
	}
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	var models struct {
		Data []struct {
			ID string `json:"id"`
		} `json:"data"`
	}
	if st, err := rq.jsonCall(ctx, http.MethodGet, "/v1/models", cfg.APIKey, "", nil, &models); err == nil && st == http.StatusOK {
		for _, m := range models.Data {
			pv.Models = append(pv.Models, m.ID)
		}
	}
	var ver struct {
		Version string `json:"version"`
	}
	if st, err := rq.jsonCall(ctx, http.MethodGet, "/version", cfg.APIKey, "", nil, &ver); err == nil && st == http.StatusOK {
		pv.ServerVersion = ver.Version
	}
	if cfg.GPUs != nil {
		cfg.GPUs.Refresh()
		pv.Driver = cfg.GPUs.Driver()
		for _, g := range cfg.GPUs.GPUs() {
			pv.GPUs = append(pv.GPUs, fmt.Sprintf("%d: %s, %.0f GiB (%s)", g.Index, g.Name, float64(g.MemoryTotal)/(1<<30), g.UUID))
		}
	}
	for _, u := range cfg.Scrape {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
		if err != nil {
			continue
		}
		resp, err := rq.client.Do(req)
		if err != nil {
			continue
		}
		info := serverInfo(resp.Body)
		resp.Body.Close()
		if len(info) > 0 {
			if pv.Servers == nil {
				pv.Servers = map[string]map[string]string{}
			}
			pv.Servers[u] = info
		}
	}
	return pv
}
