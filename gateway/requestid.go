package gateway

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"log/slog"
	"net/http"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvgate/kvgate/store"
)

// RequestIDHeader is the header that names a request: the caller's when
// it sent a valid one, else one kvgate makes; every response carries it,
// as OpenAI's and vLLM's clients expect, and it is in the request's log
// lines and its span.
const RequestIDHeader = "X-Request-Id"

// reqInfo is what the access log says of a request, filled as the request
// goes: the route and tenant by api, the model by the handler, the backend
// and tokens by the proxy.
type reqInfo struct {
	id     string
	start  time.Time
	route  string
	tenant string
	model  string
	jobID  string
	// backend and the tokens are those of the attempt that answered.
	backend                        string
	promptTokens, completionTokens int
}

type reqInfoKey struct{}

func infoOf(ctx context.Context) *reqInfo {
	i, _ := ctx.Value(reqInfoKey{}).(*reqInfo)
	return i
}

// RequestID returns the id of the request ctx belongs to ("" outside one).
func RequestID(ctx context.Context) string {
	if i := infoOf(ctx); i != nil {
		return i.id
	}
	return ""
}

// requestStart is when the request reached kvgate (now outside one).
func requestStart(ctx context.Context) time.Time {
	if i := infoOf(ctx); i != nil {
		return i.start
	}
	return time.Now()
}

// validRequestID accepts what a client may name a request with: 1 to 128
// printable ASCII characters without spaces, quotes or backslashes (the
// id goes back in a header and into logs as it came).
func validRequestID(id string) bool {
	if id == "" || len(id) > 128 {
		return false
	}
	for i := 0; i < len(id); i++ {
		c := id[i]
		if c <= ' ' || c >= 0x7f || c == '"' || c == '\\' {
			return false
		}
	}
	return true
}

// nameBackendCall sets the X-Request-Id of a call to a backend: base (the
// request's id, or the job's) and 8 random hex digits. vLLM takes the
// header for its own id of the request, in its logs and in the answer's id
// (chatcmpl-<id>), so an operator finds a kvgate request or job in the
// backend's logs by its id. The suffix makes each call's name its own: a
// client that reuses an id, or a job's attempts, never puts two requests
// of one name in a backend at once.
func nameBackendCall(req *http.Request, base string) {
	if base == "" {
		base = newRequestID()
	}
	var b [4]byte
	_, _ = rand.Read(b[:])
	req.Header.Set(RequestIDHeader, base+"-"+hex.EncodeToString(b[:]))
}

// newRequestID makes an id in OpenAI's form: req_ and 32 hex digits.
func newRequestID() string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	return "req_" + hex.EncodeToString(b[:])
}

// ServeHTTP serves the API: it names the request (X-Request-Id), traces
// it when tracing is on, and writes its access log line.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	id := r.Header.Get(RequestIDHeader)
	if !validRequestID(id) {
		id = newRequestID()
	}
	w.Header().Set(RequestIDHeader, id)
	info := &reqInfo{id: id, start: time.Now()}
	ctx := context.WithValue(r.Context(), reqInfoKey{}, info)
	ctx, span := s.startServerSpan(ctx, r, id)
	aw := &accessWriter{ResponseWriter: w}
	r = r.WithContext(ctx)
	s.mux.ServeHTTP(aw, r)
	if info.route == "" {
		_, info.route, _ = strings.Cut(r.Pattern, " ") // "GET /healthz": the method is logged apart
		if info.route == "" {
			info.route = r.Pattern
		}
	}
	status := aw.status
	if status == 0 {
		status = http.StatusOK
	}
	endServerSpan(span, info, status)
	s.accessLog(ctx, info, r.Method, status)
}

