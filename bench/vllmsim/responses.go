package vllmsim

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"time"
)

// The Responses API (POST /v1/responses) as vLLM serves it: the input (a
// string, or a list of messages whose content is a string or input_text
// parts) and the instructions (a system message) go through the chat
// template; the answer is a ResponsesResponse with one message output
// item, or, streaming, vLLM's typed events (`event: <type>` and the event
// as data; no [DONE]): response.created, response.in_progress,
// response.output_item.added, response.content_part.added, one
// response.output_text.delta per token, response.output_text.done,
// response.content_part.done, response.output_item.done,
// response.completed. Like vLLM, the response has no "error" key. Tools,
// reasoning, background and previous_response_id are not simulated.

// responsesRequest is the part of vLLM's ResponsesRequest the simulator
// reads or echoes.
type responsesRequest struct {
	samplingFields
	Input              json.RawMessage `json:"input"`
	Instructions       *string         `json:"instructions"`
	MaxOutputTokens    *int            `json:"max_output_tokens"`
	Temperature        *float64        `json:"temperature"`
	TopP               *float64        `json:"top_p"`
	Metadata           json.RawMessage `json:"metadata"`
	ParallelToolCalls  *bool           `json:"parallel_tool_calls"`
	ToolChoice         json.RawMessage `json:"tool_choice"`
	Tools              json.RawMessage `json:"tools"`
	Background         bool            `json:"background"`
	ServiceTier        string          `json:"service_tier"`
	Text               json.RawMessage `json:"text"`
	Truncation         string          `json:"truncation"`
	User               *string         `json:"user"`
	PreviousResponseID *string         `json:"previous_response_id"`
	TopLogprobs        *int            `json:"top_logprobs"`
	MaxToolCalls       *int            `json:"max_tool_calls"`
}

// responsesMeta is what a response echoes of its request.
type responsesMeta struct {
	req *responsesRequest
}

// responsesMessages turns the input and the instructions into chat
// messages.
func responsesMessages(req *responsesRequest) ([]ChatMessage, error) {
	var msgs []ChatMessage
	if req.Instructions != nil && *req.Instructions != "" {
		msgs = append(msgs, ChatMessage{Role: "system", Content: *req.Instructions})
	}
	var text string
	if err := json.Unmarshal(req.Input, &text); err == nil {
		return append(msgs, ChatMessage{Role: "user", Content: text}), nil
	}
	var items []struct {
		Type    string          `json:"type"`
		Role    string          `json:"role"`
		Content json.RawMessage `json:"content"`
	}
	if err := json.Unmarshal(req.Input, &items); err != nil {
		return nil, fmt.Errorf("input must be a string or a list of input items")
	}
	for i, it := range items {
		if it.Type != "" && it.Type != "message" {
			return nil, fmt.Errorf("input[%d]: item type %q is not supported by the simulator", i, it.Type)
		}
		if it.Role == "" {
			return nil, fmt.Errorf("input[%d].role is required", i)
		}
		m := ChatMessage{Role: it.Role}
		if err := json.Unmarshal(it.Content, &m.Content); err != nil {
			var parts []struct {
				Type string `json:"type"`
				Text string `json:"text"`
			}
			if err := json.Unmarshal(it.Content, &parts); err != nil {
				return nil, fmt.Errorf("input[%d].content must be a string or a list of content parts", i)
			}
			texts := make([]string, 0, len(parts))
			for j, p := range parts {
				if p.Type != "input_text" && p.Type != "output_text" {
					return nil, fmt.Errorf("input[%d].content[%d]: content type %q is not supported by this text-only model", i, j, p.Type)
				}
				texts = append(texts, p.Text)
			}
			m.Content = strings.Join(texts, "\n")
		}
		msgs = append(msgs, m)
	}
	return msgs, nil
}

func (s *Sim) handleResponses(w http.ResponseWriter, r *http.Request) {
	var req responsesRequest
	if !s.decodeBody(w, r, &req) || !s.checkModel(w, req.Model) {
		return
	}
	if s.cfg.Profile.Embedding {
		writeError(w, http.StatusBadRequest, "The model does not support Responses API")
		return
	}
	if len(req.Input) == 0 || string(req.Input) == "null" {
		writeErrorType(w, http.StatusBadRequest, "BadRequestError", "input is required", "input")
		return
	}
	msgs, err := responsesMessages(&req)
	if err != nil {
		writeErrorType(w, http.StatusBadRequest, "BadRequestError", err.Error(), "input")
		return
	}
	if len(msgs) == 0 {
		writeErrorType(w, http.StatusBadRequest, "BadRequestError", "input must not be empty", "input")
		return
	}
	prompt := Tokenize(RenderChatTools(msgs, req.Tools, true), false)
	req.StreamOptions = nil // not a Responses API field
	req.responses = &responsesMeta{req: &req}
	s.generate(w, r, kindResponses, prompt, req.MaxOutputTokens, req.samplingFields)
}

