package scheduler

import (
	"cmp"
	"math"
	"slices"
	"time"
)

// Per-tenant reports, for operators (GET /v1/fleet/queues): what each
// tenant has waiting in this replica's queue, by class, and what this
// replica has admitted for it, against its weight. Reading them never
// changes a decision: the counts are kept beside admission (tryAdmit
// calls noteAdmission with the grant it made), not used by it.

// shareWindow is the time constant of the recent admissions a tenant's
// measured share is taken over: tokens admitted decay by e every minute.
const shareWindow = time.Minute

// tenantAdmissions is one tenant's admissions in one class.
type tenantAdmissions struct {
	weight float64 // the weight its last ticket carried
	count  int64
	tokens int64   // KV tokens reserved (prompt plus output budget)
	recent float64 // tokens, decayed over shareWindow
	at     time.Time
}

type tenantClass struct {
	class  Class
	tenant string
}

// decayed is a's recent tokens at now.
func (a *tenantAdmissions) decayed(now time.Time) float64 {
	if dt := now.Sub(a.at); dt > 0 {
		return a.recent * math.Exp(-dt.Seconds()/shareWindow.Seconds())
	}
	return a.recent
}

// noteAdmission counts an admitted ticket for its tenant; s.mu is held.
func (s *Scheduler) noteAdmission(t *Ticket, now time.Time) {
	if s.tenantAdm == nil {
		s.tenantAdm = map[tenantClass]*tenantAdmissions{}
	}
	k := tenantClass{t.Class, t.Tenant}
	a := s.tenantAdm[k]
	if a == nil {
		a = &tenantAdmissions{}
		s.tenantAdm[k] = a
	}
	need := int64(max(t.Need(), 1))
	a.recent = a.decayed(now) + float64(need)
	a.at, a.weight = now, cmp.Or(t.Weight, 1)
	a.count++
	a.tokens += need
}

// TenantQueue is one tenant's part of one class, on this replica.
type TenantQueue struct {
	Class  Class
	Tenant string
	Weight float64 // its tickets' weight (the last one seen)
	// Waiting in this replica's queue now.
	Queued       int
	QueuedTokens int
	OldestWait   time.Duration // of its longest-waiting ticket
	// Admitted since start, and the KV tokens they reserved.
	Admitted       int64
	AdmittedTokens int64
	// Share is its part of the class's tokens admitted recently (decayed
	// over a minute): what weighted fair queueing divides. WeightShare
	// is its weight over the weights of the class's active tenants
	// (those with work waiting or admitted recently): the share its
	// weight entitles it to while they all have work.
	Share, WeightShare float64
}

// TenantQueues reports every tenant with work waiting or admitted, by
// class then tenant.
func (s *Scheduler) TenantQueues() []TenantQueue {
	now := s.now()
	s.mu.Lock()
	defer s.mu.Unlock()
	rows := map[tenantClass]*TenantQueue{}
	row := func(c Class, tenant string) *TenantQueue {
		k := tenantClass{c, tenant}
		r := rows[k]
		if r == nil {
			r = &TenantQueue{Class: c, Tenant: tenant, Weight: 1}
			rows[k] = r
		}
		return r
	}
	for c := range s.queues {
		for _, t := range s.queues[c] {
			r := row(Class(c), t.Tenant)
			r.Queued++
			r.QueuedTokens += t.Need()
			r.OldestWait = max(r.OldestWait, now.Sub(t.enqueued))
			r.Weight = cmp.Or(t.Weight, 1)
		}
	}
	var recent [numClasses]float64
	recentOf := map[tenantClass]float64{}
	for k, a := range s.tenantAdm {
		r := row(k.class, k.tenant)
		r.Admitted, r.AdmittedTokens = a.count, a.tokens
		if r.Queued == 0 {
			r.Weight = a.weight
		}
		d := a.decayed(now)
		recentOf[k] = d
		recent[k.class] += d
	}
	var weights [numClasses]float64
	active := func(r *TenantQueue) bool {
		return r.Queued > 0 || recentOf[tenantClass{r.Class, r.Tenant}] >= 1
	}
	for _, r := range rows {
		if active(r) {
			weights[r.Class] += r.Weight
		}
	}
	out := make([]TenantQueue, 0, len(rows))
	for k, r := range rows {
		if recent[k.class] > 0 {
			r.Share = recentOf[k] / recent[k.class]
		}
		if active(r) && weights[k.class] > 0 {
			r.WeightShare = r.Weight / weights[k.class]
		}
		out = append(out, *r)
	}
	slices.SortFunc(out, func(a, b TenantQueue) int {
		return cmp.Or(cmp.Compare(a.Class, b.Class), cmp.Compare(a.Tenant, b.Tenant))
	})
	return out
}
