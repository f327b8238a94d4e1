package vllmsim

import (
	"bufio"
	"encoding/json"
	"net/http"
	"strings"
	"testing"
)

func rerankerProfile(t testing.TB) Profile {
	t.Helper()
	p, err := LookupProfile("h100-bge-reranker-v2-m3")
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// TestRerankAndScore: the reranker profile serves /rerank and /score (at
// every path vLLM serves them) in vLLM's shapes: results sorted by
// relevance, the document that shares the query's words first, top_n
// kept, usage counting every pair's prompt; score pairs one text with
// many or many with as many. Other models refuse them, and the reranker
// refuses embeddings and chat.
func TestRerankAndScore(t *testing.T) {
	_, c := startSim(t, Config{Profile: rerankerProfile(t), Speedup: 100})
	docs := []string{"Cats are small carnivores.", "vLLM is a fast inference engine for large language models.", "Paris is in France."}
	for _, path := range []string{"/rerank", "/v1/rerank", "/v2/rerank"} {
		var out struct {
			ID      string `json:"id"`
			Model   string `json:"model"`
			Results []struct {
				Index    int `json:"index"`
				Document struct {
					Text       *string `json:"text"`
					MultiModal any     `json:"multi_modal"`
				} `json:"document"`
				RelevanceScore float64 `json:"relevance_score"`
			} `json:"results"`
			Usage struct {
				PromptTokens int `json:"prompt_tokens"`
				TotalTokens  int `json:"total_tokens"`
			} `json:"usage"`
		}
		c.post(t, path, map[string]any{"model": "BAAI/bge-reranker-v2-m3", "query": "what is vLLM, the inference engine?",
			"documents": docs, "top_n": 2}).ok(t, &out)
		if !strings.HasPrefix(out.ID, "rerank-") || out.Model != "BAAI/bge-reranker-v2-m3" || len(out.Results) != 2 {
			t.Fatalf("%s: %+v", path, out)
		}
		if out.Results[0].Index != 1 || out.Results[0].Document.Text == nil || *out.Results[0].Document.Text != docs[1] ||
			out.Results[0].RelevanceScore <= out.Results[1].RelevanceScore || out.Results[0].RelevanceScore >= 1 || out.Results[1].RelevanceScore <= 0 {
			t.Errorf("%s: not sorted by relevance: %+v", path, out.Results)
		}
		want := 0
		for _, d := range docs {
			want += len(pairTokens("what is vLLM, the inference engine?", d))
		}
		if out.Usage.PromptTokens != want || out.Usage.TotalTokens != want {
			t.Errorf("%s: usage %+v, want %d tokens", path, out.Usage, want)
		}
	}
	for _, path := range []string{"/score", "/v1/score"} {
		var out struct {
			Object string `json:"object"`
			Data   []struct {
				Index  int     `json:"index"`
				Object string  `json:"object"`
				Score  float64 `json:"score"`
			} `json:"data"`
			Usage usageInfo `json:"usage"`
		}
		c.post(t, path, map[string]any{"model": "BAAI/bge-reranker-v2-m3", "text_1": "inference engine", "text_2": docs}).ok(t, &out)
		if out.Object != "list" || len(out.Data) != 3 || out.Data[1].Score <= out.Data[0].Score || out.Data[2].Object != "score" || out.Usage.PromptTokens == 0 {
			t.Errorf("%s one to many: %+v", path, out)
		}
		c.post(t, path, map[string]any{"text_1": []string{"a", "b"}, "text_2": []string{"a", "b"}}).ok(t, &out)
		if len(out.Data) != 2 {
			t.Errorf("%s many to many: %+v", path, out)
		}
		if r := c.post(t, path, map[string]any{"text_1": []string{"a", "b"}, "text_2": []string{"a", "b", "c"}}); r.status != http.StatusBadRequest {
			t.Errorf("%s mismatched lengths: %d %s", path, r.status, r.body)
		}
		// vLLM's other shapes of the request: the same pairs, the same scores.
		var text struct {
			Data []struct {
				Score float64 `json:"score"`
			} `json:"data"`
		}
		c.post(t, path, map[string]any{"text_1": "inference engine", "text_2": docs}).ok(t, &text)
		for _, names := range [][2]string{{"queries", "documents"}, {"queries", "items"}, {"data_1", "data_2"}} {
			var other struct {
				Data []struct {
					Score float64 `json:"score"`
				} `json:"data"`
			}
			c.post(t, path, map[string]any{names[0]: "inference engine", names[1]: docs}).ok(t, &other)
			if len(other.Data) != 3 || other.Data[1].Score != text.Data[1].Score {
				t.Errorf("%s with %s and %s: %+v, want the scores text_1 and text_2 get, %+v", path, names[0], names[1], other, text)
			}
		}
		if r := c.post(t, path, map[string]any{"queries": []string{}, "documents": docs}); r.status != http.StatusBadRequest || !strings.Contains(string(r.body), `"queries"`) {
			t.Errorf("%s empty queries: %d %s, want 400 naming queries", path, r.status, r.body)
		}
	}
	if r := c.post(t, "/rerank", map[string]any{"query": "", "documents": docs}); r.status != http.StatusBadRequest {
		t.Errorf("empty query: %d %s", r.status, r.body)
	}
	if r := c.post(t, "/v1/embeddings", map[string]any{"input": "hi"}); r.status != http.StatusBadRequest {
		t.Errorf("embeddings on a reranker: %d %s", r.status, r.body)
	}
	if r := c.post(t, "/v1/chat/completions", map[string]any{"messages": []map[string]string{{"role": "user", "content": "hi"}}}); r.status != http.StatusBadRequest {
		t.Errorf("chat on a reranker: %d %s", r.status, r.body)
	}
	_, llm := startSim(t, Config{Profile: testProfile(t, 4096, 1024), Speedup: 100})
	if r := llm.post(t, "/rerank", map[string]any{"query": "q", "documents": docs}); r.status != http.StatusBadRequest ||
		!strings.Contains(string(r.body), "does not support Rerank API") {
		t.Errorf("rerank on a chat model: %d %s", r.status, r.body)
	}
}

// TestResponsesAPI: /v1/responses answers a ResponsesResponse as vLLM
// does (no error key, one message item, usage in input/output tokens),
// and streams vLLM's typed events in order, with one delta per token and
// the full response in response.completed; no [DONE].
func TestResponsesAPI(t *testing.T) {
	_, c := startSim(t, Config{Profile: testProfile(t, 4096, 1024), Speedup: 100})
	body := map[string]any{"model": "meta-llama/Llama-3.1-8B-Instruct", "input": "Say hi.", "instructions": "Be terse.",
		"max_output_tokens": 5, "ignore_eos": true, "metadata": map[string]string{"k": "v"}}
	var resp map[string]any
	c.post(t, "/v1/responses", body).ok(t, &resp)
	if _, ok := resp["error"]; ok {
		t.Errorf("vLLM sends no error key: %v", resp)
	}
	if resp["object"] != "response" || !strings.HasPrefix(resp["id"].(string), "resp_") || resp["status"] != "incomplete" ||
		resp["instructions"] != "Be terse." || resp["max_output_tokens"] != 5.0 || resp["metadata"].(map[string]any)["k"] != "v" {
		t.Errorf("response: %v", resp)
	}
	usage := resp["usage"].(map[string]any)
	if usage["output_tokens"] != 5.0 || usage["total_tokens"] != usage["input_tokens"].(float64)+5 {
		t.Errorf("usage: %v", usage)
	}
	out := resp["output"].([]any)
	if len(out) != 1 || out[0].(map[string]any)["type"] != "message" || out[0].(map[string]any)["content"].([]any)[0].(map[string]any)["type"] != "output_text" {
		t.Errorf("output: %v", out)
	}

	body["stream"] = true
	hr, err := c.send(t.Context(), t, http.MethodPost, "/v1/responses", body)
	if err != nil {
		t.Fatal(err)
	}
	defer hr.Body.Close()
	var types []string
	deltas, text := 0, ""
	sc := bufio.NewScanner(hr.Body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	var event string
	for sc.Scan() {
		line := sc.Text()
		switch {
		case strings.HasPrefix(line, "event: "):
			event = strings.TrimPrefix(line, "event: ")
		case strings.HasPrefix(line, "data: "):
			var ev map[string]any
			if err := json.Unmarshal([]byte(strings.TrimPrefix(line, "data: ")), &ev); err != nil {
				t.Fatalf("event data %q: %v", line, err)
			}
			if ev["type"] != event || ev["sequence_number"] != float64(len(types)) {
				t.Errorf("event %q has type %v, sequence %v", event, ev["type"], ev["sequence_number"])
			}
			types = append(types, event)
			switch event {
			case "response.output_text.delta":
				deltas++
				text += ev["delta"].(string)
			case "response.completed":
				r := ev["response"].(map[string]any)
				u := r["usage"].(map[string]any)
				if u["output_tokens"] != 5.0 || r["output"].([]any)[0].(map[string]any)["content"].([]any)[0].(map[string]any)["text"] != text {
					t.Errorf("completed: %v", r)
				}
			}
		}
	}
	want := []string{"response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"}
	if len(types) != len(want)+5+4 || deltas != 5 || strings.Join(types[:4], ",") != strings.Join(want, ",") ||
		types[len(types)-1] != "response.completed" || types[len(types)-2] != "response.output_item.done" {
		t.Errorf("events: %v", types)
	}
}
