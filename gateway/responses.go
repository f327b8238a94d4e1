package gateway

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"
)

// The Responses API (POST /v1/responses), passed to the backends as vLLM
// serves it, on the interactive path of chat and completions: the same
// validation of the fields admission reads (everything else passes
// through untouched), admission (the prompt, input and instructions,
// estimated from their size; output reserved up to max_output_tokens, or
// the default), quotas, usage (input_tokens and output_tokens, from the
// answer or from the stream's response.completed event) and metrics. A
// stream is vLLM's typed events (`event: response.*`), relayed event by
// event; it ends with response.completed, response.incomplete or
// response.failed rather than [DONE].
//
// vLLM leaves out the response's "error" key, which OpenAI always sends
// (null on success) and the SDKs' types declare, and sends null for keys
// the SDKs declare optional but not nullable (text, user, usage, a content
// part's logprobs); kvgate adds the one and leaves out the others, in the
// answer and in the events that carry a response, an item or a part.

func (s *Server) handleResponses(w http.ResponseWriter, r *http.Request) int {
	return s.handleInference(w, r, epResponses)
}

// parseSurface checks the fields of the Responses API and the scoring
// routes that admission reads, and sizes their prompt.
func (c *call) parseSurface() error {
	switch c.ep {
	case epResponses:
		if !isPresent(c.f.Input) || string(c.f.Input) == `""` || string(c.f.Input) == "[]" {
			return badRequest("input", "'input' must be a non-empty string or array of input items.")
		}
		if laxTrue(c.f.Background) {
			// vLLM would answer at once and generate afterwards, unseen by
			// admission, its KV held past the grant kvgate releases.
			return badRequest("background", "kvgate runs a response while its request is open and does not take background responses: "+
				"submit it as a durable job (POST /v1/jobs with endpoint /v1/responses) and read its result when it is done.")
		}
		size, media := promptSize(c.f.Input)
		c.promptBytes, c.media = size+len(c.f.Instructions)+toolBytes(c.f.Tools), media
	case epRerank:
		if !isPresent(c.f.Query) || string(c.f.Query) == `""` {
			return badRequest("query", "'query' must be a non-empty string.")
		}
		n := listLen(c.f.Documents)
		if n < 1 {
			return badRequest("documents", "'documents' must be a non-empty array.")
		}
		// A cross-encoder reads the query with each document.
		c.promptBytes = satMul(len(c.f.Query), n) + len(c.f.Documents)
	case epScore:
		side1, side2, name1, name2 := c.f.scoreSides()
		n1, n2 := listLen(side1), listLen(side2)
		if n1 < 1 {
			return badRequest(name1, fmt.Sprintf("'%s' must be a non-empty string or array.", name1))
		}
		if n2 < 1 {
			return badRequest(name2, fmt.Sprintf("'%s' must be a non-empty string or array.", name2))
		}
		c.promptBytes = len(side2) + len(side1)
		if n1 == 1 {
			c.promptBytes = satMul(len(side1), n2) + len(side2)
		}
	}
	return nil
}

// scoreSides returns a score request's two sides and their names, in the
// order vLLM tries its request's shapes (queries and documents, queries
// and items, data_1 and data_2); text_1 and text_2 when none is there.
func (f *reqFields) scoreSides() (first, second json.RawMessage, name1, name2 string) {
	switch {
	case isPresent(f.Queries) && isPresent(f.Documents):
		return f.Queries, f.Documents, "queries", "documents"
	case isPresent(f.Queries) && isPresent(f.Items):
		return f.Queries, f.Items, "queries", "items"
	case isPresent(f.Data1) && isPresent(f.Data2):
		return f.Data1, f.Data2, "data_1", "data_2"
	}
	return f.Text1, f.Text2, "text_1", "text_2"
}

func isPresent(raw json.RawMessage) bool { return len(raw) > 0 && string(raw) != "null" }

// listLen is how many items a JSON array holds, 1 for a non-empty string,
// and 0 for anything else.
func listLen(raw json.RawMessage) int {
	raw = bytes.TrimSpace(raw)
	switch {
	case len(raw) == 0:
		return 0
	case raw[0] == '"':
		var s string
		if json.Unmarshal(raw, &s) != nil || s == "" {
			return 0
		}
		return 1
	case raw[0] == '[':
		var items []json.RawMessage
		if json.Unmarshal(raw, &items) != nil {
			return 0
		}
		return len(items)
	}
	return 0
}

