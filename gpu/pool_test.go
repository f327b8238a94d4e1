package gpu

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"net"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/dgxh100"

	"github.com/kvgate/kvgate/bench/eventually"

	"github.com/kvgate/kvgate/bench/vllmsim"
)

// fastPool is a PoolConfig on a test's time scale.
func fastPool() PoolConfig {
	return PoolConfig{
		ScrapeInterval: 10 * time.Millisecond,
		ProbeInterval:  20 * time.Millisecond,
		StaleAfter:     200 * time.Millisecond,
		EjectBase:      50 * time.Millisecond,
	}
}

// startSim starts an unpaced simulator of the small test profile; mutate,
// if not nil, adjusts its configuration first.
func startSim(t *testing.T, mutate func(*vllmsim.Config)) (*vllmsim.Sim, *httptest.Server) {
	t.Helper()
	cfg := vllmsim.Config{Profile: testProfile(t), Seed: 7}
	if mutate != nil {
		mutate(&cfg)
	}
	return vllmsim.NewTestServer(t, cfg)
}

func newTestPool(t *testing.T, cfgs []BackendConfig, pc PoolConfig) *Pool {
	t.Helper()
	p, err := NewPool(cfgs, pc)
	if err != nil {
		t.Fatalf("NewPool: %v", err)
	}
	return p
}

// runPool runs p until the test ends, and checks that Run returns the
// context's error once cancelled.
func runPool(t *testing.T, p *Pool) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- p.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; !errors.Is(err, context.Canceled) {
			t.Errorf("Run returned %v, want context.Canceled", err)
		}
	})
}

func mustSnapshot(t *testing.T, p *Pool, name string) *Snapshot {
	t.Helper()
	s, ok := p.Snapshot(name)
	if !ok {
		t.Fatalf("no backend %q", name)
	}
	return s
}

func TestPoolDiscovery(t *testing.T) {
	t.Run("one backend", func(t *testing.T) {
		sim, srv := startSim(t, nil)
		p := newTestPool(t, []BackendConfig{{Name: "a", URL: srv.URL}}, fastPool())
		if got := p.Models(); len(got) != 0 {
			t.Errorf("Models() before discovery = %v, want none", got)
		}
		if s := mustSnapshot(t, p, "a"); s.Routable() {
			t.Error("a backend with no known models is routable")
		}
		p.Probe(t.Context())
		want := []Model{{ID: sim.Model(), MaxModelLen: 8192}}
		if got := p.Models(); !slices.Equal(got, want) {
			t.Errorf("Models() = %v, want %v", got, want)
		}
		s := mustSnapshot(t, p, "a")
		if !slices.Equal(s.Models, want) {
			t.Errorf("snapshot Models = %v, want %v", s.Models, want)
		}
		if m, ok := s.Serves(sim.Model()); !ok || m != want[0] {
			t.Errorf("Serves(%q) = %v, %v", sim.Model(), m, ok)
		}
		if _, ok := s.Serves("other"); ok {
			t.Error(`Serves("other") = true`)
		}
		if !s.Routable() {
			t.Errorf("healthy discovered backend not routable: %+v", s)
		}
	})

	t.Run("Run discovers", func(t *testing.T) {
		sim, srv := startSim(t, nil)
		p := newTestPool(t, []BackendConfig{{Name: "a", URL: srv.URL}}, fastPool())
		runPool(t, p)
		eventually.True(t, "discovery", func() bool { return len(p.Models()) == 1 })
		if got := p.Models()[0].ID; got != sim.Model() {
			t.Errorf("model %q, want %q", got, sim.Model())
		}
	})

	t.Run("same model on two backends appears once", func(t *testing.T) {
		simA, srvA := startSim(t, nil)
		_, srvB := startSim(t, func(c *vllmsim.Config) { c.Profile.MaxModelLen = 4096 })
		p := newTestPool(t, []BackendConfig{{Name: "a", URL: srvA.URL}, {Name: "b", URL: srvB.URL}}, fastPool())
		p.Probe(t.Context())
		// The union keeps the smallest max_model_len, which every backend
		// serving the model can honour.
		want := []Model{{ID: simA.Model(), MaxModelLen: 4096}}
		if got := p.Models(); !slices.Equal(got, want) {
			t.Errorf("Models() = %v, want %v", got, want)
		}
		if got := mustSnapshot(t, p, "a").Models; !slices.Equal(got, []Model{{ID: simA.Model(), MaxModelLen: 8192}}) {
			t.Errorf("backend a's own models = %v", got)
		}
	})

	t.Run("served model names", func(t *testing.T) {
		_, srvA := startSim(t, func(c *vllmsim.Config) { c.ServedModelName = "beta" })
		_, srvB := startSim(t, func(c *vllmsim.Config) { c.ServedModelName = "alpha" })
		p := newTestPool(t, []BackendConfig{{Name: "a", URL: srvA.URL}, {Name: "b", URL: srvB.URL}}, fastPool())
		p.Probe(t.Context())
		want := []Model{{ID: "alpha", MaxModelLen: 8192}, {ID: "beta", MaxModelLen: 8192}}
		if got := p.Models(); !slices.Equal(got, want) {
			t.Errorf("Models() = %v, want %v (sorted by id)", got, want)
		}
		a := mustSnapshot(t, p, "a")
		if _, ok := a.Serves("beta"); !ok {
			t.Error(`backend a does not serve "beta"`)
		}
		if _, ok := a.Serves("alpha"); ok {
			t.Error(`backend a serves "alpha", which only b serves`)
		}
	})
}

