package gateway

import (
	"bytes"
	"context"
	"encoding/json"
	"net/http"
	"sync"
	"sync/atomic"
	"time"
)

// estimator turns prompt sizes into token counts without a tokenizer: bytes
// of the prompt's JSON times a per-model ratio, learned from the
// prompt_tokens the backends report. It starts high (one token per three
// bytes), so that a cold estimate reserves too much rather than too little.
type estimator struct {
	mu    sync.Mutex
	ratio map[string]float64 // tokens per byte
	seen  map[string]int     // observations per model
	calls atomic.Uint64
}

const (
	initialTokensPerByte = 1.0 / 3
	estimateSmoothing    = 0.1 // weight of each new observation
	// An observation is taken within these bounds: text's JSON runs from
	// about a token per 6 bytes (indented code, escapes) to a token per
	// byte (CJK, base64). Outside them it is a prompt built to steer the
	// estimate (a run of escaped spaces the tokenizer makes one token of),
	// which would otherwise drag every tenant's estimate for the model
	// down, and their reservations under what their prompts take.
	minTokensPerByte = 1.0 / 8
	maxTokensPerByte = 1.0
)

func newEstimator() *estimator {
	return &estimator{ratio: map[string]float64{}, seen: map[string]int{}}
}

// Streams carry usage only when asked, and asking costs every stream a
// rewritten body and an extra event. The estimate needs a sample, not
// every stream: all of them while a model has few observations, then one
// in sampleEvery.
const (
	warmObservations = 32
	sampleEvery      = 16
)

// wantSample reports whether a stream of model should ask for usage.
func (e *estimator) wantSample(model string) bool {
	e.mu.Lock()
	n := e.seen[model]
	e.mu.Unlock()
	return n < warmObservations || e.calls.Add(1)%sampleEvery == 0
}

func (e *estimator) estimate(model string, n int) int {
	e.mu.Lock()
	r, ok := e.ratio[model]
	e.mu.Unlock()
	if !ok {
		r = initialTokensPerByte
	}
	return max(1, int(float64(n)*r+0.5))
}

// mediaPartBytes is what one image, audio or video part of a prompt
// counts as: its bytes (a data URL runs to megabytes) say nothing of the
// tokens the model's encoder makes of it, so each counts as about a
// thousand tokens' worth of text, the size of a typical image's.
const mediaPartBytes = 4096

// textParts are the content parts that are text, whose bytes count.
var textParts = map[string]bool{"text": true, "input_text": true, "output_text": true, "refusal": true}

// promptSize sizes a chat request's messages or a Responses request's
// input for the estimate: their bytes, but each content part that is not
// text (an image, audio, video or file) as mediaPartBytes; media says how
// many such parts there were.
func promptSize(raw json.RawMessage) (size, media int) {
	size = len(raw)
	if !bytes.Contains(raw, []byte(`"type"`)) {
		return size, 0 // no content parts: the common case, not decoded
	}
	var items []struct {
		Content json.RawMessage `json:"content"`
	}
	if json.Unmarshal(raw, &items) != nil {
		return size, 0
	}
	for _, it := range items {
		var parts []json.RawMessage
		if json.Unmarshal(it.Content, &parts) != nil {
			continue
		}
		for _, p := range parts {
			var part struct {
				Type string `json:"type"`
			}
			if json.Unmarshal(p, &part) == nil && part.Type != "" && !textParts[part.Type] {
				size += mediaPartBytes - len(p)
				media++
			}
		}
	}
	return max(size, 1), media
}

// observe corrects the model's ratio with a reported count.
func (e *estimator) observe(model string, n, tokens int) {
	if n <= 0 || tokens <= 0 {
		return
	}
	obs := min(max(float64(tokens)/float64(n), minTokensPerByte), maxTokensPerByte)
	e.mu.Lock()
	defer e.mu.Unlock()
	e.seen[model]++
	r, ok := e.ratio[model]
	if !ok {
		e.ratio[model] = obs
		return
	}
	e.ratio[model] = r + estimateSmoothing*(obs-r)
}

// countPrompt counts the call's prompt tokens: exactly through a backend's
// /tokenize when so configured (falling back to the estimate if that
// fails), by estimate otherwise. exact tells which.
func (s *Server) countPrompt(ctx context.Context, c *call) (n int, exact bool) {
	est := s.est.estimate(c.model, c.promptBytes)
	if s.cfg.TokenCount != "tokenize" || (c.ep != epChat && c.ep != epCompletion) {
		return est, false
	}
	for _, sn := range s.pool.Snapshots() {
		if _, ok := sn.Serves(c.model); !ok || !sn.Routable() {
			continue
		}
		if n, err := s.tokenize(ctx, sn.URL, c); err == nil {
			return n, true
		}
		break
	}
	return est, false
}

func (s *Server) tokenize(ctx context.Context, base string, c *call) (int, error) {
	req := map[string]json.RawMessage{"model": mustJSON(c.model)}
	if c.ep == epChat {
		req["messages"] = c.f.Messages
		if toolBytes(c.f.Tools) > 0 {
			req["tools"] = c.f.Tools // the template renders them
		}
	} else {
		req["prompt"] = c.f.Prompt
	}
	body, _ := json.Marshal(req)
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	hr, err := http.NewRequestWithContext(ctx, http.MethodPost, base+"/tokenize", bytes.NewReader(body))
	if err != nil {
		return 0, err
	}
	hr.Header.Set("Content-Type", "application/json")
	nameBackendCall(hr, RequestID(ctx))
	resp, err := s.client.Do(hr)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	var out struct {
		Count int `json:"count"`
	}
	if resp.StatusCode != http.StatusOK {
		return 0, &upstreamError{status: resp.StatusCode, msg: "tokenize failed"}
	}
	if err := json.NewDecoder(resp.Body).Decode(&out); err != nil {
		return 0, err
	}
	return out.Count, nil
}

func mustJSON(v any) json.RawMessage {
	b, _ := json.Marshal(v)
	return b
}
