package scheduler

import (
	"context"
	"math"
	"testing"
)

// TenantQueues reports each tenant's queued tickets and, once they are
// admitted, its admissions and measured share against its weight's.
func TestTenantQueues(t *testing.T) {
	s := newTestScheduler(t, Policy{MaxQueue: 1000}, backendSnap("a", 300)) // room for one 200-token ticket
	hold, err := s.Acquire(context.Background(), &Ticket{Tenant: "holder", Class: Batch, Model: model, PromptTokens: 100, MaxTokens: 100})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var chans []<-chan outcome
	n := 0
	for i := range 40 {
		for _, tk := range []*Ticket{{Tenant: "heavy", Weight: 3}, {Tenant: "light", Weight: 1}} {
			if tk.Tenant == "light" && i%3 != 0 {
				continue
			}
			tk.Class, tk.Model, tk.PromptTokens, tk.MaxTokens = Batch, model, 100, 100
			chans = append(chans, acquireAsync(ctx, s, tk))
			n++
			waitQueued(t, s, n)
		}
	}
	byTenant := func() map[string]TenantQueue {
		m := map[string]TenantQueue{}
		for _, r := range s.TenantQueues() {
			if r.Class != Batch {
				t.Errorf("a row of class %v: %+v", r.Class, r)
			}
			m[r.Tenant] = r
		}
		return m
	}
	q := byTenant()
	if h, l := q["heavy"], q["light"]; h.Queued != 40 || l.Queued != 14 || h.QueuedTokens != 40*200 || h.Weight != 3 || l.Weight != 1 ||
		h.OldestWait <= 0 || h.Admitted != 0 {
		t.Fatalf("queued: heavy %+v, light %+v", h, l)
	}
	if h := q["holder"]; h.Admitted != 1 || h.AdmittedTokens != 200 || h.Queued != 0 {
		t.Errorf("holder %+v, want 1 admitted of 200 tokens", h)
	}
	// Weight shares among the active tenants: 3, 1 and the holder's 1.
	if h, l := q["heavy"], q["light"]; math.Abs(h.WeightShare-0.6) > 1e-9 || math.Abs(l.WeightShare-0.2) > 1e-9 {
		t.Errorf("weight shares: heavy %v, light %v, want 0.6 and 0.2", h.WeightShare, l.WeightShare)
	}
	// Let 24 through, one at a time: while both wait, heavy gets 3 of 4.
	hold.Release()
	admitted := 0
	for admitted < 24 {
		for _, ch := range chans {
			select {
			case o := <-ch:
				if o.err != nil {
					t.Fatal(o.err)
				}
				admitted++
				o.g.Release()
			default:
			}
		}
	}
	q = byTenant()
	h, l := q["heavy"], q["light"]
	if h.Admitted+l.Admitted < 24 || h.Queued+l.Queued+int(h.Admitted+l.Admitted) != 54 {
		t.Fatalf("after 24 admissions: heavy %+v, light %+v", h, l)
	}
	// Shares are of every admission in the class, the holder's included;
	// between the two, heavy's is about three times light's.
	if h.Share <= 0 || l.Share <= 0 || math.Abs(h.Share+l.Share+q["holder"].Share-1) > 1e-9 {
		t.Errorf("shares: heavy %v, light %v, holder %v: want positive, summing to 1", h.Share, l.Share, q["holder"].Share)
	}
	if r := h.Share / l.Share; r < 2 || r > 4.5 {
		t.Errorf("heavy's share is %.2f× light's (%d and %d admitted), want about 3×", r, h.Admitted, l.Admitted)
	}
}
