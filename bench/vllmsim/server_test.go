package vllmsim

import (
	"bufio"
	"bytes"
	"context"
	"encoding/base64"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"math"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvgate/kvgate/bench/eventually"
)

// Helpers shared by the HTTP tests of this package (server_test.go and
// metrics_test.go). They talk to a real httptest server over TCP.

// testProfile returns the 8B H100 profile shrunk to a small context and KV
// cache, so that tests stay fast and limits are easy to reach.
func testProfile(t testing.TB, maxModelLen, numGPUBlocks int) Profile {
	t.Helper()
	p, err := LookupProfile("h100-llama-3.1-8b")
	if err != nil {
		t.Fatal(err)
	}
	p.MaxModelLen, p.NumGPUBlocks = maxModelLen, numGPUBlocks
	return p
}

func embeddingProfile(t testing.TB) Profile {
	t.Helper()
	p, err := LookupProfile("h100-bge-m3")
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// simClient sends requests to one test server.
type simClient struct {
	base string
	hc   *http.Client
}

func startSim(t *testing.T, cfg Config) (*Sim, simClient) {
	t.Helper()
	sim, srv := NewTestServer(t, cfg)
	return sim, simClient{base: srv.URL, hc: srv.Client()}
}

type httpResult struct {
	status int
	header http.Header
	body   []byte
}

func encodeBody(t testing.TB, body any) io.Reader {
	t.Helper()
	switch b := body.(type) {
	case nil:
		return nil
	case string:
		return strings.NewReader(b)
	case []byte:
		return bytes.NewReader(b)
	default:
		j, err := json.Marshal(b)
		if err != nil {
			t.Fatalf("encoding request body: %v", err)
		}
		return bytes.NewReader(j)
	}
}

func (c simClient) newRequest(ctx context.Context, t testing.TB, method, path string, body any) *http.Request {
	t.Helper()
	req, err := http.NewRequestWithContext(ctx, method, c.base+path, encodeBody(t, body))
	if err != nil {
		t.Fatalf("new request: %v", err)
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	return req
}

// send starts a request and returns the response with its body unread.
func (c simClient) send(ctx context.Context, t testing.TB, method, path string, body any) (*http.Response, error) {
	t.Helper()
	return c.hc.Do(c.newRequest(ctx, t, method, path, body))
}

func (c simClient) do(t testing.TB, method, path string, body any) httpResult {
	t.Helper()
	resp, err := c.send(context.Background(), t, method, path, body)
	if err != nil {
		t.Fatalf("%s %s: %v", method, path, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("%s %s: reading body: %v", method, path, err)
	}
	return httpResult{status: resp.StatusCode, header: resp.Header, body: b}
}

func (c simClient) get(t testing.TB, path string) httpResult {
	t.Helper()
	return c.do(t, http.MethodGet, path, nil)
}

func (c simClient) post(t testing.TB, path string, body any) httpResult {
	t.Helper()
	return c.do(t, http.MethodPost, path, body)
}

// ok fails the test unless the answer is 200, and decodes it into v.
func (r httpResult) ok(t testing.TB, v any) {
	t.Helper()
	if r.status != http.StatusOK {
		t.Fatalf("status %d, want 200; body %s", r.status, clip(r.body))
	}
	if v == nil {
		return
	}
	if err := json.Unmarshal(r.body, v); err != nil {
		t.Fatalf("decoding %s: %v", clip(r.body), err)
	}
}

func (c simClient) serverLoad(t testing.TB) int {
	t.Helper()
	var v struct {
		ServerLoad *int `json:"server_load"`
	}
	c.get(t, "/load").ok(t, &v)
	if v.ServerLoad == nil {
		t.Fatal("/load: no server_load")
	}
	return *v.ServerLoad
}

func (c simClient) tokenCount(t testing.TB, body map[string]any) int {
	t.Helper()
	var v struct {
		Count int `json:"count"`
	}
	c.post(t, "/tokenize", body).ok(t, &v)
	return v.Count
}

func setFaults(t testing.TB, c simClient, f Faults) {
	t.Helper()
	r := c.do(t, http.MethodPut, "/admin/faults", f)
	var got Faults
	r.ok(t, &got)
	if got != f {
		t.Fatalf("PUT /admin/faults answered %+v, want %+v", got, f)
	}
}

// clip shortens a body for a failure message.
func clip(b []byte) string {
	const n = 400
	if len(b) <= n {
		return string(b)
	}
	return fmt.Sprintf("%s... (%d bytes)", b[:n], len(b))
}

type usageJSON struct {
	PromptTokens     int `json:"prompt_tokens"`
	CompletionTokens int `json:"completion_tokens"`
	TotalTokens      int `json:"total_tokens"`
}

type messageJSON struct {
	Role    *string `json:"role"`
	Content *string `json:"content"`
}

type choiceJSON struct {
	Index        int          `json:"index"`
	Message      *messageJSON `json:"message"`
	Delta        *messageJSON `json:"delta"`
	Text         *string      `json:"text"`
	FinishReason *string      `json:"finish_reason"`
}

func (c choiceJSON) content() string {
	switch {
	case c.Message != nil && c.Message.Content != nil:
		return *c.Message.Content
	case c.Delta != nil && c.Delta.Content != nil:
		return *c.Delta.Content
	case c.Text != nil:
		return *c.Text
	}
	return ""
}

// responseJSON covers chat and completion responses and stream chunks.
type responseJSON struct {
	ID      string         `json:"id"`
	Object  string         `json:"object"`
	Created int64          `json:"created"`
	Model   string         `json:"model"`
	Choices []choiceJSON   `json:"choices"`
	Usage   *usageJSON     `json:"usage"`
	Error   *errorInfoJSON `json:"error"`
}

type errorInfoJSON struct {
	Message string          `json:"message"`
	Type    string          `json:"type"`
	Param   *string         `json:"param"`
	Code    json.RawMessage `json:"code"`
}

// checkErrorBody checks that body is vLLM's nested error object, exactly
// {"error":{"message","type","param","code"}} with code the HTTP status as
// a JSON integer; param, when not empty, is the expected param and msg a
// substring of the message.
func checkErrorBody(t testing.TB, body []byte, status int, param, msg string) errorInfoJSON {
	t.Helper()
	var outer map[string]json.RawMessage
	if err := json.Unmarshal(body, &outer); err != nil {
		t.Fatalf("error body %q is not JSON: %v", clip(body), err)
	}
	if len(outer) != 1 || outer["error"] == nil {
		t.Fatalf("error body %s: want exactly one key, \"error\"", clip(body))
	}
	var keys map[string]json.RawMessage
	if err := json.Unmarshal(outer["error"], &keys); err != nil {
		t.Fatalf("error body %s: \"error\" is not an object: %v", clip(body), err)
	}
	for _, k := range []string{"message", "type", "param", "code"} {
		if _, ok := keys[k]; !ok {
			t.Errorf("error body %s: no %q", clip(body), k)
		}
	}
	var e errorInfoJSON
	if err := json.Unmarshal(outer["error"], &e); err != nil {
		t.Fatalf("error body %s: %v", clip(body), err)
	}
	if string(e.Code) != strconv.Itoa(status) {
		t.Errorf("error code %s, want the integer %d", e.Code, status)
	}
	if e.Message == "" || e.Type == "" {
		t.Errorf("error body %s: empty message or type", clip(body))
	}
	if param != "" && (e.Param == nil || *e.Param != param) {
		t.Errorf("error body %s: param %v, want %q", clip(body), e.Param, param)
	}
	if msg != "" && !strings.Contains(e.Message, msg) {
		t.Errorf("error message %q does not contain %q", e.Message, msg)
	}
	return e
}

func checkAPIError(t testing.TB, r httpResult, status int, param, msg string) errorInfoJSON {
	t.Helper()
	if r.status != status {
		t.Errorf("status %d, want %d; body %s", r.status, status, clip(r.body))
	}
	if ct := r.header.Get("Content-Type"); !strings.HasPrefix(ct, "application/json") {
		t.Errorf("error Content-Type %q, want application/json", ct)
	}
	return checkErrorBody(t, r.body, status, param, msg)
}

// parseSSE splits a complete event stream into its data payloads. Every
// event must be exactly "data: <payload>\n\n", and the last one, and only
// it, "data: [DONE]".
func parseSSE(t testing.TB, body []byte) []string {
	t.Helper()
	var out []string
	rest := string(body)
	for rest != "" {
		if !strings.HasPrefix(rest, "data: ") {
			t.Fatalf("event %d does not start with \"data: \": %.120q", len(out), rest)
		}
		end := strings.Index(rest, "\n\n")
		if end < 0 {
			t.Fatalf("event %d is not ended by a blank line: %.120q", len(out), rest)
		}
		payload := rest[len("data: "):end]
		if strings.Contains(payload, "\n") {
			t.Fatalf("event %d spans several lines: %q", len(out), payload)
		}
		out = append(out, payload)
		rest = rest[end+2:]
	}
	if len(out) == 0 || out[len(out)-1] != "[DONE]" {
		t.Fatalf("stream does not end with data: [DONE]: %q", body)
	}
	for i, p := range out[:len(out)-1] {
		if p == "[DONE]" {
			t.Fatalf("[DONE] at event %d of %d", i, len(out))
		}
		if !json.Valid([]byte(p)) {
			t.Fatalf("event %d is not JSON: %q", i, p)
		}
	}
	return out
}

// readEvent reads one "data: ...\n\n" event from a live stream.
func readEvent(br *bufio.Reader) (string, error) {
	line, err := br.ReadString('\n')
	if err != nil {
		return "", err
	}
	if !strings.HasPrefix(line, "data: ") {
		return "", fmt.Errorf("event line %q does not start with \"data: \"", line)
	}
	blank, err := br.ReadString('\n')
	if err != nil {
		return "", err
	}
	if blank != "\n" {
		return "", fmt.Errorf("event %q is followed by %q, not a blank line", line, blank)
	}
	return strings.TrimSuffix(strings.TrimPrefix(line, "data: "), "\n"), nil
}

func chatMessages(user string) []map[string]any {
	return []map[string]any{
		{"role": "system", "content": "you are a terse helper"},
		{"role": "user", "content": user},
	}
}

// genCase is one generation request, chat or completion, with what its
// answer must look like.
type genCase struct {
	name      string
	path      string
	chat      bool
	req       map[string]any // without stream fields
	tokenize  map[string]any // the /tokenize body counting the same prompt; nil: promptLen
	promptLen int
	maxTokens int
}

func (g genCase) idPrefix() string {
	if g.chat {
		return "chatcmpl-"
	}
	return "cmpl-"
}

func (g genCase) object(stream bool) string {
	switch {
	case g.chat && stream:
		return "chat.completion.chunk"
	case g.chat:
		return "chat.completion"
	}
	return "text_completion"
}

func (g genCase) wantPrompt(t testing.TB, c simClient) int {
	t.Helper()
	if g.tokenize == nil {
		return g.promptLen
	}
	return c.tokenCount(t, g.tokenize)
}

func genCases(model string) []genCase {
	msgs := chatMessages("tell me about the kv cache of a gpu")
	parts := []map[string]any{{"role": "user", "content": []map[string]any{
		{"type": "text", "text": "first part of the question"},
		{"type": "text", "text": "second part"},
	}}}
	prompt := "the quick brown fox jumps over the lazy dog"
	return []genCase{
		{
			name: "chat", path: "/v1/chat/completions", chat: true,
			req:      map[string]any{"model": model, "messages": msgs, "max_tokens": 12, "ignore_eos": true},
			tokenize: map[string]any{"model": model, "messages": msgs}, maxTokens: 12,
		},
		{
			name: "chat max_completion_tokens", path: "/v1/chat/completions", chat: true,
			req:      map[string]any{"model": model, "messages": msgs, "max_completion_tokens": 9, "ignore_eos": true},
			tokenize: map[string]any{"messages": msgs}, maxTokens: 9,
		},
		{
			name: "chat content parts without model", path: "/v1/chat/completions", chat: true,
			req:      map[string]any{"messages": parts, "max_tokens": 5, "ignore_eos": true},
			tokenize: map[string]any{"messages": parts}, maxTokens: 5,
		},
		{
			name: "completion", path: "/v1/completions",
			req:      map[string]any{"model": model, "prompt": prompt, "max_tokens": 10, "ignore_eos": true},
			tokenize: map[string]any{"model": model, "prompt": prompt}, maxTokens: 10,
		},
		{
			name: "completion prompt list", path: "/v1/completions",
			req:      map[string]any{"model": model, "prompt": []string{prompt + " again"}, "max_tokens": 7, "ignore_eos": true},
			tokenize: map[string]any{"prompt": prompt + " again"}, maxTokens: 7,
		},
		{
			name: "completion token ids", path: "/v1/completions",
			req:       map[string]any{"model": model, "prompt": []int{128000, 300, 301, 302, 65, 66}, "max_tokens": 6, "ignore_eos": true},
			promptLen: 6, maxTokens: 6,
		},
	}
}

func TestGenerateNonStreaming(t *testing.T) {
	p := testProfile(t, 2048, 512)
	sim, c := startSim(t, Config{Profile: p, Seed: 1})
	for _, g := range genCases(p.Model) {
		t.Run(g.name, func(t *testing.T) {
			r := c.post(t, g.path, g.req)
			var resp responseJSON
			r.ok(t, &resp)
			if ct := r.header.Get("Content-Type"); !strings.HasPrefix(ct, "application/json") {
				t.Errorf("Content-Type %q", ct)
			}
			if !strings.HasPrefix(resp.ID, g.idPrefix()) || len(resp.ID) == len(g.idPrefix()) {
				t.Errorf("id %q, want prefix %q", resp.ID, g.idPrefix())
			}
			if resp.Object != g.object(false) {
				t.Errorf("object %q, want %q", resp.Object, g.object(false))
			}
			if resp.Model != sim.Model() || resp.Created <= 0 {
				t.Errorf("model %q created %d, want %q and a timestamp", resp.Model, resp.Created, sim.Model())
			}
			if len(resp.Choices) != 1 {
				t.Fatalf("%d choices, want 1: %s", len(resp.Choices), r.body)
			}
			ch := resp.Choices[0]
			if ch.Index != 0 {
				t.Errorf("choice index %d", ch.Index)
			}
			if g.chat {
				if ch.Message == nil || ch.Message.Role == nil || *ch.Message.Role != "assistant" || ch.Message.Content == nil {
					t.Errorf("chat message %s, want role assistant and content", r.body)
				}
			} else if ch.Text == nil {
				t.Errorf("completion choice has no text: %s", r.body)
			}
			if ch.FinishReason == nil || *ch.FinishReason != FinishLength {
				t.Errorf("finish_reason %v, want length (ignore_eos with max_tokens)", ch.FinishReason)
			}
			text := ch.content()
			if n := len(Tokenize(text, false)); n != g.maxTokens {
				t.Errorf("text %q is %d tokens, want %d", text, n, g.maxTokens)
			}
			want := usageJSON{PromptTokens: g.wantPrompt(t, c), CompletionTokens: g.maxTokens}
			want.TotalTokens = want.PromptTokens + want.CompletionTokens
			if resp.Usage == nil || *resp.Usage != want {
				t.Errorf("usage %+v, want %+v", resp.Usage, want)
			}

			// The same request again gives the same text: the simulator
			// is deterministic per prompt.
			var again responseJSON
			c.post(t, g.path, g.req).ok(t, &again)
			if len(again.Choices) != 1 || again.Choices[0].content() != text {
				t.Errorf("second answer differs from first %q", text)
			}
			if again.ID == resp.ID {
				t.Errorf("two responses share id %q", resp.ID)
			}
		})
	}

	t.Run("without ignore_eos finish_reason matches length", func(t *testing.T) {
		for i := range 8 {
			r := c.post(t, "/v1/completions", map[string]any{"prompt": fmt.Sprintf("sample number %d", i), "max_tokens": 300})
			var resp responseJSON
			r.ok(t, &resp)
			n := resp.Usage.CompletionTokens
			reason := *resp.Choices[0].FinishReason
			if n < 1 || n > 300 || (reason == FinishLength) != (n == 300) || (reason != FinishLength && reason != FinishStop) {
				t.Errorf("%d tokens with finish_reason %q (max_tokens 300)", n, reason)
			}
		}
	})

	t.Run("prompt plus max_tokens equal to max_model_len fits", func(t *testing.T) {
		prompt := "a boundary case"
		n := c.tokenCount(t, map[string]any{"prompt": prompt})
		var resp responseJSON
		c.post(t, "/v1/completions", map[string]any{"prompt": prompt, "max_tokens": p.MaxModelLen - n, "ignore_eos": true}).ok(t, &resp)
		if resp.Usage.CompletionTokens != p.MaxModelLen-n || resp.Usage.TotalTokens != p.MaxModelLen {
			t.Errorf("usage %+v, want %d completion tokens filling max_model_len %d", resp.Usage, p.MaxModelLen-n, p.MaxModelLen)
		}
	})
}

// streamCheck is what a stream must contain.
type streamCheck struct {
	chat           bool
	object, prefix string
	model          string
	promptTokens   int
	maxTokens      int
	finishReason   string
	usage          bool // a final chunk with "choices": [] and usage
	continuous     bool // usage in every chunk
	text           string
}

// checkStream checks a complete stream's events against want, in vLLM's
// framing: a chat stream opens with the assistant role, then one chunk per
// token, the finish reason on the last token's chunk only, an optional usage
// chunk with no choices, and [DONE].
func checkStream(t testing.TB, events []string, want streamCheck) {
	t.Helper()
	var text strings.Builder
	tokens, id := 0, ""
	sawUsage := false
	for i, ev := range events[:len(events)-1] {
		var raw map[string]json.RawMessage
		var ch responseJSON
		if err := json.Unmarshal([]byte(ev), &raw); err != nil {
			t.Fatalf("event %d: %v", i, err)
		}
		if err := json.Unmarshal([]byte(ev), &ch); err != nil {
			t.Fatalf("event %d: %v", i, err)
		}
		if i == 0 {
			id = ch.ID
		}
		if ch.ID != id || !strings.HasPrefix(id, want.prefix) {
			t.Errorf("event %d: id %q (first %q), want one id with prefix %q", i, ch.ID, id, want.prefix)
		}
		if ch.Object != want.object || ch.Model != want.model || ch.Created <= 0 {
			t.Errorf("event %d: object %q model %q created %d, want %q %q", i, ch.Object, ch.Model, ch.Created, want.object, want.model)
		}
		u, hasUsage := raw["usage"]
		hasUsage = hasUsage && string(u) != "null"
		checkUsage := func(completion int) {
			t.Helper()
			w := usageJSON{want.promptTokens, completion, want.promptTokens + completion}
			if ch.Usage == nil || *ch.Usage != w {
				t.Errorf("event %d: usage %+v, want %+v", i, ch.Usage, w)
			}
		}
		if c, ok := raw["choices"]; ok && string(c) == "[]" {
			if !want.usage {
				t.Errorf("event %d: usage chunk %s without include_usage", i, ev)
			}
			if i != len(events)-2 {
				t.Errorf("usage chunk at event %d of %d, want it last before [DONE]", i, len(events))
			}
			checkUsage(want.maxTokens)
			sawUsage = true
			continue
		}
		if len(ch.Choices) != 1 || ch.Choices[0].Index != 0 {
			t.Fatalf("event %d: want one choice of index 0: %s", i, ev)
		}
		c0 := ch.Choices[0]
		if want.chat && i == 0 {
			if c0.Delta == nil || c0.Delta.Role == nil || *c0.Delta.Role != "assistant" || c0.Delta.Content == nil || *c0.Delta.Content != "" || c0.FinishReason != nil {
				t.Errorf("first chat chunk %s, want delta {role: assistant, content: \"\"} and no finish_reason", ev)
			}
			if want.continuous {
				checkUsage(0)
			} else if hasUsage {
				t.Errorf("event %d: usage without continuous_usage_stats: %s", i, ev)
			}
			continue
		}
		if want.chat && (c0.Delta == nil || c0.Delta.Content == nil || c0.Delta.Role != nil) {
			t.Errorf("event %d: chat token chunk %s, want a delta with content only", i, ev)
		}
		if !want.chat && c0.Text == nil {
			t.Errorf("event %d: completion chunk %s has no text", i, ev)
		}
		tokens++
		content := c0.content()
		if n := len(Tokenize(content, false)); n != 1 {
			t.Errorf("event %d: chunk text %q is %d tokens, want one chunk per token", i, content, n)
		}
		text.WriteString(content)
		if tokens == want.maxTokens {
			if c0.FinishReason == nil || *c0.FinishReason != want.finishReason {
				t.Errorf("last token chunk finish_reason %v, want %q", c0.FinishReason, want.finishReason)
			}
		} else if c0.FinishReason != nil {
			t.Errorf("token chunk %d of %d has finish_reason %q", tokens, want.maxTokens, *c0.FinishReason)
		}
		if want.continuous {
			checkUsage(tokens)
		} else if hasUsage {
			t.Errorf("event %d: usage without continuous_usage_stats: %s", i, ev)
		}
	}
	if tokens != want.maxTokens {
		t.Errorf("%d token chunks, want %d", tokens, want.maxTokens)
	}
	if sawUsage != want.usage {
		t.Errorf("usage chunk present %v, want %v", sawUsage, want.usage)
	}
	if text.String() != want.text {
		t.Errorf("streamed text %q differs from the non-streaming text %q", text.String(), want.text)
	}
}

func TestGenerateStreaming(t *testing.T) {
	p := testProfile(t, 2048, 512)
	sim, c := startSim(t, Config{Profile: p, Seed: 3})
	options := []struct {
		name              string
		opts              map[string]any
		usage, continuous bool
	}{
		{"no stream_options", nil, false, false},
		{"include_usage", map[string]any{"include_usage": true}, true, false},
		{"continuous_usage_stats", map[string]any{"include_usage": true, "continuous_usage_stats": true}, true, true},
	}
	for _, g := range genCases(p.Model) {
		for _, o := range options {
			t.Run(g.name+"/"+o.name, func(t *testing.T) {
				var plain responseJSON
				c.post(t, g.path, g.req).ok(t, &plain)

				body := maps.Clone(g.req)
				body["stream"] = true
				if o.opts != nil {
					body["stream_options"] = o.opts
				}
				r := c.post(t, g.path, body)
				if r.status != http.StatusOK {
					t.Fatalf("status %d: %s", r.status, r.body)
				}
				if ct := r.header.Get("Content-Type"); !strings.HasPrefix(ct, "text/event-stream") {
					t.Errorf("Content-Type %q, want text/event-stream", ct)
				}
				checkStream(t, parseSSE(t, r.body), streamCheck{
					chat: g.chat, object: g.object(true), prefix: g.idPrefix(), model: sim.Model(),
					promptTokens: g.wantPrompt(t, c), maxTokens: g.maxTokens, finishReason: FinishLength,
					usage: o.usage, continuous: o.continuous, text: plain.Choices[0].content(),
				})
			})
		}
	}
}

// TestStreamOptionsDefaults holds vLLM's StreamOptions semantics:
// include_usage defaults to true once stream_options is present, and
// continuous_usage_stats only applies together with include_usage
// (serving_chat.py / serving_completion.py: include_continuous_usage =
// include_usage and continuous_usage_stats).
func TestStreamOptionsDefaults(t *testing.T) {
	p := testProfile(t, 2048, 512)
	sim, c := startSim(t, Config{Profile: p})
	msgs := chatMessages("what is a stream option")
	req := map[string]any{"messages": msgs, "max_tokens": 6, "ignore_eos": true}
	var plain responseJSON
	c.post(t, "/v1/chat/completions", req).ok(t, &plain)
	for _, o := range []struct {
		name              string
		opts              map[string]any
		usage, continuous bool
	}{
		{"empty object", map[string]any{}, true, false},
		{"continuous only", map[string]any{"continuous_usage_stats": true}, true, true},
		{"continuous without include_usage", map[string]any{"include_usage": false, "continuous_usage_stats": true}, false, false},
		// Pydantic keeps a null as None, which vLLM reads as false.
		{"include_usage null", map[string]any{"include_usage": nil}, false, false},
	} {
		t.Run(o.name, func(t *testing.T) {
			body := maps.Clone(req)
			body["stream"], body["stream_options"] = true, o.opts
			r := c.post(t, "/v1/chat/completions", body)
			r.ok(t, nil)
			checkStream(t, parseSSE(t, r.body), streamCheck{
				chat: true, object: "chat.completion.chunk", prefix: "chatcmpl-", model: sim.Model(),
				promptTokens: c.tokenCount(t, map[string]any{"messages": msgs}), maxTokens: 6, finishReason: FinishLength,
				usage: o.usage, continuous: o.continuous, text: plain.Choices[0].content(),
			})
		})
	}
}

func TestDefaultMaxTokens(t *testing.T) {
	p := testProfile(t, 256, 64)
	_, c := startSim(t, Config{Profile: p})

	t.Run("chat fills the context", func(t *testing.T) {
		msgs := chatMessages("no limit given")
		n := c.tokenCount(t, map[string]any{"messages": msgs})
		var resp responseJSON
		c.post(t, "/v1/chat/completions", map[string]any{"messages": msgs, "ignore_eos": true}).ok(t, &resp)
		if resp.Usage.CompletionTokens != p.MaxModelLen-n || *resp.Choices[0].FinishReason != FinishLength {
			t.Errorf("usage %+v finish %q, want max_model_len - prompt = %d tokens, length", resp.Usage, *resp.Choices[0].FinishReason, p.MaxModelLen-n)
		}
	})

	// vLLM's CompletionRequest declares max_tokens: int | None = 16.
	t.Run("completion defaults to 16", func(t *testing.T) {
		var resp responseJSON
		c.post(t, "/v1/completions", map[string]any{"prompt": "no limit given", "ignore_eos": true}).ok(t, &resp)
		if resp.Usage.CompletionTokens != 16 || *resp.Choices[0].FinishReason != FinishLength {
			t.Errorf("usage %+v finish %q, want 16 tokens, length", resp.Usage, *resp.Choices[0].FinishReason)
		}
	})
}

func TestErrors(t *testing.T) {
	p := testProfile(t, 256, 64)
	_, c := startSim(t, Config{Profile: p, MaxBodyBytes: 4096})
	_, ce := startSim(t, Config{Profile: embeddingProfile(t)})

	msgs := chatMessages("hello")
	short := "a short prompt of some words"
	long := strings.Repeat("x ", 300) // 600 tokens, over max_model_len 256
	if n := len(Tokenize(long, true)); n <= p.MaxModelLen {
		t.Fatalf("long prompt is %d tokens, not over %d", n, p.MaxModelLen)
	}
	big := map[string]any{"messages": chatMessages(strings.Repeat("y", 5000)), "max_tokens": 1}

	cases := []struct {
		name   string
		c      simClient
		method string
		path   string
		body   any
		status int
		param  string
		msg    string
	}{
		{"invalid JSON", c, "POST", "/v1/chat/completions", `{"model":`, 400, "", ""},
		{"invalid JSON completions", c, "POST", "/v1/completions", `[1,2`, 400, "", ""},
		{"missing messages", c, "POST", "/v1/chat/completions", map[string]any{"model": p.Model}, 400, "", ""},
		{"empty messages", c, "POST", "/v1/chat/completions", map[string]any{"messages": []any{}}, 400, "", ""},
		{"missing prompt", c, "POST", "/v1/completions", map[string]any{"model": p.Model}, 400, "", ""},
		{"empty prompt", c, "POST", "/v1/completions", map[string]any{"prompt": []int{}}, 400, "", ""},
		{"out-of-vocabulary prompt id", c, "POST", "/v1/completions", map[string]any{"prompt": []int{1, 999999}}, 400, "prompt", ""},
		{"unknown model chat", c, "POST", "/v1/chat/completions", map[string]any{"model": "nope", "messages": msgs}, 404, "model", "nope"},
		{"unknown model completions", c, "POST", "/v1/completions", map[string]any{"model": "nope", "prompt": short}, 404, "model", ""},
		{"unknown model tokenize", c, "POST", "/tokenize", map[string]any{"model": "nope", "prompt": short}, 404, "model", ""},
		{"context too long", c, "POST", "/v1/completions", map[string]any{"prompt": short, "max_tokens": 250}, 400, "", "maximum context length"},
		{"context too long chat", c, "POST", "/v1/chat/completions", map[string]any{"messages": msgs, "max_tokens": 250}, 400, "", "maximum context length"},
		{"prompt alone too long", c, "POST", "/v1/completions", map[string]any{"prompt": long}, 400, "", "maximum context length"},
		{"prompt alone too long with max_tokens", c, "POST", "/v1/completions", map[string]any{"prompt": long, "max_tokens": 1}, 400, "", "maximum context length"},
		{"max_tokens 0", c, "POST", "/v1/completions", map[string]any{"prompt": short, "max_tokens": 0}, 400, "max_tokens", ""},
		{"max_tokens negative", c, "POST", "/v1/chat/completions", map[string]any{"messages": msgs, "max_tokens": -3}, 400, "", ""},
		{"min_tokens over max_tokens", c, "POST", "/v1/completions", map[string]any{"prompt": short, "max_tokens": 5, "min_tokens": 10}, 400, "min_tokens", "less than or equal to max_tokens=5"},
		{"min_tokens negative", c, "POST", "/v1/chat/completions", map[string]any{"messages": msgs, "max_tokens": 5, "min_tokens": -1}, 400, "min_tokens", ""},
		{"n=2", c, "POST", "/v1/chat/completions", map[string]any{"messages": msgs, "max_tokens": 4, "n": 2}, 400, "n", ""},
		{"stream_options without stream", c, "POST", "/v1/chat/completions", map[string]any{"messages": msgs, "max_tokens": 4, "stream_options": map[string]any{"include_usage": true}}, 400, "stream_options", ""},
		{"stream_options with stream false", c, "POST", "/v1/completions", map[string]any{"prompt": short, "max_tokens": 4, "stream": false, "stream_options": map[string]any{"include_usage": true}}, 400, "", ""},
		{"body over MaxBodyBytes", c, "POST", "/v1/chat/completions", big, 413, "", ""},
		{"unknown path", c, "GET", "/v1/nope", nil, 404, "", ""},
		{"unknown POST path", c, "POST", "/v2/chat/completions", map[string]any{"messages": msgs}, 404, "", ""},
		{"embeddings on a generative model", c, "POST", "/v1/embeddings", map[string]any{"input": "hello"}, 400, "", ""},
		{"chat on the embedding model", ce, "POST", "/v1/chat/completions", map[string]any{"messages": msgs, "max_tokens": 4}, 400, "", ""},
		{"completions on the embedding model", ce, "POST", "/v1/completions", map[string]any{"prompt": short, "max_tokens": 4}, 400, "", ""},
		{"tokenize with prompt and messages", c, "POST", "/tokenize", map[string]any{"prompt": short, "messages": msgs}, 400, "", ""},
		{"message without role", c, "POST", "/v1/chat/completions", map[string]any{"messages": []map[string]any{{"content": "hi"}}}, 400, "messages", ""},
		{"image content part", c, "POST", "/v1/chat/completions", map[string]any{"messages": []map[string]any{{"role": "user", "content": []map[string]any{{"type": "image_url", "image_url": map[string]any{"url": "http://x/y.png"}}}}}}, 400, "messages", ""},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			e := checkAPIError(t, tc.c.do(t, tc.method, tc.path, tc.body), tc.status, tc.param, tc.msg)
			if tc.status == 400 && e.Type != "BadRequestError" {
				t.Errorf("type %q, want BadRequestError", e.Type)
			}
			if tc.status == 404 && tc.param == "model" && e.Type != "NotFoundError" {
				t.Errorf("type %q, want NotFoundError", e.Type)
			}
		})
	}
	if got := c.serverLoad(t); got != 0 {
		t.Errorf("server_load %d after rejected requests, want 0", got)
	}
}

// vLLM (FastAPI) answers 405 for a known path with the wrong method, through
// its HTTPException handler in the nested error shape.
func TestMethodNotAllowed(t *testing.T) {
	_, c := startSim(t, Config{Profile: testProfile(t, 256, 64)})
	for _, path := range []string{"/v1/chat/completions", "/v1/completions", "/tokenize"} {
		checkAPIError(t, c.get(t, path), http.StatusMethodNotAllowed, "", "")
	}
}

func TestModelsAndInfoEndpoints(t *testing.T) {
	p := testProfile(t, 2048, 512)
	sim, c := startSim(t, Config{Profile: p})

	t.Run("models", func(t *testing.T) {
		var v struct {
			Object string `json:"object"`
			Data   []struct {
				ID          string          `json:"id"`
				Object      string          `json:"object"`
				Created     int64           `json:"created"`
				OwnedBy     string          `json:"owned_by"`
				Root        string          `json:"root"`
				Parent      *string         `json:"parent"`
				MaxModelLen int             `json:"max_model_len"`
				Permission  json.RawMessage `json:"permission"`
			} `json:"data"`
		}
		c.get(t, "/v1/models").ok(t, &v)
		if v.Object != "list" || len(v.Data) != 1 {
			t.Fatalf("models %+v, want a list of one", v)
		}
		m := v.Data[0]
		if m.ID != p.Model || m.Object != "model" || m.OwnedBy != "vllm" || m.MaxModelLen != p.MaxModelLen || m.Created <= 0 || m.Root == "" {
			t.Errorf("model card %+v, want id %q, object model, owned_by vllm, max_model_len %d", m, p.Model, p.MaxModelLen)
		}
		var perms []map[string]any
		if err := json.Unmarshal(m.Permission, &perms); err != nil || len(perms) != 1 {
			t.Errorf("permission %s, want a list of one", m.Permission)
		}
	})

	t.Run("health", func(t *testing.T) {
		r := c.get(t, "/health")
		if r.status != 200 || len(r.body) != 0 {
			t.Errorf("/health %d %q, want 200 and an empty body", r.status, r.body)
		}
	})

	t.Run("ping", func(t *testing.T) {
		for _, m := range []string{http.MethodGet, http.MethodPost} {
			if r := c.do(t, m, "/ping", nil); r.status != 200 {
				t.Errorf("%s /ping %d, want 200", m, r.status)
			}
		}
	})

	t.Run("version", func(t *testing.T) {
		var v map[string]string
		c.get(t, "/version").ok(t, &v)
		if v["version"] != Version || len(v) != 1 {
			t.Errorf("/version %v, want {version: %s}", v, Version)
		}
	})

	t.Run("load", func(t *testing.T) {
		if got := c.serverLoad(t); got != 0 {
			t.Errorf("server_load %d on an idle server", got)
		}
		if got := sim.Engine().Load(); got != 0 {
			t.Errorf("engine load %d on an idle server", got)
		}
	})
}

func TestServedModelName(t *testing.T) {
	p := testProfile(t, 2048, 512)
	sim, c := startSim(t, Config{Profile: p, ServedModelName: "my-llama"})
	if sim.Model() != "my-llama" {
		t.Fatalf("Model() %q", sim.Model())
	}
	var models struct {
		Data []struct {
			ID string `json:"id"`
		} `json:"data"`
	}
	c.get(t, "/v1/models").ok(t, &models)
	if len(models.Data) != 1 || models.Data[0].ID != "my-llama" {
		t.Errorf("models %+v, want id my-llama", models)
	}
	var resp responseJSON
	c.post(t, "/v1/completions", map[string]any{"model": "my-llama", "prompt": "hi there", "max_tokens": 2}).ok(t, &resp)
	if resp.Model != "my-llama" {
		t.Errorf("response model %q, want my-llama", resp.Model)
	}
	checkAPIError(t, c.post(t, "/v1/completions", map[string]any{"model": p.Model, "prompt": "hi", "max_tokens": 2}), 404, "model", "")
}

func TestTokenize(t *testing.T) {
	p := testProfile(t, 2048, 512)
	_, c := startSim(t, Config{Profile: p})
	type tokenizeResp struct {
		Count       int       `json:"count"`
		MaxModelLen int       `json:"max_model_len"`
		Tokens      []int     `json:"tokens"`
		TokenStrs   *[]string `json:"token_strs"`
	}
	text := "Hello, world: the kv cache is full! 42"

	t.Run("prompt", func(t *testing.T) {
		var v tokenizeResp
		c.post(t, "/tokenize", map[string]any{"model": p.Model, "prompt": text}).ok(t, &v)
		if v.Count != len(v.Tokens) || v.Count < 2 || v.MaxModelLen != p.MaxModelLen {
			t.Errorf("tokenize %+v: count must equal len(tokens), max_model_len %d", v, p.MaxModelLen)
		}
		if v.Tokens[0] != tokBeginOfText {
			t.Errorf("first token %d, want BOS %d (add_special_tokens defaults to true)", v.Tokens[0], tokBeginOfText)
		}
		if v.TokenStrs != nil {
			t.Errorf("token_strs %v without return_token_strs", *v.TokenStrs)
		}
		var noSpecial tokenizeResp
		c.post(t, "/tokenize", map[string]any{"prompt": text, "add_special_tokens": false}).ok(t, &noSpecial)
		if noSpecial.Count != v.Count-1 || noSpecial.Tokens[0] == tokBeginOfText {
			t.Errorf("add_special_tokens false: %d tokens starting %d, want %d without BOS", noSpecial.Count, noSpecial.Tokens[0], v.Count-1)
		}
	})

	t.Run("return_token_strs", func(t *testing.T) {
		var v tokenizeResp
		c.post(t, "/tokenize", map[string]any{"prompt": text, "return_token_strs": true}).ok(t, &v)
		if v.TokenStrs == nil || len(*v.TokenStrs) != v.Count {
			t.Fatalf("token_strs %v, want %d strings", v.TokenStrs, v.Count)
		}
		if got := strings.Join(*v.TokenStrs, ""); got != "<|begin_of_text|>"+text {
			t.Errorf("joined token_strs %q, want BOS + %q", got, text)
		}
	})

	t.Run("chat", func(t *testing.T) {
		msgs := chatMessages("count me")
		var v tokenizeResp
		c.post(t, "/tokenize", map[string]any{"messages": msgs, "return_token_strs": true}).ok(t, &v)
		if v.Count != len(v.Tokens) || v.Tokens[0] != tokBeginOfText {
			t.Errorf("chat tokenize %+v, want the template's BOS first", v)
		}
		joined := strings.Join(*v.TokenStrs, "")
		for _, want := range []string{"<|start_header_id|>system<|end_header_id|>", "count me<|eot_id|>", "<|start_header_id|>assistant<|end_header_id|>\n\n"} {
			if !strings.Contains(joined, want) {
				t.Errorf("chat template %q lacks %q", joined, want)
			}
		}
		var noGen tokenizeResp
		c.post(t, "/tokenize", map[string]any{"messages": msgs, "add_generation_prompt": false}).ok(t, &noGen)
		if noGen.Count >= v.Count {
			t.Errorf("without the generation prompt %d tokens, with %d", noGen.Count, v.Count)
		}
	})

	t.Run("detokenize round trip", func(t *testing.T) {
		for _, special := range []bool{false, true} {
			var v tokenizeResp
			c.post(t, "/tokenize", map[string]any{"prompt": text, "add_special_tokens": special}).ok(t, &v)
			var d struct {
				Prompt string `json:"prompt"`
			}
			c.post(t, "/detokenize", map[string]any{"model": p.Model, "tokens": v.Tokens}).ok(t, &d)
			want := text
			if special {
				want = "<|begin_of_text|>" + text
			}
			if d.Prompt != want {
				t.Errorf("detokenize(tokenize(%q), special %v) = %q, want %q", text, special, d.Prompt, want)
			}
		}
	})

	t.Run("detokenize out of vocabulary", func(t *testing.T) {
		for _, id := range []int{vocabSize, 1 << 20, -1} {
			checkAPIError(t, c.post(t, "/detokenize", map[string]any{"tokens": []int{300, id}}), 400, "", "")
		}
	})
}

type embeddingResp struct {
	ID     string `json:"id"`
	Object string `json:"object"`
	Model  string `json:"model"`
	Data   []struct {
		Index     int             `json:"index"`
		Object    string          `json:"object"`
		Embedding json.RawMessage `json:"embedding"`
	} `json:"data"`
	Usage usageJSON `json:"usage"`
}

func floatVector(t testing.TB, raw json.RawMessage) []float32 {
	t.Helper()
	var v []float32
	if err := json.Unmarshal(raw, &v); err != nil {
		t.Fatalf("embedding %.80s is not a float list: %v", raw, err)
	}
	return v
}

func TestEmbeddings(t *testing.T) {
	p := embeddingProfile(t)
	sim, c := startSim(t, Config{Profile: p})
	embed := func(t *testing.T, body map[string]any) embeddingResp {
		t.Helper()
		var v embeddingResp
		c.post(t, "/v1/embeddings", body).ok(t, &v)
		if v.Object != "list" || v.Model != sim.Model() || !strings.HasPrefix(v.ID, "embd-") {
			t.Errorf("embedding response id %q object %q model %q", v.ID, v.Object, v.Model)
		}
		for i, d := range v.Data {
			if d.Index != i || d.Object != "embedding" {
				t.Errorf("data[%d]: index %d object %q", i, d.Index, d.Object)
			}
		}
		return v
	}
	checkUnit := func(t *testing.T, v []float32) {
		t.Helper()
		if len(v) != p.EmbeddingDim || len(v) != 1024 {
			t.Fatalf("%d dimensions, want 1024", len(v))
		}
		var ss float64
		for _, x := range v {
			ss += float64(x) * float64(x)
		}
		if math.Abs(math.Sqrt(ss)-1) > 1e-4 {
			t.Errorf("norm %g, want 1", math.Sqrt(ss))
		}
	}
	count := func(t *testing.T, text string) int { return c.tokenCount(t, map[string]any{"prompt": text}) }

	t.Run("string", func(t *testing.T) {
		v := embed(t, map[string]any{"model": p.Model, "input": "hello world"})
		if len(v.Data) != 1 {
			t.Fatalf("%d embeddings, want 1", len(v.Data))
		}
		checkUnit(t, floatVector(t, v.Data[0].Embedding))
		if want := count(t, "hello world"); v.Usage != (usageJSON{PromptTokens: want, TotalTokens: want}) {
			t.Errorf("usage %+v, want %d prompt tokens", v.Usage, want)
		}
	})

	t.Run("list deterministic", func(t *testing.T) {
		v := embed(t, map[string]any{"input": []string{"hello world", "goodbye world", "hello world"}})
		if len(v.Data) != 3 {
			t.Fatalf("%d embeddings, want 3", len(v.Data))
		}
		a, b, a2 := floatVector(t, v.Data[0].Embedding), floatVector(t, v.Data[1].Embedding), floatVector(t, v.Data[2].Embedding)
		checkUnit(t, a)
		checkUnit(t, b)
		if !equalVectors(a, a2) {
			t.Error("the same input gave different vectors")
		}
		if equalVectors(a, b) {
			t.Error("different inputs gave the same vector")
		}
		again := embed(t, map[string]any{"input": "hello world"})
		if !equalVectors(a, floatVector(t, again.Data[0].Embedding)) {
			t.Error("the same input gave different vectors across requests")
		}
		want := 2*count(t, "hello world") + count(t, "goodbye world")
		if v.Usage.PromptTokens != want || v.Usage.TotalTokens != want {
			t.Errorf("usage %+v, want %d prompt tokens", v.Usage, want)
		}
	})

	t.Run("token ids", func(t *testing.T) {
		var tok struct {
			Tokens []int `json:"tokens"`
		}
		c.post(t, "/tokenize", map[string]any{"prompt": "hello world"}).ok(t, &tok)
		v := embed(t, map[string]any{"input": tok.Tokens})
		text := embed(t, map[string]any{"input": "hello world"})
		if len(v.Data) != 1 || !equalVectors(floatVector(t, v.Data[0].Embedding), floatVector(t, text.Data[0].Embedding)) {
			t.Error("token ids of a text embed differently from the text")
		}
		if v.Usage.PromptTokens != len(tok.Tokens) {
			t.Errorf("usage %+v, want %d", v.Usage, len(tok.Tokens))
		}
		lists := embed(t, map[string]any{"input": [][]int{{300, 301}, {302}}})
		if len(lists.Data) != 2 || lists.Usage.PromptTokens != 3 {
			t.Errorf("token-id lists: %d embeddings, usage %+v; want 2 and 3 tokens", len(lists.Data), lists.Usage)
		}
	})

	t.Run("base64", func(t *testing.T) {
		f := embed(t, map[string]any{"input": "encode me", "encoding_format": "float"})
		b := embed(t, map[string]any{"input": "encode me", "encoding_format": "base64"})
		var s string
		if err := json.Unmarshal(b.Data[0].Embedding, &s); err != nil {
			t.Fatalf("base64 embedding is not a string: %v", err)
		}
		raw, err := base64.StdEncoding.DecodeString(s)
		if err != nil {
			t.Fatalf("decoding base64: %v", err)
		}
		if len(raw) != 4*1024 {
			t.Fatalf("%d bytes, want 4096", len(raw))
		}
		dec := make([]float32, 1024)
		for i := range dec {
			dec[i] = math.Float32frombits(binary.LittleEndian.Uint32(raw[4*i:]))
		}
		if !equalVectors(dec, floatVector(t, f.Data[0].Embedding)) {
			t.Error("base64 vector differs from the float vector")
		}
	})

	t.Run("dimensions", func(t *testing.T) {
		embed(t, map[string]any{"input": "x", "dimensions": 1024})
		checkAPIError(t, c.post(t, "/v1/embeddings", map[string]any{"input": "x", "dimensions": 512}), 400, "dimensions", "")
		checkAPIError(t, c.post(t, "/v1/embeddings", map[string]any{"input": "x", "encoding_format": "hex"}), 400, "encoding_format", "")
		checkAPIError(t, c.post(t, "/v1/embeddings", map[string]any{"input": []string{}}), 400, "input", "")
	})
}

func equalVectors(a, b []float32) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if math.Float32bits(a[i]) != math.Float32bits(b[i]) {
			return false
		}
	}
	return true
}

