package scheduler

import (
	"context"
	"testing"

	"github.com/kvgate/kvgate/gpu"
)

// fairRun queues tickets for several tenants on a backend with room for
// one at a time, then lets them through one by one and returns the
// tenants in admission order.
func fairRun(t *testing.T, tickets []*Ticket) []string {
	t.Helper()
	// Room for one 200-token ticket at a time (0.95 of 300 = 285).
	s := newTestScheduler(t, Policy{MaxQueue: 10_000}, backendSnap("a", 300))
	hold, err := s.Acquire(context.Background(), &Ticket{Tenant: "holder", Model: model, PromptTokens: 100, MaxTokens: 100})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	type admitted struct {
		tenant string
		g      *Grant
	}
	done := make(chan admitted, len(tickets))
	for i, tk := range tickets {
		tk.Model, tk.PromptTokens, tk.MaxTokens = model, 100, 100
		ch := acquireAsync(ctx, s, tk)
		go func() {
			o := <-ch
			if o.err == nil {
				done <- admitted{tk.Tenant, o.g}
			}
		}()
		waitQueued(t, s, i+1) // queued in this order
	}
	var order []string
	hold.Release()
	for range tickets {
		a := <-done
		order = append(order, a.tenant)
		a.g.Release()
	}
	return order
}

// A tenant's one ticket, queued behind another tenant's backlog, goes
// second: after the backlog's head, not after the backlog.
func TestFairNewTenantSkipsBacklog(t *testing.T) {
	var tickets []*Ticket
	for range 200 {
		tickets = append(tickets, &Ticket{Tenant: "bulk", Class: Batch})
	}
	tickets = append(tickets, &Ticket{Tenant: "small", Class: Batch})
	order := fairRun(t, tickets)
	pos := -1
	for i, tenant := range order {
		if tenant == "small" {
			pos = i
		}
	}
	if pos < 0 || pos > 1 {
		t.Errorf("the small tenant's ticket went %d-th behind a backlog of 200, want first or second", pos+1)
	}
}

// Saturated tenants share admissions in proportion to their weights.
func TestFairWeights(t *testing.T) {
	var tickets []*Ticket
	for i := range 150 {
		tickets = append(tickets, &Ticket{Tenant: "heavy", Weight: 2, Class: Batch})
		if i%2 == 0 {
			tickets = append(tickets, &Ticket{Tenant: "light", Weight: 1, Class: Batch})
			tickets = append(tickets, &Ticket{Tenant: "light", Weight: 1, Class: Batch})
		}
		tickets = append(tickets, &Ticket{Tenant: "third", Weight: 1, Class: Batch})
	}
	order := fairRun(t, tickets)
	// While all three have work (the first 120 admissions), heavy gets
	// half and the others a quarter each.
	counts := map[string]int{}
	for _, tenant := range order[:120] {
		counts[tenant]++
	}
	if h, l, o := counts["heavy"], counts["light"], counts["third"]; h < 55 || h > 65 || l < 25 || l > 35 || o < 25 || o > 35 {
		t.Errorf("first 120 admissions: heavy %d, light %d, third %d; want about 60, 30, 30", h, l, o)
	}
}

// Interactive tickets still go before batch ones, whatever the tags.
func TestFairKeepsClassOrder(t *testing.T) {
	tickets := []*Ticket{{Tenant: "a", Class: Batch}, {Tenant: "a", Class: Batch}, {Tenant: "b", Class: Interactive}}
	order := fairRun(t, tickets)
	if order[0] != "b" {
		t.Errorf("admission order %v, want the interactive ticket first", order)
	}
}

// A tenant whose queued tickets time out or are cancelled is not pushed
// behind the others for the work it never got.
func TestFairForgetsRemovedTickets(t *testing.T) {
	var c fairClock
	q := []*Ticket{}
	for range 50 {
		tk := &Ticket{Tenant: "gone", PromptTokens: 100, MaxTokens: 100}
		c.tag(tk)
		q = insertFair(q, tk)
	}
	// All 50 time out, last first and first last.
	for len(q) > 0 {
		tk := q[len(q)-1]
		q = q[:len(q)-1]
		c.removed(tk, q)
	}
	next := &Ticket{Tenant: "gone", PromptTokens: 100, MaxTokens: 100}
	other := &Ticket{Tenant: "other", PromptTokens: 100, MaxTokens: 100}
	c.tag(next)
	c.tag(other)
	if next.vfinish != other.vfinish {
		t.Errorf("after its backlog timed out, the tenant's next ticket finishes at %v, another's at %v: want equal", next.vfinish, other.vfinish)
	}
}

// A tenant's ticket for another model, admitted while its backlog for a
// saturated model waits, does not carry that model's clock past the
// backlog: another tenant's next ticket for the saturated model still
// goes second, after the backlog's head, not after the whole backlog.
func TestFairClockPerModel(t *testing.T) {
	onModel := func(name, m string) *gpu.Snapshot {
		sn := backendSnap(name, 300) // room for one 200-token ticket at a time
		sn.Models = []gpu.Model{{ID: m, MaxModelLen: 100_000}}
		return sn
	}
	s := newTestScheduler(t, Policy{MaxQueue: 10_000}, onModel("ba", "a"), onModel("bb", "b"))
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	ticket := func(tenant, m string) *Ticket {
		return &Ticket{Tenant: tenant, Model: m, PromptTokens: 100, MaxTokens: 100}
	}
	holdA, err := s.Acquire(ctx, ticket("holder", "a"))
	if err != nil {
		t.Fatal(err)
	}
	holdB, err := s.Acquire(ctx, ticket("holder", "b"))
	if err != nil {
		t.Fatal(err)
	}
	type admitted struct {
		tenant string
		g      *Grant
	}
	onA := make(chan admitted, 16)
	queue := func(tk *Ticket, n int) <-chan outcome {
		ch := acquireAsync(ctx, s, tk)
		waitQueued(t, s, n)
		return ch
	}
	for i := range 10 { // x's backlog for a
		ch := queue(ticket("x", "a"), i+1)
		go func() {
			if o := <-ch; o.err == nil {
				onA <- admitted{"x", o.g}
			}
		}()
	}
	xb := queue(ticket("x", "b"), 11) // tagged behind x's backlog
	holdB.Release()
	o := <-xb // admitted from the queue, for b
	if o.err != nil {
		t.Fatal(o.err)
	}
	defer o.g.Release()
	waitQueued(t, s, 10)
	zch := queue(ticket("z", "a"), 11)
	go func() {
		if o := <-zch; o.err == nil {
			onA <- admitted{"z", o.g}
		}
	}()
	holdA.Release()
	var order []string
	for range 11 {
		a := <-onA
		order = append(order, a.tenant)
		a.g.Release()
	}
	if order[1] != "z" {
		t.Errorf("admission order on a: %v; want z second, after x's head", order)
	}
}
