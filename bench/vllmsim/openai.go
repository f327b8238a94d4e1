package vllmsim

import (
	"context"
	"encoding/base64"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"net/http"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"
)

// engineDeadMessage is what vLLM answers when its engine core has died.
const engineDeadMessage = "EngineCore encountered an issue. See stack trace (above) for the root cause."

// defaultCompletionMaxTokens is max_tokens for a completion that sets none;
// chat requests default to what is left of max_model_len.
const defaultCompletionMaxTokens = 16

func (s *Sim) inference(h http.HandlerFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		s.inUse.Add(1)
		defer s.inUse.Add(-1)
		h(w, s.withFaultMatch(r))
	}
}

// streamOptions are vLLM's: include_usage defaults to true once
// stream_options is given, and continuous_usage_stats needs it.
type streamOptions struct {
	IncludeUsage         fieldBool `json:"include_usage"`
	ContinuousUsageStats bool      `json:"continuous_usage_stats"`
}

// fieldBool is a bool field that tells an explicit null from an absent
// field, as Pydantic does: a null is kept as None, which vLLM reads as
// false even where the field's default is true.
type fieldBool struct{ given, v bool }

func (b *fieldBool) UnmarshalJSON(p []byte) error {
	b.given = true
	if string(p) == "null" {
		return nil
	}
	return json.Unmarshal(p, &b.v)
}

// or is the field's value, or def where the field was not given.
func (b fieldBool) or(def bool) bool {
	if !b.given {
		return def
	}
	return b.v
}

// samplingFields are the request fields the simulator acts on; vLLM accepts
// many more, which are parsed and ignored here.
type samplingFields struct {
	Model               string         `json:"model"`
	MaxTokens           *int           `json:"max_tokens"`
	MaxCompletionTokens *int           `json:"max_completion_tokens"`
	MinTokens           int            `json:"min_tokens"`
	IgnoreEOS           bool           `json:"ignore_eos"`
	N                   *int           `json:"n"`
	Stream              bool           `json:"stream"`
	StreamOptions       *streamOptions `json:"stream_options"`
	responses           *responsesMeta // a Responses API call: responses.go
	structuredFields                   // response_format, guided_json (structured.go)
}

type chatMessageIn struct {
	Role    string          `json:"role"`
	Content json.RawMessage `json:"content"`
}

type chatRequest struct {
	samplingFields
	Messages            []chatMessageIn `json:"messages"`
	AddGenerationPrompt *bool           `json:"add_generation_prompt"`
	Tools               json.RawMessage `json:"tools"`
}

type completionRequest struct {
	samplingFields
	Prompt json.RawMessage `json:"prompt"`
}

// convertMessages joins each message's content parts into text.
func convertMessages(in []chatMessageIn) ([]ChatMessage, error) {
	out := make([]ChatMessage, len(in))
	for i, m := range in {
		if m.Role == "" {
			return nil, fmt.Errorf("messages[%d].role is required", i)
		}
		out[i].Role = m.Role
		if len(m.Content) == 0 || string(m.Content) == "null" {
			continue
		}
		var text string
		if err := json.Unmarshal(m.Content, &text); err == nil {
			out[i].Content = text
			continue
		}
		var parts []struct {
			Type string `json:"type"`
			Text string `json:"text"`
		}
		if err := json.Unmarshal(m.Content, &parts); err != nil {
			return nil, fmt.Errorf("messages[%d].content must be a string or a list of content parts", i)
		}
		texts := make([]string, 0, len(parts))
		for j, p := range parts {
			if p.Type != "text" {
				return nil, fmt.Errorf("messages[%d].content[%d]: content type %q is not supported by this text-only model", i, j, p.Type)
			}
			texts = append(texts, p.Text)
		}
		out[i].Content = strings.Join(texts, "\n")
	}
	return out, nil
}

