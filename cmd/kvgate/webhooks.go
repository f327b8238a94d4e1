package main

import (
	"fmt"
	"log/slog"
	"net/netip"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvgate/kvgate/gateway"
	"github.com/kvgate/kvgate/gateway/webhook"
	"github.com/kvgate/kvgate/store"
)

// webhookGuard is the egress guard of webhooks.allow_cidrs and
// webhooks.allow_http.
func (c *config) webhookGuard() (*webhook.Guard, error) {
	g := &webhook.Guard{AllowHTTP: c.Webhooks.AllowHTTP}
	for i, s := range c.Webhooks.AllowCIDRs {
		p, err := netip.ParsePrefix(s)
		if err != nil {
			return nil, fmt.Errorf("webhooks.allow_cidrs[%d] %q is not a CIDR range such as 10.0.0.0/8: %v", i, s, err)
		}
		g.AllowCIDRs = append(g.AllowCIDRs, p.Masked())
	}
	return g, nil
}

// webhookDispatcher is the replica's dispatcher of webhook deliveries.
func (c *config) webhookDispatcher(st store.Store, reg prometheus.Registerer, log *slog.Logger) (*gateway.Dispatcher, *webhook.Guard, error) {
	g, err := c.webhookGuard()
	if err != nil {
		return nil, nil, err
	}
	sched := c.Webhooks.RetrySchedule
	if len(sched) == 0 {
		sched = nil // the default
	}
	d, err := gateway.NewDispatcher(gateway.DispatcherConfig{Store: st, Guard: g, Schedule: sched, Timeout: c.Webhooks.Timeout,
		Concurrency: c.Webhooks.Concurrency, Log: log, Registerer: reg})
	return d, g, err
}
