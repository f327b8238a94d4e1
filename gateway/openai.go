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
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"

	"go.opentelemetry.io/otel/trace"

	"github.com/kvgate/kvgate/gpu"
	"github.com/kvgate/kvgate/scheduler"
	"github.com/kvgate/kvgate/store"
)

// reqFields are the request fields admission needs; everything else in the
// body goes to the backend untouched.
type reqFields struct {
	Model               *string         `json:"model"`
	MaxTokens           *int            `json:"max_tokens"`
	MaxCompletionTokens *int            `json:"max_completion_tokens"`
	N                   *int            `json:"n"`
	Stream              bool            `json:"stream"`
	StreamOptions       *streamOptions  `json:"stream_options"`
	Messages            json.RawMessage `json:"messages"`
	Tools               json.RawMessage `json:"tools"` // chat and responses: their schemas are prompt tokens
	// Echo (completions): with max_tokens 0, the prompt scored and
	// nothing generated. Raw: the backend reads it as leniently as a
	// Python bool (laxTrue), and kvgate refuses nothing it takes.
	Echo json.RawMessage `json:"echo"`
	// Background (Responses): run the response after the answer; refused.
	Background json.RawMessage `json:"background"`
	// CacheSalt is vLLM's: it seeds the prompt's block hashes, so that
	// requests of two salts share no cached block.
	CacheSalt json.RawMessage `json:"cache_salt"`
	Prompt    json.RawMessage `json:"prompt"`
	Input     json.RawMessage `json:"input"`
	// The Responses API's and the scoring routes': responses.go, pooling.go.
	MaxOutputTokens *int            `json:"max_output_tokens"`
	Instructions    json.RawMessage `json:"instructions"`
	Query           json.RawMessage `json:"query"`
	Documents       json.RawMessage `json:"documents"`
	Text1           json.RawMessage `json:"text_1"`
	Text2           json.RawMessage `json:"text_2"`
	// The other shapes of vLLM's score request (scoreSides).
	Queries, Items, Data1, Data2 json.RawMessage
}

type streamOptions struct {
	IncludeUsage *bool `json:"include_usage"`
}

// decode reads the fields from a request body by their exact names, as
// the backend does (its JSON objects are Python dictionaries): left to
// itself, encoding/json would also take "MAX_TOKENS" for max_tokens, and
// admission would reserve for a limit the backend ignores.
func (f *reqFields) decode(body []byte) error {
	var opts json.RawMessage
	err := decodeExact(body, []namedField{
		{"model", &f.Model}, {"max_tokens", &f.MaxTokens}, {"max_completion_tokens", &f.MaxCompletionTokens},
		{"n", &f.N}, {"stream", &f.Stream}, {"stream_options", &opts},
		{"messages", &f.Messages}, {"tools", &f.Tools}, {"cache_salt", &f.CacheSalt}, {"echo", &f.Echo}, {"background", &f.Background}, {"prompt", &f.Prompt}, {"input", &f.Input},
		{"max_output_tokens", &f.MaxOutputTokens}, {"instructions", &f.Instructions},
		{"query", &f.Query}, {"documents", &f.Documents}, {"text_1", &f.Text1}, {"text_2", &f.Text2},
		{"queries", &f.Queries}, {"items", &f.Items}, {"data_1", &f.Data1}, {"data_2", &f.Data2},
	})
	if err != nil || len(opts) == 0 || string(opts) == "null" {
		return err
	}
	f.StreamOptions = &streamOptions{}
	var usage json.RawMessage
	if err = decodeExact(opts, []namedField{{"include_usage", &usage}}); err != nil || len(usage) == 0 {
		var typeErr *json.UnmarshalTypeError
		if errors.As(err, &typeErr) && typeErr.Field == "" {
			typeErr.Field = "stream_options" // not an object
		}
		return err
	}
	// vLLM keeps an explicit null as None, which it reads as false (no
	// usage), not as the field's default true.
	include := false
	if string(usage) != "null" {
		if err = json.Unmarshal(usage, &include); err != nil {
			var typeErr *json.UnmarshalTypeError
			if errors.As(err, &typeErr) {
				typeErr.Field = "stream_options.include_usage"
			}
			return err
		}
	}
	f.StreamOptions.IncludeUsage = &include
	return nil
}

type namedField struct {
	name string
	dst  any
}

// decodeExact decodes the JSON object b into fields by their exact names;
// other keys are left alone. A type error names the field.
func decodeExact(b []byte, fields []namedField) error {
	var m map[string]json.RawMessage
	if err := json.Unmarshal(b, &m); err != nil {
		return err
	}
	for _, f := range fields {
		raw, ok := m[f.name]
		if !ok {
			continue
		}
		if dst, ok := f.dst.(*json.RawMessage); ok {
			*dst = raw // already checked and copied: a prompt may be megabytes
			continue
		}
		if err := json.Unmarshal(raw, f.dst); err != nil {
			var typeErr *json.UnmarshalTypeError
			if errors.As(err, &typeErr) {
				typeErr.Field = strings.TrimSuffix(f.name+"."+typeErr.Field, ".")
			}
			return err
		}
	}
	return nil
}

