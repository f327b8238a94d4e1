package gateway

import (
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"slices"
	"strings"
	"testing"

	"github.com/kvgate/kvgate/bench/vllmsim"
	"github.com/kvgate/kvgate/gpu"
	"github.com/kvgate/kvgate/scheduler"
)

// TestRenderChatAsTheSimulator: kvgate renders a chat request as the
// simulator's Llama-3 template does, so that its chunks follow the blocks
// the backend caches.
func TestRenderChatAsTheSimulator(t *testing.T) {
	for _, raw := range []string{
		`[{"role":"system","content":"You are terse."},{"role":"user","content":"hi"}]`,
		`[{"role":"user","content":[{"type":"text","text":"one"},{"type":"text","text":"two"}]}]`,
		`[{"role":"user","content":"q"},{"role":"assistant","content":null},{"role":"user","content":"again"}]`,
	} {
		got, ok := renderChat(json.RawMessage(raw))
		if !ok {
			t.Fatalf("%s: not rendered", raw)
		}
		var in []struct {
			Role    string          `json:"role"`
			Content json.RawMessage `json:"content"`
		}
		if err := json.Unmarshal([]byte(raw), &in); err != nil {
			t.Fatal(err)
		}
		msgs := make([]vllmsim.ChatMessage, len(in))
		for i, m := range in {
			msgs[i].Role = m.Role
			var s string
			if json.Unmarshal(m.Content, &s) == nil {
				msgs[i].Content = s
				continue
			}
			var parts []struct{ Text string }
			_ = json.Unmarshal(m.Content, &parts)
			texts := make([]string, len(parts))
			for j, p := range parts {
				texts[j] = p.Text
			}
			msgs[i].Content = strings.Join(texts, "\n")
		}
		if want := vllmsim.RenderChat(msgs, true); got != want {
			t.Errorf("rendered\n%q\nthe simulator renders\n%q", got, want)
		}
	}
	if _, ok := renderChat(json.RawMessage(`{"not":"a list"}`)); ok {
		t.Error("a malformed messages field rendered")
	}
}

// TestPrefixHitsPredictedAndMeasured sends tenants' chats, each with its
// own long system prompt, through kvgate to two simulated backends, and
// compares the hit rate kvgate predicted with the one the simulators
// measured: close, and near what sticking each tenant to one backend
// gives.
func TestPrefixHitsPredictedAndMeasured(t *testing.T) {
	f := startFleet(t, fleetOpts{backends: 2, speedup: 50})
	rng := rand.New(rand.NewPCG(5, 5))
	words := func(n int) string {
		w := make([]string, n)
		for i := range w {
			w[i] = string([]byte{'a' + byte(rng.IntN(26)), 'a' + byte(rng.IntN(26)), 'a' + byte(rng.IntN(26))})
		}
		return " " + strings.Join(w, " ")
	}
	const tenants, turns, sysWords, qWords = 4, 6, 1500, 150
	systems := make([]string, tenants)
	for i := range systems {
		systems[i] = words(sysWords)
	}
	for turn := range turns {
		for tn := range tenants {
			body := fmt.Sprintf(`{"model":%q,"max_tokens":4,"messages":[{"role":"system","content":%q},{"role":"user","content":%q}]}`,
				llama, systems[tn], words(qWords))
			resp, b := f.post(t, "/v1/chat/completions", body)
			if resp.StatusCode != http.StatusOK {
				t.Fatalf("turn %d tenant %d: %d %s", turn, tn, resp.StatusCode, b)
			}
		}
	}
	var hits, queries float64
	for _, u := range f.urls {
		resp, err := http.Get(u + "/metrics")
		if err != nil {
			t.Fatal(err)
		}
		m, err := gpu.ParseEngineMetrics(resp.Body)
		resp.Body.Close()
		if err != nil || !m.HasPrefix {
			t.Fatalf("simulator's prefix counters: %v (present %v)", err, m.HasPrefix)
		}
		hits, queries = hits+m.PrefixHits, queries+m.PrefixQueries
	}
	var predicted, queried float64
	for _, st := range f.sched.PrefixStats() {
		predicted, queried = predicted+st.PredictedHitTokens, queried+st.QueryTokens
	}
	measuredRate, predictedRate := hits/queries, predicted/queried
	// Sticky: every turn after a tenant's first finds its system prompt
	// (1,500 of ~1,660 tokens) cached: 5/6 × 0.9 = 0.75. Spread over both
	// backends, the second turn would miss too: 4/6 × 0.9 = 0.6.
	t.Logf("prefix hit rate: predicted %.3f (%.0f/%.0f tokens), measured %.3f (%.0f/%.0f)",
		predictedRate, predicted, queried, measuredRate, hits, queries)
	if measuredRate < 0.7 {
		t.Errorf("measured hit rate %.3f: tenants' prompts were not kept on the backend caching them", measuredRate)
	}
	if d := predictedRate - measuredRate; d > 0.05 || d < -0.05 {
		t.Errorf("predicted hit rate %.3f is off the measured %.3f", predictedRate, measuredRate)
	}
}

