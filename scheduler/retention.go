package scheduler

import (
	"cmp"
	"context"
	"log/slog"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// pruneStore is what the pruner needs of the store.
type pruneStore interface {
	PruneFinal(ctx context.Context, before time.Time, limit int) (int, error)
}

// RetentionConfig tunes a Pruner. Zero values take the defaults in
// brackets.
type RetentionConfig struct {
	// Retention is how long a final job (its result, attempts, checkpoints,
	// events and audit records) is kept after its last change [30 days].
	// Dead letters and jobs under review keep as long: until replayed,
	// decided or pruned.
	Retention time.Duration
	Every     time.Duration // how often a pruning pass runs [10m]
	Batch     int           // jobs deleted per transaction [500]
	// Pause is the wait between batches of one pass, so that a large
	// backlog is pruned without holding the store busy [100ms].
	Pause  time.Duration
	Now    func() time.Time
	Logger *slog.Logger
}

// Pruner deletes final jobs past their retention, in bounded batches.
// Every replica may run one: the batches of two pruners delete
// different jobs or nothing.
type Pruner struct {
	st     pruneStore
	cfg    RetentionConfig
	pruned prometheus.Counter
}

// NewPruner returns a pruner; Run starts it.
func NewPruner(st pruneStore, cfg RetentionConfig) *Pruner {
	cfg.Retention = cmp.Or(cfg.Retention, 30*24*time.Hour)
	cfg.Every = cmp.Or(cfg.Every, 10*time.Minute)
	cfg.Batch = cmp.Or(cfg.Batch, 500)
	cfg.Pause = cmp.Or(cfg.Pause, 100*time.Millisecond)
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	return &Pruner{st: st, cfg: cfg, pruned: prometheus.NewCounter(prometheus.CounterOpts{
		Name: "kvgate_jobs_pruned_total", Help: "Final jobs deleted after their retention (jobs.retention), with their results, attempts, checkpoints, events and audit records.",
	})}
}

// Collectors returns the pruner's metrics, to register once.
func (p *Pruner) Collectors() []prometheus.Collector { return []prometheus.Collector{p.pruned} }

// Run prunes every Every until ctx ends, and returns ctx's error.
func (p *Pruner) Run(ctx context.Context) error {
	t := time.NewTicker(p.cfg.Every)
	defer t.Stop()
	for {
		if _, err := p.Pass(ctx); err != nil && ctx.Err() == nil {
			p.cfg.Logger.Warn("pruning final jobs failed", "err", err)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-t.C:
		}
	}
}

// Pass deletes the final jobs past their retention now, a batch at a
// time, and returns how many it deleted.
func (p *Pruner) Pass(ctx context.Context) (int, error) {
	before := p.cfg.Now().Add(-p.cfg.Retention)
	total := 0
	for {
		n, err := p.st.PruneFinal(ctx, before, p.cfg.Batch)
		total += n
		p.pruned.Add(float64(n))
		if err != nil || n < p.cfg.Batch {
			if total > 0 {
				p.cfg.Logger.Info("pruned final jobs past their retention", "jobs", total, "retention", p.cfg.Retention)
			}
			return total, err
		}
		t := time.NewTimer(p.cfg.Pause)
		select {
		case <-ctx.Done():
			t.Stop()
			return total, ctx.Err()
		case <-t.C:
		}
	}
}