type endpoint uint8

const (
	epChat endpoint = iota
	epCompletion
	epEmbedding
	epResponses
	epRerank
	epScore
)

var endpointPath = map[endpoint]string{
	epChat: "/v1/chat/completions", epCompletion: "/v1/completions", epEmbedding: "/v1/embeddings",
	epResponses: "/v1/responses", epRerank: "/v1/rerank", epScore: "/v1/score",
}

// pooling reports whether the endpoint's requests only prefill: they
// reserve their prompt, and no output.
func (ep endpoint) pooling() bool { return ep == epEmbedding || ep == epRerank || ep == epScore }

// tooLargeCall is a request too large for every backend, with the field
// that sized it: the client's error names it (toAPIError).
type tooLargeCall struct {
	err   *scheduler.TooLargeError
	param string // the output's field, or the input's where there is no output
	input bool   // param is the input: nothing else to reduce
}

func (e *tooLargeCall) Error() string { return e.err.Error() }
func (e *tooLargeCall) Unwrap() error { return e.err }

// tooLarge names, in a *scheduler.TooLargeError, the field that sized the
// call; any other error is returned as it is.
func (c *call) tooLarge(err error) error {
	var tl *scheduler.TooLargeError
	if !errors.As(err, &tl) {
		return err
	}
	e := &tooLargeCall{err: tl}
	capName, _ := c.outputCap()
	switch {
	case c.ep == epEmbedding:
		e.param, e.input = "input", true
	case c.ep == epRerank:
		e.param, e.input = "documents", true
	case c.ep == epScore:
		_, _, _, e.param = c.f.scoreSides()
		e.input = true
	case c.ep == epResponses && capName == "":
		e.param, e.input = "input", true
	case capName != "":
		e.param = capName
	case c.f.N != nil && *c.f.N > 1:
		e.param = "n"
	case c.ep == epChat:
		e.param, e.input = "messages", true
	default:
		e.param, e.input = "prompt", true
	}
	return e
}

// outputCap is the field that bounds the call's output as vLLM reads it,
// and its value ("" and nil when the call sets none): on chat
// max_completion_tokens, else max_tokens; on completions max_tokens alone
// (vLLM's completions API has no max_completion_tokens and ignores one
// sent); on the Responses API max_output_tokens alone.
func (c *call) outputCap() (string, *int) {
	switch {
	case c.ep == epResponses:
		if c.f.MaxOutputTokens != nil {
			return "max_output_tokens", c.f.MaxOutputTokens
		}
	case c.f.MaxCompletionTokens != nil && c.ep != epCompletion:
		return "max_completion_tokens", c.f.MaxCompletionTokens
	case c.f.MaxTokens != nil:
		return "max_tokens", c.f.MaxTokens
	}
	return "", nil
}

// call is one validated inference request.
type call struct {
	ep          endpoint
	body        []byte
	f           reqFields
	model       string
	alias       string // the alias the client asked for, resolved to model; "" if none
	promptBytes int    // size of the prompt's JSON, for the token estimate
	// media counts the prompt's image, audio and video parts, sized by a
	// guess (promptSize): such a prompt's reported tokens do not teach
	// the estimate its model's tokens per byte of text.
	media int
	// sequences is how many sequences the backend will run: n times the
	// number of prompts of a batched completion.
	sequences int
	// shortest is the shortest prompt's share of a batched completion's
	// prompt bytes (1 for one prompt): each prompt runs as a request of
	// its own, whose output has the context its own prompt leaves.
	shortest float64
}

// promptCount is how many prompts a completion's prompt field holds (a
// list of strings or of token lists is several, anything else one), and
// the shortest one's share of their bytes.
func promptCount(raw json.RawMessage) (n int, shortest float64) {
	raw = bytes.TrimSpace(raw)
	if len(raw) < 2 || raw[0] != '[' {
		return 1, 1
	}
	inner := bytes.TrimSpace(raw[1:])
	if len(inner) == 0 || (inner[0] != '"' && inner[0] != '[') {
		return 1, 1 // one prompt of token ids
	}
	var items []json.RawMessage
	if json.Unmarshal(raw, &items) != nil || len(items) == 0 {
		return 1, 1
	}
	least, total := len(items[0]), 0
	for _, it := range items {
		least, total = min(least, len(it)), total+len(it)
	}
	return len(items), float64(least) / float64(max(total, 1))
}

func (s *Server) readCall(r *http.Request, ep endpoint) (*call, error) {
	body, err := readBody(r)
	if err != nil {
		return nil, err
	}
	return parseCall(body, ep)
}

