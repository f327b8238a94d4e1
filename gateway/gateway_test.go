package gateway

import (
	"bufio"
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/kvgate/kvgate/bench/eventually"

	"github.com/prometheus/client_golang/prometheus"
	openai "github.com/sashabaranov/go-openai"

	"github.com/kvgate/kvgate/bench/vllmsim"
	"github.com/kvgate/kvgate/gpu"
	"github.com/kvgate/kvgate/scheduler"
	"github.com/kvgate/kvgate/store/postgres/pgtest"
	"github.com/kvgate/kvgate/store/sqlstore"
)

const llama = "meta-llama/Llama-3.1-8B-Instruct"

// fleet is kvgate in front of simulated vLLM servers, all in-process and
// on real HTTP.
type fleet struct {
	sig   *testSignals // nil without fleetOpts.signals
	store *sqlstore.Store
	sims  []*vllmsim.Sim
	urls  []string
	pool  *gpu.Pool
	sched *scheduler.Scheduler
	api   *Server
	srv   *httptest.Server
}

type fleetOpts struct {
	// wrap, when set, stands between kvgate and backend i: a backend
	// that misbehaves in ways the simulator's faults do not cover.
	wrap     func(i int, h http.Handler) http.Handler
	profile  vllmsim.Profile
	backends int
	speedup  float64
	policy   scheduler.Policy
	gateway  Config
	// production uses the pool's default scrape and probe intervals
	// rather than the tests' fast ones.
	production bool
	// jobs enables durable jobs on a SQLite store; runner also runs them;
	// signals relays their events through a real NATS server (JetStream)
	// to the inbox and the event streams.
	jobs, runner, signals bool
	// pg puts the jobs on a fresh PostgreSQL database instead of SQLite;
	// store puts them on the given store (and implies jobs).
	pg    bool
	store *sqlstore.Store
	// ledger puts the tenants' store (limits and the usage ledger) on the
	// jobs' store, as kvgate serve has it: each attempt's usage then lands
	// in the ledger (by the attempt's own writes for a tenant without
	// limits, store.Charge; through a permit otherwise).
	ledger bool
	// keysRequired runs the gateway outside development mode: every
	// caller needs a key.
	keysRequired bool
	// simConfig, when set, adjusts backend i's simulator configuration
	// (its profile, its served model name).
	simConfig func(i int, c *vllmsim.Config)
	// server, when set, adjusts the gateway before it serves or works.
	server func(*Server)
}

