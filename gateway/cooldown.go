package gateway

import (
	"time"

	"github.com/kvgate/kvgate/scheduler"
)

// defaultCooldown is the pause after a 429 that names no Retry-After.
const defaultCooldown = time.Second

// cooldown pauses new work to a backend that answered 429, for as long as
// it asked (at least defaultCooldown), and tells the other replicas.
func (s *Server) cooldown(g *scheduler.Grant, retryAfter time.Duration) {
	until := time.Now().Add(max(retryAfter, defaultCooldown))
	if s.pool.Cooldown(g.Backend, until) {
		s.m.cooldowns.WithLabelValues(g.Backend).Inc()
		if s.cfg.OnCooldown != nil {
			s.cfg.OnCooldown(g.URL, until)
		}
	}
}
