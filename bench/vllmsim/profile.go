package vllmsim

import (
	"fmt"
	"slices"
	"strings"
	"time"
)

// Profile describes one simulated vLLM deployment: the model it serves, the
// engine limits vLLM would start with on that hardware, and the parameters of
// the step-time model.
//
// The step-time model is a roofline: every engine step pays a fixed overhead,
// reads the weights once, reads the KV cache of every scheduled request's
// context, and pays a compute cost per prefill token:
//
//	step = Overhead + WeightBytes/(HBM·Eff) + Seqs·PerSeq
//	     + ContextTokens·KVBytesPerToken/(HBM·Eff) + PrefillTokens·PrefillPerToken
//
// Bytes are per GPU; with tensor parallelism each GPU reads its shard.
type Profile struct {
	Name        string // profile name, e.g. "h100-llama-3.1-8b"
	Description string
	Model       string // served model name
	GPU         string // GPU model, e.g. "H100-SXM-80GB"
	TP          int    // tensor-parallel size (GPUs per server)

	Embedding    bool // a pooling model: /v1/embeddings only, no decode
	EmbeddingDim int
	// Reranker is a pooling model that scores pairs (a cross-encoder):
	// /score and /rerank, not /v1/embeddings. Embedding is set too.
	Reranker bool

	// Engine limits, as vLLM would report them.
	BlockSize           int
	NumGPUBlocks        int
	MaxNumSeqs          int
	MaxNumBatchedTokens int
	MaxModelLen         int
	PrefixCaching       bool

	// Roofline parameters.
	HBMBytesPerSec  float64       // peak HBM bandwidth per GPU
	BandwidthEff    float64       // achieved fraction of HBMBytesPerSec
	WeightBytes     float64       // weight bytes read per step, per GPU
	KVBytesPerToken float64       // KV bytes per context token, per GPU
	Overhead        time.Duration // fixed per step (launch, sampling, scheduler, all-reduce)
	PerSeq          time.Duration // per scheduled sequence per step
	PrefillPerToken time.Duration // compute per prefill token

	// OutputMedian is the median of the output length distribution used
	// when a request does not set ignore_eos (log-normal, capped by
	// max_tokens).
	OutputMedian int
}

const (
	h100HBM = 3.35e12 // H100 SXM, HBM3, bytes/s
	h200HBM = 4.8e12  // H200, HBM3e, bytes/s

	// Llama-3.1 KV bytes per token in BF16: 2 (K,V) × layers × 8 KV heads × 128 × 2 bytes.
	llama8BKVBytes  = 2 * 32 * 8 * 128 * 2
	llama70BKVBytes = 2 * 80 * 8 * 128 * 2
)

// profiles are the built-in deployments. The 8B H100 figures are fitted to
// the vLLM blog's single-stream ITL line (6.44 ms + 4.37e-5 ms per context
// token: weights and KV read at 90% of HBM bandwidth, the rest fixed) and
// its concurrency-8 long-context run (36 µs per prefill token). The
// per-sequence cost is kept small (40 µs: sampling and bookkeeping) so that
// a batch of hundreds decodes at the ~25 ms steps real H100s show; it
// leaves the concurrency-8 ITL about 8% under the published one. The other
// profiles scale the same model by bandwidth, weight size and FLOPs. num_gpu_blocks follows vLLM's
// own arithmetic at gpu_memory_utilization 0.9 (reference vllm.md §3.3).
var profiles = []Profile{
	{
		Name:        "h100-llama-3.1-8b",
		Description: "Llama-3.1-8B-Instruct BF16 on one H100 SXM 80GB",
		Model:       "meta-llama/Llama-3.1-8B-Instruct", GPU: "H100-SXM-80GB", TP: 1,
		BlockSize: 16, NumGPUBlocks: 27494, MaxNumSeqs: 1024, MaxNumBatchedTokens: 8192,
		MaxModelLen: 131072, PrefixCaching: true,
		HBMBytesPerSec: h100HBM, BandwidthEff: 0.9, WeightBytes: 16.06e9, KVBytesPerToken: llama8BKVBytes,
		Overhead: 1070 * time.Microsecond, PerSeq: 40 * time.Microsecond, PrefillPerToken: 36 * time.Microsecond,
		OutputMedian: 256,
	},
	{
		Name:        "h200-llama-3.1-8b",
		Description: "Llama-3.1-8B-Instruct BF16 on one H200 141GB",
		Model:       "meta-llama/Llama-3.1-8B-Instruct", GPU: "H200-141GB", TP: 1,
		BlockSize: 16, NumGPUBlocks: 55245, MaxNumSeqs: 1024, MaxNumBatchedTokens: 8192,
		MaxModelLen: 131072, PrefixCaching: true,
		HBMBytesPerSec: h200HBM, BandwidthEff: 0.9, WeightBytes: 16.06e9, KVBytesPerToken: llama8BKVBytes,
		// Same SMs as the H100: compute-bound prefill costs the same per token.
		Overhead: 1070 * time.Microsecond, PerSeq: 40 * time.Microsecond, PrefillPerToken: 36 * time.Microsecond,
		OutputMedian: 256,
	},
	{
		Name:        "h100x4-llama-3.1-70b",
		Description: "Llama-3.1-70B-Instruct BF16, tensor parallel 4 on four H100 SXM 80GB",
		Model:       "meta-llama/Llama-3.1-70B-Instruct", GPU: "H100-SXM-80GB", TP: 4,
		BlockSize: 16, NumGPUBlocks: 29327, MaxNumSeqs: 1024, MaxNumBatchedTokens: 8192,
		MaxModelLen: 131072, PrefixCaching: true,
		HBMBytesPerSec: h100HBM, BandwidthEff: 0.9, WeightBytes: 35.3e9, KVBytesPerToken: llama70BKVBytes / 4,
		// Two all-reduces per layer over 80 layers add ~1.6 ms a step; prefill
		// FLOPs are 8.75× the 8B's, spread over four GPUs at ~90% TP efficiency.
		Overhead: 2670 * time.Microsecond, PerSeq: 40 * time.Microsecond, PrefillPerToken: 88 * time.Microsecond,
		OutputMedian: 256,
	},
	{
		Name:        "h100-bge-m3",
		Description: "BAAI/bge-m3 embedding model (1024 dimensions) on one H100 SXM 80GB",
		Model:       "BAAI/bge-m3", GPU: "H100-SXM-80GB", TP: 1,
		Embedding: true, EmbeddingDim: 1024,
		// Encoder-only: no decode, so KV is scratch for the forward pass.
		BlockSize: 16, NumGPUBlocks: 32768, MaxNumSeqs: 256, MaxNumBatchedTokens: 16384,
		MaxModelLen: 8192, PrefixCaching: false,
		HBMBytesPerSec: h100HBM, BandwidthEff: 0.9, WeightBytes: 1.14e9, KVBytesPerToken: 2 * 24 * 16 * 64 * 2,
		Overhead: 500 * time.Microsecond, PerSeq: 20 * time.Microsecond, PrefillPerToken: 3 * time.Microsecond,
	},
	{
		Name:        "h100-bge-reranker-v2-m3",
		Description: "BAAI/bge-reranker-v2-m3 cross-encoder reranker (/score, /rerank) on one H100 SXM 80GB",
		Model:       "BAAI/bge-reranker-v2-m3", GPU: "H100-SXM-80GB", TP: 1,
		// The same XLM-RoBERTa-large encoder as bge-m3, with a scoring head.
		Embedding: true, Reranker: true,
		BlockSize: 16, NumGPUBlocks: 32768, MaxNumSeqs: 256, MaxNumBatchedTokens: 16384,
		MaxModelLen: 8192, PrefixCaching: false,
		HBMBytesPerSec: h100HBM, BandwidthEff: 0.9, WeightBytes: 1.14e9, KVBytesPerToken: 2 * 24 * 16 * 64 * 2,
		Overhead: 500 * time.Microsecond, PerSeq: 20 * time.Microsecond, PrefillPerToken: 3 * time.Microsecond,
	},
}

