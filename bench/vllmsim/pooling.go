package vllmsim

import (
	"encoding/json"
	"fmt"
	"math"
	"net/http"
	"slices"
	"strings"
	"time"
)

// Scoring with a cross-encoder (a reranker profile): vLLM's /score and
// /v1/score (text_1 against text_2: one to one, one to many, or many to
// many pairwise) and /rerank, /v1/rerank, /v2/rerank (a query against
// documents, sorted by relevance, top_n of them). Each pair is one pooling
// request to the engine: the query and the document in one prompt, as a
// cross-encoder reads them, prefilled and never decoded.
//
// The relevance of a pair is deterministic: the share of the query's words
// found in the document, squashed into (0, 1), with a little seeded
// jitter so that ties break. Documents that repeat the query's words rank
// first, as they would with a real reranker on such text.

// scoreRequest is vLLM's ScoreRequest, a union of four shapes naming its
// two sides differently: queries and documents, queries and items,
// data_1 and data_2, text_1 and text_2; each side a string or a list of
// strings.
type scoreRequest struct {
	Model                string          `json:"model"`
	Queries              json.RawMessage `json:"queries"`
	Documents            json.RawMessage `json:"documents"`
	Items                json.RawMessage `json:"items"`
	Data1                json.RawMessage `json:"data_1"`
	Data2                json.RawMessage `json:"data_2"`
	Text1                json.RawMessage `json:"text_1"`
	Text2                json.RawMessage `json:"text_2"`
	TruncatePromptTokens *int            `json:"truncate_prompt_tokens"`
}

// sides returns the request's two sides and their names, in the order
// vLLM tries the union's shapes; text_1 and text_2 when none is there.
func (r scoreRequest) sides() (first, second json.RawMessage, name1, name2 string) {
	present := func(raw json.RawMessage) bool { return len(raw) > 0 && string(raw) != "null" }
	switch {
	case present(r.Queries) && present(r.Documents):
		return r.Queries, r.Documents, "queries", "documents"
	case present(r.Queries) && present(r.Items):
		return r.Queries, r.Items, "queries", "items"
	case present(r.Data1) && present(r.Data2):
		return r.Data1, r.Data2, "data_1", "data_2"
	}
	return r.Text1, r.Text2, "text_1", "text_2"
}

// rerankRequest is vLLM's RerankRequest.
type rerankRequest struct {
	Model                string          `json:"model"`
	Query                json.RawMessage `json:"query"`
	Documents            json.RawMessage `json:"documents"`
	TopN                 int             `json:"top_n"`
	TruncatePromptTokens *int            `json:"truncate_prompt_tokens"`
}

// textOrList reads a string or a list of strings.
func textOrList(raw json.RawMessage) ([]string, bool) {
	var s string
	if err := json.Unmarshal(raw, &s); err == nil {
		return []string{s}, true
	}
	var l []string
	if err := json.Unmarshal(raw, &l); err == nil {
		return l, true
	}
	return nil, false
}

// pairTokens is a cross-encoder's prompt for a pair: begin-of-text, the
// query, a separator, the document.
func pairTokens(query, doc string) []int {
	toks := Tokenize(query, true)
	toks = append(toks, tokEOT)
	return append(toks, Tokenize(doc, false)...)
}

// relevance is the pair's score in (0, 1).
func (s *Sim) relevance(query, doc string) float64 {
	words := strings.Fields(strings.ToLower(query))
	docWords := map[string]bool{}
	for _, w := range strings.Fields(strings.ToLower(doc)) {
		docWords[strings.Trim(w, ".,;:!?\"'()")] = true
	}
	hit := 0
	for _, w := range words {
		if docWords[strings.Trim(w, ".,;:!?\"'()")] {
			hit++
		}
	}
	share := 0.0
	if len(words) > 0 {
		share = float64(hit) / float64(len(words))
	}
	jitter := float64(blockHash(s.cfg.Seed, pairTokens(query, doc))%1000) / 1000 * 0.05
	return 1 / (1 + math.Exp(-(8*share - 4 + jitter)))
}

// checkScoring answers 400 unless the profile is a reranker, as vLLM
// answers a model that does not score.
func (s *Sim) checkScoring(w http.ResponseWriter, api string) bool {
	if !s.cfg.Profile.Reranker {
		writeError(w, http.StatusBadRequest, fmt.Sprintf("The model does not support %s API", api))
		return false
	}
	return true
}

// scorePairs runs each pair through the engine as a pooling request and
// returns the pairs' prompt tokens in all; ok is false when it answered
// the client itself.
func (s *Sim) scorePairs(w http.ResponseWriter, r *http.Request, pairs [][2]string, truncate *int) (int, bool) {
	p := s.cfg.Profile
	prompts := make([][]int, len(pairs))
	total := 0
	for i, pr := range pairs {
		toks := pairTokens(pr[0], pr[1])
		if truncate != nil && *truncate > 0 && len(toks) > *truncate {
			toks = toks[len(toks)-*truncate:] // vLLM keeps the end
		}
		if len(toks) > p.MaxModelLen {
			writeError(w, http.StatusBadRequest, fmt.Sprintf("This model's maximum context length is %d tokens. However, you requested %d tokens in the input for score. Please reduce the length of the input.", p.MaxModelLen, len(toks)))
			return 0, false
		}
		prompts[i] = toks
		total += len(toks)
	}
	flt, delay, _ := s.faults.draw(r)
	if !s.injectEarly(w, r, flt) {
		return 0, false
	}
	if delay > 0 && !s.waitSimulated(r.Context(), delay) {
		return 0, false
	}
	reqs := make([]*Request, 0, len(prompts))
	abortAll := func() {
		for _, q := range reqs {
			s.eng.Abort(q)
		}
	}
	for _, toks := range prompts {
		q, err := s.eng.Submit(SubmitParams{Prompt: toks})
		if err != nil {
			abortAll()
			s.submitError(w, err)
			return 0, false
		}
		reqs = append(reqs, q)
	}
	for _, q := range reqs {
		select {
		case <-q.Done():
		case <-r.Context().Done():
			abortAll()
			return 0, false
		}
		if _, _, _, err := q.Read(0); err != nil {
			writeError(w, http.StatusInternalServerError, engineDeadMessage)
			return 0, false
		}
	}
	if flt == faultDrop {
		dropConnection()
	}
	return total, true
}