// parseCall validates a request body for an endpoint and reads the fields
// admission needs.
func parseCall(body []byte, ep endpoint) (*call, error) {
	c := &call{ep: ep, body: body}
	if err := c.f.decode(body); err != nil {
		var typeErr *json.UnmarshalTypeError
		if errors.As(err, &typeErr) {
			if typeErr.Field == "" {
				return nil, badRequest("", "The request body must be a JSON object.")
			}
			return nil, badRequest(typeErr.Field, fmt.Sprintf("Invalid type for '%s': expected %s.", typeErr.Field, typeErr.Type))
		}
		return nil, badRequest("", "We could not parse the JSON body of your request. ("+err.Error()+")")
	}
	if c.f.Model == nil || *c.f.Model == "" {
		return nil, badRequest("model", "You must provide a model parameter.")
	}
	c.model = *c.f.Model
	switch ep {
	case epChat:
		if !isNonEmptyArray(c.f.Messages) {
			return nil, badRequest("messages", "'messages' must be a non-empty array of messages.")
		}
		// The chat template renders the tools' schemas into the prompt.
		size, media := promptSize(c.f.Messages)
		c.promptBytes, c.media = size+toolBytes(c.f.Tools), media
	case epCompletion:
		if len(c.f.Prompt) == 0 || string(c.f.Prompt) == "null" {
			return nil, badRequest("prompt", "You must provide a prompt.")
		}
		c.promptBytes = len(c.f.Prompt)
	case epEmbedding:
		if len(c.f.Input) == 0 || string(c.f.Input) == "null" || string(c.f.Input) == `""` || string(c.f.Input) == "[]" {
			return nil, badRequest("input", "'input' must be a non-empty string or array.")
		}
		c.promptBytes = len(c.f.Input)
	case epResponses, epRerank, epScore:
		if err := c.parseSurface(); err != nil {
			return nil, err
		}
	}
	for _, f := range []struct {
		name string
		v    *int
	}{{"max_tokens", c.f.MaxTokens}, {"max_completion_tokens", c.f.MaxCompletionTokens}, {"max_output_tokens", c.f.MaxOutputTokens}} {
		// A completion that echoes its prompt may generate nothing: vLLM
		// scores the prompt (its logprobs), the way to rate a text.
		echoOnly := ep == epCompletion && f.name == "max_tokens" && laxTrue(c.f.Echo) && f.v != nil && *f.v == 0
		if f.v != nil && *f.v < 1 && !echoOnly {
			return nil, badRequest(f.name, fmt.Sprintf("%s must be at least 1, got %d.", f.name, *f.v))
		}
	}
	if c.f.N != nil && *c.f.N < 1 {
		return nil, badRequest("n", fmt.Sprintf("n must be at least 1, got %d.", *c.f.N))
	}
	c.sequences, c.shortest = 1, 1
	if c.f.N != nil {
		c.sequences = min(*c.f.N, maxReservation)
	}
	if ep == epCompletion {
		n, shortest := promptCount(c.f.Prompt)
		c.sequences, c.shortest = satMul(c.sequences, n), shortest
	}
	if c.f.StreamOptions != nil && !c.f.Stream {
		return nil, badRequest("stream_options", "The 'stream_options' parameter is only allowed when 'stream' is enabled.")
	}
	return c, nil
}

// toolBytes is the size of a request's tools, 0 for none.
func toolBytes(tools json.RawMessage) int {
	if t := bytes.TrimSpace(tools); string(t) != "null" && string(t) != "[]" {
		return len(t)
	}
	return 0
}

// laxTrue reports whether a JSON value reads as true the way vLLM's
// request models (pydantic, lax mode) read a bool: true, 1, or a string
// such as "true", "yes", "on" or "1".
func laxTrue(raw json.RawMessage) bool {
	v := strings.ToLower(strings.Trim(string(bytes.TrimSpace(raw)), `"`))
	switch v {
	case "true", "1", "yes", "on", "t", "y":
		return true
	}
	return false
}

func isNonEmptyArray(raw json.RawMessage) bool {
	raw = bytes.TrimSpace(raw)
	return len(raw) >= 2 && raw[0] == '[' && len(bytes.TrimSpace(raw[1:len(raw)-1])) > 0
}

func (s *Server) handleChat(w http.ResponseWriter, r *http.Request) int {
	return s.handleInference(w, r, epChat)
}

func (s *Server) handleCompletion(w http.ResponseWriter, r *http.Request) int {
	return s.handleInference(w, r, epCompletion)
}

func (s *Server) handleEmbeddings(w http.ResponseWriter, r *http.Request) int {
	return s.handleInference(w, r, epEmbedding)
}

func (s *Server) handleInference(w http.ResponseWriter, r *http.Request, ep endpoint) int {
	c, err := s.readCall(r, ep)
	if err != nil {
		return writeError(w, s.log, err)
	}
	model, err := s.resolveCall(c, "model")
	if err != nil {
		return writeError(w, s.log, err)
	}
	s.labelModel(w, model.ID)
	// A model whose backends are all down is refused before it costs the
	// tenant any quota.
	if err := s.sched.CheckModel(model.ID); err != nil {
		return writeError(w, s.log, err)
	}
	return s.proxy(w, r, c, model)
}