func llamaProfile(t testing.TB) vllmsim.Profile {
	p, err := vllmsim.LookupProfile("h100-llama-3.1-8b")
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func startFleet(t testing.TB, o fleetOpts) *fleet {
	t.Helper()
	if o.profile.Name == "" {
		o.profile = llamaProfile(t)
	}
	f := &fleet{}
	var cfgs []gpu.BackendConfig
	for i := range max(o.backends, 1) {
		sc := vllmsim.Config{Profile: o.profile, Speedup: o.speedup, Seed: uint64(i)}
		if o.simConfig != nil {
			o.simConfig(i, &sc)
		}
		sim, srv := vllmsim.NewTestServer(t, sc)
		if o.wrap != nil {
			srv = httptest.NewServer(o.wrap(i, sim))
			t.Cleanup(srv.Close)
		}
		f.sims = append(f.sims, sim)
		f.urls = append(f.urls, srv.URL)
		cfgs = append(cfgs, gpu.BackendConfig{Name: fmt.Sprintf("sim%d", i), URL: srv.URL})
	}
	var err error
	pc := gpu.PoolConfig{
		ScrapeInterval: 20 * time.Millisecond, ProbeInterval: 50 * time.Millisecond, StaleAfter: 2 * time.Second,
		// Probes often, but each may take as long as production's: on a
		// loaded test machine (-race, parallel packages) a simulator busy
		// with a burst can take over 50 ms to answer /health, and three
		// such probes would eject the fleet's only backend (a 503 for
		// every request after).
		ProbeTimeout: time.Second,
		EjectBase:    200 * time.Millisecond,
		OnChange: func() {
			if f.sched != nil {
				f.sched.Wake()
			}
		},
	}
	if o.production {
		pc = gpu.PoolConfig{OnChange: pc.OnChange}
	}
	f.pool, err = gpu.NewPool(cfgs, pc)
	if err != nil {
		t.Fatal(err)
	}
	f.sched, err = scheduler.New(f.pool, scheduler.Options{Policy: o.policy})
	if err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(f.sched.Collectors()...)
	var runner *scheduler.Runner
	if o.jobs || o.store != nil {
		switch {
		case o.store != nil:
			f.store = o.store
		case o.pg:
			f.store = pgtest.Open(t)
		default:
			f.store = sqliteStore(t)
		}
		if o.ledger {
			o.gateway.Tenants.Store = f.store
		}
		if o.gateway.Jobs.Store == nil {
			o.gateway.Jobs.Store = f.store
		}
		o.gateway.Jobs.Wake = func() {
			if runner != nil {
				runner.Wake()
			}
		}
	}
	var sig *testSignals
	if o.signals {
		sig = startTestSignals(t, f.store, func() {
			if runner != nil {
				runner.Wake()
			}
		})
		o.gateway.Jobs.Feed = sig.feed
		wake := o.gateway.Jobs.Wake
		o.gateway.Jobs.Wake = func() { wake(); sig.relay.Wake() }
	}
	o.gateway.Jobs.BatchPoll = cmp.Or(o.gateway.Jobs.BatchPoll, 20*time.Millisecond)
	o.gateway.Dev = o.gateway.Dev || !o.keysRequired
	f.api, err = New(o.gateway, f.pool, f.sched, reg, nil)
	if err != nil {
		t.Fatal(err)
	}
	if o.server != nil {
		o.server(f.api)
	}
	if o.runner {
		runner = scheduler.NewRunner(f.store, f.sched, f.api, scheduler.RunnerConfig{
			Concurrency: 16, Lease: 10 * time.Second, Poll: 20 * time.Millisecond, ReapEvery: 100 * time.Millisecond,
			Backoff: scheduler.Backoff{Base: 20 * time.Millisecond, Max: 100 * time.Millisecond},
		})
		reg.MustRegister(runner.Collectors()...)
	}
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Go(func() { _ = f.pool.Run(ctx) })
	wg.Go(func() { _ = f.sched.Run(ctx) })
	if runner != nil {
		wg.Go(func() { _ = runner.Run(ctx) })
		wg.Go(func() { _ = f.api.RunBatches(ctx) })
	}
	if sig != nil {
		sig.run(ctx, &wg)
		f.sig = sig
	}
	f.srv = httptest.NewServer(f.api)
	t.Cleanup(func() {
		f.srv.Close()
		cancel()
		wg.Wait()
		if f.store != nil {
			f.store.Close()
		}
	})
	// Ready: every backend discovered and scraped.
	for deadline := time.Now().Add(10 * time.Second); ; {
		ready := true
		for _, sn := range f.pool.Snapshots() {
			ready = ready && sn.Routable() && !sn.Stale(time.Now())
		}
		if ready {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("fleet never became ready")
		}
		time.Sleep(5 * time.Millisecond)
	}
	return f
}

func (f *fleet) client(key string) *openai.Client {
	cfg := openai.DefaultConfig(key)
	cfg.BaseURL = f.srv.URL + "/v1"
	return openai.NewClientWithConfig(cfg)
}

func (f *fleet) post(t testing.TB, path, body string, header ...string) (*http.Response, []byte) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodPost, f.srv.URL+path, strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp, b
}

// inflight is what kvgate has admitted and not released, over all backends.
func (f *fleet) inflight() int {
	n := 0
	for _, l := range f.sched.Loads() {
		n += l.Inflight
	}
	return n
}

func TestChatAndCompletionsWithGoClient(t *testing.T) {
	f := startFleet(t, fleetOpts{backends: 2})
	c := f.client("unused")
	ctx := context.Background()

	chat, err := c.CreateChatCompletion(ctx, openai.ChatCompletionRequest{
		Model: llama, MaxCompletionTokens: 8,
		Messages: []openai.ChatCompletionMessage{{Role: "user", Content: "Hello there"}},
	})
	if err != nil {
		t.Fatal(err)
	}
	if chat.Choices[0].Message.Content == "" || chat.Usage.PromptTokens == 0 || chat.Usage.CompletionTokens > 8 {
		t.Errorf("chat response %+v", chat)
	}

	comp, err := c.CreateCompletion(ctx, openai.CompletionRequest{Model: llama, Prompt: "Once upon", MaxTokens: 5})
	if err != nil {
		t.Fatal(err)
	}
	if comp.Usage.CompletionTokens == 0 || comp.Usage.CompletionTokens > 5 || comp.Choices[0].Text == "" {
		t.Errorf("completion response %+v", comp)
	}

	models, err := c.ListModels(ctx)
	if err != nil || len(models.Models) != 1 || models.Models[0].ID != llama {
		t.Errorf("models %+v, %v", models, err)
	}
	if f.inflight() != 0 {
		t.Errorf("reservations left after the calls: %d", f.inflight())
	}
}

