package vllmsim

import (
	"context"
	"errors"
	"net/http/httptest"
	"testing"
)

// NewTestServer starts a simulator for cfg on an httptest server, with its
// engine running, for other packages' tests. Both stop when the test ends:
// first the HTTP server, which cuts open connections, then the engine.
func NewTestServer(tb testing.TB, cfg Config) (*Sim, *httptest.Server) {
	tb.Helper()
	sim, err := New(cfg)
	if err != nil {
		tb.Fatalf("vllmsim: %v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- sim.Run(ctx) }()
	tb.Cleanup(func() {
		cancel()
		if err := <-done; err != nil && !errors.Is(err, context.Canceled) {
			tb.Errorf("vllmsim engine: %v", err)
		}
	})
	srv := httptest.NewServer(sim)
	tb.Cleanup(srv.Close)
	return sim, srv
}
