package gateway

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"runtime/debug"
	"strconv"
	"time"

	"github.com/kvgate/kvgate/gpu"
	"github.com/kvgate/kvgate/store"
)

// vLLM's own routes beside the OpenAI API, as apps written against a vLLM
// server call them: GET /health and GET /version (no key, as vLLM serves
// them), POST /tokenize and /detokenize (a key, as every route that
// reaches a backend), passed through to a routable backend of the model.

// surfaceRoutes registers the routes of this file and of responses.go and
// pooling.go.
func (s *Server) surfaceRoutes() {
	s.mux.HandleFunc("GET /health", s.handleHealth)
	s.mux.HandleFunc("GET /version", s.handleVersion)
	s.mux.Handle("POST /tokenize", s.api("/tokenize", s.handleTokenize))
	s.mux.Handle("POST /detokenize", s.api("/detokenize", s.handleTokenize))
	s.mux.Handle("POST /v1/responses", s.api("/v1/responses", s.handleResponses))
	for _, p := range []string{"/v1/rerank", "/rerank"} {
		s.mux.Handle("POST "+p, s.api(p, s.handleRerank))
	}
	for _, p := range []string{"/v1/score", "/score"} {
		s.mux.Handle("POST "+p, s.api(p, s.handleScore))
	}
}

// handleHealth answers as vLLM's /health does: 200 with an empty body
// while the gateway can serve (a backend can take work, no drain), 503
// with an empty body otherwise. /readyz says why in words.
func (s *Server) handleHealth(w http.ResponseWriter, r *http.Request) {
	if !s.ready(time.Now()) {
		w.WriteHeader(http.StatusServiceUnavailable)
		return
	}
	w.WriteHeader(http.StatusOK)
}

// ready reports whether a request could be served now: no drain, and a
// routable backend whose metrics are fresh.
func (s *Server) ready(now time.Time) bool {
	if s.drain.draining() || s.drain.unready.Load() {
		return false
	}
	for _, sn := range s.pool.Snapshots() {
		if sn.Routable() && !sn.Stale(now) {
			return true
		}
	}
	return false
}

// handleVersion answers as vLLM's /version does: {"version": ...}, here
// kvgate's own version.
func (s *Server) handleVersion(w http.ResponseWriter, r *http.Request) {
	writeJSON(w, http.StatusOK, map[string]string{"version": s.version()})
}

// version is Config.Version, or the main module's version from the build
// information, or "dev".
func (s *Server) version() string {
	if s.cfg.Version != "" {
		return s.cfg.Version
	}
	if bi, ok := debug.ReadBuildInfo(); ok && bi.Main.Version != "" && bi.Main.Version != "(devel)" {
		return bi.Main.Version
	}
	return "dev"
}