// TestStreamsReuseBackendConnections: streams one after another reach the
// backend over one connection. The relay reads each stream's end after
// its [DONE]; before, it closed the body there, which closed the
// connection, and each stream came from a new one.
func TestStreamsReuseBackendConnections(t *testing.T) {
	var mu sync.Mutex
	conns := map[string]int{} // by the client's address: one per connection
	f := startFleet(t, fleetOpts{speedup: 50, wrap: func(_ int, h http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.URL.Path == "/v1/chat/completions" || r.URL.Path == "/v1/responses" {
				mu.Lock()
				conns[r.RemoteAddr]++
				mu.Unlock()
			}
			h.ServeHTTP(w, r)
		})
	}})
	const streams = 10
	for _, path := range []string{"/v1/chat/completions", "/v1/responses"} {
		body := fmt.Sprintf(`{"model":%q,"messages":[{"role":"user","content":"hi"}],"max_tokens":3,"stream":true}`, llama)
		if path == "/v1/responses" {
			body = fmt.Sprintf(`{"model":%q,"input":"hi","max_output_tokens":3,"stream":true}`, llama)
		}
		for range streams {
			resp, b := send(t, f.srv.URL, http.MethodPost, path, "", body)
			if resp.StatusCode != http.StatusOK || !bytes.Contains(b, []byte("data: ")) {
				t.Fatalf("%s: %d %s", path, resp.StatusCode, b)
			}
		}
	}
	mu.Lock()
	defer mu.Unlock()
	if len(conns) > 3 { // one, and a spare or two: a read of an end may be cut on a loaded machine
		t.Errorf("%d streams reached the backend over %d connections: %v", 2*streams, len(conns), conns)
	}
}

func TestStreamingWithGoClient(t *testing.T) {
	f := startFleet(t, fleetOpts{})
	c := f.client("unused")
	for _, includeUsage := range []bool{false, true} {
		t.Run(fmt.Sprintf("include_usage=%v", includeUsage), func(t *testing.T) {
			req := openai.ChatCompletionRequest{
				Model: llama, MaxCompletionTokens: 12, Stream: true,
				Messages: []openai.ChatCompletionMessage{{Role: "user", Content: "Stream please"}},
			}
			if includeUsage {
				req.StreamOptions = &openai.StreamOptions{IncludeUsage: true}
			}
			st, err := c.CreateChatCompletionStream(context.Background(), req)
			if err != nil {
				t.Fatal(err)
			}
			defer st.Close()
			var text strings.Builder
			var usage *openai.Usage
			finish := ""
			for {
				chunk, err := st.Recv()
				if errors.Is(err, io.EOF) {
					break
				}
				if err != nil {
					t.Fatal(err)
				}
				if chunk.Usage != nil {
					usage = chunk.Usage
				}
				for _, ch := range chunk.Choices {
					text.WriteString(ch.Delta.Content)
					if ch.FinishReason != "" {
						finish = string(ch.FinishReason)
					}
				}
			}
			if text.Len() == 0 || finish == "" {
				t.Errorf("stream text %q, finish %q", text.String(), finish)
			}
			if includeUsage != (usage != nil) {
				t.Errorf("usage chunk %+v with include_usage=%v", usage, includeUsage)
			}
		})
	}
}

// TestUnknownFieldsReachBackend sends vLLM extras: ignore_eos only works
// if it reaches the backend, and then the output is exactly max_tokens.
func TestUnknownFieldsReachBackend(t *testing.T) {
	f := startFleet(t, fleetOpts{})
	resp, body := f.post(t, "/v1/completions", `{"model":"`+llama+`","prompt":"x","max_tokens":300,"ignore_eos":true,
		"top_k":5,"min_p":0.1,"guided_json":{"type":"object"},"chat_template_kwargs":{"a":1},"structured_outputs":null}`)
	if resp.StatusCode != 200 {
		t.Fatalf("status %d: %s", resp.StatusCode, body)
	}
	var out struct{ Usage usage }
	_ = json.Unmarshal(body, &out)
	if out.Usage.CompletionTokens != 300 {
		t.Errorf("completion_tokens %d: ignore_eos did not reach the backend", out.Usage.CompletionTokens)
	}
}

