package baseline

import (
	"bytes"
	"container/list"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"sync"

	"github.com/kvgate/kvgate/bench/vllmsim"
	"github.com/kvgate/kvgate/scheduler"
)

// PrefixConfig tunes a Prefix router. Zero values take the defaults in
// brackets, which are the inference gateway's (GIE) and llm-d's.
type PrefixConfig struct {
	// Threshold configures the metrics scraping and health probes the
	// load scorers read (see ThresholdConfig).
	Threshold ThresholdConfig
	// BlockBytes is the prompt chunk the prefix scorer hashes [64:
	// 16 tokens of 4 characters, the prefix plugin's default].
	BlockBytes int
	// MaxBlocks is how many leading chunks a prompt is matched on
	// [256, the plugin's maxPrefixBlocksToMatch].
	MaxBlocks int
	// LRUBlocks is the chunks remembered per backend [31,250, the
	// plugin's lruCapacityPerServer].
	LRUBlocks int
	// Weights of the prefix, queue and KV-utilization scorers [3, 2, 2:
	// llm-d's inference-scheduling profile].
	PrefixWeight, QueueWeight, KVWeight float64
}

func (c *PrefixConfig) defaults() {
	if c.BlockBytes <= 0 {
		c.BlockBytes = 64
	}
	if c.MaxBlocks <= 0 {
		c.MaxBlocks = 256
	}
	if c.LRUBlocks <= 0 {
		c.LRUBlocks = 31250
	}
	if c.PrefixWeight == 0 && c.QueueWeight == 0 && c.KVWeight == 0 {
		c.PrefixWeight, c.QueueWeight, c.KVWeight = 3, 2, 2
	}
}

// Prefix routes as llm-d's endpoint picker does with its approximate
// prefix-cache scorer: it hashes each prompt (chat template applied) in
// chained chunks, remembers per backend, in an LRU of bounded size, the
// chunks of the prompts it sent there, and scores each backend by the
// share of the prompt's leading chunks it holds, plus a queue scorer
// (vLLM's waiting queue, min-max normalised over the backends) and a KV
// scorer (1 - KV-cache use), weighted, picking the highest score (ties in
// turn). Like the endpoint picker without flow control, it never holds a
// request back: a saturated fleet queues in vLLM.
//
// It reads metrics as Threshold does (Run keeps them fresh); backends
// whose metrics are stale or whose probe failed are passed over while
// another remains. Safe for concurrent use.
type Prefix struct {
	cfg PrefixConfig
	th  *Threshold

	mu  sync.Mutex
	lru []*chunkLRU
}

// chunkLRU is one backend's remembered chunks, most recent first.
type chunkLRU struct {
	entries map[uint64]*list.Element
	order   list.List
}

// NewPrefix returns an llm-d-style prefix router over the backends' base
// URLs.
func NewPrefix(backends []string, cfg PrefixConfig) (*Prefix, error) {
	cfg.defaults()
	th, err := NewThreshold(backends, cfg.Threshold)
	if err != nil {
		return nil, err
	}
	p := &Prefix{cfg: cfg, th: th}
	for range backends {
		p.lru = append(p.lru, &chunkLRU{entries: map[uint64]*list.Element{}})
	}
	return p, nil
}

// Run keeps the backends' metrics and health fresh until ctx ends.
func (p *Prefix) Run(ctx context.Context) error { return p.th.Run(ctx) }

// Refresh reads every backend's metrics and health once, now.
func (p *Prefix) Refresh(ctx context.Context) error { return p.th.Refresh(ctx) }

// ServeHTTP scores the backends for the request's prompt and relays it to
// the best.
func (p *Prefix) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	body, err := io.ReadAll(r.Body)
	if err != nil {
		http.Error(w, `{"error":{"message":"cannot read the request body","type":"invalid_request_error"}}`, http.StatusBadRequest)
		return
	}
	r.Body = io.NopCloser(bytes.NewReader(body))
	hashes := promptChunks(r.URL.Path, body, p.cfg.BlockBytes)
	if len(hashes) > p.cfg.MaxBlocks {
		hashes = hashes[:p.cfg.MaxBlocks]
	}
	i := p.pick(hashes)
	b := p.th.backends[i]
	b.inflight.Add(1)
	defer b.inflight.Add(-1)
	b.proxy.ServeHTTP(w, r)
}