func TestPoolModelFilter(t *testing.T) {
	sim, srvA := startSim(t, nil)
	_, srvB := startSim(t, nil)
	p := newTestPool(t, []BackendConfig{
		{Name: "other", URL: srvA.URL, Models: []string{"some-other-model"}},
		{Name: "listed", URL: srvB.URL, Models: []string{"x", sim.Model()}},
	}, fastPool())
	p.Probe(t.Context())
	if s := mustSnapshot(t, p, "other"); len(s.Models) != 0 || s.Routable() {
		t.Errorf("backend filtered to a model it lacks: models %v, routable %v", s.Models, s.Routable())
	}
	if s := mustSnapshot(t, p, "listed"); !slices.Equal(s.Models, []Model{{ID: sim.Model(), MaxModelLen: 8192}}) {
		t.Errorf("backend filtered to its model: models %v", s.Models)
	}
	if got := p.Models(); len(got) != 1 || got[0].ID != sim.Model() {
		t.Errorf("Models() = %v, want only %s", got, sim.Model())
	}
}

func TestPoolSnapshotFromSimulator(t *testing.T) {
	sim, srv := startSim(t, nil)
	prof := sim.Engine().Profile()
	pc := fastPool()
	pc.StaleAfter = 5 * time.Second // generous: "right after a scrape" on a slow machine
	// The same simulator behind a second listener, for a second backend.
	srv2 := httptest.NewServer(sim)
	t.Cleanup(srv2.Close)
	p := newTestPool(t, []BackendConfig{
		{Name: "default", URL: srv.URL + "/", CapacityTokens: 999},
		{Name: "configured", URL: srv2.URL, MaxNumSeqs: 64},
	}, pc)

	s := mustSnapshot(t, p, "default")
	if s.URL != srv.URL {
		t.Errorf("URL %q, want the trailing slash trimmed: %q", s.URL, srv.URL)
	}
	if !s.ScrapedAt.IsZero() || !s.Stale(time.Now()) || s.Age(time.Now()) != -1 {
		t.Errorf("before any scrape: ScrapedAt %v, Stale %v, Age %v; want zero, true, -1",
			s.ScrapedAt, s.Stale(time.Now()), s.Age(time.Now()))
	}
	if s.CapacityTokens != 999 || s.MaxNumSeqs != 256 || s.StaleAfter != pc.StaleAfter {
		t.Errorf("before any scrape: CapacityTokens %d, MaxNumSeqs %d, StaleAfter %v; want 999, 256, %v",
			s.CapacityTokens, s.MaxNumSeqs, s.StaleAfter, pc.StaleAfter)
	}

	before := time.Now()
	p.Scrape(t.Context())
	after := time.Now()
	for _, s := range p.Snapshots() {
		if s.ScrapeErr != "" {
			t.Fatalf("%s: scrape error %s", s.Name, s.ScrapeErr)
		}
		if want := prof.NumGPUBlocks * prof.BlockSize; s.CapacityTokens != want {
			t.Errorf("%s: CapacityTokens %d, want num_gpu_blocks × block_size = %d", s.Name, s.CapacityTokens, want)
		}
		if s.Metrics.BlockSize != prof.BlockSize || s.Metrics.NumGPUBlocks != prof.NumGPUBlocks || !s.Metrics.HasKVUsage {
			t.Errorf("%s: metrics %+v", s.Name, s.Metrics)
		}
		if s.ScrapedAt.Before(before) || s.ScrapedAt.After(after) {
			t.Errorf("%s: ScrapedAt %v outside the Scrape call [%v, %v]", s.Name, s.ScrapedAt, before, after)
		}
		if s.Stale(time.Now()) {
			t.Errorf("%s: stale right after a scrape", s.Name)
		}
		// Staleness is strictly older than the bound.
		if s.Stale(s.ScrapedAt.Add(s.StaleAfter)) || !s.Stale(s.ScrapedAt.Add(s.StaleAfter+time.Nanosecond)) {
			t.Errorf("%s: staleness boundary wrong around %v", s.Name, s.StaleAfter)
		}
		if got := s.Age(s.ScrapedAt.Add(3 * time.Second)); got != 3*time.Second {
			t.Errorf("%s: Age 3s after the scrape = %v", s.Name, got)
		}
		if s.GPUHealth != Healthy || s.GPUs != nil {
			t.Errorf("%s: without NVML, GPU health %v, GPUs %v; want healthy, none", s.Name, s.GPUHealth, s.GPUs)
		}
	}
	if got := mustSnapshot(t, p, "configured").MaxNumSeqs; got != 64 {
		t.Errorf("configured MaxNumSeqs = %d, want 64", got)
	}
	if got := mustSnapshot(t, p, "default").MaxNumSeqs; got != 256 {
		t.Errorf("default MaxNumSeqs = %d, want 256", got)
	}
}

// fakeBackend serves a fixed /metrics page (and status) with a healthy
// /health and one model, standing in for a server the simulator cannot
// imitate.
func fakeBackend(t *testing.T, status int, page string) *httptest.Server {
	t.Helper()
	mux := http.NewServeMux()
	mux.HandleFunc("GET /metrics", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/plain; version=0.0.4")
		w.WriteHeader(status)
		_, _ = w.Write([]byte(page))
	})
	mux.HandleFunc("GET /health", func(w http.ResponseWriter, r *http.Request) {})
	mux.HandleFunc("GET /v1/models", func(w http.ResponseWriter, r *http.Request) {
		_, _ = w.Write([]byte(`{"object":"list","data":[{"id":"fake","max_model_len":2048}]}`))
	})
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	return srv
}