// parsePrompt accepts a completion prompt as text, token ids, or a list of
// one of either.
func parsePrompt(raw json.RawMessage) ([]int, error) {
	var text string
	if err := json.Unmarshal(raw, &text); err == nil {
		return Tokenize(text, true), nil
	}
	var ids []int
	if err := json.Unmarshal(raw, &ids); err == nil {
		return ids, nil
	}
	var texts []string
	if err := json.Unmarshal(raw, &texts); err == nil && len(texts) == 1 {
		return Tokenize(texts[0], true), nil
	}
	var idLists [][]int
	if err := json.Unmarshal(raw, &idLists); err == nil && len(idLists) == 1 {
		return idLists[0], nil
	}
	if len(texts) > 1 || len(idLists) > 1 {
		return nil, errors.New("the simulator takes one prompt per request; send batched prompts as separate requests")
	}
	return nil, errors.New("prompt must be a string, a list of token ids, or a list holding one of either")
}

type genKind uint8

const (
	kindChat genKind = iota
	kindCompletion
	kindResponses
)

// genCall is a validated generation request.
type genCall struct {
	kind      genKind
	id        string
	prompt    []int
	maxTokens int
	stream    bool
	usage     bool // include_usage
	contUsage bool // continuous_usage_stats
	ignoreEOS bool
	minTokens int
	responses *responsesMeta
	// structured is the JSON the request asked for (nil: free text);
	// invalidJSON breaks it on purpose (structured.go).
	structured  *structuredSpec
	invalidJSON bool
}

func (s *Sim) handleChat(w http.ResponseWriter, r *http.Request) {
	var req chatRequest
	if !s.decodeBody(w, r, &req) || !s.checkModel(w, req.Model) {
		return
	}
	if s.cfg.Profile.Embedding {
		writeError(w, http.StatusBadRequest, "The model does not support Chat Completions API")
		return
	}
	if len(req.Messages) == 0 {
		writeErrorType(w, http.StatusBadRequest, "BadRequestError", "messages must be a non-empty list", "messages")
		return
	}
	msgs, err := convertMessages(req.Messages)
	if err != nil {
		writeErrorType(w, http.StatusBadRequest, "BadRequestError", err.Error(), "messages")
		return
	}
	prompt := Tokenize(RenderChatTools(msgs, req.Tools, boolOr(req.AddGenerationPrompt, true)), false)
	maxTok := req.MaxCompletionTokens
	if maxTok == nil {
		maxTok = req.MaxTokens
	}
	s.generate(w, r, kindChat, prompt, maxTok, req.samplingFields)
}

func (s *Sim) handleCompletion(w http.ResponseWriter, r *http.Request) {
	var req completionRequest
	if !s.decodeBody(w, r, &req) || !s.checkModel(w, req.Model) {
		return
	}
	if s.cfg.Profile.Embedding {
		writeError(w, http.StatusBadRequest, "The model does not support Completions API")
		return
	}
	if len(req.Prompt) == 0 {
		writeErrorType(w, http.StatusBadRequest, "BadRequestError", "prompt is required", "prompt")
		return
	}
	prompt, err := parsePrompt(req.Prompt)
	if err != nil {
		writeErrorType(w, http.StatusBadRequest, "BadRequestError", err.Error(), "prompt")
		return
	}
	for _, t := range prompt {
		if t < 0 || t >= vocabSize {
			writeErrorType(w, http.StatusBadRequest, "BadRequestError", fmt.Sprintf("token id %d is out of vocabulary", t), "prompt")
			return
		}
	}
	maxTok := req.MaxTokens
	if maxTok == nil {
		// vLLM's completions default, as OpenAI's legacy API had it.
		maxTok = new(defaultCompletionMaxTokens)
	}
	s.generate(w, r, kindCompletion, prompt, maxTok, req.samplingFields)
}

