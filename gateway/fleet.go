package gateway

import (
	"fmt"
	"net/http"
	"slices"
	"time"

	"github.com/kvgate/kvgate/gpu"
	"github.com/kvgate/kvgate/scheduler"
)

// The fleet's state, for operators: GET /v1/fleet answers it once, and GET
// /v1/fleet/events streams it (Server-Sent Events, one "fleet" event a
// second and at once on connecting). Backends are shared by every tenant,
// so any tenant's operator sees them all; a user key gets 403. The console's
// Fleet page draws its live chart from the stream. With ?include=queues
// each "fleet" event is followed by a "queues" event, the body of GET
// /v1/fleet/queues as the caller may see it: the console's Queues page
// follows it.

// fleetPeriod is how often the fleet stream sends the fleet's state.
const fleetPeriod = time.Second

type fleetView struct {
	Object   string             `json:"object"`
	At       int64              `json:"at_ms"`
	KVTarget float64            `json:"kv_target,omitempty"`
	Queued   map[string]int     `json:"queued,omitempty"` // waiting in kvgate, by class
	Backends []fleetBackendView `json:"backends"`
}

type fleetBackendView struct {
	Name           string   `json:"name"`
	Models         []string `json:"models"`
	Routable       bool     `json:"routable"`
	Stale          bool     `json:"stale"`
	Ejected        bool     `json:"ejected"`
	Cooling        bool     `json:"cooling"`
	HealthErr      string   `json:"health_error,omitempty"`
	ScrapeErr      string   `json:"scrape_error,omitempty"`
	KVUsage        *float64 `json:"kv_usage"` // 0..1 of capacity, as vLLM reports it; null when it does not
	CapacityTokens int      `json:"capacity_tokens"`
	Running        float64  `json:"running"`
	Waiting        float64  `json:"waiting"`
	Preemptions    float64  `json:"preemptions"`
	Inflight       int      `json:"inflight"`        // admitted by this replica
	ReservedTokens int      `json:"reserved_tokens"` // KV tokens this replica reserved
	// Refusals counts the admission checks this replica's scheduler made
	// that the backend refused, by reason (kv_budget, max_num_seqs,
	// backend_queue, ...), since start: checks, not tickets.
	Refusals  map[string]float64 `json:"refusals"`
	GPUHealth string             `json:"gpu_health,omitempty"`
	GPUs      []gpuView          `json:"gpus,omitempty"`
}

type gpuView struct {
	Index          int      `json:"index"`
	Name           string   `json:"name"`
	UtilGPU        uint32   `json:"util_gpu"`
	MemoryUsed     uint64   `json:"memory_used"`
	MemoryTotal    uint64   `json:"memory_total"`
	TemperatureC   uint32   `json:"temperature_c"`
	Throttle       []string `json:"throttle,omitempty"`
	ECCCorrected   uint64   `json:"ecc_corrected"`
	ECCUncorrected uint64   `json:"ecc_uncorrected"`
	Health         string   `json:"health"`
	Reasons        []string `json:"health_reasons,omitempty"` // why it is not healthy
}

// The scheduler's reports, when the admitter offers them (*scheduler.Scheduler does).
type (
	loadReporter interface {
		Loads() []scheduler.BackendLoad
	}
	queueReporter  interface{ Queued() [2]int }
	policyReporter interface{ Policy() scheduler.Policy }
)

func (s *Server) fleetRoutes() {
	s.mux.Handle("GET /v1/fleet", s.api("/v1/fleet", func(w http.ResponseWriter, r *http.Request) int {
		if !isOperator(r.Context()) {
			return writeError(w, s.log, errOperatorOnly)
		}
		writeJSON(w, http.StatusOK, s.fleet(time.Now()))
		return http.StatusOK
	}))
	s.mux.Handle("GET /v1/fleet/events", s.api("/v1/fleet/events", s.handleFleetEvents))
	s.mux.Handle("GET /v1/fleet/queues", s.api("/v1/fleet/queues", s.handleFleetQueues)) // fleet_queues.go
}

