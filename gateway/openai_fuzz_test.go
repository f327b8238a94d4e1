package gateway

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvgate/kvgate/bench/vllmsim"
	"github.com/kvgate/kvgate/gpu"
	"github.com/kvgate/kvgate/scheduler"
)

// The fuzz targets' gateways authenticate one key, so that they test
// the API as a tenant meets it rather than the development mode.
const fuzzKey, fuzzTenant = "sk-fuzz", "fuzz"

var fuzzAuth = Config{APIKeys: map[string]string{fuzzKey: fuzzTenant}}

// inferenceSeeds are request bodies for each endpoint: the shapes clients
// send, and the edges parseCall decides on.
var inferenceSeeds = []struct {
	ep   endpoint
	body string
}{
	{epChat, `{"model":"` + llama + `","messages":[{"role":"user","content":"hi"}],"max_tokens":4}`},
	{epChat, `{"model":"` + llama + `","messages":[{"role":"system","content":"be brief"},{"role":"user","content":[{"type":"text","text":"hi"}]}],"max_completion_tokens":3,"stream":true,"stream_options":{"include_usage":true}}`},
	{epChat, `{"model":"` + llama + `","messages":[{"role":"user","content":"hi"}],"stream":true,"max_tokens":2}`},
	{epChat, `{"model":"` + llama + `","messages":[{"role":"user","content":"hi"}],"n":2,"max_tokens":2}`},
	{epChat, `{"model":"` + llama + `","messages":[],"max_tokens":"many"}`},
	{epChat, `{"model":"` + llama + `","messages":[{"role":"user","content":"hi"}],"stream_options":{"include_usage":true}}`},
	{epChat, `{"model":"` + llama + `","messages":[{"role":"user","content":"hi"}],"stream":true,"stream_options":{"include_usage":null}}`},
	{epChat, `{"model":"` + llama + `","messages":[{"role":"user","content":"hi"}],"stream":true,"stream_options":"x"}`},
	{epChat, `{"model":"nope","messages":[{"role":"user","content":"hi"}]}`},
	{epChat, `{"messages":[{"role":"user","content":"hi"}]}`},
	{epChat, `{"model":`},
	{epCompletion, `{"model":"` + llama + `","prompt":"once upon a time","max_tokens":5}`},
	{epCompletion, `{"model":"` + llama + `","prompt":["a","b","c"],"max_tokens":2}`},
	{epCompletion, `{"model":"` + llama + `","prompt":[[1,2,3],[4,5]],"max_tokens":2,"stream":true}`},
	{epCompletion, `{"model":"` + llama + `","prompt":[1,2,3],"max_tokens":9000}`},
	{epCompletion, `{"model":"` + llama + `","prompt":"a","max_tokens":0}`},
	{epCompletion, `{"model":"` + llama + `","prompt":null}`},
	{epEmbedding, `{"model":"` + llama + `","input":"embed me"}`},
	{epEmbedding, `{"model":"` + llama + `","input":["a","b"]}`},
	{epEmbedding, `{"model":"` + llama + `","input":""}`},
}