func TestFaults(t *testing.T) {
	p := testProfile(t, 2048, 512)
	sim, c := startSim(t, Config{Profile: p})
	chat := func(stream bool) map[string]any {
		return map[string]any{"messages": chatMessages("fault me"), "max_tokens": 40, "ignore_eos": true, "stream": stream}
	}
	with := func(t *testing.T, f Faults) {
		t.Helper()
		setFaults(t, c, f)
		t.Cleanup(func() { setFaults(t, c, Faults{}) })
	}
	idle := func(t *testing.T) {
		t.Helper()
		if !eventually.Holds(5*time.Second, func() bool { return sim.Engine().Load() == 0 && c.serverLoad(t) == 0 }) {
			t.Errorf("engine load %d, server_load %d: want both back to 0", sim.Engine().Load(), c.serverLoad(t))
		}
	}

	t.Run("rate limit", func(t *testing.T) {
		with(t, Faults{RateLimitRate: 1, RetryAfterSeconds: 7})
		for _, path := range []string{"/v1/chat/completions", "/v1/completions"} {
			body := chat(false)
			if path == "/v1/completions" {
				body = map[string]any{"prompt": "fault me", "max_tokens": 4}
			}
			r := c.post(t, path, body)
			checkAPIError(t, r, 429, "", "")
			if got := r.header.Get("Retry-After"); got != "7" {
				t.Errorf("%s: Retry-After %q, want 7", path, got)
			}
		}
	})

	for _, tc := range []struct {
		name   string
		f      Faults
		status int
	}{
		{"server error", Faults{ServerErrorRate: 1}, 500},
		{"unavailable", Faults{UnavailableRate: 1}, 503},
	} {
		t.Run(tc.name, func(t *testing.T) {
			with(t, tc.f)
			checkAPIError(t, c.post(t, "/v1/chat/completions", chat(false)), tc.status, "", "")
			checkAPIError(t, c.post(t, "/v1/chat/completions", chat(true)), tc.status, "", "")
		})
	}

	t.Run("match", func(t *testing.T) {
		with(t, Faults{ServerErrorRate: 1, Match: "poison"})
		checkAPIError(t, c.post(t, "/v1/chat/completions", map[string]any{"messages": chatMessages("a poison pill"), "max_tokens": 4}), 500, "", "")
		checkAPIError(t, c.post(t, "/v1/completions", map[string]any{"prompt": "poison", "max_tokens": 4, "stream": true}), 500, "", "")
		var resp responseJSON
		c.post(t, "/v1/chat/completions", chat(false)).ok(t, &resp) // no marker: served
		if resp.Usage == nil || resp.Usage.CompletionTokens != 40 {
			t.Errorf("unmatched request usage %+v, want 40 completion tokens", resp.Usage)
		}
		var f Faults
		c.get(t, "/admin/faults").ok(t, &f)
		if f.Match != "poison" {
			t.Errorf("GET /admin/faults %+v, want match poison", f)
		}
	})

	t.Run("malformed", func(t *testing.T) {
		with(t, Faults{MalformedRate: 1})
		r := c.post(t, "/v1/chat/completions", chat(false))
		if r.status != 200 {
			t.Errorf("status %d, want 200", r.status)
		}
		var v any
		if err := json.Unmarshal(r.body, &v); err == nil {
			t.Errorf("malformed body %q decodes", r.body)
		}
	})

	t.Run("drop stream", func(t *testing.T) {
		with(t, Faults{DropRate: 1})
		for range 3 {
			resp, err := c.send(context.Background(), t, "POST", "/v1/chat/completions", chat(true))
			if err == nil {
				var b []byte
				b, err = io.ReadAll(resp.Body)
				resp.Body.Close()
				if bytes.Contains(b, []byte("data: [DONE]")) {
					t.Errorf("dropped stream reached [DONE]: %q", b)
				}
			}
			if err == nil {
				t.Error("dropped stream ended without a read error")
			}
		}
		idle(t)
	})

	t.Run("drop non-streaming", func(t *testing.T) {
		with(t, Faults{DropRate: 1})
		resp, err := c.send(context.Background(), t, "POST", "/v1/completions", map[string]any{"prompt": "drop me", "max_tokens": 4})
		if err == nil {
			_, err = io.ReadAll(resp.Body)
			resp.Body.Close()
			t.Errorf("dropped request answered %d (read error %v), want the connection cut", resp.StatusCode, err)
		}
		idle(t)
	})

	t.Run("hang", func(t *testing.T) {
		with(t, Faults{HangRate: 1})
		ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
		defer cancel()
		resp, err := c.send(ctx, t, "POST", "/v1/chat/completions", chat(false))
		if err == nil {
			resp.Body.Close()
			t.Fatalf("hung request answered %d", resp.StatusCode)
		}
		if !errors.Is(err, context.DeadlineExceeded) {
			t.Errorf("error %v, want the client's deadline", err)
		}
		idle(t)
	})

	t.Run("dead", func(t *testing.T) {
		with(t, Faults{Dead: true})
		if r := c.get(t, "/health"); r.status != 503 {
			t.Errorf("/health %d on a dead engine, want 503", r.status)
		}
		checkAPIError(t, c.post(t, "/v1/chat/completions", chat(false)), 500, "", "")
		checkAPIError(t, c.post(t, "/v1/completions", map[string]any{"prompt": "x", "max_tokens": 2, "stream": true}), 500, "", "")
		var f Faults
		c.get(t, "/admin/faults").ok(t, &f)
		if !f.Dead {
			t.Errorf("GET /admin/faults %+v, want dead", f)
		}

		setFaults(t, c, Faults{})
		if r := c.get(t, "/health"); r.status != 200 {
			t.Errorf("/health %d after revival, want 200", r.status)
		}
		var resp responseJSON
		c.post(t, "/v1/chat/completions", chat(false)).ok(t, &resp)
		if resp.Usage == nil || resp.Usage.CompletionTokens != 40 {
			t.Errorf("after revival usage %+v, want 40 completion tokens", resp.Usage)
		}
	})

	t.Run("invalid settings", func(t *testing.T) {
		for _, body := range []string{`{"rate_limit_rate": 2}`, `{"drop_rate": -0.5}`, `{"retry_after_seconds": -1}`, `{"bogus": 1}`, `{`} {
			checkAPIError(t, c.do(t, http.MethodPut, "/admin/faults", body), 400, "", "")
		}
		var f Faults
		c.get(t, "/admin/faults").ok(t, &f)
		if f != (Faults{}) {
			t.Errorf("faults %+v after rejected settings, want none", f)
		}
		var resp responseJSON
		c.post(t, "/v1/chat/completions", chat(false)).ok(t, &resp)
	})

	t.Run("get reflects put", func(t *testing.T) {
		want := Faults{RateLimitRate: 0.25, RetryAfterSeconds: 3, DropRate: 0.5, SlowFirstTokenRate: 0.1, SlowFirstTokenSeconds: 2}
		with(t, want)
		var got Faults
		c.get(t, "/admin/faults").ok(t, &got)
		if got != want {
			t.Errorf("GET /admin/faults %+v, want %+v", got, want)
		}
	})
}

