package scheduler

import (
	"cmp"
	"context"
	"log/slog"
	"sync"
	"time"

	"github.com/google/uuid"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvgate/kvgate/store"
)

// DurableMetricsConfig configures the durable path's gauges.
type DurableMetricsConfig struct {
	// Store is read on a period, never per scrape: one GROUP BY over the
	// runnable partial index and one head-of-index read, every Every.
	Store store.StatsReader
	// Pending returns the broker lag (events on the stream the shared
	// inbox consumer has not acknowledged); ok false while the broker is
	// not set up. nil: no broker.
	Pending func(ctx context.Context) (n uint64, ok bool, err error)
	Every   time.Duration // the period [5s]
	// Tenants are reported from the start, at 0 while they have no
	// backlog (the static keys' tenants): a dashboard finds their series
	// before their first job. Others appear with their first backlog.
	Tenants []string
	Logger  *slog.Logger
	Now     func() time.Time
}

// DurableMetrics exports what seed 000 asks to measure apart: the durable
// runnable backlog (jobs and tokens, by class and tenant), the oldest
// eligible job's age, the outbox's oldest unpublished event, the broker
// lag, and the completion latency (accept to final state). The gauges
// come from the last collection; when collections have failed for three
// periods the store's gauges are withheld rather than reported stale.
type DurableMetrics struct {
	cfg        DurableMetricsConfig
	log        *slog.Logger
	errors     prometheus.Counter
	completion prometheus.Histogram

	mu        sync.Mutex
	stats     store.Stats
	statsAt   time.Time // of the last successful collection
	pending   float64
	pendingOK bool
	// noConsumer: the broker's consumer did not exist yet at the last read.
	noConsumer bool
	// readOnce: a read of the broker's lag has succeeded.
	readOnce bool
	seen     map[[2]string]bool // class, tenant pairs reported before: 0 once empty

	statsFailing bool // the last read of the backlog failed (Refresh's alone)
}

var (
	descRunnable       = prometheus.NewDesc("kvgate_jobs_runnable", "Durable runnable backlog: jobs a claim could take now (READY or RETRY_SCHEDULED, available, before their deadline), by class and tenant.", []string{"class", "tenant"}, nil)
	descRunnableTokens = prometheus.NewDesc("kvgate_jobs_runnable_tokens", "Token estimate (prompt plus reserved output) of the durable runnable backlog, by class and tenant.", []string{"class", "tenant"}, nil)
	descOldestRunnable = prometheus.NewDesc("kvgate_jobs_oldest_runnable_age_seconds", "Age of the oldest eligible durable job (since it became runnable), by class; 0 with no backlog.", []string{"class"}, nil)
	descOutboxAge      = prometheus.NewDesc("kvgate_outbox_oldest_unpublished_age_seconds", "Age of the oldest outbox event not yet published to the broker; 0 when all are.", nil, nil)
	descInboxPending   = prometheus.NewDesc("kvgate_inbox_pending", "Broker lag: job events on the stream the shared inbox consumer has not acknowledged (pending plus unacknowledged deliveries).", nil, nil)
)

// NewDurableMetrics returns the collector; Run collects.
func NewDurableMetrics(cfg DurableMetricsConfig) *DurableMetrics {
	cfg.Every = cmp.Or(cfg.Every, 5*time.Second)
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	d := &DurableMetrics{
		cfg: cfg, log: log.With("component", "durable_metrics"), seen: map[[2]string]bool{},
		errors: prometheus.NewCounter(prometheus.CounterOpts{Name: "kvgate_jobs_stats_errors_total",
			Help: "Periodic reads of the backlog, outbox or broker lag that failed."}),
		completion: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "kvgate_job_completion_seconds",
			Help:    "Durable jobs' time from acceptance to a final state (succeeded, review, failed, cancelled), observed once per final event fleet-wide, where the shared inbox receives it: a review's decision and a replayed job's new end count again, from the job's first acceptance.",
			Buckets: []float64{0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 7200, 21600, 86400}}),
	}
	for _, t := range cfg.Tenants {
		d.seen[[2]string{Batch.String(), t}] = true
	}
	return d
}

// Collectors returns the metrics, to register once.
func (d *DurableMetrics) Collectors() []prometheus.Collector {
	return []prometheus.Collector{d, d.errors, d.completion}
}

// Run collects every period until ctx ends; it returns ctx's error. Until
// the broker's consumer exists (it connects after the first collection),
// the broker lag is read again every quarter second, so that it is not
// missing from /metrics for a whole period after start.
func (d *DurableMetrics) Run(ctx context.Context) error {
	t := time.NewTicker(d.cfg.Every)
	defer t.Stop()
	for {
		d.Refresh(ctx)
		for d.awaitingPending() {
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-t.C:
				d.Refresh(ctx)
			case <-time.After(min(d.cfg.Every, 250*time.Millisecond)):
				d.refreshPending(ctx)
			}
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-t.C:
		}
	}
}

// awaitingPending reports whether the broker's lag has not been read yet:
// its consumer does not exist yet, or no read has succeeded since the
// start (the broker may still be starting). Once one has, an error
// reading it waits for the next period.
func (d *DurableMetrics) awaitingPending() bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.cfg.Pending != nil && (d.noConsumer || !d.readOnce)
}

