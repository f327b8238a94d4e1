package gateway

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"strings"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/kvgate/kvgate/gateway/hop"
	"github.com/kvgate/kvgate/gpu"
	"github.com/kvgate/kvgate/scheduler"
	"github.com/kvgate/kvgate/store"
)

// Config configures the API. Zero values take the defaults in brackets.
type Config struct {
	// APIKeys maps bearer tokens to tenants.
	APIKeys map[string]string
	// Dev is development mode: a caller without a key is tenant
	// "default"'s administrator while no key exists (no static key, and a
	// tenant store that has never held one). Without it a caller needs a
	// valid key, always.
	Dev bool
	// OperatorKeys maps bearer tokens to the tenants whose operators hold
	// them: they may do all a tenant's key may, and also see retry
	// details (a job's attempts, backends and error classes).
	OperatorKeys map[string]string
	// MaxBodyBytes caps request bodies; larger ones get 413 [8 MiB].
	MaxBodyBytes int64
	// MaxAnswerBytes caps a backend's answer to a request that is not
	// streamed, which kvgate reads whole (for its usage); a larger one is
	// a 502 answer_too_large [256 MiB]. Streams are passed on as they come.
	MaxAnswerBytes int64
	// DefaultMaxTokens is the output reserved for a chat request that sets
	// no max_tokens, bounded by what the context leaves [1024].
	DefaultMaxTokens int
	// TokenCount is "estimate" (bytes times a per-model ratio learned from
	// reported usage) or "tokenize" (ask the backend's /tokenize: exact,
	// one more round trip) ["estimate"].
	TokenCount string
	// Retries is how many other backends a request may be retried on
	// before its first byte reaches the client [1].
	Retries *int
	// StreamIdleTimeout ends a stream whose backend sends nothing for this
	// long, before its first byte too [2m]; and a stream, an event stream
	// too, whose client takes nothing of a write for this long.
	StreamIdleTimeout time.Duration
	// RequestTimeout ends a non-streaming request whose backend has not
	// answered in this long [10m]; a stalled backend counts as failed.
	RequestTimeout time.Duration
	// Jobs enables the durable jobs API (/v1/jobs); without a store it
	// answers 404.
	Jobs Jobs
	// OnCooldown, when set, hears of each cooldown a backend's 429 starts
	// here, to tell the other replicas (which apply it by URL).
	OnCooldown func(backendURL string, until time.Time)
	// AdminKeys maps bearer tokens to the tenants of administrators: they
	// may do all an operator may, and manage tenants and keys
	// (/v1/admin/). A bootstrap key for a store-backed deployment.
	AdminKeys map[string]string
	// Tenants enables store-backed keys, quotas and usage; without a
	// store, only the static keys above exist and nothing is limited.
	Tenants Tenants
	// Version is what GET /version answers [the build's module version].
	Version string
	// Models maps model aliases to the models they stand for, in order:
	// the first whose backends can take work serves (see aliases.go).
	Models map[string][]string
	// Prices are per-model prices, for costs in usage and spending
	// budgets (see costs.go).
	Prices map[string]Price
	// Currency names the prices' and budgets' currency in usage reports
	// ["USD"].
	Currency string
	// Webhooks enables signed webhooks (webhooks.go); without a store
	// their routes answer 404.
	Webhooks Webhooks
	// AccessLog is the level of the access log's line per request:
	// "debug", "info" or "off" ["debug"].
	AccessLog string
	// ConsoleSecret seals the console's session cookies (console.go):
	// replicas that share it share sessions. Empty: each replica draws
	// its own at start, and sessions are per replica.
	ConsoleSecret string
	// TenantFileBytes bounds what one tenant's files (uploads, batch
	// outputs) may hold together [DefaultTenantFileBytes, 100 GiB].
	TenantFileBytes int64
	// ConsoleSessionTTL is how long a console session lasts [8h].
	ConsoleSessionTTL time.Duration
	// ConsoleSecureCookies marks the console's cookies Secure on every
	// request: behind a proxy that ends TLS, kvgate sees plain HTTP and
	// otherwise marks them Secure only on its own HTTPS.
	ConsoleSecureCookies bool
	// Backlog, when set, reports the durable runnable backlog as a
	// periodic collection last read it (scheduler.DurableMetrics.Backlog)
	// for GET /v1/fleet/queues; without it the route reads the store
	// itself, at most once a second (fleet_queues.go).
	Backlog func() ([]store.Backlog, time.Time)
}

// backendPool is what the gateway needs of the backends; *gpu.Pool
// satisfies it.
type backendPool interface {
	Snapshots() []*gpu.Snapshot
	Models() []gpu.Model
	ReportFailure(name string, err error)
	ReportSuccess(name string)
	Cooldown(name string, until time.Time) bool
}

