package scheduler

import (
	"time"

	"github.com/kvgate/kvgate/store"
)

// Backlog returns the durable runnable backlog as the last collection read
// it and when (zero before the first, or while collections fail for three
// periods, as the gauges are withheld): for reports that must not group
// the runnable index per request (GET /v1/fleet/queues).
func (d *DurableMetrics) Backlog() ([]store.Backlog, time.Time) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.statsAt.IsZero() || d.cfg.Now().Sub(d.statsAt) > 3*d.cfg.Every {
		return nil, time.Time{}
	}
	return append([]store.Backlog(nil), d.stats.Backlog...), d.statsAt
}