// TestPrefixSpace: two prompts share chunks only where vLLM's block
// hashes would be equal too: not across models (a LoRA adapter is a
// model of its own), cache salts or tools, and not past an image, audio
// or tool call that differs.
func TestPrefixSpace(t *testing.T) {
	system := strings.Repeat("You answer questions about the fleet. ", 12)
	msgs := func(user string) json.RawMessage {
		return json.RawMessage(`[{"role":"system","content":"` + system + `"},{"role":"user","content":` + user + `}]`)
	}
	prefix := func(model string, f reqFields) []uint64 {
		t.Helper()
		p := promptPrefix(&call{ep: epChat, model: model, f: f}, 200)
		if p == nil {
			t.Fatal("no prefix")
		}
		return p.Hashes
	}
	text := msgs(`"` + strings.Repeat("what runs where? ", 8) + `"`)
	base := prefix("llama", reqFields{Messages: text})
	if got := prefix("llama", reqFields{Messages: text}); !slices.Equal(got, base) {
		t.Fatal("one prompt hashed twice differs")
	}
	for name, f := range map[string]struct {
		model string
		f     reqFields
	}{
		"another model (an adapter)": {"llama-lora-sql", reqFields{Messages: text}},
		"a cache salt":               {"llama", reqFields{Messages: text, CacheSalt: json.RawMessage(`"tenant-a"`)}},
		"tools":                      {"llama", reqFields{Messages: text, Tools: json.RawMessage(`[{"type":"function","function":{"name":"f"}}]`)}},
	} {
		if got := prefix(f.model, f.f); got[0] == base[0] {
			t.Errorf("%s: shares its first chunk with the plain prompt", name)
		}
	}
	// Content past the shared system prompt: equal up to it, apart after.
	image := func(url string) json.RawMessage {
		return msgs(`[{"type":"text","text":"what is this?"},{"type":"image_url","image_url":{"url":"` + url + `"}}]`)
	}
	calls := func(args string) json.RawMessage {
		return json.RawMessage(`[{"role":"system","content":"` + system + `"},{"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function","function":{"name":"f","arguments":"` +
			args + `"}}]},{"role":"user","content":"` + strings.Repeat("and then? ", 10) + `"}]`)
	}
	for name, pair := range map[string][2]json.RawMessage{
		"another image":     {image("data:image/png;base64,AAAA"), image("data:image/png;base64,BBBB")},
		"another tool call": {calls(`{\"x\":1}`), calls(`{\"x\":2}`)},
	} {
		a, b := prefix("llama", reqFields{Messages: pair[0]}), prefix("llama", reqFields{Messages: pair[1]})
		shared := 0
		for shared < min(len(a), len(b)) && a[shared] == b[shared] {
			shared++
		}
		if whole := len(system) / scheduler.PrefixChunkBytes; shared < whole-1 || shared == min(len(a), len(b)) {
			t.Errorf("%s: %d chunks shared of %d and %d, want the system prompt's (about %d) and no more", name, shared, len(a), len(b), whole)
		}
	}
}

