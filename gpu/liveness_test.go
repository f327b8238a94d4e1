package gpu

import (
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"time"
)

// TestTimedOutProbesExcusedWhileAnswering: probes and scrapes that time
// out do not eject a backend, nor mark its metrics failed, while it goes on
// answering kvgate's dispatches; once it stops answering those too, the
// same timeouts eject it and its metrics go stale.
func TestTimedOutProbesExcusedWhileAnswering(t *testing.T) {
	sim, _ := startSim(t, nil)
	var slow atomic.Bool
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if slow.Load() && (r.URL.Path == "/health" || r.URL.Path == "/metrics") {
			select { // longer than any timeout below: a starved host, as the backend sees it
			case <-time.After(time.Second):
			case <-r.Context().Done():
				return
			}
		}
		sim.ServeHTTP(w, r)
	}))
	t.Cleanup(srv.Close)
	pc := fastPool()
	pc.EjectAfter = 3
	pc.ProbeInterval = 200 * time.Millisecond // the probe's timeout
	pc.StaleAfter = 200 * time.Millisecond    // the scrape's
	p := newTestPool(t, []BackendConfig{{Name: "a", URL: srv.URL}}, pc)
	p.Probe(t.Context())
	p.Scrape(t.Context())
	if s := mustSnapshot(t, p, "a"); !s.Routable() || s.ScrapedAt.IsZero() {
		t.Fatalf("healthy backend: %+v", s)
	}
	slow.Store(true)
	// Answering: a dispatch completes while each probe and scrape is out.
	for range 2 * pc.EjectAfter {
		done := make(chan struct{})
		go func() {
			p.Scrape(t.Context())
			close(done)
		}()
		go func() {
			time.Sleep(100 * time.Millisecond) // within both timeouts
			p.ReportSuccess("a")
		}()
		p.Probe(t.Context())
		<-done
	}
	s := mustSnapshot(t, p, "a")
	if s.ProbeFailures != 0 || s.Ejected || !s.Routable() {
		t.Errorf("answering backend after timed-out probes: probe failures %d, ejected %v", s.ProbeFailures, s.Ejected)
	}
	if s.ScrapeErr != "" {
		t.Errorf("answering backend's timed-out scrape marked failed: %q", s.ScrapeErr)
	}
	// Silent: the timeouts count.
	for range pc.EjectAfter {
		p.Probe(t.Context())
	}
	p.Scrape(t.Context())
	s = mustSnapshot(t, p, "a")
	if !s.Ejected || s.ProbeFailures != pc.EjectAfter {
		t.Errorf("silent backend after %d timed-out probes: probe failures %d, ejected %v", pc.EjectAfter, s.ProbeFailures, s.Ejected)
	}
	if s.ScrapeErr == "" {
		t.Error("silent backend's timed-out scrape not marked failed")
	}
}

func TestExcused(t *testing.T) {
	var b backend
	sent := time.Now()
	timeout := &timeoutErr{}
	if b.excused(timeout, sent) {
		t.Error("excused without any answer")
	}
	b.noteAnswer(sent.Add(-time.Millisecond))
	if b.excused(timeout, sent) {
		t.Error("excused by an answer from before the probe")
	}
	b.noteAnswer(sent.Add(time.Millisecond))
	if !b.excused(timeout, sent) {
		t.Error("a timeout not excused by an answer since")
	}
	if b.excused(http.ErrServerClosed, sent) || b.excused(nil, sent) {
		t.Error("a refusal or no error excused")
	}
}

type timeoutErr struct{}

func (*timeoutErr) Error() string   { return "i/o timeout" }
func (*timeoutErr) Timeout() bool   { return true }
func (*timeoutErr) Temporary() bool { return true }

// TestProbeTimeoutApartFromInterval: a probe may take ProbeTimeout, not
// only ProbeInterval: a /health slower than the interval but within the
// timeout is a success; one slower than the timeout is a failure.
func TestProbeTimeoutApartFromInterval(t *testing.T) {
	sim, _ := startSim(t, nil)
	var delay atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/health" {
			select {
			case <-time.After(time.Duration(delay.Load())):
			case <-r.Context().Done():
				return
			}
		}
		sim.ServeHTTP(w, r)
	}))
	t.Cleanup(srv.Close)
	pc := fastPool()
	pc.ProbeInterval, pc.ProbeTimeout = 20*time.Millisecond, 300*time.Millisecond
	p := newTestPool(t, []BackendConfig{{Name: "a", URL: srv.URL}}, pc)
	delay.Store(int64(100 * time.Millisecond)) // past the interval, within the timeout
	p.Probe(t.Context())
	if s := mustSnapshot(t, p, "a"); s.ProbeFailures != 0 {
		t.Errorf("a probe within ProbeTimeout failed: %q", s.HealthErr)
	}
	delay.Store(int64(time.Second)) // past the timeout
	p.Probe(t.Context())
	if s := mustSnapshot(t, p, "a"); s.ProbeFailures != 1 {
		t.Errorf("a probe past ProbeTimeout: %d failures, want 1", s.ProbeFailures)
	}
}