// contextError returns vLLM's 400 message for a request that does not fit
// in max_model_len, or "" when it fits.
func contextError(maxLen, promptLen int, maxTokens *int) string {
	if promptLen >= maxLen {
		return fmt.Sprintf("This model's maximum context length is %d tokens. However, your request has %d input tokens. "+
			"Please reduce the length of the input messages.", maxLen, promptLen)
	}
	if maxTokens != nil && promptLen+*maxTokens > maxLen {
		return fmt.Sprintf("'max_tokens' or 'max_completion_tokens' is too large: %d. This model's maximum context length "+
			"is %d tokens and your request has %d input tokens (%d > %d - %d).",
			*maxTokens, maxLen, promptLen, *maxTokens, maxLen, promptLen)
	}
	return ""
}

func (s *Sim) generate(w http.ResponseWriter, r *http.Request, kind genKind, prompt []int, maxTokens *int, f samplingFields) {
	p := s.cfg.Profile
	if f.N != nil && *f.N != 1 {
		writeErrorType(w, http.StatusBadRequest, "BadRequestError", "the simulator supports only n=1", "n")
		return
	}
	if maxTokens != nil && *maxTokens < 1 {
		writeErrorType(w, http.StatusBadRequest, "BadRequestError", fmt.Sprintf("max_tokens must be at least 1, got %d.", *maxTokens), "max_tokens")
		return
	}
	// vLLM's SamplingParams checks.
	if f.MinTokens < 0 {
		writeErrorType(w, http.StatusBadRequest, "BadRequestError", fmt.Sprintf("min_tokens must be greater than or equal to 0, got %d.", f.MinTokens), "min_tokens")
		return
	}
	if maxTokens != nil && f.MinTokens > *maxTokens {
		writeErrorType(w, http.StatusBadRequest, "BadRequestError",
			fmt.Sprintf("min_tokens must be less than or equal to max_tokens=%d, got %d.", *maxTokens, f.MinTokens), "min_tokens")
		return
	}
	if len(prompt) == 0 {
		writeErrorType(w, http.StatusBadRequest, "BadRequestError", "the prompt is empty", "prompt")
		return
	}
	if msg := contextError(p.MaxModelLen, len(prompt), maxTokens); msg != "" {
		writeError(w, http.StatusBadRequest, msg)
		return
	}
	c := genCall{kind: kind, prompt: prompt, stream: f.Stream, ignoreEOS: f.IgnoreEOS, minTokens: f.MinTokens, responses: f.responses}
	c.maxTokens = p.MaxModelLen - len(prompt) // vLLM's default when max_tokens is absent
	if maxTokens != nil {
		c.maxTokens = *maxTokens
	}
	if f.StreamOptions != nil {
		if !f.Stream {
			writeErrorType(w, http.StatusBadRequest, "BadRequestError", "Stream options can only be defined when `stream=True`.", "stream_options")
			return
		}
		c.usage = f.StreamOptions.IncludeUsage.or(true)
		c.contUsage = c.usage && f.StreamOptions.ContinuousUsageStats
	}
	c.id = s.requestID(r, "cmpl-")
	switch kind {
	case kindChat:
		c.id = s.requestID(r, "chatcmpl-")
	case kindResponses:
		c.id = s.newID("resp_") // vLLM's Responses API takes its id from the body, not the header
	}

	if !s.structuredCall(w, r, &c, f.structuredFields) {
		return
	}
	flt, delay, _ := s.faults.draw(r)
	if !s.injectEarly(w, r, flt) {
		return
	}
	// vLLM's latencies run from arrival, so a slow first token counts.
	arrival := s.eng.Now()
	if delay > 0 && !s.waitSimulated(r.Context(), delay) {
		return
	}
	req, err := s.eng.Submit(SubmitParams{Prompt: prompt, MaxTokens: c.maxTokens, IgnoreEOS: c.ignoreEOS, MinTokens: c.minTokens, Arrival: &arrival})
	if err != nil {
		s.submitError(w, err)
		return
	}
	if c.kind == kindResponses {
		s.serveResponse(w, r, c, req, flt == faultDrop)
		return
	}
	if c.stream {
		s.stream(w, r, c, req, flt == faultDrop)
		return
	}
	s.respond(w, r, c, req, flt == faultDrop)
}