func (s *Sim) handleScore(w http.ResponseWriter, r *http.Request) {
	var req scoreRequest
	if !s.decodeBody(w, r, &req) || !s.checkModel(w, req.Model) || !s.checkScoring(w, "Score") {
		return
	}
	side1, side2, name1, name2 := req.sides()
	t1, ok1 := textOrList(side1)
	t2, ok2 := textOrList(side2)
	switch {
	case !ok1 || len(t1) == 0:
		writeErrorType(w, http.StatusBadRequest, "BadRequestError", name1+" must be a string or a non-empty list of strings", name1)
		return
	case !ok2 || len(t2) == 0:
		writeErrorType(w, http.StatusBadRequest, "BadRequestError", name2+" must be a string or a non-empty list of strings", name2)
		return
	case len(t1) > 1 && len(t1) != len(t2):
		writeErrorType(w, http.StatusBadRequest, "BadRequestError", name1+" and "+name2+" must have the same length, or "+name1+" a single text", name1)
		return
	}
	pairs := make([][2]string, len(t2))
	for i, d := range t2 {
		q := t1[0]
		if len(t1) > 1 {
			q = t1[i]
		}
		pairs[i] = [2]string{q, d}
	}
	total, ok := s.scorePairs(w, r, pairs, req.TruncatePromptTokens)
	if !ok {
		return
	}
	type item struct {
		Index  int     `json:"index"`
		Object string  `json:"object"`
		Score  float64 `json:"score"`
	}
	data := make([]item, len(pairs))
	for i, pr := range pairs {
		data[i] = item{Index: i, Object: "score", Score: s.relevance(pr[0], pr[1])}
	}
	writeJSON(w, http.StatusOK, map[string]any{
		"id": s.newID("score-"), "object": "list", "created": time.Now().Unix(), "model": s.model, "data": data,
		"usage": usageInfo{PromptTokens: total, TotalTokens: total},
	})
}

func (s *Sim) handleRerank(w http.ResponseWriter, r *http.Request) {
	var req rerankRequest
	if !s.decodeBody(w, r, &req) || !s.checkModel(w, req.Model) || !s.checkScoring(w, "Rerank") {
		return
	}
	var query string
	if err := json.Unmarshal(req.Query, &query); err != nil || query == "" {
		writeErrorType(w, http.StatusBadRequest, "BadRequestError", "query must be a non-empty string", "query")
		return
	}
	var docs []string
	if err := json.Unmarshal(req.Documents, &docs); err != nil || len(docs) == 0 {
		writeErrorType(w, http.StatusBadRequest, "BadRequestError", "documents must be a non-empty list of strings", "documents")
		return
	}
	if req.TopN < 0 {
		writeErrorType(w, http.StatusBadRequest, "BadRequestError", "top_n must not be negative", "top_n")
		return
	}
	pairs := make([][2]string, len(docs))
	for i, d := range docs {
		pairs[i] = [2]string{query, d}
	}
	total, ok := s.scorePairs(w, r, pairs, req.TruncatePromptTokens)
	if !ok {
		return
	}
	type document struct {
		Text       string `json:"text"`
		MultiModal *any   `json:"multi_modal"`
	}
	type result struct {
		Index          int      `json:"index"`
		Document       document `json:"document"`
		RelevanceScore float64  `json:"relevance_score"`
	}
	results := make([]result, len(docs))
	for i, d := range docs {
		results[i] = result{Index: i, Document: document{Text: d}, RelevanceScore: s.relevance(query, d)}
	}
	slices.SortStableFunc(results, func(a, b result) int {
		switch {
		case a.RelevanceScore > b.RelevanceScore:
			return -1
		case a.RelevanceScore < b.RelevanceScore:
			return 1
		}
		return 0
	})
	if req.TopN > 0 && req.TopN < len(results) {
		results = results[:req.TopN]
	}
	writeJSON(w, http.StatusOK, map[string]any{
		"id": s.newID("rerank-"), "model": s.model, "results": results,
		"usage": map[string]int{"prompt_tokens": total, "total_tokens": total},
	})
}

// poolingRoutes registers the scoring routes, and the Responses API's
// (responses.go).
func (s *Sim) poolingRoutes() {
	s.mux.HandleFunc("POST /v1/responses", s.inference(s.handleResponses))
	for _, p := range []string{"/score", "/v1/score"} {
		s.mux.HandleFunc("POST "+p, s.inference(s.handleScore))
	}
	for _, p := range []string{"/rerank", "/v1/rerank", "/v2/rerank"} {
		s.mux.HandleFunc("POST "+p, s.inference(s.handleRerank))
	}
}