// answerOf reads a backend's answer for ep: the body to pass on and the
// usage it reports (nil when it reports none), in each endpoint's shape.
// An answer that is not a JSON object is an error.
func answerOf(ep endpoint, b []byte) ([]byte, *usage, error) {
	switch ep {
	case epResponses:
		var parsed struct {
			Usage *responsesUsage `json:"usage"`
		}
		if err := json.Unmarshal(b, &parsed); err != nil {
			return nil, nil, err
		}
		out, err := normalizeResponse(b)
		if err != nil {
			return nil, nil, err
		}
		return out, parsed.Usage.usage(), nil
	case epRerank, epScore:
		var parsed struct {
			Usage *struct {
				PromptTokens int `json:"prompt_tokens"`
				TotalTokens  int `json:"total_tokens"`
			} `json:"usage"`
		}
		if err := json.Unmarshal(b, &parsed); err != nil {
			return nil, nil, err
		}
		if parsed.Usage == nil {
			return b, nil, nil
		}
		// Older vLLM reports a rerank's total_tokens only.
		return b, &usage{PromptTokens: max(parsed.Usage.PromptTokens, parsed.Usage.TotalTokens)}, nil
	}
	var parsed struct {
		Usage *usage `json:"usage"`
	}
	if err := json.Unmarshal(b, &parsed); err != nil {
		return nil, nil, err
	}
	return b, parsed.Usage, nil
}

// responsesUsage is a Response's usage.
type responsesUsage struct {
	InputTokens  int `json:"input_tokens"`
	OutputTokens int `json:"output_tokens"`
}

func (u *responsesUsage) usage() *usage {
	if u == nil {
		return nil
	}
	return &usage{PromptTokens: u.InputTokens, CompletionTokens: u.OutputTokens}
}

// The keys of a Response that the SDKs declare optional but not nullable,
// and that vLLM sends as null: left out, as OpenAI leaves them out.
var responseOptional = []string{"text", "user", "usage", "status", "prompt_cache_options"}

// normalizeResponse makes a Response object what the SDKs' types declare:
// "error": null where the key is missing, the optional keys that are null
// left out, and the same for its output items' content parts.
func normalizeResponse(b []byte) ([]byte, error) {
	var m map[string]json.RawMessage
	if err := json.Unmarshal(b, &m); err != nil {
		return nil, err
	}
	if m == nil {
		return b, nil
	}
	changed := false
	if _, ok := m["error"]; !ok {
		m["error"] = json.RawMessage("null")
		changed = true
	}
	changed = dropNulls(m, responseOptional) || changed
	if raw, ok := m["output"]; ok {
		var items []json.RawMessage
		if json.Unmarshal(raw, &items) == nil {
			itemsChanged := false
			for i, it := range items {
				if out, ok := normalizeOutputItem(it); ok {
					items[i], itemsChanged = out, true
				}
			}
			if out := mustMarshalRaw(items); itemsChanged && out != nil {
				m["output"], changed = out, true
			}
		}
	}
	if !changed {
		return b, nil
	}
	return marshalRaw(m)
}

// normalizeOutputItem leaves out the null logprobs of a message item's
// content parts (optional, not nullable, in the SDKs' types); ok says it
// changed.
func normalizeOutputItem(raw json.RawMessage) (json.RawMessage, bool) {
	var m map[string]json.RawMessage
	if json.Unmarshal(raw, &m) != nil || m == nil {
		return raw, false
	}
	var parts []json.RawMessage
	if json.Unmarshal(m["content"], &parts) != nil {
		return raw, false
	}
	changed := false
	for i, p := range parts {
		if out, ok := normalizePart(p); ok {
			parts[i], changed = out, true
		}
	}
	if !changed {
		return raw, false
	}
	m["content"] = mustMarshalRaw(parts)
	out, err := marshalRaw(m)
	return out, err == nil && m["content"] != nil
}

// normalizePart leaves out a content part's null logprobs.
func normalizePart(raw json.RawMessage) (json.RawMessage, bool) {
	var m map[string]json.RawMessage
	if json.Unmarshal(raw, &m) != nil || m == nil || !dropNulls(m, []string{"logprobs"}) {
		return raw, false
	}
	out, err := marshalRaw(m)
	return out, err == nil
}

// dropNulls deletes the keys of m whose value is null; it reports whether
// it deleted any.
func dropNulls(m map[string]json.RawMessage, keys []string) bool {
	changed := false
	for _, k := range keys {
		if v, ok := m[k]; ok && string(bytes.TrimSpace(v)) == "null" {
			delete(m, k)
			changed = true
		}
	}
	return changed
}

func mustMarshalRaw(v any) json.RawMessage {
	b, err := marshalRaw(v)
	if err != nil {
		return nil
	}
	return b
}

func marshalRaw(v any) ([]byte, error) {
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(v); err != nil {
		return nil, err
	}
	return bytes.TrimRight(buf.Bytes(), "\n"), nil
}

// responsesStreamEvent is what the relay needs of one event of a
// Responses stream.
type responsesStreamEvent struct {
	typ       string
	delta     bool   // output text: a token's progress
	final     bool   // the stream's last event
	failed    bool   // a final event that says the response failed (response.failed, error)
	usage     *usage // from the final event
	rewritten []byte // the event's new data, when it changed
	// response is the response an event other than the final one carries
	// (response.created, response.in_progress), normalized; it aliases
	// the event's data.
	response []byte
}