func TestPoolScrapeFallbacksAndErrors(t *testing.T) {
	noInfo := fakeBackend(t, http.StatusOK, gauges+"vllm:kv_cache_usage_perc 0.5\n")
	noInfo2 := fakeBackend(t, http.StatusOK, gauges)
	broken := fakeBackend(t, http.StatusInternalServerError, "oops")
	empty := fakeBackend(t, http.StatusOK, unrelatedFamilies(2))
	p := newTestPool(t, []BackendConfig{
		{Name: "fallback", URL: noInfo.URL, CapacityTokens: 50000},
		{Name: "unknown", URL: noInfo2.URL},
		{Name: "broken", URL: broken.URL, CapacityTokens: 10},
		{Name: "empty", URL: empty.URL},
	}, fastPool())
	p.Scrape(t.Context())

	if s := mustSnapshot(t, p, "fallback"); s.CapacityTokens != 50000 || s.Metrics.CapacityTokens() != 0 ||
		s.Metrics.KVUsage != 0.5 || s.ScrapeErr != "" || s.ScrapedAt.IsZero() {
		t.Errorf("page without cache_config_info: CapacityTokens %d (want the configured 50000), metrics %+v, err %q",
			s.CapacityTokens, s.Metrics, s.ScrapeErr)
	}
	if s := mustSnapshot(t, p, "unknown"); s.CapacityTokens != 0 || s.ScrapeErr != "" {
		t.Errorf("no capacity anywhere: CapacityTokens %d, want 0; err %q", s.CapacityTokens, s.ScrapeErr)
	}
	if s := mustSnapshot(t, p, "broken"); !strings.Contains(s.ScrapeErr, "500") || !s.ScrapedAt.IsZero() ||
		!s.Stale(time.Now()) || s.CapacityTokens != 10 {
		t.Errorf("status 500: ScrapeErr %q, ScrapedAt %v, CapacityTokens %d", s.ScrapeErr, s.ScrapedAt, s.CapacityTokens)
	}
	if s := mustSnapshot(t, p, "empty"); s.ScrapeErr != ErrNoEngineMetrics.Error() || !s.ScrapedAt.IsZero() {
		t.Errorf("page without engine gauges: ScrapeErr %q, ScrapedAt %v", s.ScrapeErr, s.ScrapedAt)
	}
}

func TestPoolStaleWhenServerGone(t *testing.T) {
	_, srv := startSim(t, nil)
	pc := fastPool()
	p := newTestPool(t, []BackendConfig{{Name: "a", URL: srv.URL}}, pc)
	runPool(t, p)
	eventually.True(t, "a fresh scrape", func() bool {
		s := mustSnapshot(t, p, "a")
		return !s.ScrapedAt.IsZero() && !s.Stale(time.Now())
	})

	srv.Close()
	eventually.True(t, "the snapshot to go stale", func() bool { return mustSnapshot(t, p, "a").Stale(time.Now()) })
	now := time.Now()
	s := mustSnapshot(t, p, "a")
	if age := s.Age(now); age <= pc.StaleAfter {
		t.Errorf("stale snapshot aged %v, bound %v", age, pc.StaleAfter)
	}
	// Failed scrapes keep the last good metrics and say why they failed.
	if s.ScrapeErr == "" {
		t.Error("no scrape error after the server went away")
	}
	if s.Metrics.NumGPUBlocks == 0 {
		t.Errorf("last good metrics lost: %+v", s.Metrics)
	}
}

// checkEjectedFor checks that an ejection made between t0 and t1 lasts d.
func checkEjectedFor(t *testing.T, s *Snapshot, t0, t1 time.Time, d time.Duration) {
	t.Helper()
	if !s.Ejected || s.Routable() {
		t.Fatalf("not ejected: %+v", s)
	}
	if s.EjectedUntil.Before(t0.Add(d)) || s.EjectedUntil.After(t1.Add(d)) {
		t.Errorf("EjectedUntil %v, want within [%v, %v] (ejected for %v)", s.EjectedUntil, t0.Add(d), t1.Add(d), d)
	}
}

// recover probes until the backend is back, and checks it came back only
// after its ejection ended.
func recoverByProbing(t *testing.T, p *Pool, name string) {
	t.Helper()
	until := mustSnapshot(t, p, name).EjectedUntil
	eventually.True(t, "recovery", func() bool {
		p.Probe(t.Context())
		return !mustSnapshot(t, p, name).Ejected
	})
	if now := time.Now(); now.Before(until) {
		t.Errorf("recovered at %v, before its ejection ended at %v", now, until)
	}
	s := mustSnapshot(t, p, name)
	if !s.Routable() || s.Failures != 0 || s.ProbeFailures != 0 || s.HealthErr != "" {
		t.Errorf("after recovery: routable %v, failures %d/%d, health error %q", s.Routable(), s.Failures, s.ProbeFailures, s.HealthErr)
	}
}

