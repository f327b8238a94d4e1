package gateway

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvgate/kvgate/bench/eventually"
	"github.com/kvgate/kvgate/bench/vllmsim"
	"github.com/kvgate/kvgate/gpu"
	"github.com/kvgate/kvgate/scheduler"
	"github.com/kvgate/kvgate/store"
)

func rerankerProfile(t testing.TB) vllmsim.Profile {
	p, err := vllmsim.LookupProfile("h100-bge-reranker-v2-m3")
	if err != nil {
		t.Fatal(err)
	}
	return p
}

const reranker = "BAAI/bge-reranker-v2-m3"

// ledgerOf returns a tenant's ledger for today, summed.
func ledgerOf(t *testing.T, st store.Tenants, tenant string) store.UsageDay {
	t.Helper()
	now := time.Now().UTC()
	days, err := st.Usage(context.Background(), tenant, now.AddDate(0, 0, -1), now.AddDate(0, 0, 1))
	if err != nil {
		t.Fatal(err)
	}
	var sum store.UsageDay
	for _, d := range days {
		sum.Requests += d.Requests
		sum.Attempts += d.Attempts
		sum.Uncertain += d.Uncertain
		sum.PromptTokens += d.PromptTokens
		sum.CompletionTokens += d.CompletionTokens
		sum.ReservedTokens += d.ReservedTokens
		sum.UncertainTokens += d.UncertainTokens
	}
	return sum
}

// TestHealthVersionTokenize: /health and /version answer as vLLM's do,
// without a key; /tokenize and /detokenize need one and pass through to a
// backend of the model, in vLLM's shapes, the model defaulting to the only
// one served; a model nothing serves is a 404.
func TestHealthVersionTokenize(t *testing.T) {
	f := startFleet(t, fleetOpts{speedup: 50, keysRequired: true, gateway: Config{APIKeys: map[string]string{"sk-a": "acme"}, Version: "1.2.3"}})
	resp, b := send(t, f.srv.URL, http.MethodGet, "/health", "", "")
	if resp.StatusCode != http.StatusOK || len(b) != 0 {
		t.Errorf("/health: %d %q", resp.StatusCode, b)
	}
	resp, b = send(t, f.srv.URL, http.MethodGet, "/version", "", "")
	if resp.StatusCode != http.StatusOK || strings.TrimSpace(string(b)) != `{"version":"1.2.3"}` {
		t.Errorf("/version: %d %s", resp.StatusCode, b)
	}

	if resp, b := send(t, f.srv.URL, http.MethodPost, "/tokenize", "", `{"prompt":"hi"}`); resp.StatusCode != http.StatusUnauthorized {
		t.Errorf("/tokenize without a key: %d %s", resp.StatusCode, b)
	}
	var tok struct {
		Count       int   `json:"count"`
		MaxModelLen int   `json:"max_model_len"`
		Tokens      []int `json:"tokens"`
	}
	for _, body := range []string{`{"model":"` + llama + `","prompt":"hello there"}`, `{"prompt":"hello there"}`} {
		resp, b = send(t, f.srv.URL, http.MethodPost, "/tokenize", "sk-a", body)
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("/tokenize %s: %d %s", body, resp.StatusCode, b)
		}
		tok = decode[struct {
			Count       int   `json:"count"`
			MaxModelLen int   `json:"max_model_len"`
			Tokens      []int `json:"tokens"`
		}](t, b)
		if want := vllmsim.Tokenize("hello there", true); tok.Count != len(want) || len(tok.Tokens) != len(want) || tok.MaxModelLen != f.sims[0].Engine().Profile().MaxModelLen {
			t.Errorf("/tokenize %s: %s", body, b)
		}
	}
	resp, b = send(t, f.srv.URL, http.MethodPost, "/tokenize", "sk-a", `{"model":"`+llama+`","messages":[{"role":"user","content":"hi"}]}`)
	if resp.StatusCode != http.StatusOK || decode[struct{ Count int }](t, b).Count < 3 {
		t.Errorf("/tokenize messages: %d %s", resp.StatusCode, b)
	}
	ids, _ := json.Marshal(tok.Tokens[1:]) // without begin_of_text
	resp, b = send(t, f.srv.URL, http.MethodPost, "/detokenize", "sk-a", `{"model":"`+llama+`","tokens":`+string(ids)+`}`)
	if resp.StatusCode != http.StatusOK || decode[struct{ Prompt string }](t, b).Prompt != "hello there" {
		t.Errorf("/detokenize: %d %s", resp.StatusCode, b)
	}
	resp, b = send(t, f.srv.URL, http.MethodPost, "/tokenize", "sk-a", `{"model":"nope","prompt":"x"}`)
	if e := errorKeys(t, "unknown model", b); resp.StatusCode != http.StatusNotFound || e["code"] != "model_not_found" {
		t.Errorf("/tokenize unknown model: %d %s", resp.StatusCode, b)
	}
	// The backend's own refusal passes on, in OpenAI's shape.
	resp, b = send(t, f.srv.URL, http.MethodPost, "/detokenize", "sk-a", `{"tokens":[999999999]}`)
	if e := errorKeys(t, "bad token", b); resp.StatusCode != http.StatusBadRequest || e["type"] != "invalid_request_error" {
		t.Errorf("/detokenize out of vocabulary: %d %s", resp.StatusCode, b)
	}

	// Every backend dead: /health says 503, with an empty body.
	f.sims[0].SetFaults(vllmsim.Faults{Dead: true})
	eventually.True(t, "/health answers 503 once the only backend is dead", func() bool {
		resp, b := send(t, f.srv.URL, http.MethodGet, "/health", "", "")
		return resp.StatusCode == http.StatusServiceUnavailable && len(b) == 0
	})
}