// injectEarly carries out the faults that answer before the engine sees the
// request, and reports whether the request should go on.
func (s *Sim) injectEarly(w http.ResponseWriter, r *http.Request, f fault) bool {
	switch f {
	case fault429:
		w.Header().Set("Retry-After", strconv.Itoa(s.faults.get().RetryAfterSeconds))
		writeError(w, http.StatusTooManyRequests, "Too many requests: the server is rate limiting (injected fault)")
		return false
	case fault500:
		writeError(w, http.StatusInternalServerError, "Internal server error (injected fault)")
		return false
	case fault503:
		writeError(w, http.StatusServiceUnavailable, "The server is overloaded (injected fault)")
		return false
	case faultHang:
		<-r.Context().Done()
		return false
	case faultMalformed:
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusOK)
		_, _ = w.Write([]byte(`{"id":"cmpl-malformed","object":"chat.completion","choices":[{"index":0,"mess`))
		return false
	}
	return true
}

// waitSimulated sleeps for sec simulated seconds, and reports false if the
// client went away first. An unpaced engine has no wall-clock rate, so the
// delay is then skipped.
func (s *Sim) waitSimulated(ctx context.Context, sec float64) bool {
	if s.cfg.Speedup == 0 {
		return true
	}
	t := time.NewTimer(time.Duration(sec / s.cfg.Speedup * float64(time.Second)))
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}

func (s *Sim) submitError(w http.ResponseWriter, err error) {
	switch {
	case errors.Is(err, ErrEngineDead):
		writeError(w, http.StatusInternalServerError, engineDeadMessage)
	default:
		writeError(w, http.StatusBadRequest, err.Error())
	}
}

// dropConnection cuts the client's connection without a proper response.
func dropConnection() { panic(http.ErrAbortHandler) }

type usageInfo struct {
	PromptTokens        int  `json:"prompt_tokens"`
	TotalTokens         int  `json:"total_tokens"`
	CompletionTokens    int  `json:"completion_tokens"`
	PromptTokensDetails *any `json:"prompt_tokens_details"`
}

func (s *Sim) respond(w http.ResponseWriter, r *http.Request, c genCall, req *Request, drop bool) {
	select {
	case <-req.Done():
	case <-r.Context().Done():
		s.eng.Abort(req)
		return
	}
	out, _, reason, err := req.Read(0)
	if err != nil {
		writeError(w, http.StatusInternalServerError, engineDeadMessage)
		return
	}
	if drop {
		dropConnection()
	}
	text, _ := Detokenize(out, true)
	if c.structured != nil {
		text = s.structuredText(c.structured, c.prompt, c.invalidJSON)
	}
	usage := usageInfo{PromptTokens: len(c.prompt), CompletionTokens: len(out), TotalTokens: len(c.prompt) + len(out)}
	created := time.Now().Unix()
	if c.kind == kindChat {
		writeJSON(w, http.StatusOK, map[string]any{
			"id": c.id, "object": "chat.completion", "created": created, "model": s.model,
			"choices": []map[string]any{{
				"index":         0,
				"message":       map[string]any{"role": "assistant", "content": text, "reasoning_content": nil, "tool_calls": []any{}},
				"logprobs":      nil,
				"finish_reason": reason,
				"stop_reason":   nil,
			}},
			"usage": usage, "prompt_logprobs": nil,
		})
		return
	}
	writeJSON(w, http.StatusOK, map[string]any{
		"id": c.id, "object": "text_completion", "created": created, "model": s.model,
		"choices": []map[string]any{{
			"index": 0, "text": text, "logprobs": nil, "finish_reason": reason, "stop_reason": nil, "prompt_logprobs": nil,
		}},
		"usage": usage,
	})
}

