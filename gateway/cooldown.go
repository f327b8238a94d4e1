package gateway

import (
	"time"

	"github.com/kvgate/kvgate/scheduler"
)

// The pause after a 429: at least defaultCooldown (a 429 without a
// Retry-After), at most maxCooldown, whatever the backend asks (an HTTP
// date far ahead would otherwise take it out for days, on every replica).
const (
	defaultCooldown = time.Second
	maxCooldown     = time.Minute
)

// cooldown pauses new work to a backend that answered 429, for as long as
// it asked within [defaultCooldown, maxCooldown], and tells the other
// replicas.
func (s *Server) cooldown(g *scheduler.Grant, retryAfter time.Duration) {
	until := time.Now().Add(min(max(retryAfter, defaultCooldown), maxCooldown))
	if s.pool.Cooldown(g.Backend, until) {
		s.m.cooldowns.WithLabelValues(g.Backend).Inc()
		if s.cfg.OnCooldown != nil {
			s.cfg.OnCooldown(g.URL, until)
		}
	}
}