// openStream starts a long streaming request on a paced server and reads its
// first n events.
func openStream(t *testing.T, ctx context.Context, c simClient, path string, body map[string]any, n int) (*http.Response, *bufio.Reader) {
	t.Helper()
	resp, err := c.send(ctx, t, "POST", path, body)
	if err != nil {
		t.Fatalf("starting stream: %v", err)
	}
	t.Cleanup(func() { resp.Body.Close() })
	if resp.StatusCode != 200 {
		b, _ := io.ReadAll(resp.Body)
		t.Fatalf("stream status %d: %s", resp.StatusCode, b)
	}
	br := bufio.NewReader(resp.Body)
	for i := range n {
		ev, err := readEvent(br)
		if err != nil {
			t.Fatalf("reading event %d: %v", i, err)
		}
		if ev == "[DONE]" {
			t.Fatalf("stream ended after %d events", i)
		}
	}
	return resp, br
}

func TestClientDisconnectAbortsRequest(t *testing.T) {
	p := testProfile(t, 8192, 1024)
	// Paced at 10×: the request below would take seconds to finish.
	sim, c := startSim(t, Config{Profile: p, Speedup: 10})
	for _, stream := range []bool{true, false} {
		t.Run(fmt.Sprintf("stream=%v", stream), func(t *testing.T) {
			before := successCount(t, c, FinishAbort)
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			body := map[string]any{"prompt": "a long story about gpus", "max_tokens": 8000, "ignore_eos": true, "stream": stream}
			errc := make(chan error, 1)
			if stream {
				openStream(t, ctx, c, "/v1/completions", body, 3)
			} else {
				req := c.newRequest(ctx, t, "POST", "/v1/completions", body)
				go func() {
					resp, err := c.hc.Do(req)
					if err == nil {
						resp.Body.Close()
					}
					errc <- err
				}()
			}
			// The request is in flight in the engine and on the server.
			if !eventually.Holds(5*time.Second, func() bool { return sim.Engine().Load() == 1 && c.serverLoad(t) == 1 }) {
				t.Fatalf("engine load %d, server_load %d while the request runs; want 1", sim.Engine().Load(), c.serverLoad(t))
			}
			if !eventually.Holds(5*time.Second, func() bool {
				fams := scrape(t, c)
				running, _ := sampleValue(fams, "vllm:num_requests_running", nil)
				usage, _ := sampleValue(fams, "vllm:kv_cache_usage_perc", nil)
				return running == 1 && usage > 0
			}) {
				t.Error("metrics never showed the running request holding KV blocks")
			}

			cancel()
			if !stream {
				if err := <-errc; !errors.Is(err, context.Canceled) {
					t.Errorf("client error %v, want context.Canceled", err)
				}
			}
			if !eventually.Holds(5*time.Second, func() bool {
				return sim.Engine().Load() == 0 && successCount(t, c, FinishAbort) == before+1
			}) {
				t.Fatalf("engine load %d, aborted requests %g: want 0 and %g", sim.Engine().Load(), successCount(t, c, FinishAbort), before+1)
			}
			if !eventually.Holds(5*time.Second, func() bool { return c.serverLoad(t) == 0 }) {
				t.Errorf("server_load %d after the client left, want 0", c.serverLoad(t))
			}
			fams := scrape(t, c)
			if v, _ := sampleValue(fams, "vllm:request_success_total", map[string]string{"finished_reason": FinishLength}); v != 0 {
				t.Errorf("%g requests finished by length, want 0", v)
			}
			if v, _ := sampleValue(fams, "vllm:num_requests_running", nil); v != 0 {
				t.Errorf("num_requests_running %g after the abort", v)
			}
			if v, _ := sampleValue(fams, "vllm:kv_cache_usage_perc", nil); v != 0 {
				t.Errorf("kv_cache_usage_perc %g after the abort, want 0", v)
			}
		})
	}
}