func TestPoolEjectionByProbes(t *testing.T) {
	sim, srv := startSim(t, nil)
	pc := fastPool()
	pc.EjectAfter = 3
	pc.EjectBase = 200 * time.Millisecond
	pc.ProbeInterval = 5 * time.Second // only the probe timeout: the test probes by hand
	p := newTestPool(t, []BackendConfig{{Name: "a", URL: srv.URL}}, pc)
	p.Probe(t.Context())
	if s := mustSnapshot(t, p, "a"); !s.Routable() || s.Failures != 0 {
		t.Fatalf("healthy backend: %+v", s)
	}

	sim.SetFaults(vllmsim.Faults{Dead: true})
	for i := 1; i < pc.EjectAfter; i++ {
		p.Probe(t.Context())
		s := mustSnapshot(t, p, "a")
		if s.ProbeFailures != i || s.Ejected || !s.Routable() {
			t.Fatalf("after %d failed probes: probe failures %d, ejected %v, routable %v", i, s.ProbeFailures, s.Ejected, s.Routable())
		}
		if !strings.Contains(s.HealthErr, "503") {
			t.Errorf("HealthErr %q, want the 503", s.HealthErr)
		}
	}
	t0 := time.Now()
	p.Probe(t.Context())
	t1 := time.Now()
	first := mustSnapshot(t, p, "a")
	checkEjectedFor(t, first, t0, t1, pc.EjectBase)
	if first.ProbeFailures != pc.EjectAfter {
		t.Errorf("probe failures %d, want %d", first.ProbeFailures, pc.EjectAfter)
	}

	// Still dead: more failures, the same ejection.
	p.Probe(t.Context())
	if s := mustSnapshot(t, p, "a"); !s.Ejected || s.ProbeFailures != pc.EjectAfter+1 || !s.EjectedUntil.Equal(first.EjectedUntil) {
		t.Errorf("failed probe while ejected: ejected %v, probe failures %d, until %v (was %v)",
			s.Ejected, s.ProbeFailures, s.EjectedUntil, first.EjectedUntil)
	}

	// Alive again, but the ejection is served in full.
	sim.SetFaults(vllmsim.Faults{})
	p.Probe(t.Context())
	if s := mustSnapshot(t, p, "a"); time.Now().Before(s.EjectedUntil) && !s.Ejected {
		t.Error("a healthy probe ended the ejection early")
	}
	recoverByProbing(t, p, "a")

	// A second ejection lasts twice as long.
	sim.SetFaults(vllmsim.Faults{Dead: true})
	for range pc.EjectAfter - 1 {
		p.Probe(t.Context())
	}
	t0 = time.Now()
	p.Probe(t.Context())
	t1 = time.Now()
	second := mustSnapshot(t, p, "a")
	checkEjectedFor(t, second, t0, t1, 2*pc.EjectBase)
	sim.SetFaults(vllmsim.Faults{})
	recoverByProbing(t, p, "a")
}

func TestPoolEjectionBackoffCapped(t *testing.T) {
	_, srv := startSim(t, nil)
	pc := fastPool()
	pc.EjectAfter = 1
	pc.EjectBase = 40 * time.Millisecond
	pc.EjectMax = 100 * time.Millisecond
	_, other := startSim(t, nil) // serves the model too: a is not its last backend
	p := newTestPool(t, []BackendConfig{{Name: "a", URL: srv.URL}, {Name: "b", URL: other.URL}}, pc)
	p.Probe(t.Context())
	for _, want := range []time.Duration{40 * time.Millisecond, 80 * time.Millisecond, 100 * time.Millisecond, 100 * time.Millisecond} {
		t0 := time.Now()
		p.ReportFailure("a", errors.New("boom"))
		t1 := time.Now()
		checkEjectedFor(t, mustSnapshot(t, p, "a"), t0, t1, want)
		recoverByProbing(t, p, "a")
	}
}

func TestPoolReportedFailures(t *testing.T) {
	_, srv := startSim(t, nil)
	pc := fastPool()
	pc.EjectAfter = 3
	pc.EjectBase = 100 * time.Millisecond
	_, other := startSim(t, nil) // serves the model too: a is not its last backend
	p := newTestPool(t, []BackendConfig{{Name: "a", URL: srv.URL}, {Name: "b", URL: other.URL}}, pc)
	p.Probe(t.Context())

	// Unknown names are ignored.
	p.ReportFailure("nope", errors.New("x"))
	p.ReportSuccess("nope")
	if _, ok := p.Snapshot("nope"); ok {
		t.Error(`Snapshot("nope") found a backend`)
	}

	// Failures below the threshold: a success resets them.
	p.ReportFailure("a", errors.New("connection reset"))
	p.ReportFailure("a", errors.New("connection reset"))
	if s := mustSnapshot(t, p, "a"); s.Failures != 2 || s.Ejected || s.HealthErr != "connection reset" {
		t.Fatalf("after 2 failures: failures %d, ejected %v, err %q", s.Failures, s.Ejected, s.HealthErr)
	}
	p.ReportSuccess("a")
	if s := mustSnapshot(t, p, "a"); s.Failures != 0 || s.Ejected || !s.Routable() {
		t.Fatalf("after a success: failures %d, ejected %v", s.Failures, s.Ejected)
	}

	// A healthy probe does not: a backend whose /health is fine may still
	// fail every request.
	p.ReportFailure("a", errors.New("stall"))
	p.Probe(t.Context())
	if s := mustSnapshot(t, p, "a"); s.Failures != 1 || s.HealthErr != "stall" {
		t.Fatalf("after a healthy probe: failures %d, err %q; want the dispatch failure kept", s.Failures, s.HealthErr)
	}
	p.ReportSuccess("a")

	// EjectAfter in a row eject a backend whose /health is fine.
	for range pc.EjectAfter - 1 {
		p.ReportFailure("a", errors.New("500 from backend"))
	}
	t0 := time.Now()
	p.ReportFailure("a", errors.New("500 from backend"))
	t1 := time.Now()
	checkEjectedFor(t, mustSnapshot(t, p, "a"), t0, t1, pc.EjectBase)

	// A success does not end an ejection.
	p.ReportSuccess("a")
	if s := mustSnapshot(t, p, "a"); !s.Ejected || s.Failures != pc.EjectAfter {
		t.Errorf("success while ejected: ejected %v, failures %d", s.Ejected, s.Failures)
	}
	recoverByProbing(t, p, "a")
}