// labelModel names the request's model in its metrics: a model a backend
// serves or is configured to serve. Another, taken while a backend's
// models are not known yet (lookupModel), could be any string a client
// sends, and is left out: each would make a series of its own for good.
func (s *Server) labelModel(w http.ResponseWriter, id string) {
	sw, ok := w.(*statusWriter)
	if !ok {
		return
	}
	for _, m := range s.pool.Models() {
		if m.ID == id {
			sw.model = id
			return
		}
	}
}

// lookupModel finds a model that a backend serves, is configured to serve,
// or may serve once reached (a backend whose models are not known yet:
// see gpu.Snapshot.MayServe); ok is false only when none does or may. The
// max_model_len of a model not yet discovered is 0, unknown.
func (s *Server) lookupModel(id string) (gpu.Model, bool) {
	for _, m := range s.pool.Models() {
		if m.ID == id {
			return m, true
		}
	}
	for _, sn := range s.pool.Snapshots() {
		if sn.MayServe(id) {
			return gpu.Model{ID: id}, true
		}
	}
	return gpu.Model{}, false
}

// reservation returns the prompt tokens, the output tokens to reserve, and
// whether the prompt count is exact rather than estimated.
func (s *Server) reservation(ctx context.Context, c *call, model gpu.Model) (prompt, maxOut int, exact bool) {
	prompt, exact = s.countPrompt(ctx, c)
	_, maxOut = s.reservationWith(c, model, prompt)
	return prompt, maxOut, exact
}

// reservationWith returns a call's total reservation and its output part,
// given its prompt tokens.
func (s *Server) reservationWith(c *call, model gpu.Model, prompt int) (total, maxOut int) {
	if c.ep.pooling() {
		return prompt, 0
	}
	// Each prompt of a batched completion has the context its own prompt
	// leaves: the shortest prompt's room bounds every sequence's output.
	room := model.MaxModelLen - int(float64(prompt)*cmp.Or(c.shortest, 1))
	if model.MaxModelLen <= 0 {
		room = 1 << 30
	}
	switch _, v := c.outputCap(); {
	case v != nil:
		maxOut = *v
	case c.ep == epCompletion:
		maxOut = 16 // the completions API's default
	default:
		maxOut = s.cfg.DefaultMaxTokens
	}
	// The backend refuses what does not fit its context; the reservation
	// need not be larger than what it could run. Each sequence of a
	// request with n > 1 or several prompts grows its own output.
	maxOut = satMul(max(1, min(maxOut, room)), c.sequences)
	return prompt + maxOut, maxOut
}

// maxReservation caps what one request may reserve, in sequences or
// tokens: far beyond any fleet's KV cache, so that admission refuses it as
// too large, and far enough from overflow that sums of reservations stay
// exact. A client's n can be anything up to 2^63.
const maxReservation = 1 << 40

// satMul is a×b for positive a and b, at most maxReservation.
func satMul(a, b int) int {
	if a > maxReservation/b {
		return maxReservation
	}
	return min(a*b, maxReservation)
}

