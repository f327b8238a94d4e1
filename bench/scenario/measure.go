package scenario

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/kvgate/kvgate/bench"
	"github.com/kvgate/kvgate/gpu"
	"github.com/kvgate/kvgate/scheduler"
)

// fleetCounters are a fleet's cumulative engine counters at one instant.
type fleetCounters struct {
	wall        time.Time
	sim         []time.Duration // each engine's simulated clock
	stalled     []time.Duration // each engine's vllmsim.Engine.Stalled
	generation  float64         // vllm:generation_tokens_total, summed
	preemptions float64         // vllm:num_preemptions_total, summed
	// prefixHits and prefixQueries are vllm:prefix_cache_hits_total and
	// _queries_total, summed, in tokens.
	prefixHits, prefixQueries float64
}

// readFleet reads every backend's /metrics, as a monitoring system would,
// and the engines' simulated clocks.
func readFleet(ctx context.Context, s *stack) (fleetCounters, error) {
	c := fleetCounters{wall: time.Now()}
	for i, b := range s.backends {
		c.sim = append(c.sim, s.sims[i].Engine().Now())
		c.stalled = append(c.stalled, s.sims[i].Engine().Stalled())
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, b+"/metrics", nil)
		if err != nil {
			return c, err
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return c, fmt.Errorf("read fleet counters: %w", err)
		}
		m, err := gpu.ParseEngineMetrics(resp.Body)
		resp.Body.Close()
		if err != nil {
			return c, fmt.Errorf("read fleet counters of %s: %w", b, err)
		}
		c.generation += m.Generation
		c.preemptions += m.Preemptions
		c.prefixHits += m.PrefixHits
		c.prefixQueries += m.PrefixQueries
	}
	return c, nil
}

// elapsed is the simulated time since an earlier reading, averaged over
// the engines.
func (c fleetCounters) elapsed(from fleetCounters) time.Duration {
	var sum time.Duration
	for i := range c.sim {
		sum += c.sim[i] - from.sim[i]
	}
	return sum / time.Duration(max(1, len(c.sim)))
}

// stalledShare is the share of the simulated time since from that the
// engines spent stalled by the host (vllmsim.Engine.Stalled), averaged
// over the engines.
func (c fleetCounters) stalledShare(from fleetCounters) float64 {
	var sum time.Duration
	for i := range c.stalled {
		sum += c.stalled[i] - from.stalled[i]
	}
	if d := c.elapsed(from); d > 0 {
		return float64(sum/time.Duration(max(1, len(c.stalled)))) / float64(d)
	}
	return 0
}

// tokPerSec is the fleet's output tokens per simulated second since from.
func (c fleetCounters) tokPerSec(from fleetCounters) float64 {
	if d := c.elapsed(from).Seconds(); d > 0 {
		return (c.generation - from.generation) / d
	}
	return 0
}

// speedup is how many simulated seconds passed per wall second since from.
// A host that cannot keep a speed-up stretches simulated time rather than
// skip it, so this stays close to the one asked for; the figure records it.
func (c fleetCounters) speedup(from fleetCounters) float64 {
	if w := c.wall.Sub(from.wall).Seconds(); w > 0 {
		return c.elapsed(from).Seconds() / w
	}
	return 1
}

// toSimTime rescales a report measured in wall time on a fleet that ran k
// times faster into simulated time: every offset and latency is multiplied
// by k and every summary recomputed, so that its throughputs are per
// simulated second and its latencies what a client of real GPUs would see
// (kvgate's own sub-millisecond overhead is scaled along, a negligible
// bias). cfg, the load in simulated units, replaces the wall-clock config.
func toSimTime(rep *bench.Report, k float64, cfg bench.Config) {
	scale := func(d time.Duration) time.Duration { return time.Duration(float64(d) * k) }
	for i := range rep.Requests {
		r := &rep.Requests[i]
		r.Intended, r.Sent, r.TTFT, r.TPOT, r.E2EL = scale(r.Intended), scale(r.Sent), scale(r.TTFT), scale(r.TPOT), scale(r.E2EL)
		for j := range r.ITLs {
			r.ITLs[j] = scale(r.ITLs[j])
		}
	}
	cfg.Workload, cfg.Arrival = cfg.Tenants[0].Workload, cfg.Tenants[0].Arrival
	cfg.Target, cfg.Scrape, cfg.Metadata, cfg.Label = rep.Config.Target, rep.Config.Scrape, rep.Config.Metadata, rep.Config.Label
	if vc, err := cfg.Validate(); err == nil {
		vc.ScrapeInterval = scale(rep.Config.ScrapeInterval)
		vc.JobPollInterval = scale(rep.Config.JobPollInterval)
		rep.Config = vc
	}
	for i := range rep.LoadPoints {
		pt := &rep.LoadPoints[i]
		pt.Start *= k
		pt.RequestRate = bench.Rate(float64(pt.RequestRate) / k)
		dur := time.Duration(pt.Summary.Duration * k * float64(time.Second))
		var all []bench.Record
		for _, r := range rep.Requests {
			if r.Point == pt.Index {
				all = append(all, r)
			}
		}
		pt.Summary = bench.Summarize(all, dur, rep.Config.SLO, rep.Config.Percentiles)
		shares := make([]float64, 0, len(pt.Tenants))
		for j := range pt.Tenants {
			ts := &pt.Tenants[j]
			var own []bench.Record
			for _, r := range all {
				if r.Tenant == ts.Name {
					own = append(own, r)
				}
			}
			ts.Summary = bench.Summarize(own, dur, rep.Config.SLO, rep.Config.Percentiles)
			shares = append(shares, ts.Summary.OutputThroughput/ts.Weight)
		}
		pt.JainIndex = bench.JainIndex(shares)
	}
	for i := range rep.TimeSeries {
		rep.TimeSeries[i].T *= k
	}
	if rep.Headline >= 0 && rep.Headline < len(rep.LoadPoints) {
		h := rep.LoadPoints[rep.Headline]
		rep.Summary, rep.Tenants, rep.JainIndex, rep.RequestRate = h.Summary, h.Tenants, h.JainIndex, h.RequestRate
	}
	for i := range rep.TTFTs {
		rep.TTFTs[i] *= k
	}
	for i := range rep.ITLs {
		for j := range rep.ITLs[i] {
			rep.ITLs[i][j] *= k
		}
	}
}

