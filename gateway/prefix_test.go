package gateway

import (
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net/http"
	"strings"
	"testing"

	"github.com/kvgate/kvgate/bench/vllmsim"
	"github.com/kvgate/kvgate/gpu"
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