// Refresh collects once.
func (d *DurableMetrics) Refresh(ctx context.Context) {
	ctx, cancel := context.WithTimeout(ctx, max(d.cfg.Every, time.Second))
	defer cancel()
	now := d.cfg.Now()
	if d.cfg.Store != nil {
		st, err := d.cfg.Store.Stats(ctx, now)
		if err != nil {
			d.errors.Inc()
			// Once at Warn: after three periods the backlog's gauges are
			// withheld, and the alerts on them see no series.
			if !d.statsFailing {
				d.log.Warn("durable backlog stats failed: its gauges are withheld after three periods", "err", err)
			} else {
				d.log.Debug("durable backlog stats failed", "err", err)
			}
			d.statsFailing = true
		} else {
			if d.statsFailing {
				d.log.Info("durable backlog stats read again")
			}
			d.statsFailing = false
			d.mu.Lock()
			d.stats, d.statsAt = st, now
			d.mu.Unlock()
		}
	}
	d.refreshPending(ctx)
}

// refreshPending reads the broker lag.
func (d *DurableMetrics) refreshPending(ctx context.Context) {
	if d.cfg.Pending == nil {
		return
	}
	ctx, cancel := context.WithTimeout(ctx, max(d.cfg.Every, time.Second))
	defer cancel()
	n, ok, err := d.cfg.Pending(ctx)
	if err != nil {
		d.errors.Inc()
		d.log.Debug("inbox pending failed", "err", err)
	}
	d.mu.Lock()
	d.pending, d.pendingOK = float64(n), ok && err == nil
	d.noConsumer = !ok && err == nil
	d.readOnce = d.readOnce || d.pendingOK
	d.mu.Unlock()
}

// ObserveEvent feeds the completion histogram from the inbox: a job's
// final event, received once fleet-wide, against its acceptance (the
// job id's UUIDv7 time, to the millisecond).
func (d *DurableMetrics) ObserveEvent(e Event) {
	if !e.State.Final() || e.CreatedAt.IsZero() {
		return
	}
	id, err := uuid.Parse(e.JobID)
	if err != nil || id.Version() != 7 {
		return
	}
	sec, nsec := id.Time().UnixTime()
	if took := e.CreatedAt.Sub(time.Unix(sec, nsec)); took >= 0 {
		d.completion.Observe(took.Seconds())
	}
}

// JobClass is the class label of a durable job of a priority: "batch"
// (the scheduler class jobs run in) at the default priority 0, the jobs
// API's; "batch_api" above it, the Batch API's lines (each line has a
// priority of its own: a label per priority would make a series per line).
func JobClass(priority int) string {
	if priority == 0 {
		return Batch.String()
	}
	return Batch.String() + "_api"
}

// Describe implements prometheus.Collector.
func (d *DurableMetrics) Describe(ch chan<- *prometheus.Desc) {
	for _, desc := range []*prometheus.Desc{descRunnable, descRunnableTokens, descOldestRunnable, descOutboxAge, descInboxPending} {
		ch <- desc
	}
}

// Collect implements prometheus.Collector from the last collection; ages
// are taken at the scrape.
func (d *DurableMetrics) Collect(ch chan<- prometheus.Metric) {
	d.mu.Lock()
	defer d.mu.Unlock()
	now := d.cfg.Now()
	if d.cfg.Pending != nil && d.pendingOK {
		ch <- prometheus.MustNewConstMetric(descInboxPending, prometheus.GaugeValue, d.pending)
	}
	if d.cfg.Store == nil || d.statsAt.IsZero() || now.Sub(d.statsAt) > 3*d.cfg.Every {
		return
	}
	type sum struct {
		jobs, tokens float64
	}
	groups := map[[2]string]sum{}
	oldest := map[string]time.Time{Batch.String(): {}}
	for _, b := range d.stats.Backlog {
		k := [2]string{JobClass(b.Priority), b.Tenant}
		g := groups[k]
		g.jobs += float64(b.Jobs)
		g.tokens += float64(b.Tokens)
		groups[k] = g
		d.seen[k] = true
		if o, ok := oldest[k[0]]; !ok || o.IsZero() || b.OldestAvailable.Before(o) {
			oldest[k[0]] = b.OldestAvailable
		}
	}
	for k := range d.seen {
		g := groups[k]
		ch <- prometheus.MustNewConstMetric(descRunnable, prometheus.GaugeValue, g.jobs, k[0], k[1])
		ch <- prometheus.MustNewConstMetric(descRunnableTokens, prometheus.GaugeValue, g.tokens, k[0], k[1])
		if _, ok := oldest[k[0]]; !ok {
			oldest[k[0]] = time.Time{}
		}
	}
	for class, o := range oldest {
		age := 0.0
		if !o.IsZero() {
			age = max(0, now.Sub(o).Seconds())
		}
		ch <- prometheus.MustNewConstMetric(descOldestRunnable, prometheus.GaugeValue, age, class)
	}
	age := 0.0
	if o := d.stats.OldestUnpublished; !o.IsZero() {
		age = max(0, now.Sub(o).Seconds())
	}
	ch <- prometheus.MustNewConstMetric(descOutboxAge, prometheus.GaugeValue, age)
}

// InboxPending is the broker lag: the events on the stream that the
// shared inbox consumer has not acknowledged, not yet delivered or
// delivered and unacknowledged; ok false until the broker is set up.
func (b *Broker) InboxPending(ctx context.Context) (n uint64, ok bool, err error) {
	c := b.cons.Load()
	if c == nil {
		return 0, false, nil
	}
	n, err = consumerPending(ctx, *c)
	return n, err == nil, err
}

// consumerPending is a consumer's lag: messages not yet delivered plus
// those delivered and not acknowledged.
func consumerPending(ctx context.Context, c jetstream.Consumer) (uint64, error) {
	info, err := c.Info(ctx)
	if err != nil {
		return 0, err
	}
	return info.NumPending + uint64(max(info.NumAckPending, 0)), nil
}
