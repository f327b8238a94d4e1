package vllmsim

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net/http"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// Config configures a simulated vLLM server.
type Config struct {
	Profile Profile
	// ServedModelName is the model id clients use; the profile's model by
	// default (vLLM's --served-model-name).
	ServedModelName string
	Speedup         float64 // see Options.Speedup
	Seed            uint64
	LegacyMetrics   bool
	Quirks          Quirks // quirks.go
	Faults          Faults
	// MaxBodyBytes caps request bodies; 32 MiB by default.
	MaxBodyBytes int64
	Logger       *slog.Logger
}

// Sim is a simulated vLLM server: an http.Handler over an Engine. Its
// handlers are safe for concurrent use; Run drives the engine.
type Sim struct {
	cfg     Config
	model   string
	eng     *Engine
	faults  *faultSet
	log     *slog.Logger
	mux     *http.ServeMux
	created int64
	inUse   atomic.Int64 // in-flight inference requests, for /load
	ids     atomic.Uint64
	idSalt  uint64
}

// New returns a simulator for cfg. It fails on an unusable profile or
// fault setting.
func New(cfg Config) (*Sim, error) {
	if err := cfg.Faults.Validate(); err != nil {
		return nil, err
	}
	eng, err := NewEngine(Options{Profile: cfg.Profile, ModelName: cfg.ServedModelName, Speedup: cfg.Speedup, Seed: cfg.Seed, LegacyMetrics: cfg.LegacyMetrics, Quirks: cfg.Quirks})
	if err != nil {
		return nil, err
	}
	if cfg.MaxBodyBytes <= 0 {
		cfg.MaxBodyBytes = 32 << 20
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	s := &Sim{
		cfg:     cfg,
		model:   cfg.Profile.Model,
		eng:     eng,
		faults:  newFaultSet(cfg.Faults, cfg.Seed),
		log:     cfg.Logger.With("component", "vllmsim", "profile", cfg.Profile.Name),
		mux:     http.NewServeMux(),
		created: time.Now().Unix(),
		idSalt:  rand.Uint64(),
	}
	if cfg.ServedModelName != "" {
		s.model = cfg.ServedModelName
	}
	if cfg.Faults.Dead {
		eng.Kill()
	}
	s.routes()
	return s, nil
}

// Engine returns the simulator's engine.
func (s *Sim) Engine() *Engine { return s.eng }

// Model returns the served model name.
func (s *Sim) Model() string { return s.model }

// Run drives the engine until ctx is done and returns ctx's error.
func (s *Sim) Run(ctx context.Context) error { return s.eng.Run(ctx) }

// ServeHTTP serves vLLM's HTTP API.
func (s *Sim) ServeHTTP(w http.ResponseWriter, r *http.Request) { s.mux.ServeHTTP(w, r) }

func (s *Sim) routes() {
	s.mux.HandleFunc("POST /v1/chat/completions", s.inference(s.handleChat))
	s.mux.HandleFunc("POST /v1/completions", s.inference(s.handleCompletion))
	s.mux.HandleFunc("POST /v1/embeddings", s.inference(s.handleEmbeddings))
	s.mux.HandleFunc("GET /v1/models", s.handleModels)
	s.mux.HandleFunc("POST /tokenize", s.handleTokenize)
	s.mux.HandleFunc("POST /detokenize", s.handleDetokenize)
	s.mux.HandleFunc("GET /health", s.handleHealth)
	s.mux.HandleFunc("GET /ping", s.handleHealth)
	s.mux.HandleFunc("POST /ping", s.handleHealth)
	s.mux.HandleFunc("GET /version", s.handleVersion)
	s.mux.HandleFunc("GET /load", s.handleLoad)
	s.poolingRoutes()
	s.mux.HandleFunc("GET /metrics", func(w http.ResponseWriter, r *http.Request) {
		promhttp.HandlerFor(s.eng.reg.Load(), promhttp.HandlerOpts{}).ServeHTTP(w, r)
	})
	s.mux.HandleFunc("GET /admin/faults", s.handleFaults)
	s.mux.HandleFunc("PUT /admin/faults", s.handleFaults)
	s.mux.HandleFunc("POST /admin/faults", s.handleFaults)
	known := map[string]bool{}
	for _, p := range []string{"/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/models",
		"/tokenize", "/detokenize", "/health", "/ping", "/version", "/load", "/metrics", "/admin/faults",
		"/v1/responses", "/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank"} {
		known[p] = true
	}
	s.mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		if known[r.URL.Path] {
			writeErrorType(w, http.StatusMethodNotAllowed, "MethodNotAllowed", "Method Not Allowed", "")
			return
		}
		writeErrorType(w, http.StatusNotFound, "NotFoundError", "Not Found", "")
	})
}