func TestErrors(t *testing.T) {
	p := llamaProfile(t)
	p.NumGPUBlocks, p.MaxModelLen = 1024, 8192 // 16k tokens of KV
	f := startFleet(t, fleetOpts{profile: p, gateway: Config{MaxBodyBytes: 4096, APIKeys: map[string]string{"sk-good": "acme"}}})
	auth := []string{"Authorization", "Bearer sk-good"}
	big := strings.Repeat("x", 5000)
	tests := []struct {
		name   string
		path   string
		body   string
		header []string
		status int
		typ    string
		code   string
		param  string
	}{
		{name: "no key", path: "/v1/chat/completions", body: `{}`, status: 401, typ: "invalid_request_error"},
		{name: "wrong key", path: "/v1/chat/completions", body: `{}`, header: []string{"Authorization", "Bearer sk-bad"}, status: 401, code: "invalid_api_key"},
		{name: "invalid JSON", path: "/v1/chat/completions", body: `{"model":`, header: auth, status: 400, typ: "invalid_request_error"},
		{name: "wrong type", path: "/v1/chat/completions", body: `{"model":"` + llama + `","messages":[],"max_tokens":"many"}`, header: auth, status: 400, param: "max_tokens"},
		{name: "missing model", path: "/v1/chat/completions", body: `{"messages":[{"role":"user","content":"hi"}]}`, header: auth, status: 400, param: "model"},
		{name: "missing messages", path: "/v1/chat/completions", body: `{"model":"` + llama + `"}`, header: auth, status: 400, param: "messages"},
		{name: "empty messages", path: "/v1/chat/completions", body: `{"model":"` + llama + `","messages":[]}`, header: auth, status: 400, param: "messages"},
		{name: "missing prompt", path: "/v1/completions", body: `{"model":"` + llama + `"}`, header: auth, status: 400, param: "prompt"},
		{name: "missing input", path: "/v1/embeddings", body: `{"model":"` + llama + `"}`, header: auth, status: 400, param: "input"},
		{name: "zero max_tokens", path: "/v1/completions", body: `{"model":"` + llama + `","prompt":"a","max_tokens":0}`, header: auth, status: 400, param: "max_tokens"},
		{name: "zero max_completion_tokens", path: "/v1/chat/completions", body: `{"model":"` + llama + `","messages":[{"role":"user","content":"a"}],"max_completion_tokens":0}`, header: auth, status: 400, param: "max_completion_tokens"},
		{name: "background response", path: "/v1/responses", body: `{"model":"` + llama + `","input":"a","background":true}`, header: auth, status: 400, param: "background"},
		{name: "negative max_output_tokens", path: "/v1/responses", body: `{"model":"` + llama + `","input":"a","max_output_tokens":-1}`, header: auth, status: 400, param: "max_output_tokens"},
		{name: "unknown model", path: "/v1/chat/completions", body: `{"model":"nope","messages":[{"role":"user","content":"hi"}]}`, header: auth, status: 404, code: "model_not_found", param: "model"},
		{name: "body too large", path: "/v1/completions", body: `{"model":"` + llama + `","prompt":"` + big + `"}`, header: auth, status: 413},
		{name: "backend's context length", path: "/v1/completions", body: `{"model":"` + llama + `","prompt":"a","max_tokens":9000}`, header: auth, status: 400, code: "context_length_exceeded"},
		{name: "more KV than any backend holds", path: "/v1/completions", body: `{"model":"` + llama + `","prompt":"a","max_tokens":8000,"n":1}`, header: auth, status: 200},
		// Past every backend's KV cache: the error names the field that sized it.
		{name: "too large by max_completion_tokens", path: "/v1/chat/completions", body: `{"model":"` + llama + `","messages":[{"role":"user","content":"a"}],"max_completion_tokens":4000,"n":5}`,
			header: auth, status: 400, code: "context_length_exceeded", param: "max_completion_tokens"},
		{name: "too large by max_tokens", path: "/v1/completions", body: `{"model":"` + llama + `","prompt":"a","max_tokens":4000,"n":5}`,
			header: auth, status: 400, code: "context_length_exceeded", param: "max_tokens"},
		{name: "too large by n", path: "/v1/chat/completions", body: `{"model":"` + llama + `","messages":[{"role":"user","content":"a"}],"n":100}`,
			header: auth, status: 400, code: "context_length_exceeded", param: "n"},
		{name: "unknown route", path: "/v1/nothing", body: `{}`, header: auth, status: 404},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			resp, body := f.post(t, tc.path, tc.body, tc.header...)
			if resp.StatusCode != tc.status {
				t.Fatalf("status %d, want %d: %s", resp.StatusCode, tc.status, body)
			}
			if tc.status == 200 {
				return
			}
			var e struct {
				Error struct {
					Message string  `json:"message"`
					Type    string  `json:"type"`
					Code    any     `json:"code"`
					Param   *string `json:"param"`
				} `json:"error"`
			}
			if err := json.Unmarshal(body, &e); err != nil || e.Error.Message == "" || e.Error.Type == "" {
				t.Fatalf("not an OpenAI error body: %s", body)
			}
			if tc.typ != "" && e.Error.Type != tc.typ {
				t.Errorf("type %q, want %q", e.Error.Type, tc.typ)
			}
			if tc.code != "" && e.Error.Code != tc.code {
				t.Errorf("code %v, want %q", e.Error.Code, tc.code)
			}
			if tc.param != "" && (e.Error.Param == nil || *e.Error.Param != tc.param) {
				t.Errorf("param %v, want %q", e.Error.Param, tc.param)
			}
		})
	}
}