// FuzzInferenceRequest sends arbitrary bodies to the chat, completions
// and embeddings endpoints of a gateway in front of a simulated backend.
// A body parseCall refuses must come back from the real handler as the
// same 4xx in OpenAI's error shape; a body it takes must give a sane
// admission reservation (a prompt estimate of at least one token and at
// most one per byte, at least one output token per sequence, no overflow)
// from the fields as the backend reads them, and the handler answers it
// without a 5xx (see vllmShapedKeys for the one exception).
func FuzzInferenceRequest(f *testing.F) {
	p := llamaProfile(f)
	p.NumGPUBlocks, p.MaxModelLen = 1024, 8192 // 16k tokens of KV: large requests are refused quickly
	fl := startFleet(f, fleetOpts{profile: p, gateway: fuzzAuth})
	model, ok := fl.api.lookupModel(llama)
	if !ok {
		f.Fatalf("the simulator does not serve %s", llama)
	}
	for _, s := range inferenceSeeds {
		f.Add(uint8(s.ep), []byte(s.body))
	}
	f.Fuzz(func(t *testing.T, epn uint8, body []byte) {
		ep := endpoint(epn % 3)
		c, perr := parseCall(body, ep)
		if perr != nil {
			if e := toAPIError(perr); e.status < 400 || e.status > 499 {
				t.Fatalf("parseCall refused the body with %d: %v", e.status, perr)
			}
		} else {
			checkReadAsBackend(t, c, body)
			checkReservation(t, fl.api, c, model, body)
		}

		rec := httptest.NewRecorder()
		req := httptest.NewRequest(http.MethodPost, endpointPath[ep], bytes.NewReader(body))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Authorization", "Bearer "+fuzzKey)
		fl.api.ServeHTTP(rec, req)
		switch {
		case perr != nil:
			if want := toAPIError(perr).status; rec.Code != want {
				t.Fatalf("parseCall refused the body with %d, the handler answered %d: %s", want, rec.Code, rec.Body.Bytes())
			}
			checkOpenAIError(t, rec.Code, rec.Header(), rec.Body.Bytes())
		case rec.Code >= 500 && vllmShapedKeys(body):
			// The simulator is healthy and idle: a 5xx is the request's doing.
			t.Fatalf("a request kvgate took got %d: %s", rec.Code, rec.Body.Bytes())
		case rec.Code >= 400:
			checkOpenAIError(t, rec.Code, rec.Header(), rec.Body.Bytes())
		}
	})
}

// checkReadAsBackend fails t unless parseCall read the fields admission
// uses as the backend will: vLLM's JSON objects are dictionaries, whose
// keys match exactly (the last of a repeated key wins, as in Go).
// Admitting on a field the backend ignores ("MAX_TOKENS": 1) would
// reserve less than it runs.
func checkReadAsBackend(t *testing.T, c *call, body []byte) {
	t.Helper()
	var m map[string]json.RawMessage
	if err := json.Unmarshal(body, &m); err != nil {
		t.Fatalf("parseCall took a body that is not a JSON object: %v", err)
	}
	for name, got := range map[string]any{
		"model": c.f.Model, "max_tokens": c.f.MaxTokens, "max_completion_tokens": c.f.MaxCompletionTokens,
		"n": c.f.N, "stream": c.f.Stream, "messages": c.f.Messages, "prompt": c.f.Prompt, "input": c.f.Input,
	} {
		b, _ := json.Marshal(got)
		want := []byte("null")
		if raw, ok := m[name]; ok {
			want = raw
		}
		if name == "stream" && string(want) == "null" {
			want = []byte("false")
		}
		if !jsonEqual(b, want) {
			t.Fatalf("parseCall read %s as %s; the backend reads %s", name, b, want)
		}
	}
	var opts map[string]json.RawMessage
	_ = json.Unmarshal(m["stream_options"], &opts)
	var usage *bool
	if c.f.StreamOptions != nil {
		usage = c.f.StreamOptions.IncludeUsage
	}
	want, ok := opts["include_usage"]
	switch {
	case !ok:
		want = json.RawMessage("null") // absent: vLLM's default
	case string(want) == "null":
		want = json.RawMessage("false") // Pydantic's None, which vLLM reads as false
	}
	if got, _ := json.Marshal(usage); !jsonEqual(got, want) {
		t.Fatalf("parseCall read stream_options.include_usage as %s; the backend reads %s", got, opts["include_usage"])
	}
}

