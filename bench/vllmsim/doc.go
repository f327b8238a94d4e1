// Package vllmsim simulates a vLLM server (V1 engine) closely enough that
// admission control, preemption and throughput behave on it as they do on a
// real GPU.
//
// The simulator is an [http.Handler] that speaks vLLM's OpenAI-compatible
// HTTP surface (/v1/chat/completions, /v1/completions, /v1/embeddings,
// /v1/models, /tokenize, /detokenize, /health, /version, /load, /metrics)
// in front of an [Engine] that runs vLLM's scheduler step: one token budget
// per step, running requests first, chunked prefill, paged KV blocks with
// prefix caching and LRU eviction, and preemption by recompute of the newest
// running request when a block cannot be had. Step times come from a
// roofline model whose parameters belong to a named [Profile] and are
// calibrated against published H100 figures (see [Calibrate]).
//
// Time is simulated: the engine's clock may run many times faster than the
// wall clock (Options.Speedup), or be driven step by step without any
// waiting (Engine.Step), so that long experiments fit in tests. Latencies in
// /metrics are simulated seconds.
//
// The package is a test and benchmark fixture. It is not a model server: the
// text it generates is deterministic filler, and its tokenizer is a stand-in
// that counts roughly like a real one without matching any real vocabulary.
package vllmsim