// TestResponsesOverHTTP: /v1/responses passes through to the simulator,
// unknown fields included, with the "error": null that vLLM leaves out;
// its usage lands in the tenant's ledger; a stream relays vLLM's typed
// events in order, ends with response.completed (no [DONE]), and charges
// the tenant what response.completed reports.
func TestResponsesOverHTTP(t *testing.T) {
	st := sqliteStore(t)
	f := startFleet(t, fleetOpts{store: st, speedup: 50, keysRequired: true, gateway: Config{Tenants: Tenants{Store: st}}})
	key := newTenant(t, st, "acme", store.Limits{TPM: 100_000}, store.RoleUser)
	body := `{"model":"` + llama + `","input":[{"role":"user","content":[{"type":"input_text","text":"Say hi."}]}],` +
		`"instructions":"Be terse.","max_output_tokens":6,"ignore_eos":true,"metadata":{"k":"v"}}`
	resp, b := send(t, f.srv.URL, http.MethodPost, "/v1/responses", key, body)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("responses: %d %s", resp.StatusCode, b)
	}
	var r map[string]json.RawMessage
	if err := json.Unmarshal(b, &r); err != nil {
		t.Fatal(err)
	}
	if string(r["error"]) != "null" || string(r["object"]) != `"response"` || string(r["metadata"]) != `{"k":"v"}` {
		t.Errorf("response: %s", b)
	}
	// vLLM's nulls for what the SDKs declare optional, not nullable, are
	// left out; the rest passes as the backend sent it.
	for _, k := range []string{"user", "text"} {
		if v, ok := r[k]; ok {
			t.Errorf("%s: %s, want it left out", k, v)
		}
	}
	if string(r["max_tool_calls"]) != "null" || strings.Contains(string(r["output"]), `"logprobs"`) {
		t.Errorf("response: %s", b)
	}
	if resp.Header.Get("x-ratelimit-limit-tokens") != "100000" {
		t.Errorf("x-ratelimit-limit-tokens = %q", resp.Header.Get("x-ratelimit-limit-tokens"))
	}
	var u struct{ InputTokens, OutputTokens int }
	u2 := decode[struct {
		Usage struct {
			InputTokens  int `json:"input_tokens"`
			OutputTokens int `json:"output_tokens"`
		} `json:"usage"`
	}](t, b).Usage
	u.InputTokens, u.OutputTokens = u2.InputTokens, u2.OutputTokens
	if u.OutputTokens != 6 || u.InputTokens < 5 {
		t.Errorf("usage: %+v", u)
	}
	// The permit is released after the answer went out.
	eventually.True(t, "the response's usage lands in the ledger", func() bool {
		got := ledgerOf(t, st, "acme")
		return got.PromptTokens == int64(u.InputTokens) && got.CompletionTokens == 6 && got.ReservedTokens == 0
	})

	// Streaming.
	req, _ := http.NewRequest(http.MethodPost, f.srv.URL+"/v1/responses", strings.NewReader(strings.Replace(body, `"ignore_eos":true`, `"ignore_eos":true,"stream":true`, 1)))
	req.Header.Set("Authorization", "Bearer "+key)
	req.Header.Set("Content-Type", "application/json")
	hr, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer hr.Body.Close()
	if hr.StatusCode != http.StatusOK || !strings.HasPrefix(hr.Header.Get("Content-Type"), "text/event-stream") {
		b, _ := io.ReadAll(hr.Body)
		t.Fatalf("stream: %d %s", hr.StatusCode, b)
	}
	var types []string
	sc := bufio.NewScanner(hr.Body)
	event := ""
	var completed map[string]json.RawMessage
	for sc.Scan() {
		line := sc.Text()
		if rest, ok := strings.CutPrefix(line, "event: "); ok {
			event = rest
			continue
		}
		rest, ok := strings.CutPrefix(line, "data: ")
		if !ok {
			continue
		}
		var ev struct {
			Type     string                     `json:"type"`
			Seq      int                        `json:"sequence_number"`
			Response map[string]json.RawMessage `json:"response"`
		}
		if err := json.Unmarshal([]byte(rest), &ev); err != nil {
			t.Fatalf("event %q: %v", rest, err)
		}
		if ev.Type != event || ev.Seq != len(types) {
			t.Errorf("event %q: type %q, sequence %d", event, ev.Type, ev.Seq)
		}
		if ev.Response != nil && (string(ev.Response["error"]) != "null" || ev.Response["user"] != nil || ev.Response["usage"] != nil && string(ev.Response["usage"]) == "null") {
			t.Errorf("%s: the response is not normalized: %s", ev.Type, rest)
		}
		if strings.Contains(rest, `"logprobs":null`) {
			t.Errorf("%s: null logprobs: %s", ev.Type, rest)
		}
		types = append(types, ev.Type)
		if ev.Type == "response.completed" {
			completed = ev.Response
		}
	}
	if len(types) != 4+6+4 || types[0] != "response.created" || types[len(types)-1] != "response.completed" || completed == nil {
		t.Fatalf("events: %v", types)
	}
	eventually.True(t, "the stream's usage lands in the ledger", func() bool {
		got := ledgerOf(t, st, "acme")
		return got.CompletionTokens == 12 && got.ReservedTokens == 0 && got.UncertainTokens == 0
	})

	// Bad input: OpenAI-shaped 400s, before anything is charged.
	for _, bad := range []string{`{"model":"` + llama + `"}`, `{"model":"` + llama + `","input":""}`, `{"model":"` + llama + `","input":"x","max_output_tokens":0}`} {
		resp, b := send(t, f.srv.URL, http.MethodPost, "/v1/responses", key, bad)
		if e := errorKeys(t, bad, b); resp.StatusCode != http.StatusBadRequest || e["param"] == nil {
			t.Errorf("%s: %d %s", bad, resp.StatusCode, b)
		}
	}
	if got := ledgerOf(t, st, "acme"); got.Requests != 2 {
		t.Errorf("requests in the ledger: %d, want 2 (bad input is not admitted)", got.Requests)
	}
}