// stream writes the response as server-sent events in vLLM's framing: one
// chunk per token (a chat stream starts with the assistant role), the
// finish reason on the last token's chunk, then an optional usage chunk with
// no choices, then "data: [DONE]".
func (s *Sim) stream(w http.ResponseWriter, r *http.Request, c genCall, req *Request, drop bool) {
	rc := http.NewResponseController(w)
	h := w.Header()
	h.Set("Content-Type", "text/event-stream; charset=utf-8")
	h.Set("Cache-Control", "no-cache")
	w.WriteHeader(http.StatusOK)

	object := "text_completion"
	if c.kind == kindChat {
		object = "chat.completion.chunk"
	}
	head := fmt.Appendf(nil, `data: {"id":%q,"object":%q,"created":%d,"model":`, c.id, object, time.Now().Unix())
	head = appendJSONString(head, s.model)
	head = append(head, `,"choices":[`...)

	dropAt := -1
	if drop {
		dropAt = s.faults.dropAfter(req.Target())
	}
	finalReason := FinishStop
	if req.Target() == c.maxTokens {
		finalReason = FinishLength
	}

	buf := make([]byte, 0, 4096)
	if c.kind == kindChat {
		buf = append(buf, head...)
		buf = append(buf, `{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]`...)
		buf = s.appendUsage(buf, c, 0, c.contUsage)
		buf = append(buf, "}\n\n"...)
	}
	sent := 0
	for {
		toks, finished, reason, err := req.Read(sent)
		if sent == 0 && len(toks) == 0 && !finished {
			// vLLM sends the role chunk (and the headers) with the
			// request's first engine output, its first token: a stream's
			// first byte is its time to first token, queue and prefill
			// included.
			if !s.waitOutput(r, req) {
				return
			}
			continue
		}
		for _, t := range toks {
			if sent == dropAt {
				_, _ = w.Write(buf)
				_ = rc.Flush()
				s.eng.Abort(req)
				dropConnection()
			}
			sent++
			text, _ := TokenString(t)
			fr := ""
			if sent == req.Target() {
				fr = finalReason
			}
			buf = s.appendTokenChunk(buf, head, c, text, fr, sent)
		}
		if finished {
			if err != nil {
				buf = append(buf, "data: "...)
				b, _ := json.Marshal(apiError{Error: apiErrorInfo{Message: engineDeadMessage, Type: "InternalServerError", Code: 500}})
				buf = append(buf, b...)
				buf = append(buf, "\n\n"...)
			} else if sent != req.Target() {
				// Ended early (aborted): close the choice with its reason.
				buf = s.appendTokenChunk(buf, head, c, "", reason, sent)
			}
			if c.usage && err == nil {
				buf = append(buf, head[:len(head)-len(`"choices":[`)]...)
				buf = append(buf, `"choices":[]`...)
				buf = s.appendUsage(buf, c, sent, true)
				buf = append(buf, "}\n\n"...)
			}
			buf = append(buf, "data: [DONE]\n\n"...)
			_, _ = w.Write(buf)
			_ = rc.Flush()
			return
		}
		if !s.flushAndWait(w, rc, r, req, &buf) {
			return
		}
	}
}

func (s *Sim) appendTokenChunk(buf, head []byte, c genCall, text, finish string, sent int) []byte {
	buf = append(buf, head...)
	if c.kind == kindChat {
		buf = append(buf, `{"index":0,"delta":{"content":`...)
		buf = appendJSONString(buf, text)
		buf = append(buf, `},"logprobs":null,"finish_reason":`...)
	} else {
		buf = append(buf, `{"index":0,"text":`...)
		buf = appendJSONString(buf, text)
		buf = append(buf, `,"logprobs":null,"finish_reason":`...)
	}
	if finish == "" {
		buf = append(buf, "null"...)
	} else {
		buf = appendJSONString(buf, finish)
	}
	buf = append(buf, `,"stop_reason":null}]`...)
	buf = s.appendUsage(buf, c, sent, c.contUsage)
	return append(buf, "}\n\n"...)
}

