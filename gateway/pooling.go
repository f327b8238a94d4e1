package gateway

import "net/http"

// The scoring routes of vLLM's pooling models (cross-encoder rerankers):
// POST /v1/rerank and /rerank (a query against documents), POST /v1/score
// and /score (text_1 against text_2), passed to a backend serving the
// model at /v1/rerank and /v1/score, on the interactive path: unknown
// fields pass through, admission reserves the prompt only (every pair's
// query and document, estimated from their size; nothing is decoded),
// quotas and usage (the answer's prompt_tokens, or a rerank's total_tokens
// from an older vLLM) and metrics as for embeddings.

func (s *Server) handleRerank(w http.ResponseWriter, r *http.Request) int {
	return s.handleInference(w, r, epRerank)
}

func (s *Server) handleScore(w http.ResponseWriter, r *http.Request) int {
	return s.handleInference(w, r, epScore)
}