// accessLog writes one line per request at the configured level.
func (s *Server) accessLog(ctx context.Context, i *reqInfo, method string, status int) {
	if s.accessLevel == accessOff || !s.log.Enabled(ctx, s.accessLevel) {
		return
	}
	attrs := []slog.Attr{
		slog.String("request_id", i.id), slog.String("method", method), slog.String("route", i.route), slog.Int("status", status),
		slog.Float64("duration_ms", float64(time.Since(i.start).Microseconds())/1000),
	}
	if i.tenant != "" {
		attrs = append(attrs, slog.String("tenant", i.tenant))
	}
	if i.model != "" {
		attrs = append(attrs, slog.String("model", i.model))
	}
	if i.backend != "" {
		attrs = append(attrs, slog.String("backend", i.backend))
	}
	if i.promptTokens > 0 || i.completionTokens > 0 {
		attrs = append(attrs, slog.Int("prompt_tokens", i.promptTokens), slog.Int("completion_tokens", i.completionTokens))
	}
	if i.jobID != "" {
		attrs = append(attrs, slog.String("job_id", i.jobID))
	}
	// The line names its request itself: LogHandler must not add the id
	// again (it still adds the trace).
	s.log.LogAttrs(context.WithValue(ctx, reqInfoKey{}, (*reqInfo)(nil)), s.accessLevel, "request", attrs...)
}

// accessOff is the access log's level when it is off: above any.
const accessOff = slog.Level(1 << 20)

// parseAccessLog reads Config.AccessLog.
func parseAccessLog(v string) (slog.Level, bool) {
	switch v {
	case "", "debug":
		return slog.LevelDebug, true
	case "info":
		return slog.LevelInfo, true
	case "off":
		return accessOff, true
	}
	return 0, false
}

// noteAnswer records, for the access log and the request's span, the
// backend that answered and its usage.
func noteAnswer(ctx context.Context, backend string, u *usage) {
	i := infoOf(ctx)
	if i == nil {
		return
	}
	i.backend = backend
	if u != nil {
		i.promptTokens, i.completionTokens = u.PromptTokens, u.CompletionTokens
	}
}

// accessWriter remembers the status written.
type accessWriter struct {
	http.ResponseWriter
	status int
}

func (w *accessWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

func (w *accessWriter) WriteHeader(code int) {
	if w.status == 0 {
		w.status = code
	}
	w.ResponseWriter.WriteHeader(code)
}

func (w *accessWriter) Write(b []byte) (int, error) {
	if w.status == 0 {
		w.status = http.StatusOK
	}
	return w.ResponseWriter.Write(b)
}

// LogHandler wraps a slog handler so that a record logged with a
// request's context (slog's ...Context calls) carries its request_id, and
// its trace_id and span_id when it is traced.
func LogHandler(h slog.Handler) slog.Handler { return ctxHandler{h} }

type ctxHandler struct{ slog.Handler }

func (h ctxHandler) Handle(ctx context.Context, r slog.Record) error {
	if id := RequestID(ctx); id != "" {
		r.AddAttrs(slog.String("request_id", id))
	}
	if tid, sid, ok := traceIDs(ctx); ok {
		r.AddAttrs(slog.String("trace_id", tid), slog.String("span_id", sid))
	}
	return h.Handler.Handle(ctx, r)
}

func (h ctxHandler) WithAttrs(as []slog.Attr) slog.Handler {
	return ctxHandler{h.Handler.WithAttrs(as)}
}
func (h ctxHandler) WithGroup(name string) slog.Handler { return ctxHandler{h.Handler.WithGroup(name)} }

// initObservability sets up the access log and the acceptance histogram.
func (s *Server) initObservability(reg prometheus.Registerer) error {
	lvl, ok := parseAccessLog(s.cfg.AccessLog)
	if !ok {
		return fmt.Errorf("access log %q is not debug, info or off", s.cfg.AccessLog)
	}
	s.accessLevel = lvl
	s.accepted = prometheus.NewHistogram(prometheus.HistogramOpts{Name: "kvgate_job_acceptance_seconds",
		Help:    "Time from a job submission's arrival to its durable acceptance (the 202 with a new job; replays of a key are not counted).",
		Buckets: []float64{0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10}})
	return reg.Register(s.accepted)
}

// jobAccepted observes a new job's acceptance: its latency, its id in the
// access log, and its trace linked to the request's.
func (s *Server) jobAccepted(ctx context.Context, j store.Job) {
	start := requestStart(ctx)
	s.accepted.Observe(time.Since(start).Seconds())
	if i := infoOf(ctx); i != nil {
		i.jobID = j.ID
	}
	linkJob(ctx, j, start)
}
