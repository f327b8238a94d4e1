package gateway

import (
	"fmt"
	"log/slog"
	"net/http"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// metrics are the gateway's own series. Labels are bounded: route
// templates, models the backends serve, backend names, status codes.
type metrics struct {
	requests *prometheus.CounterVec
	duration *prometheus.HistogramVec
	ttft     *prometheus.HistogramVec
	itl      *prometheus.HistogramVec
	upstream *prometheus.CounterVec
	retries  *prometheus.CounterVec
	inflight prometheus.Gauge
	// cooldowns counts the pauses backends' 429s started here.
	cooldowns *prometheus.CounterVec
}

func newMetrics() *metrics {
	return &metrics{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvgate_gateway_requests_total", Help: "API requests by route, method, model and status.",
		}, []string{"route", "method", "model", "status"}),
		duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "kvgate_gateway_request_duration_seconds", Help: "End-to-end API request latency, queueing included.",
			Buckets: []float64{0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320},
		}, []string{"route", "model"}),
		ttft: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "kvgate_gateway_time_to_first_token_seconds", Help: "Time from dispatch to the first streamed token.",
			Buckets: []float64{0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80},
		}, []string{"model"}),
		itl: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "kvgate_gateway_inter_token_seconds", Help: "Gaps between streamed tokens as the client sees them.",
			Buckets: []float64{0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1, 2.5, 5, 10},
		}, []string{"model"}),
		upstream: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvgate_gateway_upstream_errors_total", Help: "Backend failures by kind: connect, read, stall (silent past the timeout), 5xx, 429, refused (401/403: it wants a key kvgate does not send), model_missing (404: it no longer serves the model), malformed, stream_cut, stream_error (an error event in the stream).",
		}, []string{"backend", "kind"}),
		retries: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvgate_gateway_retries_total", Help: "Requests retried on another backend before their first byte.",
		}, []string{"model"}),
		inflight: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "kvgate_gateway_inflight_requests", Help: "API requests being served.",
		}),
		cooldowns: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "kvgate_gateway_backend_cooldowns_total", Help: "Pauses of new work to a backend that answered 429, started by this replica.",
		}, []string{"backend"}),
	}
}

func (m *metrics) register(reg prometheus.Registerer) error {
	for _, c := range []prometheus.Collector{m.requests, m.duration, m.ttft, m.itl, m.upstream, m.retries, m.inflight, m.cooldowns} {
		if err := reg.Register(c); err != nil {
			return err
		}
	}
	return nil
}

func (m *metrics) request(route, method, model string, status int, d time.Duration) {
	switch method {
	case http.MethodGet, http.MethodHead, http.MethodPost, http.MethodPatch, http.MethodPut, http.MethodDelete:
	default:
		method = "other" // a label takes no client's string
	}
	m.requests.WithLabelValues(route, method, model, strconv.Itoa(status)).Inc()
	m.duration.WithLabelValues(route, model).Observe(d.Seconds())
}

func (m *metrics) upstreamError(backend, kind string) {
	m.upstream.WithLabelValues(backend, kind).Inc()
}

func (m *metrics) retry(model string) { m.retries.WithLabelValues(model).Inc() }

// promLog logs what /metrics could not gather, at Warn.
type promLog struct{ log *slog.Logger }

func (l promLog) Println(v ...any) {
	l.log.Warn("metrics: a collector failed", "err", fmt.Sprint(v...))
}