// admitter is what the gateway needs of the scheduler.
type admitter interface {
	Acquire(ctx context.Context, t *scheduler.Ticket) (*scheduler.Grant, error)
	CheckModel(model string) error
}

// Server serves the OpenAI-compatible API. It is an http.Handler, safe for
// concurrent use.
type Server struct {
	cfg     Config
	pool    backendPool
	sched   admitter
	log     *slog.Logger
	client  *http.Client
	est     *estimator
	jobs    Jobs
	m       *metrics
	mux     *routeMux
	retries int
	keys    *keyCache    // nil without Tenants.Store
	limits  *tenantCache // nil without Tenants.Store
	quota   *quotaMetrics
	drain   *drainState
	// permitsBehind tracks the permits written behind their requests
	// (quota.go); nil without Tenants.Store.
	permitsBehind *permitsBehind
	// accessLevel is the access log's level (requestid.go).
	accessLevel slog.Level
	accepted    prometheus.Histogram
	batches     batchStore // nil unless the job store keeps files and batches
	batchWk     batchWork
	fileMax     fileMax             // the upload limits (files.go)
	consoleSeal *consoleSealer      // console.go
	gatherer    prometheus.Gatherer // the registry, for the fleet's refusal counts (fleet.go)
	backlogs    backlogCache        // the durable backlog's last read (fleet_queues.go)
	tokenizeRR  atomic.Uint64       // the next backend a /tokenize goes to, of those serving its model (vllmroutes.go)
}

// New returns the API server. reg receives the gateway's metrics and is
// served, with whatever else it holds, at /metrics. A configuration that
// no caller could authenticate against (no static key, no tenant store,
// not Dev) is an error.
func New(cfg Config, pool backendPool, sched admitter, reg *prometheus.Registry, log *slog.Logger) (*Server, error) {
	cfg.MaxBodyBytes = cmp.Or(cfg.MaxBodyBytes, 8<<20)
	cfg.MaxAnswerBytes = cmp.Or(cfg.MaxAnswerBytes, 256<<20)
	cfg.DefaultMaxTokens = cmp.Or(cfg.DefaultMaxTokens, 1024)
	cfg.TokenCount = cmp.Or(cfg.TokenCount, "estimate")
	cfg.StreamIdleTimeout = cmp.Or(cfg.StreamIdleTimeout, 2*time.Minute)
	cfg.RequestTimeout = cmp.Or(cfg.RequestTimeout, 10*time.Minute)
	if err := cfg.Jobs.Check(); err != nil {
		return nil, fmt.Errorf("jobs: %w", err)
	}
	cfg.Jobs = cfg.Jobs.withDefaults()
	if err := checkAliases(cfg.Models); err != nil {
		return nil, err
	}
	if err := checkPrices(cfg.Prices); err != nil {
		return nil, err
	}
	if cfg.TokenCount != "estimate" && cfg.TokenCount != "tokenize" {
		return nil, fmt.Errorf("token count %q is not estimate or tokenize", cfg.TokenCount)
	}
	retries := 1
	if cfg.Retries != nil {
		retries = max(0, *cfg.Retries)
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	s := &Server{
		cfg: cfg, pool: pool, sched: sched, retries: retries,
		log: log.With("component", "gateway"),
		// The dispatching client never retries a request that may have
		// reached a backend: kvgate decides. hop runs each exchange on the
		// request's goroutine (its package comment says why) and hands the
		// rest to net/http.
		client: &http.Client{Transport: hop.New(&http.Transport{
			MaxIdleConns:        1024,
			MaxIdleConnsPerHost: 512,
			IdleConnTimeout:     90 * time.Second,
			DisableCompression:  true,
		}, 512, 90*time.Second)},
		est:         newEstimator(),
		jobs:        cfg.Jobs,
		m:           newMetrics(),
		mux:         newRouteMux(),
		drain:       newDrainState(),
		consoleSeal: newConsoleSealer(cfg.ConsoleSecret),
		gatherer:    reg,
	}
	if err := s.m.register(reg); err != nil {
		return nil, err
	}
	if err := s.initObservability(reg); err != nil {
		return nil, err
	}
	if err := s.initTenants(reg); err != nil {
		return nil, err
	}
	if err := s.initAuth(); err != nil {
		return nil, err
	}
	s.routes(reg)
	return s, nil
}

func (s *Server) routes(reg *prometheus.Registry) {
	s.mux.Handle("POST /v1/chat/completions", s.api("/v1/chat/completions", s.handleChat))
	s.mux.Handle("POST /v1/completions", s.api("/v1/completions", s.handleCompletion))
	s.mux.Handle("POST /v1/embeddings", s.api("/v1/embeddings", s.handleEmbeddings))
	s.mux.Handle("GET /v1/models", s.api("/v1/models", s.handleModels))
	// The rest of the path: a model's id may hold slashes (org/name),
	// sent as they are or escaped (%2F, as the Node SDK does).
	s.mux.Handle("GET /v1/models/{model...}", s.api("/v1/models/{model}", s.handleModel))
	s.surfaceRoutes()
	if s.jobs.Store != nil {
		s.jobRoutes()
		s.outcomeRoutes(reg) // outcomes.go
	}
	if bs, ok := s.jobs.Store.(batchStore); ok {
		s.batches = bs
		s.batchWk = batchWork{ch: make(chan struct{}, 1)}
		s.fileMax = fileMax{any: maxFileBytes, batch: maxBatchFileBytes}
		s.fileRoutes()
		s.batchRoutes()
	}
	if s.cfg.Webhooks.Store != nil {
		s.webhookRoutes() // webhooks.go
	}
	if s.cfg.Tenants.Store != nil {
		s.tenantRoutes()
	}
	s.fleetRoutes()   // fleet.go
	s.consoleRoutes() // console.go
	s.mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/plain")
		_, _ = w.Write([]byte("ok\n"))
	})
	s.mux.HandleFunc("GET /readyz", s.handleReady)
	// A collector that cannot read (the job store away) is left out and
	// logged; the rest are served. The default answered 500 with none, so
	// that a store outage silenced every alert and scaled KEDA to zero.
	s.mux.Handle("GET /metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{
		ErrorHandling: promhttp.ContinueOnError, ErrorLog: promLog{s.log}, Registry: reg}))
	s.mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		writeError(w, s.log, &apiError{status: http.StatusNotFound, typ: "invalid_request_error",
			msg: fmt.Sprintf("Unknown request URL: %s %s.", r.Method, r.URL.Path)})
	})
}