// TestResponsesJob: a durable job may post to /v1/responses (batch lines
// use it): the executor runs it, its result is the Response with its error
// key, and its usage lands in the tenant's ledger.
func TestResponsesJob(t *testing.T) {
	st := sqliteStore(t)
	f := startFleet(t, fleetOpts{store: st, runner: true, speedup: 50, gateway: Config{Tenants: Tenants{Store: st}}})
	body := `{"endpoint":"/v1/responses","body":{"model":"` + llama + `","input":"Say hi.","max_output_tokens":4,"ignore_eos":true}}`
	resp, b := f.post(t, "/v1/jobs", body, "Idempotency-Key", "resp-job")
	if resp.StatusCode != http.StatusAccepted {
		t.Fatalf("submit: %d %s", resp.StatusCode, b)
	}
	id := decode[jobView](t, b).ID
	waitJob(t, f, "default", id, store.Succeeded)
	resp, b = send(t, f.srv.URL, http.MethodGet, "/v1/jobs/"+id+"/result", "", "")
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("result: %d %s", resp.StatusCode, b)
	}
	var out map[string]json.RawMessage
	if err := json.Unmarshal(b, &out); err != nil {
		t.Fatal(err)
	}
	if string(out["object"]) != `"response"` || string(out["error"]) != "null" {
		t.Errorf("result: %s", b)
	}
	eventually.True(t, "the job's usage lands in the ledger", func() bool {
		got := ledgerOf(t, st, "default")
		return got.CompletionTokens == 4 && got.PromptTokens > 0 && got.ReservedTokens == 0
	})
}

// TestRerankAndScoreOverHTTP: /v1/rerank, /rerank, /v1/score and /score
// pass through to a reranker backend in vLLM's shapes; admission reserves
// the prompt only (a tenant whose TPM is below the default output budget
// is admitted), and the ledger charges the prompt tokens the backend
// reports, no completion tokens.
func TestRerankAndScoreOverHTTP(t *testing.T) {
	st := sqliteStore(t)
	f := startFleet(t, fleetOpts{store: st, speedup: 50, keysRequired: true, profile: rerankerProfile(t),
		gateway: Config{Tenants: Tenants{Store: st}, DefaultMaxTokens: 4096}})
	key := newTenant(t, st, "acme", store.Limits{TPM: 1000}, store.RoleUser)
	docs := `["Cats are small carnivores.","vLLM is a fast inference engine.","Paris is in France."]`
	var prompt int64
	for _, path := range []string{"/v1/rerank", "/rerank"} {
		resp, b := send(t, f.srv.URL, http.MethodPost, path, key, `{"model":"`+reranker+`","query":"what is vLLM","documents":`+docs+`,"top_n":2,"extra":"passes"}`)
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("%s: %d %s", path, resp.StatusCode, b)
		}
		out := decode[struct {
			Results []struct {
				Index          int     `json:"index"`
				RelevanceScore float64 `json:"relevance_score"`
			} `json:"results"`
			Usage struct {
				PromptTokens int64 `json:"prompt_tokens"`
			} `json:"usage"`
		}](t, b)
		if len(out.Results) != 2 || out.Results[0].Index != 1 || out.Usage.PromptTokens == 0 {
			t.Errorf("%s: %s", path, b)
		}
		prompt += out.Usage.PromptTokens
	}
	for path, sides := range map[string]string{"/v1/score": `"queries":"what is vLLM","documents":`, "/score": `"text_1":"what is vLLM","text_2":`} {
		resp, b := send(t, f.srv.URL, http.MethodPost, path, key, `{"model":"`+reranker+`",`+sides+docs+`}`)
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("%s: %d %s", path, resp.StatusCode, b)
		}
		out := decode[struct {
			Data []struct {
				Score float64 `json:"score"`
			} `json:"data"`
			Usage struct {
				PromptTokens int64 `json:"prompt_tokens"`
			} `json:"usage"`
		}](t, b)
		if len(out.Data) != 3 || out.Data[1].Score <= out.Data[0].Score {
			t.Errorf("%s: %s", path, b)
		}
		prompt += out.Usage.PromptTokens
	}
	eventually.True(t, "the ledger charges the prompt tokens only", func() bool {
		got := ledgerOf(t, st, "acme")
		return got.PromptTokens == prompt && got.CompletionTokens == 0 && got.Requests == 4 && got.ReservedTokens == 0
	})
	for _, c := range []struct{ path, body, param string }{
		{"/v1/rerank", `{"model":"` + reranker + `","documents":["a"]}`, "query"},
		{"/v1/rerank", `{"model":"` + reranker + `","query":"q","documents":[]}`, "documents"},
		{"/v1/score", `{"model":"` + reranker + `","text_1":"q"}`, "text_2"},
		{"/score", `{"model":"` + reranker + `","text_1":[],"text_2":"d"}`, "text_1"},
		{"/v1/score", `{"model":"` + reranker + `","queries":[],"documents":["d"]}`, "queries"},
		{"/v1/score", `{"model":"` + reranker + `","data_1":"q","data_2":[]}`, "data_2"},
	} {
		resp, b := send(t, f.srv.URL, http.MethodPost, c.path, key, c.body)
		if e := errorKeys(t, c.path, b); resp.StatusCode != http.StatusBadRequest || e["param"] != c.param {
			t.Errorf("%s %s: %d %s", c.path, c.body, resp.StatusCode, b)
		}
	}
	// The metrics count the routes by their own names.
	resp, b := send(t, f.srv.URL, http.MethodGet, "/metrics", "", "")
	for _, route := range []string{`route="/v1/rerank"`, `route="/rerank"`, `route="/v1/score"`, `route="/score"`} {
		if resp.StatusCode != http.StatusOK || !strings.Contains(string(b), route) {
			t.Errorf("/metrics has no %s", route)
		}
	}
}

