// Package gateway is kvgate's HTTP front: the OpenAI-compatible API that
// internal apps call with the official SDKs, its authentication, its
// OpenAI-shaped errors, and its metrics.
//
// Each inference request is parsed only as far as admission needs (model,
// token counts, streaming), becomes a scheduler ticket, waits for a grant,
// and is then passed to the granted vLLM backend byte for byte: fields
// kvgate does not know (vLLM's top_k, guided_json, ...) reach the backend
// unchanged. A streaming response is relayed event by event; its usage is
// read on the way to settle the token estimate. Before the first byte
// reaches the client, a failed backend is retried once on another; after
// it, the stream ends with an error event.
//
// The package does not decide admission (package scheduler) or watch the
// backends (package gpu), and it keeps no durable state.
package gateway
