package gateway

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvgate/kvgate/bench/eventually"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvgate/kvgate/bench/vllmsim"
	"github.com/kvgate/kvgate/gpu"
	"github.com/kvgate/kvgate/scheduler"
)

// Tests of how kvgate treats backends that are down, die, or fail some
// requests: defects 8 and 10 of issue 10.

// lockedBuffer collects log output written from many goroutines.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// count returns how many log lines carry msg.
func (l *lockedBuffer) count(msg string) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return strings.Count(l.b.String(), "msg="+strconv.Quote(msg)) + strings.Count(l.b.String(), "msg="+msg+" ")
}

// downURL is the address of a backend that is not listening: a port that
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

// gateway is kvgate in front of the given backends, without waiting for
// any of them to be reachable.
type gateway struct {
	pool  *gpu.Pool
	sched *scheduler.Scheduler
	srv   *httptest.Server
	logs  *lockedBuffer
}

type gatewayOpts struct {
	policy  scheduler.Policy
	gateway Config
	pool    func(*gpu.PoolConfig) // adjusts the test's pool settings
}

func startGateway(t *testing.T, backends []gpu.BackendConfig, o gatewayOpts) *gateway {
	t.Helper()
	g := &gateway{logs: &lockedBuffer{}}
	log := slog.New(slog.NewTextHandler(g.logs, nil))
	pc := gpu.PoolConfig{
		ScrapeInterval: 20 * time.Millisecond, ProbeInterval: 50 * time.Millisecond, StaleAfter: 2 * time.Second,
		EjectBase: 10 * time.Second, Logger: log,
		OnChange: func() {
			if g.sched != nil {
				g.sched.Wake()
			}
		},
	}
	if o.pool != nil {
		o.pool(&pc)
	}
	var err error
	g.pool, err = gpu.NewPool(backends, pc)
	if err != nil {
		t.Fatal(err)
	}
	g.sched, err = scheduler.New(g.pool, scheduler.Options{Policy: o.policy, Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	o.gateway.Dev = true // these tests are about backends, not keys
	api, err := New(o.gateway, g.pool, g.sched, prometheus.NewRegistry(), log)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Go(func() { _ = g.pool.Run(ctx) })
	wg.Go(func() { _ = g.sched.Run(ctx) })
	g.srv = httptest.NewServer(api)
	t.Cleanup(func() {
		g.srv.Close()
		cancel()
		wg.Wait()
	})
	return g
}

func (g *gateway) post(t *testing.T, path, body string) (*http.Response, []byte) {
	t.Helper()
	resp, err := http.Post(g.srv.URL+path, "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp, b
}

func (g *gateway) routable(name string) bool {
	s, _ := g.pool.Snapshot(name)
	return s.Routable() && !s.Stale(time.Now())
}

// wantUnreachable checks an answer is the 503 that says no backend of the
// model is reachable, with a Retry-After.
func wantUnreachable(t *testing.T, resp *http.Response, body []byte, model string) {
	t.Helper()
	var e struct {
		Error struct {
			Message, Type, Code string
		}
	}
	_ = json.Unmarshal(body, &e)
	if resp.StatusCode != http.StatusServiceUnavailable || !strings.Contains(e.Error.Message, "No backend serving model `"+model+"` is reachable") {
		t.Errorf("answer %d %s, want 503 saying no backend serving %s is reachable", resp.StatusCode, body, model)
	}
	if ra, err := strconv.Atoi(resp.Header.Get("Retry-After")); err != nil || ra < 1 {
		t.Errorf("Retry-After %q, want a number of seconds", resp.Header.Get("Retry-After"))
	}
}

const chatBody = `{"model":"%s","messages":[{"role":"user","content":"%s"}],"max_tokens":4}`

// TestBackendDownAtStart: with the only backend not listening, a request
// for its model is answered at once with 503 and Retry-After, not 404,
// whether its models are configured or not yet known; the refusals are
// logged once, not once per request. A configured model is listed before
// discovery; a model no backend is configured for is still 404.
func TestBackendDownAtStart(t *testing.T) {
	t.Run("configured models", func(t *testing.T) {
		g := startGateway(t, []gpu.BackendConfig{{Name: "down", URL: downURL(t), Models: []string{llama}}}, gatewayOpts{})
		for i := range 5 {
			resp, body := g.post(t, "/v1/chat/completions", fmt.Sprintf(chatBody, llama, strconv.Itoa(i)))
			wantUnreachable(t, resp, body, llama)
		}
		if n := g.logs.count("no routable backend"); n != 1 {
			t.Errorf("%d log lines for 5 refusals in a row, want 1:\n%s", n, g.logs)
		}
		resp, err := http.Get(g.srv.URL + "/v1/models")
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if !strings.Contains(string(b), `"id":"`+llama+`"`) {
			t.Errorf("/v1/models %s does not list the configured model", b)
		}
		resp, body := g.post(t, "/v1/chat/completions", fmt.Sprintf(chatBody, "other-model", "x"))
		if resp.StatusCode != http.StatusNotFound || !strings.Contains(string(body), "model_not_found") {
			t.Errorf("a model no backend is configured for: %d %s, want 404 model_not_found", resp.StatusCode, body)
		}
	})
	t.Run("models not yet known", func(t *testing.T) {
		g := startGateway(t, []gpu.BackendConfig{{Name: "down", URL: downURL(t)}}, gatewayOpts{})
		resp, body := g.post(t, "/v1/chat/completions", fmt.Sprintf(chatBody, llama, "x"))
		wantUnreachable(t, resp, body, llama)
	})
	t.Run("comes up later", func(t *testing.T) {
		// The configured backend starts after kvgate: once discovered, it
		// serves.
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		addr := l.Addr().String()
		l.Close()
		g := startGateway(t, []gpu.BackendConfig{{Name: "late", URL: "http://" + addr, Models: []string{llama}}}, gatewayOpts{})
		resp, body := g.post(t, "/v1/chat/completions", fmt.Sprintf(chatBody, llama, "early"))
		wantUnreachable(t, resp, body, llama)
		sim, err := vllmsim.New(vllmsim.Config{Profile: llamaProfile(t)})
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- sim.Run(ctx) }()
		l, err = net.Listen("tcp", addr)
		if err != nil {
			cancel()
			t.Skipf("the port was taken meanwhile: %v", err)
		}
		srv := &httptest.Server{Listener: l, Config: &http.Server{Handler: sim}}
		srv.Start()
		t.Cleanup(func() { srv.Close(); cancel(); <-done })
		eventually.True(t, "the late backend to be routable", func() bool { return g.routable("late") })
		if resp, body := g.post(t, "/v1/chat/completions", fmt.Sprintf(chatBody, llama, "late")); resp.StatusCode != 200 {
			t.Errorf("after the backend came up: %d %s", resp.StatusCode, body)
		}
	})
}

// TestBackendDiesWhileRequestsWait: a request queued for a busy backend
// fails fast with 503 when that backend, the model's last, dies, rather
// than waiting out max_queue_wait for "at capacity"; later requests are
// refused the same way, whether the pool has ejected the backend yet or
// the request finds its port closed.
func TestBackendDiesWhileRequestsWait(t *testing.T) {
	_, srv := vllmsim.NewTestServer(t, vllmsim.Config{Profile: llamaProfile(t)})
	g := startGateway(t, []gpu.BackendConfig{{Name: "sim", URL: srv.URL, MaxNumSeqs: 1}},
		gatewayOpts{policy: scheduler.Policy{MaxQueueWait: 20 * time.Second}})
	eventually.True(t, "the backend to be routable", func() bool { return g.routable("sim") })

	// A ticket of the test's own holds the backend's only sequence.
	hold, err := g.sched.Acquire(context.Background(), &scheduler.Ticket{Model: llama, PromptTokens: 1, MaxTokens: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer hold.Release()
	type answer struct {
		resp *http.Response
		body []byte
	}
	queued := make(chan answer, 1)
	go func() {
		resp, err := http.Post(g.srv.URL+"/v1/chat/completions", "application/json", strings.NewReader(fmt.Sprintf(chatBody, llama, "queued")))
		if err != nil {
			queued <- answer{}
			return
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		queued <- answer{resp, b}
	}()
	eventually.True(t, "the second request to queue", func() bool { return g.sched.Queued()[scheduler.Interactive] == 1 })

	// The backend dies: its connections are cut and its port refuses.
	srv.CloseClientConnections()
	srv.Close()
	a := <-queued
	if a.resp == nil {
		t.Fatal("the queued request failed at the transport")
	}
	wantUnreachable(t, a.resp, a.body, llama)
	hold.Release()
	resp, body := g.post(t, "/v1/chat/completions", fmt.Sprintf(chatBody, llama, "after"))
	wantUnreachable(t, resp, body, llama)
}

// TestBackendFoundDeadByARequest: a request sent to a backend that died
// before kvgate noticed (it still looks routable) finds its port closed;
// with no other backend, the answer is the same 503, not a 502.
func TestBackendFoundDeadByARequest(t *testing.T) {
	_, srv := vllmsim.NewTestServer(t, vllmsim.Config{Profile: llamaProfile(t)})
	g := startGateway(t, []gpu.BackendConfig{{Name: "sim", URL: srv.URL}}, gatewayOpts{pool: func(pc *gpu.PoolConfig) {
		pc.ProbeInterval, pc.StaleAfter = time.Hour, time.Hour // kvgate would notice only in an hour
	}})
	eventually.True(t, "the backend to be routable", func() bool { return g.routable("sim") })
	srv.CloseClientConnections()
	srv.Close()
	resp, body := g.post(t, "/v1/chat/completions", fmt.Sprintf(chatBody, llama, "x"))
	wantUnreachable(t, resp, body, llama)
}

// TestRequestFailingEverywhereEjectsNoBackend: a request that fails the
// same way on two backends is its own problem: it is not retried further
// and counts against neither backend's health, so that a client's bad
// requests cannot eject the fleet. A backend that fails every request
// while the other serves them is still ejected.
func TestRequestFailingEverywhereEjectsNoBackend(t *testing.T) {
	var cfgs []gpu.BackendConfig
	var sims []*vllmsim.Sim
	var poisoned, posts [3]atomic.Int64
	for i := range 3 {
		sim, err := vllmsim.New(vllmsim.Config{Profile: llamaProfile(t), Seed: uint64(i),
			Faults: vllmsim.Faults{ServerErrorRate: 1, Match: "poison"}})
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { done <- sim.Run(ctx) }()
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.Method == http.MethodPost {
				b, _ := io.ReadAll(r.Body)
				r.Body = io.NopCloser(bytes.NewReader(b))
				if bytes.Contains(b, []byte("poison")) {
					poisoned[i].Add(1)
				}
				posts[i].Add(1)
			}
			sim.ServeHTTP(w, r)
		}))
		t.Cleanup(func() { srv.Close(); cancel(); <-done })
		sims = append(sims, sim)
		cfgs = append(cfgs, gpu.BackendConfig{Name: fmt.Sprintf("sim%d", i), URL: srv.URL})
	}
	two := 2
	g := startGateway(t, cfgs, gatewayOpts{gateway: Config{Retries: &two}})
	for i := range 3 {
		eventually.True(t, "the backends to be routable", func() bool { return g.routable(fmt.Sprintf("sim%d", i)) })
	}

	for i := range 6 {
		resp, body := g.post(t, "/v1/chat/completions", fmt.Sprintf(chatBody, llama, "poison "+strconv.Itoa(i)))
		if resp.StatusCode != http.StatusInternalServerError {
			t.Errorf("poisoned request %d: %d %s, want the backends' 500", i, resp.StatusCode, body)
		}
	}
	if n := poisoned[0].Load() + poisoned[1].Load() + poisoned[2].Load(); n != 12 {
		t.Errorf("6 poisoned requests reached backends %d times, want 12: each stops after failing the same way twice", n)
	}
	for _, sn := range g.pool.Snapshots() {
		if sn.Ejected || sn.Failures != 0 {
			t.Errorf("%s: ejected %v, %d failures counted for requests that fail everywhere", sn.Name, sn.Ejected, sn.Failures)
		}
	}
	if resp, err := http.Get(g.srv.URL + "/readyz"); err != nil || resp.StatusCode != 200 {
		t.Errorf("/readyz %v %v after poisoned requests", resp, err)
	}
	var before [3]int64
	for i := range posts {
		before[i] = posts[i].Load()
	}
	if resp, body := g.post(t, "/v1/chat/completions", fmt.Sprintf(chatBody, llama, "fine")); resp.StatusCode != 200 {
		t.Errorf("a good request: %d %s", resp.StatusCode, body)
	}

	// The backend that served it fails everything from now on while the
	// others serve: it alone is ejected. Each request is a prompt new to
	// the fleet, placed where the recent work is least, so that the
	// failing backend keeps being tried (a short prompt would stay with
	// its template's prefix on the backend that served it after a retry).
	bad := -1
	for i := range posts {
		if posts[i].Load() > before[i] {
			bad = i
		}
	}
	if bad < 0 {
		t.Fatal("no backend served the good request")
	}
	badName := fmt.Sprintf("sim%d", bad)
	sims[bad].SetFaults(vllmsim.Faults{ServerErrorRate: 1})
	for i := 0; !mustSnap(g, badName).Ejected; i++ {
		if i == 20 {
			t.Fatalf("%s failing every request is not ejected: %+v", badName, mustSnap(g, badName))
		}
		prompt := strings.Repeat(fmt.Sprintf("a new document, number %d, ", i), 40)
		if resp, body := g.post(t, "/v1/chat/completions", fmt.Sprintf(chatBody, llama, prompt)); resp.StatusCode != 200 {
			t.Errorf("request %d with one bad backend: %d %s", i, resp.StatusCode, body)
		}
	}
	for i := range sims {
		if name := fmt.Sprintf("sim%d", i); i != bad {
			if sn := mustSnap(g, name); sn.Ejected || sn.Failures != 0 {
				t.Errorf("%s charged for %s's failures: ejected %v, %d failures", name, badName, sn.Ejected, sn.Failures)
			}
		}
	}
}

func mustSnap(g *gateway, name string) *gpu.Snapshot {
	s, _ := g.pool.Snapshot(name)
	return s
}