func successCount(t testing.TB, c simClient, reason string) float64 {
	t.Helper()
	v, _ := sampleValue(scrape(t, c), "vllm:request_success_total", map[string]string{"finished_reason": reason})
	return v
}

func TestEngineDeathMidStream(t *testing.T) {
	p := testProfile(t, 8192, 1024)
	sim, c := startSim(t, Config{Profile: p, Speedup: 10})
	for _, path := range []string{"/v1/chat/completions", "/v1/completions"} {
		t.Run(path, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			body := map[string]any{"max_tokens": 8000, "ignore_eos": true, "stream": true,
				"stream_options": map[string]any{"include_usage": true}}
			if path == "/v1/completions" {
				body["prompt"] = "a long story about engines"
			} else {
				body["messages"] = chatMessages("a long story about engines")
			}
			_, br := openStream(t, ctx, c, path, body, 3)

			setFaults(t, c, Faults{Dead: true})
			t.Cleanup(func() { setFaults(t, c, Faults{}) })

			var events []string
			for {
				ev, err := readEvent(br)
				if err != nil {
					t.Fatalf("after %d more events: %v", len(events), err)
				}
				events = append(events, ev)
				if ev == "[DONE]" {
					break
				}
			}
			if len(events) < 2 {
				t.Fatalf("events %q, want an error event before [DONE]", events)
			}
			checkErrorBody(t, []byte(events[len(events)-2]), 500, "", "")
			for _, ev := range events[:len(events)-2] {
				var ch responseJSON
				if err := json.Unmarshal([]byte(ev), &ch); err != nil || len(ch.Choices) != 1 || ch.Choices[0].FinishReason != nil {
					t.Errorf("event %q before the error: want a token chunk without finish_reason", ev)
				}
			}
			if r := c.get(t, "/health"); r.status != 503 {
				t.Errorf("/health %d, want 503", r.status)
			}
			if !eventually.Holds(5*time.Second, func() bool { return sim.Engine().Load() == 0 && c.serverLoad(t) == 0 }) {
				t.Errorf("engine load %d server_load %d after death, want 0", sim.Engine().Load(), c.serverLoad(t))
			}

			setFaults(t, c, Faults{})
			var resp responseJSON
			c.post(t, "/v1/completions", map[string]any{"prompt": "alive again", "max_tokens": 3, "ignore_eos": true}).ok(t, &resp)
			if resp.Usage.CompletionTokens != 3 {
				t.Errorf("after revival usage %+v", resp.Usage)
			}
		})
	}
}