// TestQueueTimeout fills a small backend with one long request; the next
// waits in kvgate and, past its wait, gets 503 with Retry-After.
func TestQueueTimeout(t *testing.T) {
	p := llamaProfile(t)
	p.NumGPUBlocks, p.MaxModelLen = 600, 8192 // 9,584 tokens
	f := startFleet(t, fleetOpts{profile: p, speedup: 1, policy: scheduler.Policy{MaxQueueWait: 100 * time.Millisecond}})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	hold, _ := http.NewRequestWithContext(ctx, http.MethodPost, f.srv.URL+"/v1/completions",
		strings.NewReader(`{"model":"`+llama+`","prompt":"a","max_tokens":8000,"ignore_eos":true}`))
	go func() {
		if resp, err := http.DefaultClient.Do(hold); err == nil {
			resp.Body.Close()
		}
	}()
	eventually.True(t, "the long request to be admitted", func() bool { return f.inflight() == 1 })
	// It would grow alongside the first: no room until that one ends.
	resp, body := f.post(t, "/v1/completions", `{"model":"`+llama+`","prompt":"b","max_tokens":8000}`)
	if resp.StatusCode != http.StatusServiceUnavailable || resp.Header.Get("Retry-After") == "" {
		t.Fatalf("status %d, Retry-After %q: %s", resp.StatusCode, resp.Header.Get("Retry-After"), body)
	}
	if !strings.Contains(string(body), "server_overloaded") {
		t.Errorf("body %s", body)
	}
	cancel()
	eventually.True(t, "the cancelled request's reservation to be freed", func() bool { return f.inflight() == 0 })
}

// TestDisconnectCancelsUpstream: a client that hangs up mid-stream frees its
// reservation and its backend request at once.
func TestDisconnectCancelsUpstream(t *testing.T) {
	f := startFleet(t, fleetOpts{speedup: 5})
	for _, stream := range []bool{true, false} {
		t.Run(fmt.Sprintf("stream=%v", stream), func(t *testing.T) {
			ctx, cancel := context.WithCancel(context.Background())
			body := fmt.Sprintf(`{"model":"%s","prompt":"long","max_tokens":5000,"ignore_eos":true,"stream":%v}`, llama, stream)
			req, _ := http.NewRequestWithContext(ctx, http.MethodPost, f.srv.URL+"/v1/completions", strings.NewReader(body))
			done := make(chan struct{})
			go func() {
				defer close(done)
				resp, err := http.DefaultClient.Do(req)
				if err != nil {
					return
				}
				defer resp.Body.Close()
				br := bufio.NewReader(resp.Body)
				for range 5 {
					if _, err := br.ReadString('\n'); err != nil {
						return
					}
				}
				<-ctx.Done()
			}()
			eventually.True(t, "the backend to run the request", func() bool { return f.sims[0].Engine().Load() == 1 })
			cancel()
			<-done
			eventually.True(t, "the reservation to be freed", func() bool { return f.inflight() == 0 })
			eventually.True(t, "the backend request to be aborted", func() bool { return f.sims[0].Engine().Load() == 0 })
		})
	}
}

