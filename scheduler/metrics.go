package scheduler

import (
	"time"

	"github.com/kvgate/kvgate/gpu"
	"github.com/prometheus/client_golang/prometheus"
)

// Admission outcomes, the values of the outcome label.
const (
	outcomeAdmitted       = "admitted"        // at once
	outcomeQueuedAdmitted = "queued_admitted" // after waiting
	outcomeTimeout        = "queue_timeout"
	outcomeQueueFull      = "queue_full"
	outcomeTooLarge       = "too_large"
	outcomeCancelled      = "cancelled"
	outcomeNoBackend      = "no_backend"
	outcomeShutdown       = "shutting_down"
)

type metrics struct {
	outcomes *prometheus.CounterVec
	wait     *prometheus.HistogramVec
	blocks   *prometheus.CounterVec
	share    prometheus.Gauge
	s        *Scheduler

	// refusals are blocks' counters by backend and reason, looked up once
	// each (under Scheduler.mu, where every admission check runs): a
	// saturated fleet's pass refuses tens of checks a release, and each
	// lookup by label values hashed and validated both strings again.
	refusals map[[2]string]prometheus.Counter
}

func newMetrics(s *Scheduler) *metrics {
	return &metrics{
		s: s,
		outcomes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvgate_scheduler_admissions_total",
			Help: "Tickets by class and admission outcome.",
		}, []string{"class", "outcome"}),
		wait: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "kvgate_scheduler_queue_wait_seconds",
			Help:    "Time admitted tickets waited in kvgate's queue.",
			Buckets: []float64{0, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300},
		}, []string{"class"}),
		blocks: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvgate_scheduler_backend_refusals_total",
			Help: "Admission checks a backend refused, by reason (kv_budget, max_num_seqs, backend_queue, metrics_stale, pacing, preempting, ...); a queued ticket is checked again on every release, scrape and tick, so this counts checks, not tickets.",
		}, []string{"backend", "reason"}),
		share: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "kvgate_scheduler_capacity_share_ratio",
			Help: "The part of every backend's KV budget this replica may fill: 1 alone, 1/n beside n-1 other replicas.",
		}),
	}
}

func (m *metrics) outcome(c Class, o string) { m.outcomes.WithLabelValues(c.String(), o).Inc() }
func (m *metrics) waited(c Class, d time.Duration) {
	m.wait.WithLabelValues(c.String()).Observe(d.Seconds())
}

// blocked counts a refused check; the caller holds Scheduler.mu.
func (m *metrics) blocked(backend, reason string) {
	k := [2]string{backend, reason}
	c := m.refusals[k]
	if c == nil {
		if m.refusals == nil {
			m.refusals = map[[2]string]prometheus.Counter{}
		}
		c = m.blocks.WithLabelValues(backend, reason)
		m.refusals[k] = c
	}
	c.Inc()
}

var (
	descQueue    = prometheus.NewDesc("kvgate_scheduler_queue_depth", "Tickets waiting in kvgate, by class.", []string{"class"}, nil)
	descInflight = prometheus.NewDesc("kvgate_scheduler_backend_inflight_requests", "Requests kvgate has in flight on a backend.", []string{"backend"}, nil)
	descReserved = prometheus.NewDesc("kvgate_scheduler_backend_reserved_tokens", "KV tokens reserved on a backend: prompt plus max output of each in-flight request.", []string{"backend"}, nil)
	descCapacity = prometheus.NewDesc("kvgate_scheduler_backend_capacity_tokens", "A backend's KV capacity in tokens (num_gpu_blocks x block_size).", []string{"backend"}, nil)
	descUsage    = prometheus.NewDesc("kvgate_scheduler_backend_kv_usage_ratio", "A backend's KV-cache usage as it last reported it.", []string{"backend"}, nil)
	descAge      = prometheus.NewDesc("kvgate_scheduler_backend_metrics_age_seconds", "Age of a backend's last metrics scrape (-1: never).", []string{"backend"}, nil)
	descStale    = prometheus.NewDesc("kvgate_scheduler_backend_stale", "1 when a backend's metrics are past the staleness bound (it counts as saturated).", []string{"backend"}, nil)
	descRoutable = prometheus.NewDesc("kvgate_scheduler_backend_routable", "1 when a backend may take new work (models known, not ejected, GPUs not failed).", []string{"backend"}, nil)
	descProgress = prometheus.NewDesc("kvgate_scheduler_backend_progress_source", "1 for the source admission follows a backend's non-streaming requests by: steps (vllm:iteration_tokens_total), decode_rate (generation_tokens_total over running, bounded), none (assumes no progress); 0 for the others.", []string{"backend", "source"}, nil)
)

// Collectors returns the scheduler's metrics, to register once.
func (s *Scheduler) Collectors() []prometheus.Collector {
	return []prometheus.Collector{s.m.outcomes, s.m.wait, s.m.blocks, s.m.share, stateCollector{s}, prefixCollector{s}}
}

// stateCollector reads queue and backend state at scrape time.
type stateCollector struct{ s *Scheduler }

func (c stateCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{descQueue, descInflight, descReserved, descCapacity, descUsage, descAge, descStale, descRoutable, descProgress} {
		ch <- d
	}
}

func (c stateCollector) Collect(ch chan<- prometheus.Metric) {
	q := c.s.Queued()
	for cl := range q {
		ch <- prometheus.MustNewConstMetric(descQueue, prometheus.GaugeValue, float64(q[cl]), Class(cl).String())
	}
	loads := map[string]BackendLoad{}
	for _, l := range c.s.Loads() {
		loads[l.Backend] = l
	}
	now := c.s.now()
	b2f := func(b bool) float64 {
		if b {
			return 1
		}
		return 0
	}
	for _, sn := range c.s.src.Snapshots() {
		l := loads[sn.Name]
		ch <- prometheus.MustNewConstMetric(descInflight, prometheus.GaugeValue, float64(l.Inflight), sn.Name)
		ch <- prometheus.MustNewConstMetric(descReserved, prometheus.GaugeValue, float64(l.Reserved), sn.Name)
		ch <- prometheus.MustNewConstMetric(descCapacity, prometheus.GaugeValue, float64(sn.CapacityTokens), sn.Name)
		if sn.Metrics.HasKVUsage { // unknown is no sample, not an empty cache
			ch <- prometheus.MustNewConstMetric(descUsage, prometheus.GaugeValue, sn.Metrics.KVUsage, sn.Name)
		}
		ch <- prometheus.MustNewConstMetric(descAge, prometheus.GaugeValue, sn.Age(now).Seconds(), sn.Name)
		ch <- prometheus.MustNewConstMetric(descStale, prometheus.GaugeValue, b2f(sn.Stale(now)), sn.Name)
		ch <- prometheus.MustNewConstMetric(descRoutable, prometheus.GaugeValue, b2f(sn.Routable()), sn.Name)
		src := sn.ProgressSource()
		for _, v := range gpu.ProgressSources {
			ch <- prometheus.MustNewConstMetric(descProgress, prometheus.GaugeValue, b2f(v == src), sn.Name, v)
		}
	}
}
