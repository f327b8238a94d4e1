package scheduler

import (
	"slices"
)

// Weighted fair queueing across tenants, within each class.
//
// Each class keeps a virtual clock (one per model, below). A ticket that enters the queue gets a
// start tag, the later of the clock and its tenant's last finish tag, and a
// finish tag, its start plus its cost (the KV tokens it reserves) divided
// by its tenant's weight. The queue is kept in finish-tag order and the
// clock moves to the start tag of each ticket admitted from it (start-time
// fair queueing). A tenant with a long backlog has finish tags far ahead
// of the clock, so another tenant's first ticket, tagged at the clock,
// goes ahead of all but the backlog's head: it waits at most about one
// ticket per other backlogged tenant, whatever their backlogs. Weights
// divide capacity in proportion while every tenant has work; capacity one
// leaves idle goes to the others. Ordering costs O(log n) to find a place
// and a copy to insert; the backlog is never scanned for fairness.

// Each class keeps one clock per model: models are served by backends
// of their own (or by shares of them), and a ticket admitted for one
// model while another model's backends are full moves only its own
// model's clock. With one clock for all, a tenant's ticket for an idle
// model, tagged behind its backlog for a saturated one, would carry the
// clock past that backlog when admitted, and every other tenant's next
// ticket for the saturated model would then queue behind the whole of
// it. For the same reason a tenant's finish tag is its own per model.

// fairClocks are one class's clocks, by model.
type fairClocks map[string]*fairClock

// of returns model's clock, made on first use.
func (cs *fairClocks) of(model string) *fairClock {
	if *cs == nil {
		*cs = fairClocks{}
	}
	c := (*cs)[model]
	if c == nil {
		c = &fairClock{}
		(*cs)[model] = c
	}
	return c
}

// fairClock is one class's virtual time for one model.
type fairClock struct {
	now    float64
	finish map[string]float64 // each tenant's last finish tag
}

// tag sets t's start and finish tags and records the tenant's finish.
func (c *fairClock) tag(t *Ticket) {
	if c.finish == nil {
		c.finish = map[string]float64{}
	}
	w := t.Weight
	if w <= 0 {
		w = 1
	}
	start := max(c.now, c.finish[t.Tenant])
	t.vstart, t.vfinish = start, start+float64(max(t.Need(), 1))/w
	c.finish[t.Tenant] = t.vfinish
}

// admitted moves the clock to the start of a ticket leaving the queue for
// service, and forgets tenants whose finish tags it has passed (the same
// as having none).
func (c *fairClock) admitted(t *Ticket, queued int) {
	c.now = max(c.now, t.vstart)
	if len(c.finish) > 2*queued+64 {
		for tenant, f := range c.finish {
			if f <= c.now {
				delete(c.finish, tenant)
			}
		}
	}
}

// removed forgets a ticket that left the queue unserved (cancelled or
// timed out): its tenant's finish tag goes back to its last queued
// ticket's for the model, or to none, so that work a tenant never got
// does not push its next requests behind everyone else's. q is the
// class's queue, every model's tickets.
func (c *fairClock) removed(t *Ticket, q []*Ticket) {
	if c.finish[t.Tenant] != t.vfinish {
		return // a later ticket of the tenant holds the tag
	}
	last := 0.0
	for _, x := range q {
		if x.Tenant == t.Tenant && x.Model == t.Model && x.vfinish > last {
			last = x.vfinish
		}
	}
	if last > 0 {
		c.finish[t.Tenant] = last
	} else {
		delete(c.finish, t.Tenant)
	}
}

// insertFair puts t into q in finish-tag order, after tickets with the
// same tag (first come, first served among equals).
func insertFair(q []*Ticket, t *Ticket) []*Ticket {
	i, _ := slices.BinarySearchFunc(q, t.vfinish, func(x *Ticket, f float64) int {
		if x.vfinish <= f {
			return -1
		}
		return 1
	})
	return slices.Insert(q, i, t)
}