// responseObject is the ResponsesResponse for c, with output items and
// usage when known.
func (s *Sim) responseObject(c genCall, created int64, status string, output []any, usage any) map[string]any {
	req := c.responses.req
	raw := func(b json.RawMessage, def any) any {
		if len(b) == 0 || string(b) == "null" {
			return def
		}
		return b
	}
	var incomplete any
	if status == "incomplete" {
		incomplete = map[string]string{"reason": "max_output_tokens"}
	}
	serviceTier, truncation := req.ServiceTier, req.Truncation
	if serviceTier == "" {
		serviceTier = "auto"
	}
	if truncation == "" {
		truncation = "disabled"
	}
	return map[string]any{
		"id": c.id, "created_at": created, "incomplete_details": incomplete, "instructions": req.Instructions,
		"metadata": raw(req.Metadata, nil), "model": s.model, "object": "response", "output": output,
		"parallel_tool_calls": boolOr(req.ParallelToolCalls, true),
		"temperature":         floatOr(req.Temperature, 1), "tool_choice": raw(req.ToolChoice, "auto"),
		"tools": raw(req.Tools, []any{}), "top_p": floatOr(req.TopP, 1), "background": req.Background,
		"max_output_tokens": c.maxTokens, "max_tool_calls": req.MaxToolCalls, "previous_response_id": req.PreviousResponseID,
		"prompt": nil, "reasoning": nil, "service_tier": serviceTier, "status": status, "text": raw(req.Text, nil),
		"top_logprobs": req.TopLogprobs, "truncation": truncation, "usage": usage, "user": req.User,
		"input_messages": nil, "output_messages": nil,
	}
}

func floatOr(p *float64, def float64) float64 {
	if p == nil {
		return def
	}
	return *p
}

func responseUsage(prompt, output int) map[string]any {
	return map[string]any{
		"input_tokens": prompt, "input_tokens_details": map[string]int{"cached_tokens": 0},
		"output_tokens": output, "output_tokens_details": map[string]int{"reasoning_tokens": 0},
		"total_tokens": prompt + output,
	}
}

// outputMessage is a message output item.
func outputMessage(id, text, status string, content bool) map[string]any {
	parts := []any{}
	if content {
		parts = append(parts, outputText(text))
	}
	return map[string]any{"id": id, "content": parts, "role": "assistant", "status": status, "type": "message"}
}

func outputText(text string) map[string]any {
	return map[string]any{"annotations": []any{}, "text": text, "type": "output_text", "logprobs": nil}
}

// responseStatus is completed, or incomplete when the output ran to
// max_output_tokens.
func responseStatus(c genCall, reason string) string {
	if reason == FinishLength {
		return "incomplete"
	}
	return "completed"
}

// serveResponse answers a Responses API call once the engine has it.
func (s *Sim) serveResponse(w http.ResponseWriter, r *http.Request, c genCall, req *Request, drop bool) {
	if c.stream {
		s.streamResponse(w, r, c, req, drop)
		return
	}
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
	msgID := "msg_" + c.id[len("resp_"):]
	writeJSON(w, http.StatusOK, s.responseObject(c, time.Now().Unix(), responseStatus(c, reason),
		[]any{outputMessage(msgID, text, "completed", true)}, responseUsage(len(c.prompt), len(out))))
}

// streamResponse writes vLLM's typed events for the response.
func (s *Sim) streamResponse(w http.ResponseWriter, r *http.Request, c genCall, req *Request, drop bool) {
	rc := http.NewResponseController(w)
	h := w.Header()
	h.Set("Content-Type", "text/event-stream; charset=utf-8")
	h.Set("Cache-Control", "no-cache")
	w.WriteHeader(http.StatusOK)
	created := time.Now().Unix()
	msgID := "msg_" + c.id[len("resp_"):]
	seq := 0
	var buf []byte
	event := func(typ string, fields map[string]any) {
		fields["type"], fields["sequence_number"] = typ, seq
		seq++
		b, _ := json.Marshal(fields)
		buf = fmt.Appendf(buf, "event: %s\ndata: %s\n\n", typ, b)
	}
	event("response.created", map[string]any{"response": s.responseObject(c, created, "in_progress", []any{}, nil)})
	event("response.in_progress", map[string]any{"response": s.responseObject(c, created, "in_progress", []any{}, nil)})
	event("response.output_item.added", map[string]any{"item": outputMessage(msgID, "", "in_progress", false), "output_index": 0})
	event("response.content_part.added", map[string]any{"content_index": 0, "item_id": msgID, "output_index": 0, "part": outputText("")})

	dropAt := -1
	if drop {
		dropAt = s.faults.dropAfter(req.Target())
	}
	var text strings.Builder
	sent := 0
	for {
		toks, finished, reason, err := req.Read(sent)
		for _, t := range toks {
			if sent == dropAt {
				_, _ = w.Write(buf)
				_ = rc.Flush()
				s.eng.Abort(req)
				dropConnection()
			}
			sent++
			piece, _ := TokenString(t)
			text.WriteString(piece)
			event("response.output_text.delta", map[string]any{"content_index": 0, "delta": piece, "item_id": msgID,
				"logprobs": []any{}, "output_index": 0})
		}
		if finished {
			if err != nil {
				b, _ := json.Marshal(apiError{Error: apiErrorInfo{Message: engineDeadMessage, Type: "InternalServerError", Code: 500}})
				buf = fmt.Appendf(buf, "event: error\ndata: %s\n\n", b)
			} else {
				full := text.String()
				event("response.output_text.done", map[string]any{"content_index": 0, "item_id": msgID, "logprobs": []any{},
					"output_index": 0, "text": full})
				event("response.content_part.done", map[string]any{"content_index": 0, "item_id": msgID, "output_index": 0,
					"part": outputText(full)})
				item := outputMessage(msgID, full, "completed", true)
				event("response.output_item.done", map[string]any{"item": item, "output_index": 0})
				event("response.completed", map[string]any{"response": s.responseObject(c, created, responseStatus(c, reason),
					[]any{item}, responseUsage(len(c.prompt), sent))})
			}
			_, _ = w.Write(buf)
			_ = rc.Flush()
			return
		}
		if !s.flushAndWait(w, rc, r, req, &buf) {
			return
		}
	}
}