// TestModelAliases: an alias is listed by /v1/models with the model it
// resolves to, serves requests (the backend sees the model's name), and
// falls back, in order, to the next model when no backend of the first
// is routable; with none routable it is 503 backend_unavailable, and a
// configuration whose alias names an alias is refused.
func TestModelAliases(t *testing.T) {
	f := startFleet(t, fleetOpts{speedup: 50, backends: 2,
		simConfig: func(i int, c *vllmsim.Config) { c.ServedModelName = []string{"primary", "fallback"}[i] },
		gateway:   Config{Models: map[string][]string{"gpt-4o-mini": {"primary", "fallback"}}}})
	chat := `{"model":"gpt-4o-mini","messages":[{"role":"user","content":"hi"}],"max_tokens":2}`
	served := func() string {
		resp, b := f.post(t, "/v1/chat/completions", chat)
		if resp.StatusCode != http.StatusOK {
			return fmt.Sprintf("%d %s", resp.StatusCode, b)
		}
		return decode[struct{ Model string }](t, b).Model
	}
	resp, b := send(t, f.srv.URL, http.MethodGet, "/v1/models", "", "")
	models := decode[list[struct {
		ID   string `json:"id"`
		Root string `json:"root"`
	}]](t, b)
	found := false
	for _, m := range models.Data {
		found = found || (m.ID == "gpt-4o-mini" && m.Root == "primary")
	}
	if resp.StatusCode != http.StatusOK || !found {
		t.Errorf("/v1/models: %s", b)
	}
	// One model by its id, as the SDKs' models.retrieve asks: an alias, a
	// served model whose id holds a slash, sent as it is or escaped.
	for path, want := range map[string]string{
		"/v1/models/gpt-4o-mini":       "gpt-4o-mini",
		"/v1/models/primary":           "primary",
		"/v1/models/no-such-model":     "",
		"/v1/models/gpt-4o-mini/extra": "",
	} {
		resp, b := send(t, f.srv.URL, http.MethodGet, path, "", "")
		m := decode[modelView](t, b)
		if want == "" && (resp.StatusCode != http.StatusNotFound || !strings.Contains(string(b), `"model_not_found"`)) ||
			want != "" && (resp.StatusCode != http.StatusOK || m.ID != want || m.Object != "model") {
			t.Errorf("GET %s: %d %s, want %q", path, resp.StatusCode, b, want)
		}
	}
	if got := served(); got != "primary" {
		t.Errorf("alias served by %q, want primary", got)
	}
	// /tokenize resolves it too: the backend, which knows no alias, answers.
	if resp, b := f.post(t, "/tokenize", `{"model":"gpt-4o-mini","prompt":"hi"}`); resp.StatusCode != http.StatusOK ||
		decode[struct{ Count int }](t, b).Count != len(vllmsim.Tokenize("hi", true)) {
		t.Errorf("/tokenize of the alias: %d %s", resp.StatusCode, b)
	}
	f.sims[0].SetFaults(vllmsim.Faults{Dead: true})
	eventually.True(t, "the alias falls back to its second model", func() bool { return served() == "fallback" })
	f.sims[1].SetFaults(vllmsim.Faults{Dead: true})
	eventually.True(t, "with no model of the alias routable, 503 backend_unavailable", func() bool {
		resp, b := f.post(t, "/v1/chat/completions", chat)
		return resp.StatusCode == http.StatusServiceUnavailable && strings.Contains(string(b), "backend_unavailable")
	})
	f.sims[0].SetFaults(vllmsim.Faults{})
	eventually.True(t, "back to the first model once it is routable again", func() bool { return served() == "primary" })

	if err := checkAliases(map[string][]string{"a": {"b"}, "b": {"c"}}); err == nil {
		t.Error("an alias of an alias was accepted")
	}
	if err := checkAliases(map[string][]string{"a": {}}); err == nil {
		t.Error("an alias without models was accepted")
	}
}

// TestAliasJob: a job may name an alias; it is accepted for the model the
// alias resolves to, and its body reaches the backend with that model.
func TestAliasJob(t *testing.T) {
	f := startFleet(t, fleetOpts{jobs: true, runner: true, speedup: 50,
		gateway: Config{Models: map[string][]string{"gpt-4o-mini": {llama}}}})
	resp, b := f.post(t, "/v1/jobs", `{"endpoint":"/v1/chat/completions","body":{"model":"gpt-4o-mini","messages":[{"role":"user","content":"hi"}],"max_tokens":2}}`,
		"Idempotency-Key", "alias-job")
	if resp.StatusCode != http.StatusAccepted {
		t.Fatalf("submit: %d %s", resp.StatusCode, b)
	}
	j := decode[jobView](t, b)
	if j.Model != llama {
		t.Errorf("the job is for %q, want %q", j.Model, llama)
	}
	waitJob(t, f, "default", j.ID, store.Succeeded)
	resp, b = send(t, f.srv.URL, http.MethodGet, "/v1/jobs/"+j.ID+"/result", "", "")
	if resp.StatusCode != http.StatusOK || decode[struct{ Model string }](t, b).Model != llama {
		t.Errorf("result: %d %s", resp.StatusCode, b)
	}
	resp, b = f.post(t, "/v1/jobs", `{"endpoint":"/v1/chat/completions","body":{"model":"no-such-alias","messages":[{"role":"user","content":"hi"}]}}`,
		"Idempotency-Key", "alias-job-2")
	if e := errorKeys(t, "unknown model", b); resp.StatusCode != http.StatusNotFound || e["param"] != "body.model" {
		t.Errorf("unknown model: %d %s", resp.StatusCode, b)
	}
}