// proxy admits the call and passes it to a backend, retrying on another
// backend while nothing has reached the client.
func (s *Server) proxy(w http.ResponseWriter, r *http.Request, c *call, model gpu.Model) int {
	ctx := r.Context()
	prompt, maxOut, exact := s.reservation(ctx, c, model)
	permit, err := s.acquireQuota(ctx, prompt, maxOut, s.priceOf(model.ID, c.alias))
	if err != nil {
		if ctx.Err() != nil {
			return 499
		}
		return writeError(w, s.log, err)
	}
	permit.headers(w.Header())
	// A request may run past its permit's lease (a long max_queue_wait,
	// retries, a slow stream); swept, the permit would no longer count
	// against its tenant's concurrency.
	kept := permit.keep()
	var (
		attempts int     // that reached a backend, or may have
		last     *result // the last attempt's
		sent     *result // the last of the attempts that reached a backend
		cut      int     // the attempts before sent cut with no answer: their usage is unknown
		health   requestHealth
	)
	reserved := usage{PromptTokens: prompt, CompletionTokens: maxOut}
	defer health.settle(s.pool)
	defer func() {
		kept()
		o, u := outcome(attempts, sent, reserved)
		if permit.writtenBehind() {
			// Under way before the answer's last bytes leave: a usage
			// read made once the client has them waits for it (quota.go).
			permit.release(ctx, o, attempts, cut, u)
			return
		}
		if permit != nil && last != nil && last.wrote {
			_ = http.NewResponseController(w).Flush() // the client need not wait for the release
		}
		permit.release(ctx, o, attempts, cut, u)
	}()
	ticket := &scheduler.Ticket{
		Tenant: tenantOf(ctx), Weight: s.weight(ctx, tenantOf(ctx)), Class: scheduler.Interactive, Model: model.ID,
		PromptTokens: prompt, MaxTokens: maxOut, Prefix: promptPrefix(c, prompt),
	}
	if !exact {
		ticket.PromptEstimate = func() int { return s.est.estimate(model.ID, c.promptBytes) }
	}
	body, injected := c.body, false
	// vLLM's include_usage is true by default once stream_options is
	// there: a client that sent stream_options without it gets usage.
	clientUsage := c.f.StreamOptions != nil && (c.f.StreamOptions.IncludeUsage == nil || *c.f.StreamOptions.IncludeUsage)
	if c.f.Stream && c.ep != epResponses && !clientUsage && (permit != nil || (!exact && s.est.wantSample(model.ID))) {
		// Ask for usage to settle the estimate, or the tenant's quota; the
		// client does not see it.
		if b, err := withStreamUsage(c.body, c.f.StreamOptions != nil || bytes.Contains(c.body, []byte(`"stream_options"`))); err == nil {
			body, injected = b, true
		}
	}
	for retries := 0; ; {
		actx, aspan := startAdmission(ctx, scheduler.Interactive.String())
		grant, err := s.sched.Acquire(actx, ticket)
		endSpan(aspan, 0, err)
		if err != nil {
			if ctx.Err() != nil {
				return 499 // the client left; nobody to answer
			}
			if sent != nil {
				return writeError(w, s.log, sent.err) // what a backend said beats why there is no other
			}
			// Only refused connections so far, if any: no backend serving
			// the model is reachable (ErrNoRoutableBackend), or none has room.
			return writeError(w, s.log, c.tooLarge(err))
		}
		res := func() result {
			defer grant.Release() // deferred: a panic (net/http recovers it) must not keep the backend's room
			return s.forward(ctx, w, grant, c, body, injected)
		}()
		last = &res
		if res.up.class.sent() {
			if sent != nil {
				if o, _ := outcome(1, sent, reserved); o == store.Uncertain {
					cut++ // retried, and what it used stays charged
				}
			}
			attempts++
			sent = &res
		}
		sameTwice := health.observe(s.pool, grant.Backend, res.up)
		if res.err == nil {
			noteAnswer(ctx, grant.Backend, res.usage)
			if res.usage != nil && c.promptBytes > 0 && c.media == 0 {
				s.est.observe(model.ID, c.promptBytes, res.usage.PromptTokens)
			}
			return res.status
		}
		if res.wrote || ctx.Err() != nil {
			return res.status
		}
		if sameTwice {
			// The request's own problem: another backend would fail it too.
			s.log.Debug("request failed the same way on two backends; not retried", "model", model.ID,
				"backend", grant.Backend, "class", res.up.class.String(), "status", res.up.status)
			return writeError(w, s.log, res.err)
		}
		if !res.up.class.retryElsewhere() {
			return writeError(w, s.log, res.err)
		}
		// A request that never left costs no retry: try any other backend,
		// and when there is none, Acquire says so.
		if res.up.class != upstreamNotSent {
			if retries >= s.retries || !s.hasOtherBackend(model.ID, append(ticket.Exclude, grant.Backend)) {
				return writeError(w, s.log, res.err)
			}
			retries++
		}
		ticket.Exclude = append(ticket.Exclude, grant.Backend)
		s.m.retry(model.ID)
		s.log.Info("retrying on another backend", "model", model.ID, "failed_backend", grant.Backend, "err", res.err)
	}
}

func (s *Server) hasOtherBackend(model string, exclude []string) bool {
	for _, sn := range s.pool.Snapshots() {
		if _, ok := sn.Serves(model); ok && sn.Routable() && !slices.Contains(exclude, sn.Name) {
			return true
		}
	}
	return false
}

// withStreamUsage sets stream_options.include_usage in a request body,
// keeping every other field as it was (but continuous_usage_stats).
func withStreamUsage(body []byte, hasOptions bool) ([]byte, error) {
	if !hasOptions {
		// The common case: splice the field in after the opening brace
		// rather than decode and re-encode the whole body.
		if i := bytes.IndexByte(body, '{'); i >= 0 {
			const field = `"stream_options":{"include_usage":true}`
			rest := bytes.TrimLeft(body[i+1:], " \t\r\n")
			out := make([]byte, 0, len(body)+len(field)+1)
			out = append(out, body[:i+1]...)
			out = append(out, field...)
			if len(rest) > 0 && rest[0] != '}' {
				out = append(out, ',')
			}
			return append(out, body[i+1:]...), nil
		}
	}
	var m map[string]json.RawMessage
	if err := json.Unmarshal(body, &m); err != nil {
		return nil, err
	}
	opts := map[string]json.RawMessage{}
	if raw, ok := m["stream_options"]; ok && string(raw) != "null" {
		if err := json.Unmarshal(raw, &opts); err != nil {
			return nil, err
		}
	}
	opts["include_usage"] = json.RawMessage("true")
	// The client asked for no usage: continuous stats, which vLLM sends
	// only with include_usage, would now put usage on every chunk.
	delete(opts, "continuous_usage_stats")
	b, err := json.Marshal(opts)
	if err != nil {
		return nil, err
	}
	m["stream_options"] = b
	return json.Marshal(m)
}