func (s *Sim) appendUsage(buf []byte, c genCall, completion int, include bool) []byte {
	if !include {
		return buf
	}
	return fmt.Appendf(buf, `,"usage":{"prompt_tokens":%d,"total_tokens":%d,"completion_tokens":%d}`,
		len(c.prompt), len(c.prompt)+completion, completion)
}

// appendJSONString appends s as a JSON string literal.
func appendJSONString(buf []byte, s string) []byte {
	const hex = "0123456789abcdef"
	buf = append(buf, '"')
	for i := 0; i < len(s); {
		c := s[i]
		if c >= 0x20 && c != '"' && c != '\\' && c < utf8.RuneSelf {
			buf = append(buf, c)
			i++
			continue
		}
		if c < utf8.RuneSelf {
			switch c {
			case '"', '\\':
				buf = append(buf, '\\', c)
			case '\n':
				buf = append(buf, '\\', 'n')
			case '\r':
				buf = append(buf, '\\', 'r')
			case '\t':
				buf = append(buf, '\\', 't')
			default:
				buf = append(buf, '\\', 'u', '0', '0', hex[c>>4], hex[c&0xf])
			}
			i++
			continue
		}
		r, size := utf8.DecodeRuneInString(s[i:])
		if r == utf8.RuneError && size == 1 {
			buf = append(buf, `\ufffd`...)
		} else {
			buf = append(buf, s[i:i+size]...)
		}
		i += size
	}
	return append(buf, '"')
}

type embeddingRequest struct {
	Model          string          `json:"model"`
	Input          json.RawMessage `json:"input"`
	EncodingFormat string          `json:"encoding_format"`
	Dimensions     *int            `json:"dimensions"`
}

// parseEmbeddingInput accepts text, a list of texts, token ids, or a list of
// token-id lists.
func parseEmbeddingInput(raw json.RawMessage) ([][]int, error) {
	var text string
	if err := json.Unmarshal(raw, &text); err == nil {
		return [][]int{Tokenize(text, true)}, nil
	}
	var texts []string
	if err := json.Unmarshal(raw, &texts); err == nil {
		out := make([][]int, len(texts))
		for i, t := range texts {
			out[i] = Tokenize(t, true)
		}
		return out, nil
	}
	var ids []int
	if err := json.Unmarshal(raw, &ids); err == nil {
		return [][]int{ids}, nil
	}
	var lists [][]int
	if err := json.Unmarshal(raw, &lists); err == nil {
		return lists, nil
	}
	return nil, errors.New("input must be a string, a list of strings, a list of token ids, or a list of token-id lists")
}