// TestResponsesStreamCut: a backend that cuts a Responses stream after
// its first events ends the client's stream as OpenAI ends a response
// that fails: response.failed, next in sequence, carrying the response
// the stream began with, its status failed and its error set (no
// response.completed, no chat-style error chunk). The tenant stays
// charged the reservation as uncertain usage; a non-streaming call the
// backend cuts is a 502, charged the same way.
func TestResponsesStreamCut(t *testing.T) {
	st := sqliteStore(t)
	f := startFleet(t, fleetOpts{store: st, speedup: 50, keysRequired: true, gateway: Config{Tenants: Tenants{Store: st}}})
	key := newTenant(t, st, "acme", store.Limits{}, store.RoleUser)
	f.sims[0].SetFaults(vllmsim.Faults{DropRate: 1})
	body := `{"model":"` + llama + `","input":"Say hi.","max_output_tokens":20,"ignore_eos":true,"stream":true}`
	resp, b := send(t, f.srv.URL, http.MethodPost, "/v1/responses", key, body)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("stream: %d %s", resp.StatusCode, b)
	}
	events, partial := parseEventStream(b)
	if len(partial) > 0 || len(events) < 2 {
		t.Fatalf("cut stream, %d events:\n%s", len(events), b)
	}
	type event struct {
		Type     string `json:"type"`
		Seq      int64  `json:"sequence_number"`
		Response struct {
			ID     string          `json:"id"`
			Status string          `json:"status"`
			Model  string          `json:"model"`
			Error  json.RawMessage `json:"error"`
		} `json:"response"`
	}
	var first, prev, last event
	for i, e := range events {
		prev = last
		if err := json.Unmarshal([]byte(e.data), &last); err != nil {
			t.Fatalf("event %d %q: %v", i, e.data, err)
		}
		if i == 0 {
			first = last
		}
		if !strings.HasPrefix(string(e.raw), "event: "+last.Type+"\n") {
			t.Errorf("event %d: %q, its event line not its type", i, e.raw)
		}
	}
	var failure struct{ Code, Message string }
	if first.Type != "response.created" || last.Type != "response.failed" || last.Seq != prev.Seq+1 ||
		last.Response.ID != first.Response.ID || last.Response.ID == "" || last.Response.Model != llama ||
		last.Response.Status != "failed" || json.Unmarshal(last.Response.Error, &failure) != nil ||
		failure.Code != "server_error" || !strings.Contains(failure.Message, "failed mid-stream") {
		t.Errorf("cut stream ends with %+v after %+v (first %+v):\n%s", last, prev, first, b)
	}
	if strings.Contains(string(b), "response.completed") || strings.Contains(string(b), `data: {"error"`) {
		t.Errorf("cut stream:\n%s", b)
	}
	eventually.True(t, "the cut stream stays charged as uncertain", func() bool {
		got := ledgerOf(t, st, "acme")
		return got.ReservedTokens == 0 && got.UncertainTokens > 0 && got.CompletionTokens == 0
	})
	before := ledgerOf(t, st, "acme").UncertainTokens
	resp, b = send(t, f.srv.URL, http.MethodPost, "/v1/responses", key, strings.Replace(body, `"stream":true`, `"stream":false`, 1))
	if e := errorKeys(t, "cut answer", b); resp.StatusCode != http.StatusBadGateway || e["type"] != "server_error" {
		t.Errorf("cut answer: %d %s", resp.StatusCode, b)
	}
	eventually.True(t, "the cut answer stays charged as uncertain", func() bool {
		got := ledgerOf(t, st, "acme")
		return got.ReservedTokens == 0 && got.UncertainTokens > before
	})
}

// TestSurfaceReservations: a Responses call reserves its prompt and
// max_output_tokens (never max_tokens, which the API does not have), or
// the default output; rerank and score reserve their prompt only, sized
// by every pair they make.
func TestSurfaceReservations(t *testing.T) {
	s := &Server{cfg: Config{DefaultMaxTokens: 1024}}
	m := gpu.Model{ID: "m", MaxModelLen: 4096}
	for _, c := range []struct {
		ep          endpoint
		body        string
		total, out  int
		promptBytes int
	}{
		{epResponses, `{"model":"m","input":"hi","max_output_tokens":4,"max_tokens":100000}`, 14, 4, len(`"hi"`)},
		{epResponses, `{"model":"m","input":"hi","instructions":"be brief"}`, 1034, 1024, len(`"hi"`) + len(`"be brief"`)},
		{epRerank, `{"model":"m","query":"qq","documents":["a","b","c"],"max_tokens":50}`, 10, 0, 3*len(`"qq"`) + len(`["a","b","c"]`)},
		{epScore, `{"model":"m","text_1":"qq","text_2":["a","b"]}`, 10, 0, 2*len(`"qq"`) + len(`["a","b"]`)},
		{epScore, `{"model":"m","text_1":["q1","q2"],"text_2":["a","b"]}`, 10, 0, len(`["q1","q2"]`) + len(`["a","b"]`)},
		{epScore, `{"model":"m","queries":"qq","items":["a","b"]}`, 10, 0, 2*len(`"qq"`) + len(`["a","b"]`)},
	} {
		call, err := parseCall([]byte(c.body), c.ep)
		if err != nil {
			t.Fatalf("%s: %v", c.body, err)
		}
		total, out := s.reservationWith(call, m, 10)
		if total != c.total || out != c.out || call.promptBytes != c.promptBytes {
			t.Errorf("%s: reserves %d (output %d), prompt bytes %d; want %d (%d), %d", c.body, total, out, call.promptBytes, c.total, c.out, c.promptBytes)
		}
	}
}