func TestPoolRunEjectsAndRecovers(t *testing.T) {
	sim, srv := startSim(t, nil)
	pc := fastPool()
	pc.EjectAfter = 2
	p := newTestPool(t, []BackendConfig{{Name: "a", URL: srv.URL}}, pc)
	runPool(t, p)
	eventually.True(t, "routable", func() bool { return mustSnapshot(t, p, "a").Routable() })

	sim.SetFaults(vllmsim.Faults{Dead: true})
	eventually.True(t, "ejection", func() bool { return mustSnapshot(t, p, "a").Ejected })
	if s := mustSnapshot(t, p, "a"); s.Routable() || s.ProbeFailures < pc.EjectAfter {
		t.Errorf("ejected: routable %v, probe failures %d", s.Routable(), s.ProbeFailures)
	}
	sim.SetFaults(vllmsim.Faults{})
	eventually.True(t, "recovery", func() bool { return mustSnapshot(t, p, "a").Routable() })
	if s := mustSnapshot(t, p, "a"); s.Failures != 0 || s.ProbeFailures != 0 || s.Ejected {
		t.Errorf("recovered: failures %d/%d, ejected %v", s.Failures, s.ProbeFailures, s.Ejected)
	}
}

func TestPoolOnChange(t *testing.T) {
	_, srv := startSim(t, nil)
	var calls atomic.Int64
	var seen atomic.Pointer[Snapshot]
	var p *Pool
	pc := fastPool()
	pc.OnChange = func() {
		calls.Add(1)
		// Called after publishing and without locks: reading the pool
		// from the callback sees the new state and does not deadlock.
		seen.Store(p.Snapshots()[0])
	}
	p = newTestPool(t, []BackendConfig{{Name: "a", URL: srv.URL}}, pc)

	p.Scrape(t.Context())
	if calls.Load() == 0 {
		t.Fatal("OnChange not called after a scrape")
	}
	if s := seen.Load(); s == nil || s.ScrapedAt.IsZero() || s != mustSnapshot(t, p, "a") {
		t.Errorf("OnChange saw %+v, not the scrape's snapshot", s)
	}

	n := calls.Load()
	runPool(t, p)
	eventually.True(t, "OnChange from Run's scrapes", func() bool { return calls.Load() >= n+5 })
}

func TestNewPoolErrors(t *testing.T) {
	for _, tc := range []struct {
		name string
		cfgs []BackendConfig
	}{
		{"nil", nil},
		{"empty", []BackendConfig{}},
		{"no URL", []BackendConfig{{Name: "a"}}},
		{"relative path", []BackendConfig{{URL: "/v1"}}},
		{"no scheme", []BackendConfig{{URL: "localhost:8000"}}},
		{"host without scheme", []BackendConfig{{URL: "10.0.0.5"}}},
		{"not http", []BackendConfig{{URL: "ftp://10.0.0.5:8000"}}},
		{"no host", []BackendConfig{{URL: "http://"}}},
		{"unparsable", []BackendConfig{{URL: "http://[::1"}}},
		{"control character", []BackendConfig{{URL: "http://a\n:8000"}}},
		{"duplicate URL", []BackendConfig{{Name: "a", URL: "http://h:8000"}, {Name: "b", URL: "http://h:8000"}}},
		{"duplicate URL up to a slash", []BackendConfig{{Name: "a", URL: "http://h:8000"}, {Name: "b", URL: "http://h:8000/"}}},
		{"duplicate name", []BackendConfig{{Name: "a", URL: "http://h:8000"}, {Name: "a", URL: "http://h:8001"}}},
		{"duplicate default name", []BackendConfig{{URL: "http://h:8000/a"}, {URL: "http://h:8000/b"}}},
		{"explicit name equals a default", []BackendConfig{{URL: "http://h:8000"}, {Name: "h:8000", URL: "http://g:8000"}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p, err := NewPool(tc.cfgs, PoolConfig{})
			if err == nil {
				t.Fatalf("NewPool succeeded: %+v", p.Snapshots())
			}
			if p != nil {
				t.Errorf("NewPool returned a pool with error %v", err)
			}
		})
	}
}

func TestNewPoolDefaults(t *testing.T) {
	p, err := NewPool([]BackendConfig{
		{URL: "http://10.0.0.5:8000/"},
		{Name: "b", URL: "https://gpu-b.internal", MaxNumSeqs: 128, CapacityTokens: 4096},
	}, PoolConfig{})
	if err != nil {
		t.Fatal(err)
	}
	if p.StaleAfter() != time.Second {
		t.Errorf("default StaleAfter %v, want 1s", p.StaleAfter())
	}
	got := p.Snapshots()
	if len(got) != 2 {
		t.Fatalf("%d snapshots, want 2", len(got))
	}
	if s := got[0]; s.Name != "10.0.0.5:8000" || s.URL != "http://10.0.0.5:8000" || s.MaxNumSeqs != 256 ||
		s.CapacityTokens != 0 || s.StaleAfter != time.Second {
		t.Errorf("defaulted backend: %+v", s)
	}
	if s := got[1]; s.Name != "b" || s.URL != "https://gpu-b.internal" || s.MaxNumSeqs != 128 || s.CapacityTokens != 4096 {
		t.Errorf("configured backend: %+v", s)
	}
	if _, ok := p.Snapshot("10.0.0.5:8000"); !ok {
		t.Error("backend not found by its default name")
	}
}