// vllmShapedKeys reports whether every top-level key of the JSON object
// body is snake_case ASCII, as all of vLLM's request fields are. The
// simulator decodes with encoding/json, which, unlike vLLM, also takes
// "streAm" for stream (and answers an event stream kvgate did not ask
// for); for other keys the simulator is no stand-in for vLLM.
func vllmShapedKeys(body []byte) bool {
	var m map[string]json.RawMessage
	if json.Unmarshal(body, &m) != nil {
		return false
	}
	for k := range m {
		if strings.TrimLeft(k, "abcdefghijklmnopqrstuvwxyz0123456789_") != "" {
			return false
		}
	}
	return true
}

// checkReservation fails t unless admission would reserve a sane amount
// for c: what parseCall read is consistent with the body (its prompt no
// larger than the body, each media part counted as mediaPartBytes), the
// prompt estimate is between one token and one per byte, and the output reserved
// is at least one token per sequence (none for embeddings) and no
// arithmetic wrapped.
func checkReservation(t *testing.T, s *Server, c *call, model gpu.Model, body []byte) {
	t.Helper()
	if c.model == "" || c.sequences < 1 || c.sequences > maxReservation || c.promptBytes < 1 || c.promptBytes > len(body)+c.media*mediaPartBytes {
		t.Fatalf("call model %q, %d sequences, %d prompt bytes from %d bytes", c.model, c.sequences, c.promptBytes, len(body))
	}
	if c.f.N != nil && c.sequences < min(*c.f.N, maxReservation) {
		t.Fatalf("%d sequences for n = %d", c.sequences, *c.f.N)
	}
	prompt := newEstimator().estimate(c.model, c.promptBytes)
	if prompt < 1 || prompt > c.promptBytes {
		t.Fatalf("estimate %d tokens for %d bytes", prompt, c.promptBytes)
	}
	total, maxOut := s.reservationWith(c, model, prompt)
	if c.ep == epEmbedding {
		if total != prompt || maxOut != 0 {
			t.Fatalf("embedding reserves %d, %d output; want %d, 0", total, maxOut, prompt)
		}
		return
	}
	if maxOut < c.sequences || maxOut > maxReservation || total != prompt+maxOut {
		t.Fatalf("reservation %d with %d output for a %d-token prompt and %d sequences", total, maxOut, prompt, c.sequences)
	}
}

// checkOpenAIError fails t unless status and body are an error in
// OpenAI's shape: a JSON object whose error has a message and a type.
func checkOpenAIError(t *testing.T, status int, h http.Header, body []byte) {
	t.Helper()
	if status < 400 {
		t.Fatalf("status %d for an error", status)
	}
	if ct := h.Get("Content-Type"); ct != "application/json" {
		t.Fatalf("error with Content-Type %q: %s", ct, body)
	}
	var e struct {
		Error *struct {
			Message string `json:"message"`
			Type    string `json:"type"`
		} `json:"error"`
	}
	if err := json.Unmarshal(body, &e); err != nil || e.Error == nil || e.Error.Message == "" || e.Error.Type == "" {
		t.Fatalf("%d without an OpenAI error body (%v): %s", status, err, body)
	}
}

// streamBody is an upstream response body that hands out its bytes in
// the pieces cuts asks for (a cut of 0 is a read of nothing), then ends
// with end.
type streamBody struct {
	b    []byte
	cuts []byte
	end  error
}

func (s *streamBody) Read(p []byte) (int, error) {
	if len(s.b) == 0 {
		return 0, s.end
	}
	n := len(s.b)
	if len(s.cuts) > 0 {
		n = min(n, int(s.cuts[0]%64))
		s.cuts = s.cuts[1:]
	}
	n = copy(p, s.b[:n])
	s.b = s.b[n:]
	return n, nil
}

func (s *streamBody) Close() error { return nil }

// streamTransport answers every request with body as an event stream.
type streamTransport struct{ body *streamBody }

func (t streamTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	return &http.Response{
		StatusCode: http.StatusOK, Proto: "HTTP/1.1", ProtoMajor: 1, ProtoMinor: 1, Request: r,
		Header: http.Header{"Content-Type": {"text/event-stream"}}, Body: t.body, ContentLength: -1,
	}, nil
}