// TestImagePromptEstimate: an image in a chat prompt counts as a typical
// image's tokens, not as the bytes of its data URL (800 KB read as some
// 270,000 tokens was refused as too large for the context, or charged to
// the tenant's TPM); and its reported prompt tokens do not teach the
// estimate its model's tokens per byte of text.
func TestImagePromptEstimate(t *testing.T) {
	photo := "data:image/jpeg;base64," + strings.Repeat("QUFB", 200_000) // 800 KB
	msgs := `[{"role":"user","content":[{"type":"text","text":"What is in this photo?"},{"type":"image_url","image_url":{"url":"` + photo + `"}}]}]`
	size, media := promptSize(json.RawMessage(msgs))
	if media != 1 || size > mediaPartBytes+200 {
		t.Errorf("promptSize of a question and an 800 KB image: %d bytes, %d media parts; want about %d, 1", size, media, mediaPartBytes)
	}
	if size, media := promptSize(json.RawMessage(`[{"role":"user","content":[{"type":"text","text":"one"},{"type":"text","text":"two"}]}]`)); media != 0 || size < 50 {
		t.Errorf("text parts: %d bytes, %d media parts; want their bytes, none", size, media)
	}
	// The simulator serves text-only models (it refuses images, as vLLM
	// does for one): this backend answers as a vision model would.
	f := startFleet(t, fleetOpts{speedup: 50, wrap: func(_ int, h http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.Method != http.MethodPost || r.URL.Path != "/v1/chat/completions" {
				h.ServeHTTP(w, r)
				return
			}
			_, _ = io.Copy(io.Discard, r.Body)
			w.Header().Set("Content-Type", "application/json")
			_, _ = io.WriteString(w, `{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":"`+llama+
				`","choices":[{"index":0,"message":{"role":"assistant","content":"a cat"},"finish_reason":"stop"}],`+
				`"usage":{"prompt_tokens":1480,"completion_tokens":2,"total_tokens":1482}}`)
		})
	}})
	before := f.api.est.estimate(llama, 1000)
	for i := range 3 {
		resp, body := f.post(t, "/v1/chat/completions", `{"model":"`+llama+`","max_tokens":4,"messages":`+strings.Replace(msgs, "this photo", fmt.Sprint("photo ", i), 1)+`}`)
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("a chat with an 800 KB image: %d %.300s", resp.StatusCode, body)
		}
	}
	if after := f.api.est.estimate(llama, 1000); after != before {
		t.Errorf("three image prompts moved the estimate of 1,000 bytes of text from %d to %d tokens", before, after)
	}
}

// TestImageChunksKeepTheTextsTokens: an image counts in the rendered
// prompt as long as in the estimate, so each chunk stands for the tokens
// of 64 bytes of text, with or without an image beside it: the shared
// chunks are not credited with the image's tokens.
func TestImageChunksKeepTheTextsTokens(t *testing.T) {
	system := strings.Repeat("You describe photos for the catalogue. ", 50)
	chunkTokens := func(user string) float64 {
		t.Helper()
		c, err := parseCall([]byte(`{"model":"m","messages":[{"role":"system","content":"`+system+`"},{"role":"user","content":`+user+`}]}`), epChat)
		if err != nil {
			t.Fatal(err)
		}
		p := promptPrefix(c, newEstimator().estimate("m", c.promptBytes))
		if p == nil {
			t.Fatal("no prefix")
		}
		return p.ChunkTokens
	}
	text := chunkTokens(`"what is in it?"`)
	image := chunkTokens(`[{"type":"text","text":"what is in it?"},{"type":"image_url","image_url":{"url":"https://example.com/cat.jpg"}}]`)
	if image < 0.9*text || image > 1.1*text {
		t.Errorf("a chunk stands for %.1f tokens beside an image, %.1f without: want about the same", image, text)
	}
}

// TestEstimateCannotBeSteered: observations outside what text's JSON can
// make (a prompt of escaped spaces that tokenizes to a few tokens) move a
// model's ratio no further than the bound, so one tenant's cheap requests
// cannot halve the estimate of every other tenant's prompts.
func TestEstimateCannotBeSteered(t *testing.T) {
	e := newEstimator()
	e.observe("m", 4000, 1000) // a quarter of a token a byte, as English in JSON
	for range 500 {
		e.observe("m", 60000, 10) // 10,000 escaped spaces: a few tokens
	}
	if got := e.estimate("m", 8000); got < 8000/8 {
		t.Errorf("8,000 bytes estimated at %d tokens after steering, want at least %d", got, 8000/8)
	}
	for range 500 {
		e.observe("m", 10, 10_000)
	}
	if got := e.estimate("m", 8000); got > 8000 {
		t.Errorf("8,000 bytes estimated at %d tokens, want at most one a byte", got)
	}
}