// Profiles returns the built-in profiles, in a stable order.
func Profiles() []Profile { return slices.Clone(profiles) }

// LookupProfile returns the built-in profile with the given name.
func LookupProfile(name string) (Profile, error) {
	for _, p := range profiles {
		if p.Name == name {
			return p, nil
		}
	}
	names := make([]string, len(profiles))
	for i, p := range profiles {
		names[i] = p.Name
	}
	return Profile{}, fmt.Errorf("unknown profile %q (have %s)", name, strings.Join(names, ", "))
}

// Validate reports whether the profile's limits are usable.
func (p Profile) Validate() error {
	switch {
	case p.Model == "":
		return fmt.Errorf("profile %s: no model name", p.Name)
	case p.BlockSize <= 0:
		return fmt.Errorf("profile %s: block size %d must be positive", p.Name, p.BlockSize)
	case p.NumGPUBlocks < 2:
		return fmt.Errorf("profile %s: num_gpu_blocks %d must be at least 2", p.Name, p.NumGPUBlocks)
	case p.MaxNumSeqs <= 0:
		return fmt.Errorf("profile %s: max_num_seqs %d must be positive", p.Name, p.MaxNumSeqs)
	case p.MaxNumBatchedTokens <= 0:
		return fmt.Errorf("profile %s: max_num_batched_tokens %d must be positive", p.Name, p.MaxNumBatchedTokens)
	case p.MaxModelLen <= 1:
		return fmt.Errorf("profile %s: max_model_len %d must be above 1", p.Name, p.MaxModelLen)
	case p.Embedding && p.MaxNumBatchedTokens < p.MaxModelLen:
		// vLLM runs pooling models without chunked prefill: a whole prompt per step.
		return fmt.Errorf("profile %s: an embedding model needs max_num_batched_tokens (%d) >= max_model_len (%d)",
			p.Name, p.MaxNumBatchedTokens, p.MaxModelLen)
	case p.Reranker && !p.Embedding:
		return fmt.Errorf("profile %s: a reranker is a pooling model: set Embedding too", p.Name)
	case p.Embedding && !p.Reranker && p.EmbeddingDim <= 0:
		return fmt.Errorf("profile %s: embedding dimension must be positive", p.Name)
	case p.HBMBytesPerSec <= 0 || p.BandwidthEff <= 0 || p.BandwidthEff > 1:
		return fmt.Errorf("profile %s: bandwidth %g at efficiency %g is not usable", p.Name, p.HBMBytesPerSec, p.BandwidthEff)
	}
	return nil
}

// CapacityTokens is the KV cache size in tokens: num_gpu_blocks × block_size.
func (p Profile) CapacityTokens() int { return p.NumGPUBlocks * p.BlockSize }

// StepTime is the modelled duration of one engine step that schedules seqs
// sequences whose contexts (tokens computed plus tokens scheduled) add up to
// contextTokens, of which prefillTokens are prompt tokens computed this step.
func (p Profile) StepTime(seqs, contextTokens, prefillTokens int) time.Duration {
	bw := p.HBMBytesPerSec * p.BandwidthEff
	sec := (p.WeightBytes + float64(contextTokens)*p.KVBytesPerToken) / bw
	return p.Overhead + time.Duration(sec*float64(time.Second)) +
		time.Duration(seqs)*p.PerSeq + time.Duration(prefillTokens)*p.PrefillPerToken
}