// TestResponsesTrail: the relay reads sequence numbers without decoding
// an event, keeps the last response an event carried, and without one
// ends a failed stream with the API's error event.
func TestResponsesTrail(t *testing.T) {
	for data, want := range map[string]int64{
		`{"delta":"\"sequence_number\":99","sequence_number":42,"type":"response.output_text.delta"}`: 42,
		`{"sequence_number": 7}`:                          7,
		`{"type":"response.created","sequence_number":0}`: 0,
	} {
		if n, ok := sequenceNumber([]byte(data)); !ok || n != want {
			t.Errorf("%s: %d, %v; want %d", data, n, ok, want)
		}
	}
	if _, ok := sequenceNumber([]byte(`{"type":"x","sequence_number":null}`)); ok {
		t.Error("a null sequence number read as one")
	}
	var tr responsesTrail
	tr.see([]byte(`{"sequence_number":3,"type":"response.output_text.delta"}`), responsesStreamEvent{})
	if tr.failedEvent(errStreamCut) != nil {
		t.Error("response.failed without a response seen")
	}
	ev := string(tr.errorEvent(errStreamCut))
	want := `event: error` + "\n" + `data: {"code":"upstream_error","message":"The model backend failed mid-stream; the response is incomplete.","param":null,"sequence_number":4,"type":"error"}` + "\n\n"
	if ev != want {
		t.Errorf("error event %q, want %q", ev, want)
	}
}

// TestModelBySlashedID: GET /v1/models/{model} finds a model whose id
// holds a slash (org/name), sent as it is (the Python SDK) or escaped
// (the Node SDK's %2F).
func TestModelBySlashedID(t *testing.T) {
	f := startFleet(t, fleetOpts{backends: 1})
	for _, path := range []string{"/v1/models/" + llama, "/v1/models/" + url.PathEscape(llama)} {
		eventually.True(t, "GET "+path, func() bool {
			resp, b := send(t, f.srv.URL, http.MethodGet, path, "", "")
			return resp.StatusCode == http.StatusOK && decode[modelView](t, b).ID == llama
		})
	}
}

// TestBatchedCompletionReservation: each prompt of a completion with a
// list of prompts runs as a request of its own, with the context its own
// prompt leaves: four prompts of ~1,000 tokens with max_tokens 3,000 in a
// 4,096 context need 4 × (1,000 + 3,000), not the 96 tokens of output that
// the four prompts together leave.
func TestBatchedCompletionReservation(t *testing.T) {
	s := &Server{cfg: Config{DefaultMaxTokens: 1024}}
	m := gpu.Model{ID: "m", MaxModelLen: 4096}
	p := strings.Repeat("x", 4000)
	for _, c := range []struct {
		body          string
		prompt        int
		wantTotal     int
		wantOutputMin int
	}{
		{`{"model":"m","prompt":["` + p + `","` + p + `","` + p + `","` + p + `"],"max_tokens":3000}`, 4000, 16000, 12000},
		// The shortest prompt bounds each output: a long one beside it
		// does not shrink the short one's room.
		{`{"model":"m","prompt":["hi","` + p + p + p + `"],"max_tokens":3000}`, 3000, 9000, 6000},
		{`{"model":"m","prompt":"` + p + `","max_tokens":3000}`, 1000, 4000, 3000},
		{`{"model":"m","prompt":"` + p + `","max_tokens":4000}`, 1000, 4096, 3096}, // what the context leaves
	} {
		call, err := parseCall([]byte(c.body), epCompletion)
		if err != nil {
			t.Fatal(err)
		}
		total, out := s.reservationWith(call, m, c.prompt)
		if total != c.wantTotal || out < c.wantOutputMin {
			t.Errorf("%.60s…: reserves %d (output %d), want %d (output at least %d)", c.body, total, out, c.wantTotal, c.wantOutputMin)
		}
	}
}

// TestToolsCountInThePrompt: a chat request's tools are rendered into its
// prompt by the chat template, so they count in its reservation: sent to
// /tokenize with the messages (the count then matches what the backend
// reports), and in the estimate's bytes.
func TestToolsCountInThePrompt(t *testing.T) {
	tools := `[{"type":"function","function":{"name":"lookup","description":"` + strings.Repeat("find the invoice by its number ", 40) +
		`","parameters":{"type":"object","properties":{"n":{"type":"string"}}}}}]`
	body := `{"model":"` + llama + `","messages":[{"role":"user","content":"hi"}],"tools":` + tools + `,"max_tokens":2}`
	f := startFleet(t, fleetOpts{gateway: Config{TokenCount: "tokenize"}})
	c, err := f.api.readCall(httptest.NewRequest(http.MethodPost, "/v1/chat/completions", strings.NewReader(body)), epChat)
	if err != nil {
		t.Fatal(err)
	}
	if c.promptBytes < len(tools) {
		t.Errorf("the estimate reads %d prompt bytes, fewer than the tools' %d", c.promptBytes, len(tools))
	}
	var prompt int
	eventually.True(t, "an exact count", func() bool {
		model, ok := f.api.lookupModel(llama)
		var exact bool
		prompt, _, exact = f.api.reservation(context.Background(), c, model)
		return ok && exact
	})
	resp, b := f.post(t, "/v1/chat/completions", body)
	var out struct{ Usage usage }
	if err := json.Unmarshal(b, &out); err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("chat with tools: %d %s", resp.StatusCode, b)
	}
	if out.Usage.PromptTokens != prompt || prompt < 300 {
		t.Errorf("reserved %d prompt tokens, the backend counted %d: the tools must count", prompt, out.Usage.PromptTokens)
	}
}