// TestPoolRatesUnderLoad drives a paced simulator with a small KV cache
// past its capacity and checks that the pool derives a decode rate and a
// preemption rate from consecutive scrapes.
func TestPoolRatesUnderLoad(t *testing.T) {
	_, srv := startSim(t, func(c *vllmsim.Config) {
		c.Speedup = 50
		c.Profile.NumGPUBlocks = 256 // 4,096 tokens
		c.Profile.MaxModelLen = 2048
	})
	var decode, preempt atomic.Uint64 // float64 bits of the largest rate seen
	var p *Pool
	record := func(hi *atomic.Uint64, v float64) {
		for {
			old := hi.Load()
			if v <= math.Float64frombits(old) || hi.CompareAndSwap(old, math.Float64bits(v)) {
				return
			}
		}
	}
	pc := fastPool()
	pc.StaleAfter = 2 * time.Second
	pc.OnChange = func() {
		// Rates hold between two scrapes only: catch every one.
		s := p.Snapshots()[0]
		record(&decode, s.DecodeRate)
		record(&preempt, s.PreemptionRate)
	}
	p = newTestPool(t, []BackendConfig{{Name: "a", URL: srv.URL}}, pc)
	runPool(t, p)

	// Sixteen clients, each wanting ~1,200 tokens of KV, keep four times
	// the cache busy until the test ends.
	ctx, cancel := context.WithCancel(t.Context())
	var wg sync.WaitGroup
	t.Cleanup(wg.Wait)
	t.Cleanup(cancel)
	for i := range 16 {
		wg.Go(func() {
			for n := 0; ctx.Err() == nil; n++ {
				// Errors come only from the cancellation at the end.
				_, _ = complete(ctx, srv.URL, strings.Repeat(fmt.Sprintf("client %d request %d ", i, n), 40), 1000)
			}
		})
	}
	eventually.True(t, "positive decode and preemption rates", func() bool {
		return math.Float64frombits(decode.Load()) > 0 && math.Float64frombits(preempt.Load()) > 0
	})
	d, r := math.Float64frombits(decode.Load()), math.Float64frombits(preempt.Load())
	t.Logf("largest decode rate %.0f tokens/s per sequence, preemption rate %.1f/s", d, r)
	if math.IsInf(d, 0) || math.IsInf(r, 0) {
		t.Errorf("infinite rate: decode %v, preemption %v", d, r)
	}
}

// TestPoolConcurrentScrape calls Scrape from many goroutines while Run
// scrapes the same backend: the pool's methods are documented as safe for
// concurrent use. A fast hand-written page makes the scrapes overlap.
func TestPoolConcurrentScrape(t *testing.T) {
	srv := fakeBackend(t, http.StatusOK, dpPage)
	p := newTestPool(t, []BackendConfig{{Name: "a", URL: srv.URL}}, fastPool())
	runPool(t, p)
	var wg sync.WaitGroup
	for range 16 {
		wg.Go(func() {
			for range 60 {
				p.Scrape(t.Context())
			}
		})
	}
	wg.Wait()
	if s := mustSnapshot(t, p, "a"); s.ScrapeErr != "" || s.PreemptionRate != 0 || s.DecodeRate != 0 {
		t.Errorf("after concurrent scrapes of a constant page: %+v", s)
	}
}

func TestCooldown(t *testing.T) {
	p, err := NewPool([]BackendConfig{{Name: "a", URL: "http://a"}, {Name: "b", URL: "http://b"}}, PoolConfig{})
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	if !p.Cooldown("a", now.Add(time.Minute)) {
		t.Fatal("first cooldown not applied")
	}
	if p.Cooldown("a", now.Add(time.Second)) {
		t.Error("an earlier end shortened the cooldown")
	}
	if !p.CooldownURL("http://a", now.Add(2*time.Minute)) || p.CooldownURL("http://nowhere", now.Add(time.Hour)) {
		t.Error("cooldown by URL")
	}
	a, _ := p.Snapshot("a")
	b, _ := p.Snapshot("b")
	if !a.Cooling(now.Add(90*time.Second)) || a.Cooling(now.Add(3*time.Minute)) || b.Cooling(now) {
		t.Errorf("cooling: a until %v, b until %v", a.CoolingUntil, b.CoolingUntil)
	}
}

// downURL is the address of a server that is not listening: a port that
// was bound and closed.
func downURL(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	return "http://" + addr
}