// streamText returns the text of a completed stream's token chunks and the
// usage of its final chunk, if any.
func streamText(t testing.TB, events []string) (string, *usageJSON) {
	t.Helper()
	var sb strings.Builder
	var usage *usageJSON
	for _, ev := range events[:len(events)-1] {
		var ch responseJSON
		if err := json.Unmarshal([]byte(ev), &ch); err != nil {
			t.Fatalf("chunk %q: %v", ev, err)
		}
		if len(ch.Choices) == 1 {
			sb.WriteString(ch.Choices[0].content())
		}
		if ch.Usage != nil {
			usage = ch.Usage
		}
	}
	return sb.String(), usage
}

// TestConcurrentRequestsUnderKVPressure runs more concurrent work than the
// KV cache holds, so that the engine preempts, and checks every answer is
// whole and the same as the one the request gets alone.
func TestConcurrentRequestsUnderKVPressure(t *testing.T) {
	p := testProfile(t, 512, 48) // 47 usable blocks: 752 tokens
	// Paced at 20× (a decode step is about 0.3 ms), the requests overlap
	// however the client's goroutines are scheduled.
	_, c := startSim(t, Config{Profile: p, Seed: 5, Speedup: 20})
	_, alone := startSim(t, Config{Profile: p, Seed: 5})
	const n, maxTokens = 8, 200
	type result struct {
		i      int
		status int
		body   []byte
		err    error
	}
	body := func(i int, stream bool) map[string]any {
		b := map[string]any{"prompt": fmt.Sprintf("concurrent request number %d", i), "max_tokens": maxTokens, "ignore_eos": true}
		if stream {
			b["stream"], b["stream_options"] = true, map[string]any{"include_usage": true}
		}
		return b
	}
	results := make(chan result, n)
	for i := range n {
		req := c.newRequest(context.Background(), t, "POST", "/v1/completions", body(i, i%2 == 0))
		go func() {
			resp, err := c.hc.Do(req)
			if err != nil {
				results <- result{i: i, err: err}
				return
			}
			defer resp.Body.Close()
			b, err := io.ReadAll(resp.Body)
			results <- result{i, resp.StatusCode, b, err}
		}()
	}
	texts := make([]string, n)
	var prompt, completion int
	for range n {
		r := <-results
		if r.err != nil || r.status != 200 {
			t.Fatalf("request %d: status %d err %v: %s", r.i, r.status, r.err, r.body)
		}
		var u *usageJSON
		if r.i%2 == 0 {
			texts[r.i], u = streamText(t, parseSSE(t, r.body))
		} else {
			var resp responseJSON
			if err := json.Unmarshal(r.body, &resp); err != nil {
				t.Fatalf("request %d: %v", r.i, err)
			}
			texts[r.i], u = resp.Choices[0].content(), resp.Usage
		}
		if u == nil || u.CompletionTokens != maxTokens {
			t.Fatalf("request %d: usage %+v, want %d completion tokens", r.i, u, maxTokens)
		}
		prompt += u.PromptTokens
		completion += u.CompletionTokens
	}

	fams := waitIdle(t, c, "vllm:kv_cache_usage_perc")
	if v, _ := sampleValue(fams, "vllm:num_preemptions_total", nil); v == 0 {
		t.Error("no preemptions: the test did not put the KV cache under pressure")
	}
	for name, want := range map[string]int{"vllm:prompt_tokens_total": prompt, "vllm:generation_tokens_total": completion} {
		if v, _ := sampleValue(fams, name, nil); v != float64(want) {
			t.Errorf("%s = %g, want %d (recomputation after preemption must not count twice)", name, v, want)
		}
	}
	if v, _ := sampleValue(fams, "vllm:request_success_total", map[string]string{"finished_reason": FinishLength}); v != n {
		t.Errorf("request_success_total{length} = %g, want %d", v, n)
	}

	// Preemption by recompute must not change what a request generates:
	// an idle server with the same seed gives each request the same text.
	for i := range n {
		var resp responseJSON
		alone.post(t, "/v1/completions", body(i, false)).ok(t, &resp)
		if got := resp.Choices[0].content(); got != texts[i] {
			t.Errorf("request %d alone generated %q, under pressure %q", i, got, texts[i])
		}
	}
}