type tenantKey struct{}

type operatorKey struct{}

// isOperator reports whether the caller holds an operator or admin key
// (or the gateway runs without keys, in development mode).
func isOperator(ctx context.Context) bool {
	op, _ := ctx.Value(operatorKey{}).(bool)
	return op
}

// tenantOf returns the tenant that api authenticated.
func tenantOf(ctx context.Context) string {
	t, _ := ctx.Value(tenantKey{}).(string)
	return t
}

// readScope is the tenant a request acts for: its key's, but for an
// admin's read (GET or HEAD) with ?tenant=, which reads as that tenant
// (its jobs, a job's attempts and events, ...). Nothing an admin changes
// crosses tenants this way: writes act for the key's own tenant.
func readScope(r *http.Request, p principal) string {
	if p.role == store.RoleAdmin && (r.Method == http.MethodGet || r.Method == http.MethodHead) {
		if t := r.URL.Query().Get("tenant"); t != "" {
			return t
		}
	}
	return p.tenant
}

// api wraps an API handler: authentication, the body limit, and the
// request metrics. A handler returns the status it wrote.
func (s *Server) api(route string, h func(w http.ResponseWriter, r *http.Request) int) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		start := time.Now()
		if !s.drain.enter() {
			w.Header().Set("Connection", "close")
			status := writeError(w, s.log, errDraining)
			s.m.request(route, r.Method, "", status, time.Since(start))
			return
		}
		defer s.drain.leave()
		p, err := s.authenticate(r)
		if err != nil {
			status := writeError(w, s.log, err)
			s.m.request(route, r.Method, "", status, time.Since(start))
			return
		}
		if err := storableQuery(r); err != nil {
			status := writeError(w, s.log, err)
			s.m.request(route, r.Method, "", status, time.Since(start))
			return
		}
		// The drain's deadline ends the request: see Drain.
		ctx, cancel := context.WithCancelCause(r.Context())
		defer cancel(nil)
		stop := context.AfterFunc(s.drain.deadline, func() { cancel(errDrainDeadline) })
		defer stop()
		ctx = context.WithValue(ctx, tenantKey{}, readScope(r, p))
		ctx = context.WithValue(ctx, principalKey{}, p)
		if p.role == store.RoleOperator || p.role == store.RoleAdmin {
			ctx = context.WithValue(ctx, operatorKey{}, true)
		}
		r = r.WithContext(ctx)
		r.Body = http.MaxBytesReader(w, r.Body, s.cfg.MaxBodyBytes)
		rw := &statusWriter{ResponseWriter: w}
		if i := infoOf(ctx); i != nil {
			i.route, i.tenant = route, p.tenant
			defer func() { i.model = rw.model }()
		}
		s.m.inflight.Inc()
		defer s.m.inflight.Dec()
		status := h(rw, r)
		if !rw.wrote && errors.Is(context.Cause(ctx), errDrainDeadline) {
			// Cut before its answer (waiting for room, or for a backend
			// that had not answered yet): say so rather than send nothing.
			status = writeError(rw, s.log, errDrainDeadline)
		}
		s.m.request(route, r.Method, rw.model, status, time.Since(start))
	})
}