// TestBackendDiesMidStream: once bytes have reached the client, a failing
// backend ends the stream with an error event, not a silent cut.
func TestBackendDiesMidStream(t *testing.T) {
	f := startFleet(t, fleetOpts{speedup: 5})
	resp, err := http.Post(f.srv.URL+"/v1/chat/completions", "application/json", strings.NewReader(
		`{"model":"`+llama+`","messages":[{"role":"user","content":"hi"}],"max_tokens":5000,"ignore_eos":true,"stream":true}`))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	br := bufio.NewReader(resp.Body)
	for range 4 {
		if _, err := br.ReadString('\n'); err != nil {
			t.Fatal(err)
		}
	}
	f.sims[0].SetFaults(vllmsim.Faults{Dead: true})
	rest, _ := io.ReadAll(br)
	if !bytes.Contains(rest, []byte(`"error"`)) {
		t.Errorf("stream ended without an error event: ...%s", tail(rest))
	}
	eventually.True(t, "the reservation to be freed", func() bool { return f.inflight() == 0 })
}

func tail(b []byte) []byte { return b[max(0, len(b)-300):] }

// TestRetryOnAnotherBackend: a backend failing before the first byte costs
// the client nothing; the request lands on the other one.
func TestRetryOnAnotherBackend(t *testing.T) {
	f := startFleet(t, fleetOpts{backends: 2})
	f.sims[0].SetFaults(vllmsim.Faults{ServerErrorRate: 1})
	f.sims[1].SetFaults(vllmsim.Faults{})
	for i := range 6 {
		resp, body := f.post(t, "/v1/completions", fmt.Sprintf(`{"model":"%s","prompt":"try %d","max_tokens":4}`, llama, i))
		if resp.StatusCode != 200 {
			t.Fatalf("request %d: status %d: %s", i, resp.StatusCode, body)
		}
	}
	// Three failures in a row eject the bad backend.
	eventually.True(t, "the failing backend to be ejected", func() bool {
		s, _ := f.pool.Snapshot("sim0")
		return s.Ejected
	})
	// With both failing, the client gets the backend's error.
	f.sims[1].SetFaults(vllmsim.Faults{UnavailableRate: 1})
	resp, body := f.post(t, "/v1/completions", `{"model":"`+llama+`","prompt":"x","max_tokens":4}`)
	if resp.StatusCode < 500 {
		t.Errorf("status %d with every backend failing: %s", resp.StatusCode, body)
	}
}