// simStream is the event stream the simulator answers a streaming chat
// request with, usage included.
func simStream(tb testing.TB) []byte {
	_, srv := vllmsim.NewTestServer(tb, vllmsim.Config{Profile: llamaProfile(tb), Seed: 3})
	resp, err := http.Post(srv.URL+"/v1/chat/completions", "application/json", strings.NewReader(
		`{"model":"`+llama+`","messages":[{"role":"user","content":"hi"}],"max_tokens":3,"ignore_eos":true,"stream":true,"stream_options":{"include_usage":true}}`))
	if err != nil {
		tb.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil || resp.StatusCode != http.StatusOK {
		tb.Fatalf("simulator stream: %d, %v: %s", resp.StatusCode, err, b)
	}
	return b
}

// FuzzStreamRelay relays arbitrary upstream event streams, read in
// arbitrary pieces, to a client. Whatever the upstream sends, the client
// gets either nothing (and the caller's JSON error, as for any backend
// failing before its first byte) or a well-formed event stream: complete
// events only, each ended by a blank line, made of the upstream's own
// bytes in order, and ending with [DONE] when the relay reports success or
// with an OpenAI-shaped error event when it does not.
func FuzzStreamRelay(f *testing.F) {
	const chunk = `data: {"id":"c1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"hi"}}]}` + "\n\n"
	const usage = `data: {"id":"c1","object":"chat.completion.chunk","choices":[],"usage":{"prompt_tokens":5,"completion_tokens":1}}` + "\n\n"
	for _, s := range []string{
		string(simStream(f)),
		chunk + usage + "data: [DONE]\n\n",
		chunk + chunk,                    // cut before [DONE]
		chunk + `data: {"id":"c1","choi`, // cut mid-event
		strings.ReplaceAll(chunk+"data: [DONE]\n\n", "\n", "\r\n"),
		": keep-alive\n\n" + chunk + "data:[DONE]\n\n",
		"event: message\ndata: {\"choices\":\ndata: [{}]}\n\n" + "data: [DONE]\n\n",
		"data: " + strings.Repeat("x", 9000) + "\n\n" + "data: [DONE]\n\n",
		chunk + `data: {"error":{"message":"engine dead","type":"server_error"}}` + "\n\n",
		"data: [DONE]\n\ndata: after\n\n",
		"not an event stream at all",
		"",
	} {
		f.Add([]byte(s), []byte{7, 1, 0, 63, 2}, false, false)
		f.Add([]byte(s), []byte{}, true, true)
	}
	pool, err := gpu.NewPool([]gpu.BackendConfig{{Name: "fuzz", URL: "http://fuzz.invalid"}}, gpu.PoolConfig{})
	if err != nil {
		f.Fatal(err)
	}
	c, err := parseCall([]byte(`{"model":"`+llama+`","messages":[{"role":"user","content":"hi"}],"stream":true}`), epChat)
	if err != nil {
		f.Fatal(err)
	}
	f.Fuzz(func(t *testing.T, stream, cuts []byte, injected, reset bool) {
		s, err := New(Config{Dev: true}, pool, nil, prometheus.NewRegistry(), nil)
		if err != nil {
			t.Fatal(err)
		}
		end := io.EOF
		if reset {
			end = io.ErrUnexpectedEOF // the connection broke
		}
		s.client = &http.Client{Transport: streamTransport{&streamBody{b: stream, cuts: cuts, end: end}}}
		rec := httptest.NewRecorder()
		res := s.forward(context.Background(), rec, &scheduler.Grant{Backend: "fuzz", URL: "http://fuzz.invalid"}, c, c.body, injected)
		out := rec.Body.Bytes()
		if !res.wrote {
			if len(out) != 0 || res.err == nil || !res.up.class.retryElsewhere() {
				t.Fatalf("nothing written, yet %d bytes out, err %v, class %s", len(out), res.err, res.up.class)
			}
			writeError(rec, s.log, res.err) // what proxy does when no other backend is left
			checkOpenAIError(t, rec.Code, rec.Header(), rec.Body.Bytes())
			return
		}
		if ct := rec.Header().Get("Content-Type"); !isEventStream(ct) || rec.Code != http.StatusOK {
			t.Fatalf("stream answered %d with Content-Type %q", rec.Code, ct)
		}
		events, partial := parseEventStream(out)
		if len(partial) > 0 || len(events) == 0 {
			t.Fatalf("the client's stream ends inside an event (%q); %d whole events in:\n%q", clip(partial), len(events), clip(out))
		}
		last := events[len(events)-1]
		relayed := out
		if res.err == nil {
			if last.data != "[DONE]" {
				t.Fatalf("a successful stream ends with the event %q, not [DONE]:\n%q", clip([]byte(last.data)), clip(out))
			}
		} else {
			var e struct {
				Error *struct {
					Message string `json:"message"`
					Type    string `json:"type"`
				} `json:"error"`
			}
			if err := json.Unmarshal([]byte(last.data), &e); err != nil || e.Error == nil || e.Error.Message == "" || e.Error.Type == "" {
				t.Fatalf("a failed stream (%v) ends with the event %q, not an OpenAI error:\n%q", res.err, clip([]byte(last.data)), clip(out))
			}
			relayed = out[:len(out)-len(last.raw)]
		}
		// What the client got before kvgate's own error event came from
		// upstream: its prefix, or (when kvgate drops the usage event it
		// asked for) the prefix less whole events.
		if !injected && !bytes.HasPrefix(stream, relayed) {
			t.Fatalf("the client's stream is not a prefix of the upstream's:\n%q\n%q", clip(relayed), clip(stream))
		}
		if injected && !isSubsequence(relayed, stream) {
			t.Fatalf("the client's stream holds bytes the upstream did not send:\n%q\n%q", clip(relayed), clip(stream))
		}
	})
}

// relayedEvent is one event as a client parses it.
type relayedEvent struct {
	data string // the data lines, joined by newlines
	raw  []byte // the event's bytes, its blank line included
}

// parseEventStream splits b into events as the HTML Living Standard's
// event stream parser does (lines end with CRLF, LF or CR; a blank line
// dispatches the event, if it has data), and returns the bytes after the
// last blank line: an event the client would drop unfinished.
func parseEventStream(b []byte) (events []relayedEvent, partial []byte) {
	start := 0
	var data []string
	for i := 0; i < len(b); {
		j := bytes.IndexAny(b[i:], "\r\n")
		if j < 0 {
			break // a line without its end
		}
		line := b[i : i+j]
		next := i + j + 1
		if b[i+j] == '\r' {
			if next == len(b) {
				break // CR at the very end: the LF may follow
			}
			if b[next] == '\n' {
				next++
			}
		}
		i = next
		if len(line) == 0 {
			if data != nil {
				events = append(events, relayedEvent{data: strings.Join(data, "\n"), raw: b[start:i]})
			}
			start, data = i, nil
			continue
		}
		field, value, _ := bytes.Cut(line, []byte(":"))
		value = bytes.TrimPrefix(value, []byte(" "))
		if string(field) == "data" {
			data = append(data, string(value))
		}
	}
	return events, b[start:]
}

// clip shortens b for a failure message.
func clip(b []byte) []byte {
	if len(b) <= 400 {
		return b
	}
	return slices.Concat(b[:200], []byte(" ... "), b[len(b)-200:])
}

// isSubsequence reports whether a's bytes appear in b in order.
func isSubsequence(a, b []byte) bool {
	for _, c := range a {
		i := bytes.IndexByte(b, c)
		if i < 0 {
			return false
		}
		b = b[i+1:]
	}
	return true
}