// TestPoolConfiguredModels: a backend's configured models are known before
// it answers /v1/models: listed (max_model_len unknown) and MayServe, but
// not Serves, so it is not routable. Once discovered, what the server
// lists (filtered by the configuration) is the truth.
func TestPoolConfiguredModels(t *testing.T) {
	sim, srv := startSim(t, nil)
	p := newTestPool(t, []BackendConfig{
		{Name: "down", URL: downURL(t), Models: []string{"x"}},
		{Name: "unknown", URL: downURL(t)},
		{Name: "up", URL: srv.URL, Models: []string{sim.Model(), "not-served"}},
	}, fastPool())
	if got, want := p.Models(), []Model{{ID: sim.Model()}, {ID: "not-served"}, {ID: "x"}}; !slices.Equal(got, want) {
		t.Errorf("Models() before discovery = %v, want %v", got, want)
	}
	for _, tc := range []struct {
		backend, model string
		may            bool
	}{
		{"down", "x", true}, {"down", "y", false},
		{"unknown", "x", true}, {"unknown", "anything", true}, // its models are not known yet
		{"up", sim.Model(), true}, {"up", "y", false},
	} {
		s := mustSnapshot(t, p, tc.backend)
		if got := s.MayServe(tc.model); got != tc.may {
			t.Errorf("%s before discovery: MayServe(%q) = %v, want %v", tc.backend, tc.model, got, tc.may)
		}
		if _, ok := s.Serves(tc.model); ok || s.Routable() || s.Discovered {
			t.Errorf("%s before discovery: Serves(%q) %v, routable %v, discovered %v; want none", tc.backend, tc.model, ok, s.Routable(), s.Discovered)
		}
	}

	p.Probe(t.Context())
	up := mustSnapshot(t, p, "up")
	if !up.Discovered || !up.Routable() || !up.MayServe(sim.Model()) || up.MayServe("not-served") {
		t.Errorf("up after discovery: discovered %v, routable %v, MayServe(served) %v, MayServe(not-served) %v",
			up.Discovered, up.Routable(), up.MayServe(sim.Model()), up.MayServe("not-served"))
	}
	if got, want := p.Models(), []Model{{ID: sim.Model(), MaxModelLen: 8192}, {ID: "x"}}; !slices.Equal(got, want) {
		t.Errorf("Models() after discovery = %v, want %v", got, want)
	}
	if s := mustSnapshot(t, p, "down"); s.Discovered || !s.MayServe("x") {
		t.Errorf("down after failed discovery: discovered %v, MayServe(x) %v", s.Discovered, s.MayServe("x"))
	}
}

// TestPoolSparesLastRoutableBackend: dispatch failures eject a backend
// while another routable one serves its model, never the model's last;
// probe failures eject the last one all the same.
func TestPoolSparesLastRoutableBackend(t *testing.T) {
	_, srvA := startSim(t, nil)
	_, srvB := startSim(t, nil)
	pc := fastPool()
	pc.EjectAfter = 2
	pc.EjectBase = time.Hour // no recovery during the test
	p := newTestPool(t, []BackendConfig{{Name: "a", URL: srvA.URL}, {Name: "b", URL: srvB.URL}}, pc)
	p.Probe(t.Context())

	for range 2 {
		p.ReportFailure("a", errors.New("500 from backend"))
	}
	if s := mustSnapshot(t, p, "a"); !s.Ejected {
		t.Fatalf("a not ejected with b serving: %+v", s)
	}
	for range 5 {
		p.ReportFailure("b", errors.New("500 from backend"))
	}
	if s := mustSnapshot(t, p, "b"); s.Ejected || !s.Routable() || s.Failures != 5 {
		t.Errorf("b, the model's last routable backend: ejected %v, routable %v, failures %d; want counted, not ejected",
			s.Ejected, s.Routable(), s.Failures)
	}
	// Failing probes say b is gone: ejected though last.
	srvB.Close()
	for range 2 {
		p.Probe(t.Context())
	}
	if s := mustSnapshot(t, p, "b"); !s.Ejected {
		t.Errorf("b not ejected by failing probes: %+v", s)
	}
}

// TestGPUHealthFollowsNVMLWhileScrapesFail: a backend whose metrics page
// fails still has its GPUs' health brought up to date on each scrape: a
// critical XID while the page is down fails the backend's GPU health (and
// so takes it out of routing) at once, not once the page answers again.
func TestGPUHealthFollowsNVMLWhileScrapesFail(t *testing.T) {
	n := OpenNVML(readyMock(dgxh100.New()), NVMLConfig{})
	broken := fakeBackend(t, http.StatusInternalServerError, "oops")
	p, err := NewPool([]BackendConfig{{Name: "b", URL: broken.URL, GPUs: []string{"2"}}}, PoolConfig{NVML: n})
	if err != nil {
		t.Fatal(err)
	}
	p.Scrape(context.Background())
	if s, _ := p.Snapshot("b"); s.GPUHealth != Healthy || s.ScrapeErr == "" {
		t.Fatalf("before the XID: GPU health %v, scrape error %q", s.GPUHealth, s.ScrapeErr)
	}
	n.recordXID(2, 79)
	p.Scrape(context.Background())
	if s, _ := p.Snapshot("b"); s.GPUHealth != Failed {
		t.Errorf("after a critical XID, the page still failing: GPU health %v (%v), want failed", s.GPUHealth, s.GPUReasons)
	}
}