func (s *Sim) handleEmbeddings(w http.ResponseWriter, r *http.Request) {
	var req embeddingRequest
	if !s.decodeBody(w, r, &req) || !s.checkModel(w, req.Model) {
		return
	}
	p := s.cfg.Profile
	if !p.Embedding || p.Reranker {
		writeError(w, http.StatusBadRequest, "The model does not support Embeddings API")
		return
	}
	if len(req.Input) == 0 {
		writeErrorType(w, http.StatusBadRequest, "BadRequestError", "input is required", "input")
		return
	}
	inputs, err := parseEmbeddingInput(req.Input)
	if err != nil {
		writeErrorType(w, http.StatusBadRequest, "BadRequestError", err.Error(), "input")
		return
	}
	if len(inputs) == 0 {
		writeErrorType(w, http.StatusBadRequest, "BadRequestError", "input must not be empty", "input")
		return
	}
	switch req.EncodingFormat {
	case "", "float", "base64":
	default:
		writeErrorType(w, http.StatusBadRequest, "BadRequestError", fmt.Sprintf("encoding_format %q is not one of float, base64", req.EncodingFormat), "encoding_format")
		return
	}
	if req.Dimensions != nil && *req.Dimensions != p.EmbeddingDim {
		writeErrorType(w, http.StatusBadRequest, "BadRequestError",
			"Model does not support matryoshka representation, changing output dimensions will lead to poor results.", "dimensions")
		return
	}
	total := 0
	for i, in := range inputs {
		if len(in) == 0 {
			writeErrorType(w, http.StatusBadRequest, "BadRequestError", fmt.Sprintf("input[%d] is empty", i), "input")
			return
		}
		for _, t := range in {
			if t < 0 || t >= vocabSize {
				writeErrorType(w, http.StatusBadRequest, "BadRequestError", fmt.Sprintf("token id %d is out of vocabulary", t), "input")
				return
			}
		}
		if len(in) > p.MaxModelLen {
			writeError(w, http.StatusBadRequest, fmt.Sprintf("This model's maximum context length is %d tokens. However, you requested %d tokens in the input for embedding generation. Please reduce the length of the input.", p.MaxModelLen, len(in)))
			return
		}
		total += len(in)
	}

	flt, delay, _ := s.faults.draw(r)
	if !s.injectEarly(w, r, flt) {
		return
	}
	if delay > 0 && !s.waitSimulated(r.Context(), delay) {
		return
	}
	reqs := make([]*Request, 0, len(inputs))
	abortAll := func() {
		for _, q := range reqs {
			s.eng.Abort(q)
		}
	}
	for _, in := range inputs {
		q, err := s.eng.Submit(SubmitParams{Prompt: in})
		if err != nil {
			abortAll()
			s.submitError(w, err)
			return
		}
		reqs = append(reqs, q)
	}
	for _, q := range reqs {
		select {
		case <-q.Done():
		case <-r.Context().Done():
			abortAll()
			return
		}
		if _, _, _, err := q.Read(0); err != nil {
			writeError(w, http.StatusInternalServerError, engineDeadMessage)
			return
		}
	}
	if flt == faultDrop {
		dropConnection()
	}
	type item struct {
		Index     int    `json:"index"`
		Object    string `json:"object"`
		Embedding any    `json:"embedding"`
	}
	data := make([]item, len(inputs))
	for i, in := range inputs {
		vec := s.embed(in)
		data[i] = item{Index: i, Object: "embedding", Embedding: vec}
		if req.EncodingFormat == "base64" {
			b := make([]byte, 4*len(vec))
			for j, v := range vec {
				binary.LittleEndian.PutUint32(b[4*j:], math.Float32bits(v))
			}
			data[i].Embedding = base64.StdEncoding.EncodeToString(b)
		}
	}
	writeJSON(w, http.StatusOK, map[string]any{
		"id": s.requestID(r, "embd-"), "object": "list", "created": time.Now().Unix(), "model": s.model, "data": data,
		"usage": usageInfo{PromptTokens: total, TotalTokens: total},
	})
}

// embed returns the deterministic unit vector of a token sequence.
func (s *Sim) embed(toks []int) []float32 {
	h := blockHash(s.cfg.Seed, toks)
	rng := rand.New(rand.NewPCG(h, 0xe111bed))
	v := make([]float32, s.cfg.Profile.EmbeddingDim)
	var norm float64
	for i := range v {
		x := rng.NormFloat64()
		v[i] = float32(x)
		norm += x * x
	}
	inv := float32(1 / math.Sqrt(norm))
	for i := range v {
		v[i] *= inv
	}
	return v
}

// flushAndWait sends what a stream has buffered, then waits for the
// engine's next step on req; it aborts req and reports false when the
// client is gone.
func (s *Sim) flushAndWait(w http.ResponseWriter, rc *http.ResponseController, r *http.Request, req *Request, buf *[]byte) bool {
	if len(*buf) > 0 {
		if _, err := w.Write(*buf); err != nil {
			s.eng.Abort(req)
			return false
		}
		if err := rc.Flush(); err != nil {
			s.eng.Abort(req)
			return false
		}
		*buf = (*buf)[:0]
	}
	return s.waitOutput(r, req)
}

// waitOutput waits for req's next output, or aborts it when the client
// leaves.
func (s *Sim) waitOutput(r *http.Request, req *Request) bool {
	select {
	case <-req.Notify():
		return true
	case <-r.Context().Done():
		s.eng.Abort(req)
		return false
	}
}
