package baseline

import (
	"container/list"
	"fmt"
	"strings"
	"testing"
	"time"
)

// prefixRouter is a Prefix router over n backends whose metrics are set
// by hand; its clock stands still.
func prefixRouter(t *testing.T, n int) (*Prefix, func(i int, waiting, kv float64)) {
	t.Helper()
	now := time.Unix(1000, 0)
	urls := make([]string, n)
	for i := range urls {
		urls[i] = fmt.Sprintf("http://10.0.0.%d:8000", i+1)
	}
	p, err := NewPrefix(urls, PrefixConfig{Threshold: ThresholdConfig{Now: func() time.Time { return now }}})
	if err != nil {
		t.Fatal(err)
	}
	set := func(i int, waiting, kv float64) {
		b := p.th.backends[i]
		b.mu.Lock()
		b.metrics, b.scrapedAt = parsed(t, waiting, 0, kv), now
		b.mu.Unlock()
	}
	for i := range n {
		set(i, 0, 0)
	}
	return p, set
}

func chatBody(system, question string) []byte {
	return fmt.Appendf(nil, `{"model":"m","messages":[{"role":"system","content":%q},{"role":"user","content":%q}]}`, system, question)
}

func TestPrefixPick(t *testing.T) {
	p, set := prefixRouter(t, 3)
	sys := strings.Repeat("tenant a's instructions. ", 400) // 10,000 bytes
	chunks := func(q string) []uint64 {
		return promptChunks("/v1/chat/completions", chatBody(sys, q), 64)
	}
	first := p.pick(chunks("first question"))
	// Same system prompt, equal load: the backend that has it.
	if got := p.pick(chunks("second question")); got != first {
		t.Errorf("a shared prefix went to %d, not %d that holds it", got, first)
	}
	// Load counts beside the prefix: a backend with the longest queue and
	// a full cache scores 3×~0.95 + 0 + 2×0.01, under an idle one's
	// 0 + 2×1 + 2×1.
	other := (first + 1) % 3
	for i := range 3 {
		set(i, 10, 0.1)
	}
	set(first, 40, 0.99)
	set(other, 0, 0)
	if got := p.pick(chunks("third question")); got != other {
		t.Errorf("picked %d; the prefix alone outweighed a saturated backend's load", got)
	}
	// Stale metrics: passed over while another backend is fresh.
	p2, _ := prefixRouter(t, 2)
	p2.th.backends[0].scrapedAt = time.Time{}
	for range 4 {
		if got := p2.pick(chunks("q")); got != 1 {
			t.Errorf("picked the backend with no fresh metrics")
		}
	}
	// No text prompt: no prefix score, load alone.
	if got := promptChunks("/v1/completions", []byte(`{"prompt":[1,2,3]}`), 64); got != nil {
		t.Errorf("token ids hashed: %v", got)
	}
}

func TestChunkLRUBound(t *testing.T) {
	c := &chunkLRU{entries: map[uint64]*list.Element{}}
	c.add([]uint64{1, 2, 3, 4}, 6)
	c.add([]uint64{10, 11, 12}, 6) // 7 > 6: the oldest tail chunk goes
	if got := c.match([]uint64{1, 2, 3, 4}); got != 3 {
		t.Errorf("match %d, want 3: the first prompt's last chunk evicted first", got)
	}
	if got := c.match([]uint64{10, 11, 12}); got != 3 {
		t.Errorf("match %d for the recent prompt, want 3", got)
	}
	if len(c.entries) != 6 || c.order.Len() != 6 {
		t.Errorf("%d entries, want the bound 6", len(c.entries))
	}
}
