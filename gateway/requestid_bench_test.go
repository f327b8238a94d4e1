package gateway

import (
	"log/slog"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvgate/kvgate/gpu"
	"github.com/kvgate/kvgate/scheduler"
)

// BenchmarkRequestMiddleware measures what naming, tracing (off: the
// no-op provider) and access-logging a request adds: GET /v1/models
// through the mux alone and through ServeHTTP, side by side.
func BenchmarkRequestMiddleware(b *testing.B) {
	pool, err := gpu.NewPool([]gpu.BackendConfig{{URL: "http://127.0.0.1:1", Models: []string{"m"}}}, gpu.PoolConfig{})
	if err != nil {
		b.Fatal(err)
	}
	sched, err := scheduler.New(pool, scheduler.Options{})
	if err != nil {
		b.Fatal(err)
	}
	s, err := New(Config{Dev: true}, pool, sched, prometheus.NewRegistry(), slog.New(slog.DiscardHandler))
	if err != nil {
		b.Fatal(err)
	}
	for _, bc := range []struct {
		name string
		h    http.Handler
	}{{"mux", s.mux}, {"ServeHTTP", s}} {
		b.Run(bc.name, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				w := httptest.NewRecorder()
				bc.h.ServeHTTP(w, httptest.NewRequest(http.MethodGet, "/v1/models", nil))
				if w.Code != http.StatusOK {
					b.Fatal(w.Code, w.Body.String())
				}
			}
		})
	}
}