// responsesEvent reads one event's data. The events that carry the whole
// response (created, in_progress and the final ones), an output item or a
// content part are normalized as normalizeResponse does.
func responsesEvent(data []byte) responsesStreamEvent {
	// One event per token: know a delta without decoding it. Inside a
	// JSON string a quote is escaped, so the unescaped pair is the type.
	if bytes.Contains(data, deltaType) {
		return responsesStreamEvent{typ: "response.output_text.delta", delta: true}
	}
	return parseResponsesEvent(data)
}

var deltaType = []byte(`"type":"response.output_text.delta"`)

// parseResponsesEvent is responsesEvent without the fast path for deltas.
func parseResponsesEvent(data []byte) responsesStreamEvent {
	var ev struct {
		Type     string          `json:"type"`
		Response json.RawMessage `json:"response"`
		Item     json.RawMessage `json:"item"`
		Part     json.RawMessage `json:"part"`
	}
	if json.Unmarshal(data, &ev) != nil {
		return responsesStreamEvent{}
	}
	out := responsesStreamEvent{typ: ev.Type}
	switch ev.Type {
	case "response.output_text.delta":
		out.delta = true
		return out
	case "response.completed", "response.incomplete":
		out.final = true
	case "response.failed":
		out.final, out.failed = true, true
	case "error":
		out.final, out.failed = true, true
		return out
	}
	key, fixed := "", json.RawMessage(nil)
	switch {
	case isPresent(ev.Response):
		var resp struct {
			Usage *responsesUsage `json:"usage"`
		}
		if json.Unmarshal(ev.Response, &resp) == nil && out.final {
			out.usage = resp.Usage.usage()
		}
		b, err := normalizeResponse(ev.Response)
		if err == nil && !bytes.Equal(b, ev.Response) {
			key, fixed = "response", b
		}
		if err == nil && !out.final {
			out.response = b
		}
	case isPresent(ev.Item):
		if b, ok := normalizeOutputItem(ev.Item); ok {
			key, fixed = "item", b
		}
	case isPresent(ev.Part):
		if b, ok := normalizePart(ev.Part); ok {
			key, fixed = "part", b
		}
	}
	if fixed == nil {
		return out
	}
	var m map[string]json.RawMessage
	if json.Unmarshal(data, &m) != nil {
		return out
	}
	m[key] = fixed
	if b, err := marshalRaw(m); err == nil {
		out.rewritten = b
	}
	return out
}

// responsesTrail is what a relay keeps of a Responses stream to end it
// with response.failed if its backend fails: the response as the last
// event that carried one showed it, and the last sequence number.
type responsesTrail struct {
	response []byte
	seq      int64
}

// see records an event's sequence number and the response it carries.
func (t *responsesTrail) see(data []byte, ev responsesStreamEvent) {
	if ev.response != nil {
		t.response = append(t.response[:0], ev.response...)
	}
	if n, ok := sequenceNumber(data); ok {
		t.seq = n
	}
}

var seqKey = []byte(`"sequence_number":`)

// sequenceNumber reads an event's sequence_number without decoding it
// (one event per token); a key inside a JSON string has its quotes
// escaped, so the unescaped one is the event's own.
func sequenceNumber(data []byte) (int64, bool) {
	i := bytes.Index(data, seqKey)
	if i < 0 {
		return 0, false
	}
	rest := bytes.TrimLeft(data[i+len(seqKey):], " ")
	var n int64
	digits := 0
	for _, ch := range rest {
		if ch < '0' || ch > '9' || digits == 18 {
			break
		}
		n, digits = n*10+int64(ch-'0'), digits+1
	}
	return n, digits > 0
}

// failedEvent is the response.failed event that ends a Responses stream
// whose backend failed after it began: the response last seen, its
// status failed and its error e's (OpenAI's Response.error: a code and a
// message), next in sequence. Nil when the stream showed no response (a
// backend whose events kvgate cannot read): the caller then sends the
// API's error event.
func (t *responsesTrail) failedEvent(e *apiError) []byte {
	var resp map[string]json.RawMessage
	if t.response == nil || json.Unmarshal(t.response, &resp) != nil || resp == nil {
		return nil
	}
	resp["status"] = mustMarshalRaw("failed")
	// Response.error's code is one of a fixed set; server_error is the
	// one for a failure of the server's own.
	resp["error"] = mustMarshalRaw(map[string]string{"code": "server_error", "message": e.msg})
	b, err := marshalRaw(map[string]json.RawMessage{
		"type": mustMarshalRaw("response.failed"), "sequence_number": mustMarshalRaw(t.seq + 1), "response": mustMarshalRaw(resp),
	})
	if err != nil {
		return nil
	}
	return append(append([]byte("event: response.failed\ndata: "), b...), "\n\n"...)
}

// errorEvent is the Responses API's error event for e, next in sequence.
func (t *responsesTrail) errorEvent(e *apiError) []byte {
	ev := map[string]any{"type": "error", "code": e.code, "message": e.msg, "param": nil, "sequence_number": t.seq + 1}
	if e.param != "" {
		ev["param"] = e.param
	}
	b, _ := json.Marshal(ev)
	return append(append([]byte("event: error\ndata: "), b...), "\n\n"...)
}