// apiError is vLLM's error body: {"error": {message, type, param, code}},
// with code the HTTP status as a number.
type apiError struct {
	Error apiErrorInfo `json:"error"`
}

type apiErrorInfo struct {
	Message string  `json:"message"`
	Type    string  `json:"type"`
	Param   *string `json:"param"`
	Code    int     `json:"code"`
}

func writeError(w http.ResponseWriter, status int, msg string) {
	typ := map[int]string{
		http.StatusBadRequest:            "BadRequestError",
		http.StatusNotFound:              "NotFoundError",
		http.StatusRequestEntityTooLarge: "BadRequestError",
		http.StatusTooManyRequests:       "RateLimitError",
		http.StatusServiceUnavailable:    "ServiceUnavailableError",
	}[status]
	if typ == "" {
		typ = "InternalServerError"
	}
	writeErrorType(w, status, typ, msg, "")
}

func writeErrorType(w http.ResponseWriter, status int, typ, msg, param string) {
	e := apiError{Error: apiErrorInfo{Message: msg, Type: typ, Code: status}}
	if param != "" {
		e.Error.Param = &param
	}
	writeJSON(w, status, e)
}

// writeJSON answers with v as JSON; like Python's json, it leaves <, > and
// & unescaped.
func writeJSON(w http.ResponseWriter, status int, v any) {
	var b bytes.Buffer
	enc := json.NewEncoder(&b)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(v); err != nil {
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", strconv.Itoa(b.Len()))
	w.WriteHeader(status)
	_, _ = w.Write(b.Bytes())
}

// decodeBody reads a JSON request body into v, answering the client itself
// when it cannot.
func (s *Sim) decodeBody(w http.ResponseWriter, r *http.Request, v any) bool {
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, s.cfg.MaxBodyBytes))
	if err != nil {
		var tooBig *http.MaxBytesError
		if errors.As(err, &tooBig) {
			writeError(w, http.StatusRequestEntityTooLarge, fmt.Sprintf("request body exceeds %d bytes", tooBig.Limit))
			return false
		}
		writeError(w, http.StatusBadRequest, "could not read request body: "+err.Error())
		return false
	}
	if err := json.Unmarshal(body, v); err != nil {
		writeError(w, http.StatusBadRequest, "invalid JSON body: "+err.Error())
		return false
	}
	return true
}

// checkModel answers 404 for a model this server does not serve. An empty
// model means the served one, as in current vLLM.
func (s *Sim) checkModel(w http.ResponseWriter, model string) bool {
	if model == "" || model == s.model {
		return true
	}
	writeErrorType(w, http.StatusNotFound, "NotFoundError", fmt.Sprintf("The model `%s` does not exist.", model), "model")
	return false
}

func (s *Sim) newID(prefix string) string {
	n := s.ids.Add(1)
	return fmt.Sprintf("%s%016x%016x", prefix, s.idSalt, n)
}

// requestID is an answer's id as vLLM makes it for chat and completions:
// prefix and the caller's X-Request-Id, taken as it came, or one of its
// own without it.
func (s *Sim) requestID(r *http.Request, prefix string) string {
	if id := r.Header.Get("X-Request-Id"); id != "" {
		return prefix + id
	}
	return s.newID(prefix)
}

type modelCard struct {
	ID          string       `json:"id"`
	Object      string       `json:"object"`
	Created     int64        `json:"created"`
	OwnedBy     string       `json:"owned_by"`
	Root        string       `json:"root"`
	Parent      *string      `json:"parent"`
	MaxModelLen int          `json:"max_model_len"`
	Permission  []permission `json:"permission"`
}

type permission struct {
	ID                 string  `json:"id"`
	Object             string  `json:"object"`
	Created            int64   `json:"created"`
	AllowCreateEngine  bool    `json:"allow_create_engine"`
	AllowSampling      bool    `json:"allow_sampling"`
	AllowLogprobs      bool    `json:"allow_logprobs"`
	AllowSearchIndices bool    `json:"allow_search_indices"`
	AllowView          bool    `json:"allow_view"`
	AllowFineTuning    bool    `json:"allow_fine_tuning"`
	Organization       string  `json:"organization"`
	Group              *string `json:"group"`
	IsBlocking         bool    `json:"is_blocking"`
}