// TestHungBackendEjectedWhileItsModelsHang: a backend that hangs is
// ejected after its failed probes, without waiting for a read of its
// models (due meanwhile) that hangs too: discovery runs beside the
// probes, not before each.
func TestHungBackendEjectedWhileItsModelsHang(t *testing.T) {
	var hung atomic.Bool
	var modelReadsEnded atomic.Int64 // reads of the models that hung, then returned
	mux := http.NewServeMux()
	mux.HandleFunc("GET /health", func(w http.ResponseWriter, r *http.Request) {
		if hung.Load() {
			<-r.Context().Done()
		}
	})
	mux.HandleFunc("GET /metrics", func(w http.ResponseWriter, r *http.Request) { _, _ = w.Write([]byte(gauges)) })
	mux.HandleFunc("GET /v1/models", func(w http.ResponseWriter, r *http.Request) {
		if hung.Load() {
			<-r.Context().Done()
			modelReadsEnded.Add(1)
			return
		}
		_, _ = w.Write([]byte(`{"object":"list","data":[{"id":"fake","max_model_len":2048}]}`))
	})
	srv := httptest.NewServer(mux)
	defer srv.Close()
	cfg := fastPool()
	cfg.DiscoverInterval = 10 * time.Millisecond // due again while the backend hangs
	p, err := NewPool([]BackendConfig{{Name: "b", URL: srv.URL}}, cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { _ = p.Run(ctx); close(done) }()
	defer func() { cancel(); <-done }()
	eventually.True(t, "the backend's models to be read", func() bool {
		s, _ := p.Snapshot("b")
		return len(s.Models) == 1
	})
	hung.Store(true)
	eventually.True(t, "the hung backend to be ejected", func() bool {
		s, _ := p.Snapshot("b")
		return s.Ejected
	})
	if n := modelReadsEnded.Load(); n != 0 {
		t.Errorf("ejected only after %d reads of its models had hung for their whole timeout, each holding the probes back", n)
	}
}

// TestGPUNamedByUUIDUnreadable: a backend whose GPU, named by UUID, NVML
// cannot read at all (its UUID never learnt) is not found by that UUID;
// while some GPU is unreadable, that miss counts as the GPU failed, not
// merely as a configuration to check, so the backend leaves routing.
func TestGPUNamedByUUIDUnreadable(t *testing.T) {
	srv := readyMock(dgxh100.New())
	uuid, ret := mockDev(srv, 3).GetUUID()
	if ret != nvml.SUCCESS {
		t.Fatal(ret)
	}
	byIndex := srv.DeviceGetHandleByIndexFunc
	srv.DeviceGetHandleByIndexFunc = func(i int) (nvml.Device, nvml.Return) {
		if i == 3 {
			return nil, nvml.ERROR_UNKNOWN
		}
		return byIndex(i)
	}
	n := OpenNVML(srv, NVMLConfig{})
	b, typo := fakeBackend(t, http.StatusOK, gauges), fakeBackend(t, http.StatusOK, gauges)
	p, err := NewPool([]BackendConfig{{Name: "b", URL: b.URL, GPUs: []string{uuid}}, {Name: "typo", URL: typo.URL, GPUs: []string{"GPU-0"}}}, PoolConfig{NVML: n})
	if err != nil {
		t.Fatal(err)
	}
	p.Scrape(context.Background())
	if s, _ := p.Snapshot("b"); s.GPUHealth != Failed {
		t.Errorf("a backend on an unreadable GPU named by UUID: %v %v, want failed", s.GPUHealth, s.GPUReasons)
	}
	srv.DeviceGetHandleByIndexFunc = byIndex
	n.Refresh() // GPU 3 reads again, its UUID learnt
	p.Scrape(context.Background())
	if s, _ := p.Snapshot("b"); s.GPUHealth != Healthy {
		t.Errorf("once GPU 3 reads: %v %v, want healthy", s.GPUHealth, s.GPUReasons)
	}
	if s, _ := p.Snapshot("typo"); s.GPUHealth != Degraded {
		t.Errorf("a GPU no NVML GPU can be, every GPU read: %v %v, want degraded (a configuration to check)", s.GPUHealth, s.GPUReasons)
	}
}

// TestPoolWarnsOfPagesWithoutKVUsage: a server that publishes no KV cache
// usage is read as such (HasKVUsage false, not an empty cache), and said
// once in the log while it lasts, not at every scrape.
func TestPoolWarnsOfPagesWithoutKVUsage(t *testing.T) {
	var mu sync.Mutex
	page := gauges
	mux := http.NewServeMux()
	mux.HandleFunc("GET /metrics", func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		defer mu.Unlock()
		_, _ = w.Write([]byte(page))
	})
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	var logs strings.Builder
	var logMu sync.Mutex
	pc := fastPool()
	pc.Logger = slog.New(slog.NewTextHandler(writerFunc(func(b []byte) (int, error) {
		logMu.Lock()
		defer logMu.Unlock()
		return logs.Write(b)
	}), nil))
	p := newTestPool(t, []BackendConfig{{Name: "a", URL: srv.URL}}, pc)
	warned := func() int {
		logMu.Lock()
		defer logMu.Unlock()
		return strings.Count(logs.String(), "publishes no KV cache usage")
	}
	for range 3 {
		p.Scrape(t.Context())
	}
	if s := mustSnapshot(t, p, "a"); s.Metrics.HasKVUsage || warned() != 1 {
		t.Errorf("three pages without KV usage: HasKVUsage %v, warned %d times; want false, once", s.Metrics.HasKVUsage, warned())
	}
	mu.Lock()
	page = gauges + "vllm:kv_cache_usage_perc 0.25\n"
	mu.Unlock()
	p.Scrape(t.Context())
	if s := mustSnapshot(t, p, "a"); !s.Metrics.HasKVUsage || s.Metrics.KVUsage != 0.25 {
		t.Errorf("a page with KV usage: %+v", s.Metrics)
	}
	mu.Lock()
	page = gauges
	mu.Unlock()
	p.Scrape(t.Context())
	if warned() != 2 {
		t.Errorf("KV usage gone again: warned %d times in all, want 2", warned())
	}
}

type writerFunc func([]byte) (int, error)

func (f writerFunc) Write(b []byte) (int, error) { return f(b) }