func (s *Server) handleFleetEvents(w http.ResponseWriter, r *http.Request) int {
	if !isOperator(r.Context()) {
		return writeError(w, s.log, errOperatorOnly)
	}
	var queues bool // ?include=queues: a "queues" event beside each "fleet" one
	switch inc := r.URL.Query().Get("include"); inc {
	case "":
	case "queues":
		queues = true
	default:
		return writeError(w, s.log, badRequest("include", fmt.Sprintf("include %q is not known: the stream can include queues.", inc)))
	}
	sse, err := startSSE(w, s.cfg.StreamIdleTimeout)
	if err != nil {
		return writeError(w, s.log, err)
	}
	t := time.NewTicker(fleetPeriod)
	defer t.Stop()
	for {
		now := time.Now()
		if err := sse.send("", "fleet", s.fleet(now)); err != nil {
			return http.StatusOK
		}
		if queues {
			q, err := s.queues(r.Context(), now)
			if err != nil {
				sse.fail(err)
				return http.StatusOK
			}
			if err := sse.send("", "queues", q); err != nil {
				return http.StatusOK
			}
		}
		select {
		case <-r.Context().Done():
			return http.StatusOK
		case <-s.drain.begun:
			// A view, not a request: it ends as the drain starts, so that
			// an open console does not hold the shutdown to its deadline.
			sse.fail(errViewDrained)
			return http.StatusOK
		case <-t.C:
			// A key revoked ends the stream, as it ends a job stream.
			if err := s.reauthorize(r); err != nil {
				sse.fail(err)
				return http.StatusOK
			}
		}
	}
}

func (s *Server) fleet(now time.Time) fleetView {
	v := fleetView{Object: "fleet", At: now.UnixMilli(), Backends: []fleetBackendView{}}
	loads := map[string]scheduler.BackendLoad{}
	if lr, ok := s.sched.(loadReporter); ok {
		for _, l := range lr.Loads() {
			loads[l.Backend] = l
		}
	}
	if pr, ok := s.sched.(policyReporter); ok {
		v.KVTarget = pr.Policy().KVTarget
	}
	if qr, ok := s.sched.(queueReporter); ok {
		q := qr.Queued()
		v.Queued = map[string]int{"interactive": q[scheduler.Interactive], "batch": q[scheduler.Batch]}
	}
	refusals := s.refusals()
	for _, sn := range s.pool.Snapshots() {
		b := fleetBackendView{Refusals: refusals[sn.Name], Name: sn.Name, Models: []string{}, Routable: sn.Routable(), Stale: sn.Stale(now), Ejected: sn.Ejected,
			Cooling: sn.Cooling(now), HealthErr: sn.HealthErr, ScrapeErr: sn.ScrapeErr,
			CapacityTokens: sn.CapacityTokens, Running: sn.Metrics.Running, Waiting: sn.Metrics.Waiting,
			Preemptions: sn.Metrics.Preemptions, Inflight: loads[sn.Name].Inflight, ReservedTokens: loads[sn.Name].Reserved}
		if b.Refusals == nil {
			b.Refusals = map[string]float64{}
		}
		if sn.Metrics.HasKVUsage {
			u := sn.Metrics.KVUsage
			b.KVUsage = &u
		}
		for _, m := range sn.Models {
			b.Models = append(b.Models, m.ID)
		}
		if len(sn.GPUs) > 0 {
			b.GPUHealth = healthName(sn.GPUHealth)
		}
		for _, g := range sn.GPUs {
			b.GPUs = append(b.GPUs, gpuView{Index: g.Index, Name: g.Name, UtilGPU: g.UtilGPU, MemoryUsed: g.MemoryUsed,
				MemoryTotal: g.MemoryTotal, TemperatureC: g.TemperatureC, Throttle: g.Throttle, ECCCorrected: g.ECCCorrected,
				ECCUncorrected: g.ECCUncorrected, Health: healthName(g.Health), Reasons: g.Reasons})
		}
		v.Backends = append(v.Backends, b)
	}
	slices.SortFunc(v.Backends, func(a, b fleetBackendView) int {
		if a.Name < b.Name {
			return -1
		}
		if a.Name > b.Name {
			return 1
		}
		return 0
	})
	return v
}

// refusals reads kvgate_scheduler_backend_refusals_total from the
// registry, by backend and reason: the metric is the one count of them.
func (s *Server) refusals() map[string]map[string]float64 {
	out := map[string]map[string]float64{}
	if s.gatherer == nil {
		return out
	}
	mfs, _ := s.gatherer.Gather() // what gathered: a collector that failed (the store away) is not this one
	for _, mf := range mfs {
		if mf.GetName() != "kvgate_scheduler_backend_refusals_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			var backend, reason string
			for _, l := range m.GetLabel() {
				switch l.GetName() {
				case "backend":
					backend = l.GetValue()
				case "reason":
					reason = l.GetValue()
				}
			}
			if out[backend] == nil {
				out[backend] = map[string]float64{}
			}
			out[backend][reason] += m.GetCounter().GetValue()
		}
	}
	return out
}

func healthName(h gpu.Health) string { return h.String() }