func (s *Sim) handleModels(w http.ResponseWriter, r *http.Request) {
	writeJSON(w, http.StatusOK, map[string]any{
		"object": "list",
		"data": []modelCard{{
			ID: s.model, Object: "model", Created: s.created, OwnedBy: "vllm", Root: s.cfg.Profile.Model,
			MaxModelLen: s.cfg.Profile.MaxModelLen,
			Permission: []permission{{
				ID: fmt.Sprintf("modelperm-%016x", s.idSalt), Object: "model_permission", Created: s.created,
				AllowSampling: true, AllowLogprobs: true, AllowView: true, Organization: "*",
			}},
		}},
	})
}

type tokenizeRequest struct {
	Model               string          `json:"model"`
	Prompt              *string         `json:"prompt"`
	Messages            []chatMessageIn `json:"messages"`
	AddSpecialTokens    *bool           `json:"add_special_tokens"`
	AddGenerationPrompt *bool           `json:"add_generation_prompt"`
	ReturnTokenStrs     bool            `json:"return_token_strs"`
	Tools               json.RawMessage `json:"tools"`
}

func (s *Sim) handleTokenize(w http.ResponseWriter, r *http.Request) {
	var req tokenizeRequest
	if !s.decodeBody(w, r, &req) || !s.checkModel(w, req.Model) {
		return
	}
	var toks []int
	switch {
	case req.Prompt != nil && req.Messages == nil:
		toks = Tokenize(*req.Prompt, boolOr(req.AddSpecialTokens, true))
	case req.Messages != nil && req.Prompt == nil:
		msgs, err := convertMessages(req.Messages)
		if err != nil {
			writeError(w, http.StatusBadRequest, err.Error())
			return
		}
		toks = Tokenize(RenderChatTools(msgs, req.Tools, boolOr(req.AddGenerationPrompt, true)), boolOr(req.AddSpecialTokens, false))
	default:
		writeError(w, http.StatusBadRequest, "exactly one of prompt and messages must be given")
		return
	}
	resp := struct {
		Count       int       `json:"count"`
		MaxModelLen int       `json:"max_model_len"`
		Tokens      []int     `json:"tokens"`
		TokenStrs   *[]string `json:"token_strs"`
	}{Count: len(toks), MaxModelLen: s.cfg.Profile.MaxModelLen, Tokens: toks}
	if req.ReturnTokenStrs {
		strs := make([]string, len(toks))
		for i, t := range toks {
			strs[i], _ = TokenString(t)
		}
		resp.TokenStrs = &strs
	}
	writeJSON(w, http.StatusOK, resp)
}

func (s *Sim) handleDetokenize(w http.ResponseWriter, r *http.Request) {
	var req struct {
		Model  string `json:"model"`
		Tokens []int  `json:"tokens"`
	}
	if !s.decodeBody(w, r, &req) || !s.checkModel(w, req.Model) {
		return
	}
	text, err := Detokenize(req.Tokens, false)
	if err != nil {
		writeError(w, http.StatusBadRequest, err.Error())
		return
	}
	writeJSON(w, http.StatusOK, map[string]string{"prompt": text})
}

func (s *Sim) handleHealth(w http.ResponseWriter, r *http.Request) {
	if s.eng.Dead() {
		w.WriteHeader(http.StatusServiceUnavailable)
		return
	}
	w.WriteHeader(http.StatusOK)
}

// Version is the vLLM version the simulator reports; LegacyVersion is the
// one it reports with legacy metric names.
const (
	Version       = "0.19.1"
	LegacyVersion = "0.8.5"
)

func (s *Sim) handleVersion(w http.ResponseWriter, r *http.Request) {
	v := Version
	if s.cfg.LegacyMetrics {
		v = LegacyVersion
	}
	writeJSON(w, http.StatusOK, map[string]string{"version": v})
}

func (s *Sim) handleLoad(w http.ResponseWriter, r *http.Request) {
	writeJSON(w, http.StatusOK, map[string]int64{"server_load": s.inUse.Load()})
}

func boolOr(p *bool, def bool) bool {
	if p == nil {
		return def
	}
	return *p
}
