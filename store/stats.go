package store

import (
	"context"
	"time"
)

// Backlog is one group of the durable runnable backlog: a tenant's jobs
// that a claim could take now (READY or RETRY_SCHEDULED, available,
// before their deadline), those of priority 0 (the jobs API's) apart from
// the others (Batch API lines, each of a priority of its own): Priority
// is the group's lowest.
type Backlog struct {
	Tenant   string
	Priority int
	Jobs     int
	Tokens   int64 // the jobs' token estimates, summed
	// OldestAvailable is when the group's longest-waiting job became
	// runnable: now minus it is the oldest eligible job's age.
	OldestAvailable time.Time
}

// Stats is the durable path's state as metrics report it.
type Stats struct {
	Backlog []Backlog
	// OldestUnpublished is when the oldest outbox event not yet published
	// was committed; zero when every event is published.
	OldestUnpublished time.Time
}

// StatsReader reads Stats in a few cheap queries over the partial
// indexes of runnable jobs and unpublished events. Both SQL stores
// implement it; the metrics collector calls it on a period, never per
// scrape.
type StatsReader interface {
	Stats(ctx context.Context, now time.Time) (Stats, error)
}