// TestAliasOfItsOwnModel: an alias named like the model it names first
// gives that served model fallbacks. /v1/models lists the name once, as
// the alias; requests for it fall back when its backends go.
func TestAliasOfItsOwnModel(t *testing.T) {
	f := startFleet(t, fleetOpts{speedup: 50, backends: 2,
		simConfig: func(i int, c *vllmsim.Config) { c.ServedModelName = []string{"primary", "fallback"}[i] },
		gateway:   Config{Models: map[string][]string{"primary": {"primary", "fallback"}}}})
	resp, b := send(t, f.srv.URL, http.MethodGet, "/v1/models", "", "")
	models := decode[list[modelView]](t, b)
	var ids []string
	for _, m := range models.Data {
		ids = append(ids, m.ID+"→"+m.Root)
	}
	slices.Sort(ids)
	if resp.StatusCode != http.StatusOK || !slices.Equal(ids, []string{"fallback→", "primary→primary"}) {
		t.Errorf("/v1/models: %d %v, want fallback and the alias primary once", resp.StatusCode, ids)
	}
	chat := `{"model":"primary","messages":[{"role":"user","content":"hi"}],"max_tokens":2}`
	served := func() string {
		resp, b := f.post(t, "/v1/chat/completions", chat)
		if resp.StatusCode != http.StatusOK {
			return fmt.Sprintf("%d %s", resp.StatusCode, b)
		}
		return decode[struct{ Model string }](t, b).Model
	}
	if got := served(); got != "primary" {
		t.Errorf("served by %q, want primary", got)
	}
	f.sims[0].SetFaults(vllmsim.Faults{Dead: true})
	eventually.True(t, "primary falls back", func() bool { return served() == "fallback" })
	resp, b = send(t, f.srv.URL, http.MethodGet, "/v1/models/primary", "", "")
	if m := decode[modelView](t, b); resp.StatusCode != http.StatusOK || m.Root != "fallback" {
		t.Errorf("GET /v1/models/primary: %d %s, want the alias, root fallback", resp.StatusCode, b)
	}
	if err := checkAliases(map[string][]string{"a": {"b"}, "b": {"b", "c"}}); err == nil {
		t.Error("an alias naming another alias (itself named after its model) was accepted")
	}
	if err := checkAliases(map[string][]string{"m": {"other", "m"}}); err == nil {
		t.Error("an alias naming itself after another model was accepted: m would go to other while m is up")
	}
	// The name's price is the model's; a fallback is priced as itself.
	s := &Server{cfg: Config{Models: map[string][]string{"big": {"big", "small"}, "gpt": {"big"}},
		Prices: map[string]Price{"big": {Prompt: 3}, "gpt": {Prompt: 1}}}}
	for _, c := range []struct {
		model, asked string
		want         float64
	}{{"big", "big", 3}, {"small", "big", 0}, {"big", "gpt", 3}, {"small", "small", 0}} {
		if got := s.priceOf(c.model, c.asked).Prompt; got != c.want {
			t.Errorf("price of %s asked as %s: %v, want %v", c.model, c.asked, got, c.want)
		}
	}
}

// TestOutputCapAsVLLMReadsIt: the output a request reserves is bounded by
// the field vLLM bounds it by on that endpoint: max_completion_tokens
// before max_tokens on chat, max_tokens alone on completions (vLLM's
// completions API ignores max_completion_tokens: reserving by it there
// would let a request with max_tokens 1,000 reserve 10), max_output_tokens
// alone on the Responses API.
func TestOutputCapAsVLLMReadsIt(t *testing.T) {
	s := &Server{cfg: Config{DefaultMaxTokens: 1024}}
	m := gpu.Model{ID: "m", MaxModelLen: 32768}
	for _, c := range []struct {
		ep        endpoint
		fields    string
		wantOut   int
		wantParam string
	}{
		{epCompletion, `"max_tokens":1000,"max_completion_tokens":10`, 1000, "max_tokens"},
		{epCompletion, `"max_completion_tokens":500`, 16, "prompt"},
		{epChat, `"max_tokens":1000,"max_completion_tokens":10`, 10, "max_completion_tokens"},
		{epChat, `"max_tokens":100`, 100, "max_tokens"},
		{epChat, `"n":1`, 1024, "messages"},
		{epResponses, `"max_output_tokens":50,"max_tokens":900`, 50, "max_output_tokens"},
		{epResponses, `"max_tokens":900`, 1024, "input"}, // no limit sent: the input, as chat's messages
	} {
		body := map[endpoint]string{
			epCompletion: `{"model":"m","prompt":"hi",` + c.fields + `}`,
			epChat:       `{"model":"m","messages":[{"role":"user","content":"hi"}],` + c.fields + `}`,
			epResponses:  `{"model":"m","input":"hi",` + c.fields + `}`,
		}[c.ep]
		call, err := parseCall([]byte(body), c.ep)
		if err != nil {
			t.Fatal(err)
		}
		if _, out := s.reservationWith(call, m, 10); out != c.wantOut {
			t.Errorf("%s: reserves %d output tokens, want %d", body, out, c.wantOut)
		}
		var tl *tooLargeCall
		if !errors.As(call.tooLarge(&scheduler.TooLargeError{}), &tl) || tl.param != c.wantParam {
			t.Errorf("%s: too large names %+v, want %s", body, tl, c.wantParam)
		}
	}
}