// handleTokenize passes /tokenize or /detokenize to a routable backend of
// the request's model (the only model served, when the body names none, as
// vLLM defaults to its own), and its answer back as it is. An alias is
// resolved as for inference. Nothing is admitted: a tokenizer runs on the
// backend's CPU, not in its KV cache; but the call counts against its
// tenant's requests per minute and concurrency (a permit of no tokens),
// and the calls go round the backends serving the model, so that a
// tenant cannot load one server's CPU past its limits.
func (s *Server) handleTokenize(w http.ResponseWriter, r *http.Request) int {
	body, err := readBody(r)
	if err != nil {
		return writeError(w, s.log, err)
	}
	var f struct {
		Model *string `json:"model"`
	}
	if err := decodeExact(body, []namedField{{"model", &f.Model}}); err != nil {
		var typeErr *json.UnmarshalTypeError
		if errors.As(err, &typeErr) && typeErr.Field != "" {
			return writeError(w, s.log, badRequest(typeErr.Field, fmt.Sprintf("Invalid type for '%s': expected %s.", typeErr.Field, typeErr.Type)))
		}
		return writeError(w, s.log, badRequest("", "We could not parse the JSON body of your request. ("+err.Error()+")"))
	}
	name := ""
	if f.Model != nil {
		name = *f.Model
	}
	if name == "" {
		ms := s.pool.Models()
		if len(ms) != 1 {
			return writeError(w, s.log, badRequest("model", "You must provide a model parameter: this gateway serves more than one model."))
		}
		name = ms[0].ID
	}
	target, aliased := s.resolveAlias(name)
	model, ok := s.lookupModel(target)
	if !ok {
		return writeError(w, s.log, modelNotFound(name, "model"))
	}
	s.labelModel(w, model.ID)
	if aliased || f.Model == nil || *f.Model == "" {
		if body, err = withModel(body, model.ID); err != nil {
			return writeError(w, s.log, badRequest("", "The request body must be a JSON object."))
		}
	}
	if err := s.sched.CheckModel(model.ID); err != nil {
		return writeError(w, s.log, err)
	}
	permit, err := s.acquireQuota(r.Context(), 0, 0, Price{})
	if err != nil {
		if r.Context().Err() != nil {
			return 499
		}
		return writeError(w, s.log, err)
	}
	permit.headers(w.Header())
	kept := permit.keep() // a backend may take its request timeout, each tried
	attempts, answered := 0, false
	defer func() {
		kept()
		o := store.NotSent
		if attempts > 0 {
			o = store.Reported
		}
		if answered && permit != nil {
			_ = http.NewResponseController(w).Flush() // the client need not wait for the release
		}
		permit.release(r.Context(), o, attempts, 0, &usage{})
	}()
	var serving []*gpu.Snapshot
	for _, sn := range s.pool.Snapshots() {
		if _, ok := sn.Serves(model.ID); ok && sn.Routable() {
			serving = append(serving, sn)
		}
	}
	var last error
	first := int(s.tokenizeRR.Add(1) % uint64(max(len(serving), 1)))
	for i := range serving {
		sn := serving[(first+i)%len(serving)]
		attempts = 1
		status, done, err := s.passThrough(r.Context(), w, sn.URL+r.URL.Path, body)
		if done {
			answered = true
			return status
		}
		last = err
		s.log.Info("tokenizer pass-through failed; trying another backend", "backend", sn.Name, "err", err)
	}
	if last == nil {
		last = s.sched.CheckModel(model.ID) // none routable any more: say why
	}
	return writeError(w, s.log, last)
}

// passThrough posts body to url and copies the answer to w, whatever its
// status; done is false (and nothing written) when no answer came.
func (s *Server) passThrough(ctx context.Context, w http.ResponseWriter, url string, body []byte) (int, bool, error) {
	ctx, cancel := context.WithTimeout(ctx, s.cfg.RequestTimeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(body))
	if err != nil {
		return 0, false, err
	}
	req.Header.Set("Content-Type", "application/json")
	nameBackendCall(req, RequestID(ctx))
	resp, err := s.client.Do(req)
	if err != nil {
		return 0, false, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, 64<<20))
	if err != nil {
		return 0, false, err
	}
	if resp.StatusCode >= 400 {
		// The backend's error, in OpenAI's shape (vLLM's code is a number).
		up := classifyResponse(resp.StatusCode, resp.Header, b)
		return writeError(w, s.log, up.err), true, nil
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", strconv.Itoa(len(b)))
	w.WriteHeader(resp.StatusCode)
	_, _ = w.Write(b)
	return resp.StatusCode, true, nil
}

// withModel sets a request body's model, keeping its other fields.
func withModel(body []byte, model string) ([]byte, error) {
	var m map[string]json.RawMessage
	if err := json.Unmarshal(body, &m); err != nil {
		return nil, err
	}
	if m == nil {
		return nil, errors.New("not a JSON object")
	}
	m["model"] = mustJSON(model)
	var b bytes.Buffer
	enc := json.NewEncoder(&b)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(m); err != nil {
		return nil, err
	}
	return bytes.TrimRight(b.Bytes(), "\n"), nil
}

// modelNotFound is the 404 for a model nothing serves.
func modelNotFound(model, param string) *apiError {
	return &apiError{status: http.StatusNotFound, typ: "invalid_request_error", code: "model_not_found",
		param: param, msg: fmt.Sprintf("The model `%s` does not exist or you do not have access to it.", model)}
}