func TestSlowFirstTokenFault(t *testing.T) {
	p := testProfile(t, 2048, 512)
	// At 100×, 10 simulated seconds are 100 ms of wall time.
	_, c := startSim(t, Config{Profile: p, Speedup: 100})
	setFaults(t, c, Faults{SlowFirstTokenRate: 1, SlowFirstTokenSeconds: 10})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	start := time.Now()
	_, br := openStream(t, ctx, c, "/v1/completions", map[string]any{"prompt": "slow start", "max_tokens": 3, "ignore_eos": true, "stream": true}, 1)
	if el := time.Since(start); el < 100*time.Millisecond {
		t.Errorf("first token after %v, want at least 100ms", el)
	}
	for {
		ev, err := readEvent(br)
		if err != nil {
			t.Fatalf("reading the rest of the stream: %v", err)
		}
		if ev == "[DONE]" {
			break
		}
	}
}

func TestEngineDeathMidRequest(t *testing.T) {
	p := testProfile(t, 8192, 1024)
	sim, c := startSim(t, Config{Profile: p, Speedup: 10})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	req := c.newRequest(ctx, t, "POST", "/v1/completions", map[string]any{"prompt": "die while I wait", "max_tokens": 8000, "ignore_eos": true})
	type result struct {
		r   httpResult
		err error
	}
	done := make(chan result, 1)
	go func() {
		resp, err := c.hc.Do(req)
		if err != nil {
			done <- result{err: err}
			return
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		done <- result{httpResult{resp.StatusCode, resp.Header, b}, err}
	}()
	if !eventually.Holds(5*time.Second, func() bool { return sim.Engine().Load() == 1 }) {
		t.Fatal("the request never reached the engine")
	}
	setFaults(t, c, Faults{Dead: true})
	t.Cleanup(func() { setFaults(t, c, Faults{}) })
	res := <-done
	if res.err != nil {
		t.Fatalf("request: %v", res.err)
	}
	checkAPIError(t, res.r, 500, "", "")
}

// Kill fails every request in flight, even when the engine is revived
// before its step loop next looks at its queues.
func TestQuickKillReviveFailsInFlightRequests(t *testing.T) {
	p := testProfile(t, 2048, 512)
	// At 0.05×, one step lasts about 130 ms of wall time.
	_, c := startSim(t, Config{Profile: p, Speedup: 0.05})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, br := openStream(t, ctx, c, "/v1/chat/completions", map[string]any{
		"messages": chatMessages("quick death"), "max_tokens": 3, "ignore_eos": true, "stream": true}, 1)
	setFaults(t, c, Faults{Dead: true})
	setFaults(t, c, Faults{})
	var events []string
	for {
		ev, err := readEvent(br)
		if err != nil {
			t.Fatalf("after %d events: %v", len(events), err)
		}
		events = append(events, ev)
		if ev == "[DONE]" {
			break
		}
	}
	if len(events) < 2 || !strings.HasPrefix(events[len(events)-2], `{"error":`) {
		t.Errorf("stream %q survived the engine's death", events)
	}
}

// vLLM's input processor rejects token ids beyond the vocabulary for every
// task ("Token id N is out of vocabulary"), as the simulator's completions
// endpoint does.
func TestEmbeddingsRejectOutOfVocabularyIDs(t *testing.T) {
	_, c := startSim(t, Config{Profile: embeddingProfile(t)})
	for _, in := range []any{[]int{300, vocabSize}, [][]int{{300}, {1 << 20}}} {
		checkAPIError(t, c.post(t, "/v1/embeddings", map[string]any{"input": in}), 400, "", "")
	}
}

// TestRestartResetsCounters: an engine that dies and comes back starts
// its counters from zero, as a restarted vLLM process does, so that a
// client that watches for counter resets (kvgate's prefix index and rate
// estimates) sees the restart.
func TestRestartResetsCounters(t *testing.T) {
	p := testProfile(t, 2048, 512)
	_, c := startSim(t, Config{Profile: p, Speedup: 100})
	chat := func(n int) {
		t.Helper()
		// A request that reaches the engine in the step that finds it
		// dead fails with the requests of its former life: once more.
		for try := 0; ; try++ {
			r := c.post(t, "/v1/chat/completions", map[string]any{"messages": chatMessages("count me"), "max_tokens": n, "ignore_eos": true})
			if r.status == http.StatusOK {
				return
			}
			if try == 3 {
				t.Fatalf("chat: %d %s", r.status, r.body)
			}
		}
	}
	chat(20)
	if got := scrapeCounter(t, c.base, "vllm:generation_tokens_total"); got != 20 {
		t.Fatalf("generation_tokens_total before the restart: %v, want 20", got)
	}
	setFaults(t, c, Faults{Dead: true})
	setFaults(t, c, Faults{})
	chat(3) // served by the revived engine, after it saw its death
	if got := scrapeCounter(t, c.base, "vllm:generation_tokens_total"); got != 3 {
		t.Errorf("generation_tokens_total after the restart: %v, want 3, counted from zero", got)
	}
	if got := scrapeCounter(t, c.base, "vllm:request_success_total"); got != 1 {
		t.Errorf("request_success_total after the restart: %v, want 1", got)
	}
}

// TestRequestIDHeaderNamesTheAnswer: as vLLM does, a chat, completions or
// embeddings request's X-Request-Id becomes its answer's id, after the
// endpoint's prefix; without the header the id is the server's own.
func TestRequestIDHeaderNamesTheAnswer(t *testing.T) {
	_, c := startSim(t, Config{Profile: testProfile(t, 256, 64)})
	_, ce := startSim(t, Config{Profile: embeddingProfile(t)})
	for _, tc := range []struct {
		c      simClient
		path   string
		body   map[string]any
		prefix string
	}{
		{c, "/v1/chat/completions", map[string]any{"messages": chatMessages("hi"), "max_tokens": 2}, "chatcmpl-"},
		{c, "/v1/completions", map[string]any{"prompt": "hi", "max_tokens": 2}, "cmpl-"},
		{ce, "/v1/embeddings", map[string]any{"input": "hi"}, "embd-"},
	} {
		for _, named := range []bool{true, false} {
			req := tc.c.newRequest(context.Background(), t, http.MethodPost, tc.path, tc.body)
			if named {
				req.Header.Set("X-Request-Id", "caller-7-0a1b2c3d")
			}
			resp, err := tc.c.hc.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			var out struct{ ID string }
			err = json.NewDecoder(resp.Body).Decode(&out)
			resp.Body.Close()
			if err != nil || resp.StatusCode != http.StatusOK {
				t.Fatalf("%s: %d %v", tc.path, resp.StatusCode, err)
			}
			if got := out.ID == tc.prefix+"caller-7-0a1b2c3d"; got != named || !strings.HasPrefix(out.ID, tc.prefix) {
				t.Errorf("%s with the header %v: id %q", tc.path, named, out.ID)
			}
		}
	}
}

// TestStreamStartsWithItsFirstToken: as vLLM's, a chat stream's first
// bytes (its headers and its role chunk) leave with the request's first
// token, not at once: a client's time to first token includes the queue
// and the prefill. Stepped by hand: nothing is written before a step.
func TestStreamStartsWithItsFirstToken(t *testing.T) {
	sim, err := New(Config{Profile: testProfile(t, 2048, 512), Seed: 3})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(sim)
	defer srv.Close()
	type answer struct {
		resp *http.Response
		err  error
	}
	got := make(chan answer, 1)
	go func() {
		resp, err := http.Post(srv.URL+"/v1/chat/completions", "application/json", strings.NewReader(
			`{"model":"`+sim.Model()+`","messages":[{"role":"user","content":"one two three"}],"max_tokens":3,"stream":true}`))
		got <- answer{resp, err}
	}()
	eventually.True(t, "the request reaches the engine", func() bool { return sim.Engine().Load() == 1 })
	select {
	case a := <-got:
		if a.err == nil {
			a.resp.Body.Close()
		}
		t.Fatalf("the stream answered before any engine step: %v", a.err)
	case <-time.After(100 * time.Millisecond):
	}
	for !sim.Engine().Idle() {
		sim.Engine().Step()
	}
	a := <-got
	if a.err != nil {
		t.Fatal(a.err)
	}
	defer a.resp.Body.Close()
	first, err := bufio.NewReader(a.resp.Body).ReadString('\n')
	if err != nil || !strings.Contains(first, `"role":"assistant"`) {
		t.Errorf("first line %q, %v: want the role chunk", first, err)
	}
}
