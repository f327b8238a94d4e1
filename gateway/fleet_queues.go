package gateway

import (
	"context"
	"net/http"
	"sync"
	"time"

	"github.com/kvgate/kvgate/scheduler"
	"github.com/kvgate/kvgate/store"
)

// GET /v1/fleet/queues: who waits, and who gets admitted. Per class and
// tenant, what waits in this replica's scheduler and in the durable
// backlog (shared by every replica), the oldest eligible job's age, and
// each tenant's measured share of this replica's admissions against the
// share its weight entitles it to. An operator sees its own tenant's rows
// (and the classes' totals); an admin sees every tenant's.

// backlogTTL is how long one read of the durable backlog serves, when the
// gateway has no periodic collection to report (Config.Backlog): the read
// groups the runnable partial index (a quarter of a second with 100,000
// runnable jobs in SQLite), so a page refreshed in a loop costs one such
// read a second, not one a request.
const backlogTTL = time.Second

type queuesView struct {
	Object string `json:"object"` // "fleet.queues"
	At     int64  `json:"at_ms"`
	// Classes: this replica's scheduler queue by class, with each
	// tenant's part and admissions.
	Classes []queueClassView `json:"classes"`
	// Backlog: the durable runnable backlog, every replica's, by tenant
	// and class (from the store; read at backlog_at_ms).
	Backlog   []backlogView `json:"backlog"`
	BacklogAt int64         `json:"backlog_at_ms,omitempty"`
}

type queueClassView struct {
	Class   string            `json:"class"`
	Queued  int               `json:"queued"` // every tenant's
	Tenants []queueTenantView `json:"tenants"`
}

type queueTenantView struct {
	Tenant         string  `json:"tenant"`
	Weight         float64 `json:"weight"`
	Queued         int     `json:"queued"`
	QueuedTokens   int     `json:"queued_tokens"`
	OldestWaitMS   int64   `json:"oldest_wait_ms"`
	Admitted       int64   `json:"admitted"`        // since this replica started
	AdmittedTokens int64   `json:"admitted_tokens"` // KV tokens those reserved
	Share          float64 `json:"share"`           // of the class's tokens admitted in about the last minute
	WeightShare    float64 `json:"weight_share"`    // its weight over the class's active tenants'
}

type backlogView struct {
	Tenant string `json:"tenant"`
	Class  string `json:"class"`
	Jobs   int    `json:"jobs"`
	Tokens int64  `json:"tokens"`
	// OldestEligibleAgeS is how long the group's longest-waiting runnable
	// job has been eligible.
	OldestEligibleAgeS float64 `json:"oldest_eligible_age_s"`
}

type tenantQueueReporter interface {
	TenantQueues() []scheduler.TenantQueue
}

// backlogCache keeps the last read of the durable backlog.
type backlogCache struct {
	mu sync.Mutex
	at time.Time
	st store.Stats
}

// backlog is the durable backlog: the periodic collection's when the
// gateway has one (Config.Backlog), else a read of its own, kept for
// backlogTTL.
func (s *Server) backlog(ctx context.Context, now time.Time) (store.Stats, time.Time, error) {
	if s.cfg.Backlog != nil {
		bl, at := s.cfg.Backlog()
		return store.Stats{Backlog: bl}, at, nil
	}
	sr, ok := s.jobs.Store.(store.StatsReader)
	if !ok {
		return store.Stats{}, time.Time{}, nil
	}
	c := &s.backlogs
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.at.IsZero() && now.Sub(c.at) < backlogTTL {
		return c.st, c.at, nil
	}
	st, err := sr.Stats(ctx, now)
	if err != nil {
		return store.Stats{}, time.Time{}, err
	}
	c.st, c.at = st, now
	return st, now, nil
}

func (s *Server) handleFleetQueues(w http.ResponseWriter, r *http.Request) int {
	ctx := r.Context()
	if !isOperator(ctx) {
		return writeError(w, s.log, errOperatorOnly)
	}
	v, err := s.queues(ctx, time.Now())
	if err != nil {
		return writeError(w, s.log, err)
	}
	writeJSON(w, http.StatusOK, v)
	return http.StatusOK
}

// queues is the queues' view as the caller (ctx's key) may see it: GET
// /v1/fleet/queues, and the "queues" events of /v1/fleet/events?include=queues.
func (s *Server) queues(ctx context.Context, now time.Time) (queuesView, error) {
	all, own := isAdmin(ctx), tenantOf(ctx)
	v := queuesView{Object: "fleet.queues", At: now.UnixMilli(), Classes: []queueClassView{}, Backlog: []backlogView{}}
	var totals [2]int
	if qr, ok := s.sched.(queueReporter); ok {
		totals = qr.Queued()
	}
	for _, c := range []scheduler.Class{scheduler.Interactive, scheduler.Batch} {
		v.Classes = append(v.Classes, queueClassView{Class: c.String(), Queued: totals[c], Tenants: []queueTenantView{}})
	}
	if tr, ok := s.sched.(tenantQueueReporter); ok {
		for _, q := range tr.TenantQueues() {
			if (!all && q.Tenant != own) || int(q.Class) >= len(v.Classes) {
				continue
			}
			cv := &v.Classes[q.Class]
			cv.Tenants = append(cv.Tenants, queueTenantView{Tenant: q.Tenant, Weight: q.Weight, Queued: q.Queued,
				QueuedTokens: q.QueuedTokens, OldestWaitMS: q.OldestWait.Milliseconds(), Admitted: q.Admitted,
				AdmittedTokens: q.AdmittedTokens, Share: q.Share, WeightShare: q.WeightShare})
		}
	}
	if s.jobs.Store != nil {
		st, at, err := s.backlog(ctx, now)
		if err != nil {
			return queuesView{}, err
		}
		if !at.IsZero() {
			v.BacklogAt = at.UnixMilli()
		}
		for _, b := range st.Backlog {
			if !all && b.Tenant != own {
				continue
			}
			v.Backlog = append(v.Backlog, backlogView{Tenant: b.Tenant, Class: scheduler.JobClass(b.Priority), Jobs: b.Jobs,
				Tokens: b.Tokens, OldestEligibleAgeS: max(0, at.Sub(b.OldestAvailable).Seconds())})
		}
	}
	return v, nil
}