type usage struct {
	PromptTokens     int `json:"prompt_tokens"`
	CompletionTokens int `json:"completion_tokens"`
}

// result is how one attempt on one backend ended.
type result struct {
	status int
	err    error
	up     upstream // the backend's part, classified
	wrote  bool     // bytes reached the client
	usage  *usage
}

// errStalled cancels an attempt whose backend went silent for too long.
var errStalled = errors.New("backend stalled")

func (s *Server) forward(ctx context.Context, w http.ResponseWriter, g *scheduler.Grant, c *call, body []byte, injected bool) result {
	// A backend that goes silent is cut: a stream after StreamIdleTimeout
	// without a byte (before its headers too), any other request after
	// RequestTimeout in all.
	actx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	limit := s.cfg.RequestTimeout
	if c.f.Stream {
		limit = s.cfg.StreamIdleTimeout
	}
	cw := &clientWrites{rc: http.NewResponseController(w), idle: s.cfg.StreamIdleTimeout}
	defer cw.end()
	watchdog := time.AfterFunc(limit, func() {
		// Not while waiting on the client: its write deadline ends that
		// wait (clientWrites).
		if cw.stall() {
			cancel(errStalled)
		}
	})
	defer watchdog.Stop()
	// failed reports a transport failure: the client's leaving, a stall,
	// or a broken backend.
	failed := func(kind string, err error) result {
		if ctx.Err() != nil {
			return result{status: 499, err: errClientGone}
		}
		up := classifyTransport(err, errors.Is(context.Cause(actx), errStalled))
		if up.class == upstreamTimeout { // not a dial the stall cut: that sent nothing
			kind, err = "stall", errStalled
			up.err = err
		}
		s.m.upstreamError(g.Backend, kind)
		return result{status: http.StatusBadGateway, err: fmt.Errorf("backend %s: %w", g.Backend, err), up: up}
	}

	req, err := http.NewRequestWithContext(actx, http.MethodPost, g.URL+endpointPath[c.ep], bytes.NewReader(body))
	if err != nil {
		return result{status: http.StatusInternalServerError, err: err}
	}
	req.Header.Set("Content-Type", "application/json")
	if c.f.Stream {
		req.Header.Set("Accept", "text/event-stream")
	}
	nameBackendCall(req, RequestID(ctx))
	span := startBackendSpan(req, g)
	start := time.Now()
	resp, err := s.client.Do(req)
	if err != nil {
		endSpan(span, 0, err)
		return failed("connect", err)
	}
	defer resp.Body.Close()
	ctx = trace.ContextWithSpan(ctx, span)
	if resp.StatusCode >= 400 {
		res := s.upstreamFailure(g, resp)
		endSpan(span, resp.StatusCode, res.err)
		return res
	}
	defer func() { endSpan(span, resp.StatusCode, nil) }()
	if c.f.Stream && isEventStream(resp.Header.Get("Content-Type")) {
		return s.relay(ctx, w, g, c, resp, injected, start, watchdog, cw, failed)
	}
	b, err := io.ReadAll(io.LimitReader(resp.Body, s.cfg.MaxAnswerBytes+1))
	if err != nil {
		return failed("read", err)
	}
	g.BackendDone() // its KV is free there, however long the client takes to read the answer
	if int64(len(b)) > s.cfg.MaxAnswerBytes {
		// The backend did its work; the answer is more than kvgate holds
		// for one request, and would be again on any backend.
		return result{status: http.StatusBadGateway, err: answerTooLarge(s.cfg.MaxAnswerBytes), up: upstream{class: upstreamOK, status: resp.StatusCode}}
	}
	b, answered, err := answerOf(c.ep, b)
	if err != nil {
		s.m.upstreamError(g.Backend, "malformed")
		up := malformedAnswer(resp.StatusCode, err)
		return result{status: http.StatusBadGateway, err: fmt.Errorf("backend %s: %w", g.Backend, up.err), up: up}
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", strconv.Itoa(len(b)))
	w.WriteHeader(resp.StatusCode)
	if err := cw.write(w, b); err != nil {
		// Answered, and the client stopped reading it: the backend did
		// its part, and its usage is known.
		return result{status: 499, usage: answered, wrote: true, up: upstream{class: upstreamOK, status: resp.StatusCode}}
	}
	return result{status: resp.StatusCode, usage: answered, wrote: true, up: upstream{class: upstreamOK, status: resp.StatusCode}}
}

// upstreamFailure reads a backend's error answer. 4xx are the request's
// fault and go back to the client as they are; 429 and 5xx may be the
// backend's, and may be retried elsewhere; the proxy's requestHealth
// decides whom they count against.
func (s *Server) upstreamFailure(g *scheduler.Grant, resp *http.Response) result {
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	up := classifyResponse(resp.StatusCode, resp.Header, b)
	switch up.class {
	case upstreamRateLimited:
		s.m.upstreamError(g.Backend, "429")
		s.cooldown(g, up.retryAfter)
	case upstreamBackendError:
		s.m.upstreamError(g.Backend, "5xx")
	case upstreamRefused:
		s.m.upstreamError(g.Backend, "refused")
	case upstreamModelMissing:
		s.m.upstreamError(g.Backend, "model_missing")
	}
	return result{status: resp.StatusCode, err: up.err, up: up}
}

// errorMessage digs the message, and the field it names if any, out of an
// OpenAI- or vLLM-shaped error body.
func errorMessage(b []byte) (msg, param string) {
	var nested struct {
		Error struct {
			Message string `json:"message"`
			Param   any    `json:"param"`
		} `json:"error"`
		Message string `json:"message"` // older vLLM: flat
		Param   any    `json:"param"`
	}
	if json.Unmarshal(b, &nested) != nil {
		return "", ""
	}
	if nested.Error.Message != "" {
		p, _ := nested.Error.Param.(string)
		return nested.Error.Message, p
	}
	p, _ := nested.Param.(string)
	return nested.Message, p
}

// parseRetryAfter reads Retry-After as seconds or an HTTP date.
func parseRetryAfter(v string) time.Duration {
	if v == "" {
		return 0
	}
	if sec, err := strconv.Atoi(v); err == nil && sec >= 0 {
		return time.Duration(sec) * time.Second
	}
	if t, err := http.ParseTime(v); err == nil {
		return max(0, time.Until(t))
	}
	return 0
}

func isEventStream(ct string) bool {
	return len(ct) >= len("text/event-stream") && ct[:len("text/event-stream")] == "text/event-stream"
}

var (
	dataPrefix = []byte("data:")
	doneData   = []byte("[DONE]")
	usageKey   = []byte(`"usage"`)
	errorData  = []byte(`{"error"`)
)

// relay copies a backend's event stream to the client event by event,
// flushing whenever the backend has nothing more buffered. It reads usage
// on the way (and drops the usage event when kvgate asked for it and the
// client did not), and reports decode progress to the grant. The client's
// status line goes out with the first event: a backend that fails before
// it can still be retried elsewhere. After it, a failing or stalling
// backend ends the stream with an error event.
func (s *Server) relay(ctx context.Context, w http.ResponseWriter, g *scheduler.Grant, c *call, resp *http.Response,
	injected bool, start time.Time, watchdog *time.Timer, cw *clientWrites, failed func(string, error) result) result {
	rc := cw.rc
	rb := getRelayBuffers(resp.Body)
	defer rb.put()
	br := rb.r
	ttft, itl := s.m.ttft.WithLabelValues(c.model), s.m.itl.WithLabelValues(c.model)
	// Progress counts one sequence's tokens; with several sequences the
	// chunks interleave, and admission estimates progress instead.
	report := c.sequences == 1
	var (
		event   = rb.event[:0]
		u       *usage
		chunks  int
		last    time.Time
		done    bool
		started bool
		// unflushed: events written to the client since the last flush.
		unflushed bool
		midLine   bool // the last read ended inside a line longer than the buffer
		readErr   error
		lastPet   time.Time // the watchdog's last reset (stream_relay.go)
		// failure is the error event the backend sent in its stream (vLLM
		// sends one, then [DONE], when its engine fails a request): passed
		// to the client, and the attempt is a failure, its usage unknown.
		failure []byte
		trail   responsesTrail
	)
	for !done {
		line, err := br.ReadSlice('\n')
		if errors.Is(err, bufio.ErrBufferFull) {
			event = append(event, line...)
			midLine = true
			continue
		}
		if err != nil {
			readErr = err
			break
		}
		lastPet = petWatchdog(watchdog, s.cfg.StreamIdleTimeout, lastPet)
		cw.extend(lastPet)
		event = append(event, line...)
		// Only an empty line ends an event, as the client's parser sees
		// it: one of blanks does not, nor the end of a long line.
		if blank := !midLine && (len(line) == 1 || (len(line) == 2 && line[0] == '\r')); !blank {
			midLine = false
			continue // the event goes on
		}
		data := eventData(event)
		write := true
		switch {
		case c.ep == epResponses && data != nil:
			// Typed events, no [DONE]: see responses.go.
			ev := responsesEvent(data)
			trail.see(data, ev)
			if ev.rewritten != nil {
				event = append(append(event[:0], "event: "...), ev.typ...)
				event = append(append(append(event, "\ndata: "...), ev.rewritten...), "\n\n"...)
			}
			if ev.usage != nil {
				u = ev.usage
			}
			if ev.delta {
				chunks++
			}
			if ev.failed {
				failure = bytes.Clone(data) // passed on, and the attempt a failure, as a chat stream's error (data is reused by the next event)
			}
			done = ev.final
		case data == nil:
		case bytes.Equal(data, doneData):
			done = true
		case bytes.HasPrefix(data, errorData):
			failure = bytes.Clone(data) // the event's buffer is reused by the next one
		case bytes.Contains(data, usageKey):
			var chunk struct {
				Choices []json.RawMessage `json:"choices"`
				Usage   *usage            `json:"usage"`
			}
			if json.Unmarshal(data, &chunk) == nil && chunk.Usage != nil {
				u = chunk.Usage
				if len(chunk.Choices) == 0 && injected {
					write = false
				}
			}
			if len(chunk.Choices) > 0 {
				chunks++
			}
		default:
			chunks++
		}
		if chunks > 0 && write && !done {
			now := time.Now()
			if last.IsZero() {
				ttft.Observe(now.Sub(start).Seconds())
				firstToken(ctx, now.Sub(start))
			} else {
				itl.Observe(now.Sub(last).Seconds())
			}
			last = now
			if report {
				g.Progress(chunks)
			}
		}
		if write {
			if !started {
				started = true
				h := w.Header()
				h.Set("Content-Type", "text/event-stream; charset=utf-8")
				h.Set("Cache-Control", "no-cache")
				h.Set("X-Accel-Buffering", "no")
				w.WriteHeader(http.StatusOK)
			}
			cw.begin()
			_, err := w.Write(event)
			if cw.finish() {
				watchdog.Reset(s.cfg.StreamIdleTimeout)
			}
			if err != nil {
				return result{status: 499, err: errClientGone, wrote: true, usage: u}
			}
			unflushed = true
		}
		rb.event, event = event, event[:0] // kept for the next stream, however it grew
		// Flush what was written once the backend has nothing more
		// buffered: one write to the client per read from the backend, and
		// none for a read whose events were all dropped.
		if unflushed && (br.Buffered() == 0 || done) {
			cw.begin()
			err := rc.Flush()
			if cw.finish() {
				watchdog.Reset(s.cfg.StreamIdleTimeout)
			}
			if err != nil {
				return result{status: 499, err: errClientGone, wrote: true, usage: u}
			}
			unflushed = false
		}
	}
	if done {
		g.BackendDone()
		readTail(br, watchdog)
		if failure != nil {
			res := failed("stream_error", fmt.Errorf("the backend ended its stream with an error: %.300s", failure))
			res.wrote = true // the client has the backend's error event
			return res
		}
		return result{status: http.StatusOK, usage: u, wrote: true, up: upstream{class: upstreamOK, status: http.StatusOK}}
	}
	if readErr == io.EOF {
		readErr = io.ErrUnexpectedEOF // the stream ended without [DONE]
	}
	res := failed("stream_cut", readErr)
	res.usage = u // the backend's report, when it came before the cut
	if started && errors.Is(context.Cause(ctx), errDrainDeadline) {
		// Shutting down: the client is still there, and must hear why the
		// stream ends.
		endStream(w, rc, c.ep, &trail, errDrainDeadline)
		return result{status: http.StatusServiceUnavailable, err: errDrainDeadline, wrote: true, usage: u}
	}
	if !started || res.err == errClientGone {
		return res // nothing reached the client: retryable elsewhere
	}
	// The status line is long gone: tell the client in the stream.
	endStream(w, rc, c.ep, &trail, errStreamCut)
	res.wrote = true
	return res
}

// eventData returns the data of an SSE event (its data: lines joined), or
// nil for an event without data.
func eventData(event []byte) []byte {
	if rest, ok := bytes.CutPrefix(event, dataPrefix); ok && bytes.IndexByte(rest, '\n') == len(bytes.TrimRight(rest, "\r\n")) {
		// One data line, the way every OpenAI-compatible server sends.
		return bytes.TrimPrefix(bytes.TrimRight(rest, "\r\n"), []byte(" "))
	}
	var data []byte
	for len(event) > 0 {
		line := event
		if i := bytes.IndexByte(event, '\n'); i >= 0 {
			line, event = event[:i], event[i+1:]
		} else {
			event = nil
		}
		rest, ok := bytes.CutPrefix(line, dataPrefix)
		if !ok && bytes.Equal(bytes.TrimRight(line, "\r"), dataPrefix[:len(dataPrefix)-1]) {
			// "data" alone: a field with no colon is its whole line's
			// name with an empty value, and still a data line.
			rest, ok = []byte{}, true
		}
		if ok {
			// Each data line after the first begins a new line of the
			// data, an empty one too (the client's parser joins them so).
			rest = bytes.TrimPrefix(bytes.TrimRight(rest, "\r"), []byte(" "))
			if data != nil {
				data = append(data, '\n')
			} else {
				data = []byte{}
			}
			data = append(data, rest...)
		}
	}
	return data
}

// writeJSON answers v as JSON, leaving <, > and & as they are.
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