// pick scores every backend for a prompt's chunks, records the chunks on
// the winner, and returns it.
func (p *Prefix) pick(hashes []uint64) int {
	now := p.th.cfg.Now()
	n := len(p.th.backends)
	waiting, kv := make([]float64, n), make([]float64, n)
	ok := make([]bool, n)
	anyOK := false
	for i, b := range p.th.backends {
		b.mu.Lock()
		fresh := !b.scrapedAt.IsZero() && now.Sub(b.scrapedAt) <= p.th.cfg.Staleness
		waiting[i], kv[i], ok[i] = b.metrics.Waiting, b.metrics.KVUsage, fresh && !b.unhealthy
		if !fresh {
			waiting[i], kv[i] = 0, 1 // stale: counts as full
		}
		b.mu.Unlock()
		anyOK = anyOK || ok[i]
	}
	lo, hi := waiting[0], waiting[0]
	for _, q := range waiting {
		lo, hi = min(lo, q), max(hi, q)
	}
	turn := int(p.th.turn.Add(1) - 1)
	p.mu.Lock()
	defer p.mu.Unlock()
	best, bestScore := 0, -1.0
	for k := range n {
		i := (turn + k) % n
		if anyOK && !ok[i] {
			continue
		}
		prefix := 0.0
		if len(hashes) > 0 {
			prefix = float64(p.lru[i].match(hashes)) / float64(len(hashes))
		}
		queue := 1.0
		if hi > lo {
			queue = (hi - waiting[i]) / (hi - lo)
		}
		score := p.cfg.PrefixWeight*prefix + p.cfg.QueueWeight*queue + p.cfg.KVWeight*(1-kv[i])
		if score > bestScore {
			best, bestScore = i, score
		}
	}
	p.lru[best].add(hashes, p.cfg.LRUBlocks)
	return best
}

func (c *chunkLRU) match(hashes []uint64) int {
	n := 0
	for _, h := range hashes {
		if _, ok := c.entries[h]; !ok {
			break
		}
		n++
	}
	return n
}

func (c *chunkLRU) add(hashes []uint64, capacity int) {
	for i := len(hashes) - 1; i >= 0; i-- {
		if e, ok := c.entries[hashes[i]]; ok {
			c.order.MoveToFront(e)
			continue
		}
		c.entries[hashes[i]] = c.order.PushFront(hashes[i])
	}
	for c.order.Len() > capacity {
		e := c.order.Back()
		c.order.Remove(e)
		delete(c.entries, e.Value.(uint64))
	}
}

// promptChunks renders a request's prompt as the backend will see it
// (the Llama-3 chat template for chat) and hashes it in chained chunks; nil
// when the body has no text prompt.
func promptChunks(path string, body []byte, size int) []uint64 {
	var req struct {
		Prompt   json.RawMessage `json:"prompt"`
		Messages []struct {
			Role    string          `json:"role"`
			Content json.RawMessage `json:"content"`
		} `json:"messages"`
	}
	if json.Unmarshal(body, &req) != nil {
		return nil
	}
	var text string
	switch {
	case strings.HasSuffix(path, "/chat/completions"):
		msgs := make([]vllmsim.ChatMessage, len(req.Messages))
		for i, m := range req.Messages {
			msgs[i].Role = m.Role
			_ = json.Unmarshal(m.Content, &msgs[i].Content) // parts: left empty
		}
		text = vllmsim.RenderChat(msgs, true)
	default:
		if json.Unmarshal(req.Prompt, &text) != nil {
			return nil
		}
	}
	return scheduler.HashChunks(text, size)
}