func TestHealthReadyMetrics(t *testing.T) {
	f := startFleet(t, fleetOpts{})
	for _, path := range []string{"/healthz", "/readyz"} {
		resp, err := http.Get(f.srv.URL + path)
		if err != nil || resp.StatusCode != 200 {
			t.Fatalf("%s: %v %v", path, resp, err)
		}
		resp.Body.Close()
	}
	f.post(t, "/v1/completions", `{"model":"`+llama+`","prompt":"x","max_tokens":4}`)
	resp, err := http.Get(f.srv.URL + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	for _, want := range []string{
		`kvgate_gateway_requests_total{method="POST",model="` + llama + `",route="/v1/completions",status="200"} 1`,
		"kvgate_gateway_request_duration_seconds_bucket",
		`kvgate_scheduler_admissions_total{class="interactive",outcome="admitted"} 1`,
		`kvgate_scheduler_backend_capacity_tokens{backend="sim0"} 439904`,
		`kvgate_scheduler_backend_stale{backend="sim0"} 0`,
		"kvgate_scheduler_queue_wait_seconds_bucket",
	} {
		if !strings.Contains(string(b), want) {
			t.Errorf("/metrics lacks %s", want)
		}
	}
	f.sims[0].SetFaults(vllmsim.Faults{Dead: true})
	waitUnready(t, f.srv.URL)
}

func TestEmbeddings(t *testing.T) {
	p, _ := vllmsim.LookupProfile("h100-bge-m3")
	f := startFleet(t, fleetOpts{profile: p})
	c := f.client("unused")
	res, err := c.CreateEmbeddings(context.Background(), openai.EmbeddingRequestStrings{
		Model: "BAAI/bge-m3", Input: []string{"one", "two"},
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Data) != 2 || len(res.Data[0].Embedding) != 1024 || res.Usage.PromptTokens == 0 {
		t.Errorf("embeddings: %d items, %d dims, usage %+v", len(res.Data), len(res.Data[0].Embedding), res.Usage)
	}
}

// TestStalledBackendIsCut: a backend that accepts requests and never
// answers (while its /health stays fine) is cut after the request timeout,
// counted as failed, and the request goes to the other backend.
func TestStalledBackendIsCut(t *testing.T) {
	f := startFleet(t, fleetOpts{backends: 2, gateway: Config{RequestTimeout: 200 * time.Millisecond, StreamIdleTimeout: 200 * time.Millisecond}})
	f.sims[0].SetFaults(vllmsim.Faults{HangRate: 1})
	f.sims[1].SetFaults(vllmsim.Faults{})
	for _, stream := range []bool{false, true} {
		for i := range 3 {
			resp, body := f.post(t, "/v1/completions", fmt.Sprintf(`{"model":"%s","prompt":"p%d","max_tokens":4,"stream":%v}`, llama, i, stream))
			if resp.StatusCode != 200 {
				t.Fatalf("stream=%v request %d: status %d: %s", stream, i, resp.StatusCode, body)
			}
		}
	}
	if f.inflight() != 0 {
		t.Errorf("%d reservations held after the stalls", f.inflight())
	}
	s, _ := f.pool.Snapshot("sim0")
	if s.Failures == 0 && !s.Ejected {
		t.Error("the stalled backend was not counted as failed")
	}
	// With every backend silent, the client hears a timeout: 504, not a
	// 502 that says the backend failed.
	f.sims[1].SetFaults(vllmsim.Faults{HangRate: 1})
	resp, body := f.post(t, "/v1/completions", fmt.Sprintf(`{"model":"%s","prompt":"silence","max_tokens":4}`, llama))
	if resp.StatusCode != http.StatusGatewayTimeout || !strings.Contains(string(body), `"timeout"`) {
		t.Errorf("every backend silent: %d %s, want 504 timeout", resp.StatusCode, body)
	}
}

// TestStreamFailingBeforeFirstEventIsRetried: a backend that sends its
// stream headers and dies has sent the client nothing yet; the request is
// retried on the other backend and the client never sees the failure.
func TestStreamFailingBeforeFirstEventIsRetried(t *testing.T) {
	f := startFleet(t, fleetOpts{backends: 2, wrap: func(i int, h http.Handler) http.Handler {
		if i != 0 {
			return h
		}
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.Method == http.MethodPost && strings.HasSuffix(r.URL.Path, "/completions") {
				w.Header().Set("Content-Type", "text/event-stream")
				w.WriteHeader(http.StatusOK)
				_ = http.NewResponseController(w).Flush()
				panic(http.ErrAbortHandler)
			}
			h.ServeHTTP(w, r)
		})
	}})
	for i := range 4 {
		resp, body := f.post(t, "/v1/completions", fmt.Sprintf(`{"model":"%s","prompt":"p%d","max_tokens":3,"stream":true}`, llama, i))
		if resp.StatusCode != 200 || bytes.Contains(body, []byte(`"error"`)) || !bytes.Contains(body, []byte("data: [DONE]")) {
			t.Fatalf("request %d: status %d: %s", i, resp.StatusCode, tail(body))
		}
	}
}

func TestNSequencesReserveEach(t *testing.T) {
	f := startFleet(t, fleetOpts{})
	for _, tc := range []struct {
		body string
		want int
	}{
		{`{"prompt":"a","max_tokens":10}`, 1},
		{`{"prompt":"a","max_tokens":10,"n":3}`, 3},
		{`{"prompt":["a","b"],"max_tokens":10,"n":2}`, 4},
		{`{"prompt":[1,2,3],"max_tokens":10}`, 1},
		{`{"prompt":[[1,2],[3]],"max_tokens":10}`, 2},
	} {
		c, err := f.api.readCall(httptest.NewRequest(http.MethodPost, "/v1/completions",
			strings.NewReader(strings.Replace(tc.body, "{", `{"model":"`+llama+`",`, 1))), epCompletion)
		if err != nil {
			t.Fatal(err)
		}
		if c.sequences != tc.want {
			t.Errorf("%s: %d sequences, want %d", tc.body, c.sequences, tc.want)
		}
	}
	resp, body := f.post(t, "/v1/completions", `{"model":"`+llama+`","prompt":"a","n":0}`)
	if resp.StatusCode != 400 {
		t.Errorf("n=0: status %d: %s", resp.StatusCode, body)
	}
}