// storableQuery refuses a path or a query value that no store can hold
// (text that is not UTF-8, or holds NUL): it names no object, and handed
// to PostgreSQL it would fail the statement as the store's error.
func storableQuery(r *http.Request) error {
	if !storableText(r.URL.Path) {
		return &apiError{status: http.StatusNotFound, typ: "invalid_request_error", code: "not_found",
			msg: "No such object: the request's path is not UTF-8 text."}
	}
	for k, vs := range r.URL.Query() {
		for _, v := range vs {
			if !storableText(k) || !storableText(v) {
				return badRequest(strings.ToValidUTF8(strings.ReplaceAll(k, "\x00", ""), ""), "Query parameters must be UTF-8 text without NUL.")
			}
		}
	}
	return nil
}

// storableText reports whether s is UTF-8 without NUL: text any store
// holds.
func storableText(s string) bool {
	return utf8.ValidString(s) && !strings.ContainsRune(s, 0)
}

// statusWriter lets a handler name the model label for the request
// metrics, and tells api whether anything was written.
type statusWriter struct {
	http.ResponseWriter
	model string
	wrote bool
}

func (w *statusWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

func (w *statusWriter) WriteHeader(code int) {
	w.wrote = true
	w.ResponseWriter.WriteHeader(code)
}

func (w *statusWriter) Write(b []byte) (int, error) {
	w.wrote = true
	return w.ResponseWriter.Write(b)
}

// modelView is a model as /v1/models shows it.
type modelView struct {
	ID          string `json:"id"`
	Object      string `json:"object"`
	Created     int64  `json:"created"`
	OwnedBy     string `json:"owned_by"`
	MaxModelLen int    `json:"max_model_len,omitempty"`
	Root        string `json:"root,omitempty"` // an alias's model
}

// models are the served models, then the aliases. A served model that an
// alias of the same name stands for (itself with fallbacks) is listed once,
// as the alias, which is what a request for the name gets.
func (s *Server) models() []modelView {
	out := []modelView{}
	for _, m := range s.pool.Models() {
		if _, ok := s.cfg.Models[m.ID]; ok {
			continue
		}
		out = append(out, modelView{ID: m.ID, Object: "model", Created: startTime, OwnedBy: "kvgate", MaxModelLen: m.MaxModelLen})
	}
	for _, a := range s.aliasModels() {
		out = append(out, modelView{ID: a.ID, Object: "model", Created: startTime, OwnedBy: "kvgate", MaxModelLen: a.MaxModelLen, Root: a.root})
	}
	return out
}

func (s *Server) handleModels(w http.ResponseWriter, r *http.Request) int {
	writeJSON(w, http.StatusOK, listOf(s.models()))
	return http.StatusOK
}

// handleModel is GET /v1/models/{model}: the model as the list shows it.
func (s *Server) handleModel(w http.ResponseWriter, r *http.Request) int {
	id := r.PathValue("model")
	for _, m := range s.models() {
		if m.ID == id {
			writeJSON(w, http.StatusOK, m)
			return http.StatusOK
		}
	}
	return writeError(w, s.log, modelNotFound(id, "model"))
}

var startTime = time.Now().Unix()

// list is OpenAI's list object.
type list[T any] struct {
	Object string `json:"object"`
	Data   []T    `json:"data"`
}

// listOf starts a list with data (empty, not null, when there is none).
func listOf[T any](data []T) list[T] { return list[T]{Object: "list", Data: data} }

// handleReady answers 200 while at least one backend can take work, and
// 503 from the moment a drain begins.
func (s *Server) handleReady(w http.ResponseWriter, r *http.Request) {
	if s.drain.draining() || s.drain.unready.Load() {
		http.Error(w, "not ready: draining", http.StatusServiceUnavailable)
		return
	}
	now := time.Now()
	var reasons []string
	for _, sn := range s.pool.Snapshots() {
		switch {
		case sn.Routable() && !sn.Stale(now):
			w.Header().Set("Content-Type", "text/plain")
			_, _ = w.Write([]byte("ready\n"))
			return
		case !sn.Routable():
			reasons = append(reasons, sn.Name+": not routable")
		default:
			reasons = append(reasons, sn.Name+": metrics stale")
		}
	}
	http.Error(w, "not ready: "+strings.Join(reasons, "; "), http.StatusServiceUnavailable)
}

var errClientGone = errors.New("client went away")