// hitRate is the fleet's measured prefix-cache hit rate since from: hit
// tokens over queried tokens, or -1 when nothing was queried.
func (c fleetCounters) hitRate(from fleetCounters) float64 {
	if q := c.prefixQueries - from.prefixQueries; q > 0 {
		return (c.prefixHits - from.prefixHits) / q
	}
	return -1
}

// readRefusals sums kvgate's admission refusals by reason from its
// /metrics page at url.
func readRefusals(ctx context.Context, url string) (map[string]float64, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return nil, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, fmt.Errorf("read kvgate's refusals: %w", err)
	}
	defer resp.Body.Close()
	return parseRefusals(resp.Body)
}

// parseRefusals reads kvgate_scheduler_backend_refusals_total samples
// from a Prometheus text page, summed by their reason label.
func parseRefusals(r io.Reader) (map[string]float64, error) {
	const name = "kvgate_scheduler_backend_refusals_total{"
	out := map[string]float64{}
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line, ok := strings.CutPrefix(sc.Text(), name)
		if !ok {
			continue
		}
		labels, value, ok := strings.Cut(line, "} ")
		if !ok {
			continue
		}
		_, reason, ok := strings.Cut(labels, `reason="`)
		if !ok {
			continue
		}
		reason, _, _ = strings.Cut(reason, `"`)
		v, err := strconv.ParseFloat(strings.TrimSpace(value), 64)
		if err != nil {
			continue
		}
		out[reason] += v
	}
	return out, sc.Err()
}

// dumpMetrics writes, at a run's end, every backend's /metrics and the
// target's own (kvgate's) into one file, each under a "# source URL"
// line: the queue times in vLLM (vllm:request_queue_time_seconds) and in
// kvgate (kvgate_scheduler_queue_wait_seconds), the refusals by reason
// and the prefix counters per backend, for reading a run after it.
func dumpMetrics(ctx context.Context, s *stack, path string) error {
	urls := make([]string, 0, len(s.backends)+1)
	for _, b := range s.backends {
		urls = append(urls, b+"/metrics")
	}
	if s.gatewayMetrics != "" {
		urls = append(urls, s.gatewayMetrics)
	}
	var buf bytes.Buffer
	for _, u := range urls {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
		if err != nil {
			return err
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return fmt.Errorf("dump metrics: %w", err)
		}
		fmt.Fprintf(&buf, "# source %s\n", u)
		_, err = io.Copy(&buf, resp.Body)
		resp.Body.Close()
		if err != nil {
			return fmt.Errorf("dump metrics of %s: %w", u, err)
		}
	}
	return os.WriteFile(path, buf.Bytes(), 0o644)
}

// admitTrace collects kvgate's admissions during a run (the scheduler's
// admission observer), written as admissions.csv beside the report: per
// request, when it was queued (simulated seconds from the start), how
// long it waited in kvgate, the backend chosen and the one expected to
// hold most of its prefix, and the refusals it met while it waited.
type admitTrace struct {
	mu   sync.Mutex
	recs []scheduler.AdmitRecord
}

func (a *admitTrace) add(r scheduler.AdmitRecord) {
	a.mu.Lock()
	a.recs = append(a.recs, r)
	a.mu.Unlock()
}

// write writes the trace, times in simulated seconds (wall × speedup)
// from w0.
func (a *admitTrace) write(path string, w0 time.Time, speedup float64) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	var b bytes.Buffer
	b.WriteString("queued_s,wait_ms,backend,hit,best_prefix,best_hit,waited_on,refusals,group,reserved,shared,measured\n")
	for _, r := range a.recs {
		reasons := make([]string, 0, len(r.Refusals))
		for k, n := range r.Refusals {
			reasons = append(reasons, fmt.Sprintf("%s:%d", k, n))
		}
		slices.Sort(reasons)
		fmt.Fprintf(&b, "%.3f,%.1f,%s,%.3f,%s,%.3f,%s,%s,%016x,%d,%d,%d\n",
			r.Enqueued.Sub(w0).Seconds()*speedup, float64(r.Admitted.Sub(r.Enqueued).Microseconds())/1000*speedup,
			r.Backend, r.Hit, r.BestPrefix, r.BestHit, r.WaitedOn, strings.Join(reasons, ";"),
			r.Group, r.Reserved, r.Shared, r.Measured)
	}
	return os.WriteFile(path, b.Bytes(), 0o644)
}