// TestClientThatStopsReadingIsLetGo: a client that stops reading a
// stream, its connection left open, is let go of once it has accepted no
// byte for StreamIdleTimeout: its grant (the backend's KV reservation) is
// released, and the backend, which was streaming all along, is not cut
// and counted as stalled for the client's fault.
func TestClientThatStopsReadingIsLetGo(t *testing.T) {
	f := startFleet(t, fleetOpts{speedup: 1000, gateway: Config{StreamIdleTimeout: 300 * time.Millisecond}})
	conn := dialSmallWindow(t, f.srv.URL)
	body := fmt.Sprintf(`{"model":%q,"prompt":"p","max_tokens":20000,"ignore_eos":true,"stream":true}`, llama)
	if _, err := fmt.Fprintf(conn, "POST /v1/completions HTTP/1.1\r\nHost: kvgate\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", len(body), body); err != nil {
		t.Fatal(err)
	}
	status := make([]byte, len("HTTP/1.1 200"))
	if _, err := io.ReadFull(conn, status); err != nil || string(status) != "HTTP/1.1 200" {
		t.Fatalf("status %q, %v", status, err)
	}
	// The client reads no more. Its grant is released once the gateway's
	// writes have waited StreamIdleTimeout for it.
	eventually.True(t, "the grant of a client that stopped reading to be released", func() bool { return f.inflight() == 0 })
	s, _ := f.pool.Snapshot("sim0")
	if s.Failures != 0 || s.Ejected {
		t.Errorf("the backend was counted as failed (%d failures, ejected %v) for a client that stopped reading", s.Failures, s.Ejected)
	}
}

// dialSmallWindow connects to an http:// URL with a 4 KiB receive buffer,
// so that a client that stops reading fills it soon; closed when the test
// ends.
func dialSmallWindow(t *testing.T, base string) net.Conn {
	t.Helper()
	d := net.Dialer{Control: func(_, _ string, c syscall.RawConn) error {
		var serr error
		if err := c.Control(func(fd uintptr) {
			serr = syscall.SetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_RCVBUF, 4096)
		}); err != nil {
			return err
		}
		return serr
	}}
	conn, err := d.Dial("tcp", strings.TrimPrefix(base, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

// TestStreamStallingMidwayEndsWithAnError: a backend that goes silent
// after its first events is cut at the stream idle timeout, and the
// client hears why: the stream's error event, whole, not a connection
// dropped mid-chunk (the client's write deadline had been moved by the
// same events that reset the backend's watchdog, and ran out with it).
func TestStreamStallingMidwayEndsWithAnError(t *testing.T) {
	const idle = 300 * time.Millisecond
	f := startFleet(t, fleetOpts{gateway: Config{StreamIdleTimeout: idle, RequestTimeout: 10 * time.Second},
		wrap: scriptedChatStream(`data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"`+llama+
			`","choices":[{"index":0,"delta":{"role":"assistant","content":"Hel"},"finish_reason":null}]}`+"\n\n",
			func(r *http.Request) { <-r.Context().Done() })}) // silent from here
	resp, err := http.Post(f.srv.URL+"/v1/chat/completions", "application/json", strings.NewReader(
		`{"model":"`+llama+`","messages":[{"role":"user","content":"hi"}],"max_tokens":50,"stream":true}`))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil || !bytes.Contains(body, []byte(`"Hel"`)) || !bytes.Contains(body, []byte(`data: {"error":`)) {
		t.Errorf("the stalled stream: read error %v, body %s; want its first event, then the error event", err, tail(body))
	}
}

// scriptedChatStream stands a scripted backend stream in front of every
// backend: a chat request's body is read whole (as vLLM reads it), then
// events are sent and flushed, then end runs (nil: the answer ends there).
// Every other request reaches the backend.
func scriptedChatStream(events string, end func(r *http.Request)) func(int, http.Handler) http.Handler {
	return func(_ int, h http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.Method != http.MethodPost || !strings.HasSuffix(r.URL.Path, "/chat/completions") {
				h.ServeHTTP(w, r)
				return
			}
			_, _ = io.Copy(io.Discard, r.Body)
			w.Header().Set("Content-Type", "text/event-stream")
			_, _ = io.WriteString(w, events)
			_ = http.NewResponseController(w).Flush()
			if end != nil {
				end(r)
			}
		})
	}
}