// TestResponsesStreamEndingFailed: a Responses stream the backend ends
// with response.failed (or an error event) reaches the client as it came,
// and the attempt is a failure: the tenant is charged its reservation as
// uncertain, not the failed response's usage as if it had succeeded.
func TestResponsesStreamEndingFailed(t *testing.T) {
	st := sqliteStore(t)
	clock := &testClock{now: quotaT0}
	events := `event: response.created` + "\n" + `data: {"type":"response.created","sequence_number":0,"response":{"id":"resp_1","object":"response","created_at":1,"model":"` + llama + `","status":"in_progress","output":[]}}` + "\n\n" +
		`event: response.failed` + "\n" + `data: {"type":"response.failed","sequence_number":1,"response":{"id":"resp_1","object":"response","created_at":1,"model":"` + llama +
		`","status":"failed","output":[],"error":{"code":"server_error","message":"engine failed"},"usage":{"input_tokens":3,"output_tokens":7,"total_tokens":10}}}` + "\n\n"
	f := startFleet(t, fleetOpts{store: st, gateway: Config{Tenants: Tenants{Store: st, Now: clock.Now}},
		wrap: func(_ int, h http.Handler) http.Handler {
			return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if !strings.HasSuffix(r.URL.Path, "/responses") {
					h.ServeHTTP(w, r)
					return
				}
				_, _ = io.Copy(io.Discard, r.Body)
				w.Header().Set("Content-Type", "text/event-stream")
				_, _ = io.WriteString(w, events)
			})
		}})
	key := newTenant(t, st, "failing", store.Limits{MaxConcurrency: 10}, store.RoleUser)
	resp, b := f.post(t, "/v1/responses", `{"model":"`+llama+`","input":"hi","max_output_tokens":20,"stream":true}`, "Authorization", "Bearer "+key)
	if resp.StatusCode != http.StatusOK || !strings.Contains(string(b), "event: response.failed") || !strings.Contains(string(b), "engine failed") {
		t.Fatalf("stream: %d %s", resp.StatusCode, b)
	}
	if u := settledUsage(t, st, "failing"); u.Uncertain != 1 || u.CompletionTokens != 0 {
		t.Errorf("ledger %+v: want the request uncertain, nothing reported", u)
	}
}

// TestTokenizeUnderTheTenantsLimits: /tokenize runs on a backend's CPU,
// not its KV cache, but counts against its tenant's requests per minute
// (a permit of no tokens), and goes round the backends serving the model
// rather than always to the first.
func TestTokenizeUnderTheTenantsLimits(t *testing.T) {
	st := sqliteStore(t)
	clock := &testClock{now: quotaT0}
	var calls [2]atomic.Int64
	f := startFleet(t, fleetOpts{store: st, backends: 2, gateway: Config{Tenants: Tenants{Store: st, Now: clock.Now}},
		wrap: func(i int, h http.Handler) http.Handler {
			return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if r.URL.Path == "/tokenize" {
					calls[i].Add(1)
				}
				h.ServeHTTP(w, r)
			})
		}})
	free := newTenant(t, st, "free", store.Limits{}, store.RoleUser)
	for range 4 {
		if resp, b := send(t, f.srv.URL, http.MethodPost, "/tokenize", free, `{"prompt":"hi"}`); resp.StatusCode != http.StatusOK {
			t.Fatalf("/tokenize: %d %s", resp.StatusCode, b)
		}
	}
	if a, b := calls[0].Load(), calls[1].Load(); a != 2 || b != 2 {
		t.Errorf("four calls went %d and %d to the two backends, want two each", a, b)
	}
	limited := newTenant(t, st, "limited", store.Limits{RPM: 1}, store.RoleUser)
	if resp, b := send(t, f.srv.URL, http.MethodPost, "/tokenize", limited, `{"prompt":"hi"}`); resp.StatusCode != http.StatusOK {
		t.Fatalf("first /tokenize: %d %s", resp.StatusCode, b)
	}
	resp, b := send(t, f.srv.URL, http.MethodPost, "/detokenize", limited, `{"tokens":[1]}`)
	if e := errorKeys(t, "over RPM", b); resp.StatusCode != http.StatusTooManyRequests || e["code"] != "rate_limit_exceeded" {
		t.Errorf("a second call within the minute, RPM 1: %d %s", resp.StatusCode, b)
	}
	if u := settledUsage(t, st, "limited"); u.Requests != 1 || u.PromptTokens != 0 || u.Uncertain != 0 {
		t.Errorf("ledger %+v: want one request of no tokens", u)
	}
}

// TestModelLabelOnlyForKnownModels: while a backend's models are not known
// (it has not answered yet), a request may name any model, refused once
// no backend serving it is found; that name, any string a client sends,
// makes no series of the request metrics.
func TestModelLabelOnlyForKnownModels(t *testing.T) {
	f := startFleet(t, fleetOpts{server: func(s *Server) { s.pool = withLoading{s.pool} }})
	resp, b := f.post(t, "/v1/chat/completions", `{"model":"made-up-model-4711","messages":[{"role":"user","content":"hi"}],"max_tokens":2}`)
	if resp.StatusCode == http.StatusOK {
		t.Fatalf("a model nothing known serves, one backend loading: %d %s", resp.StatusCode, b)
	}
	r, err := http.Get(f.srv.URL + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer r.Body.Close()
	m, _ := io.ReadAll(r.Body)
	if strings.Contains(string(m), "made-up-model-4711") {
		t.Errorf("a client's model name became a metric label:\n%s", grepLines(string(m), "made-up-model-4711"))
	}
}

// withLoading is a pool with one more backend, not discovered yet (vLLM
// loading its weights): it may serve any model.
type withLoading struct{ backendPool }

func (p withLoading) Snapshots() []*gpu.Snapshot {
	return append(p.backendPool.Snapshots(), &gpu.Snapshot{Name: "loading", URL: "http://127.0.0.1:1"})
}

func grepLines(s, sub string) string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		if strings.Contains(l, sub) {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}
