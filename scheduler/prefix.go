package scheduler

import (
	"container/list"
	"math"
	"slices"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvgate/kvgate/gpu"
)

// Prefix-aware KV accounting.
//
// vLLM caches a prompt's KV in blocks of block_size tokens, each named by a
// hash chained over the block's tokens and its parent's hash, so that two
// prompts share a block only when everything before it is the same. A
// request whose first blocks are cached skips their prefill, and blocks
// that running requests share take memory once.
//
// kvgate does not tokenize, so it chains hashes over fixed-size chunks of
// the rendered prompt's bytes instead (PrefixChunkBytes, about one vLLM
// block of English text): the same prefix relation, block for block. Each
// chunk stands for the prompt's tokens in proportion to its bytes.
//
// Two structures use the hashes, per backend:
//
//   - the index (prefixIndex) remembers the chunks kvgate recently sent
//     there, in LRU order, and forgets them as the backend's cache turns
//     over: once kvgate has sent more new KV (prompt tokens not found
//     cached, plus output) than the cache holds, num_gpu_blocks ×
//     block_size, since a chunk was last sent, vLLM has had to hand its
//     block out again. The bound is scaled down when the backend's
//     measured hits (vllm:prefix_cache_hits_total) fall short of the
//     index's predictions (load kvgate did not send turns the cache over
//     faster). It predicts how much of a prompt the backend will find
//     cached, which routing weighs against load.
//   - the pins (ledger.pins) are the chunks that requests kvgate has in
//     flight there hold right now: shared, they take KV once, so
//     admission reserves for a request only the chunks not pinned yet.
//
// Both are soft state. Each replica keeps its own index, learnt from what
// it routes; a replica that starts (or restarts) empty predicts no hits
// and routes by load alone until its own traffic has filled the index
// again, which costs hit rate for about one cache turnover and never
// correctness: admission still sees the measured KV usage. Nothing is
// shared between replicas.

// PrefixChunkBytes is the size of the prompt chunks kvgate hashes: about
// one vLLM block (16 tokens) of English text at four bytes a token.
const PrefixChunkBytes = 64

// Prefix is what kvgate knows of a prompt's cacheable blocks: the chained
// hashes of its full chunks, in order, and how many tokens each stands for.
type Prefix struct {
	Hashes      []uint64
	ChunkTokens float64
	// basis is the prompt token count ChunkTokens was derived from
	// (0: none given): a re-estimated prompt rescales it (fit).
	basis int
}

// NewPrefix hashes a rendered prompt (the text the backend will tokenize,
// chat template applied) of promptTokens tokens. space names what else
// the backend's block hashes cover (the model or LoRA adapter, a cache
// salt): prompts of two spaces share no chunk, however alike their text.
// It returns nil for a prompt shorter than one chunk.
func NewPrefix(space, rendered string, promptTokens int) *Prefix {
	var root uint64
	if space != "" {
		root = chainHash(0, space)
	}
	hs := hashChunksFrom(root, rendered, PrefixChunkBytes)
	if len(hs) == 0 || promptTokens <= 0 {
		return nil
	}
	return &Prefix{Hashes: hs, ChunkTokens: float64(promptTokens) * PrefixChunkBytes / float64(len(rendered)), basis: promptTokens}
}

// fit rescales the chunks' tokens to a re-estimated prompt of
// promptTokens: a prompt hashed while its model's token estimate was
// still cold (a third of a token per byte, before the first reported
// usage) would otherwise count each chunk a third too large, in every
// pin it makes, for as long as the chunk stays pinned.
func (p *Prefix) fit(promptTokens int) {
	if p == nil || p.basis <= 0 || promptTokens <= 0 || promptTokens == p.basis {
		return
	}
	p.ChunkTokens *= float64(promptTokens) / float64(p.basis)
	p.basis = promptTokens
}

// chunkTokens is the whole tokens one chunk stands for in the ledger.
func (p *Prefix) chunkTokens() int {
	if p == nil {
		return 0
	}
	return int(math.Round(p.ChunkTokens))
}

// tokens is how many prompt tokens n chunks stand for.
func (p *Prefix) tokens(n int) int { return n * p.chunkTokens() }

// HashChunks returns the chained hashes of text's full chunks of size
// bytes: each hashes its bytes onto its parent's hash, as vLLM chains its
// block hashes, so that equal hashes mean equal text up to and including
// the chunk. A trailing partial chunk is not hashed (vLLM caches only full
// blocks).
func HashChunks(text string, size int) []uint64 { return hashChunksFrom(0, text, size) }

// hashChunksFrom is HashChunks with the first chunk's parent given.
func hashChunksFrom(parent uint64, text string, size int) []uint64 {
	if size <= 0 {
		return nil
	}
	n := len(text) / size
	out := make([]uint64, n)
	for i := range n {
		parent = chainHash(parent, text[i*size:(i+1)*size])
		out[i] = parent
	}
	return out
}

// chainHash is FNV-1a over the chunk seeded with the parent, finalised
// with splitmix64 so that nearby inputs spread; never 0.
func chainHash(parent uint64, chunk string) uint64 {
	const prime = 0x100000001b3
	h := parent ^ 0xcbf29ce484222325
	for i := 0; i < len(chunk); i++ {
		h ^= uint64(chunk[i])
		h *= prime
	}
	h ^= h >> 30
	h *= 0xbf58476d1ce4e5b9
	h ^= h >> 27
	h *= 0x94d049bb133111eb
	h ^= h >> 31
	return max(h, 1)
}

// Index correction bounds: the effective cache is scaled between these
// fractions of the backend's capacity.
const (
	minIndexScale = 0.1
	// correctEvery is how many predicted hit tokens accumulate before
	// the index compares them with the backend's measured hits: vLLM
	// counts a hit when it schedules the request, later than kvgate
	// predicts it, so shorter windows are noise.
	correctEvery = 32768
	// maxIndexChunks bounds an index whose backend's capacity is unknown:
	// 16M tokens of prompts, more than any GPU caches.
	maxIndexChunks = 1 << 20
)

// prefixIndex is one backend's approximate cache: the chunks kvgate sent
// there, most recent first. Not safe for concurrent use (s.mu guards it).
type prefixIndex struct {
	entries map[uint64]*list.Element // of *indexEntry
	lru     list.List                // front: most recently sent
	// clock is the new KV tokens kvgate has sent the backend since the
	// index began: a chunk last sent at clock c is still cached while
	// clock-c stays under the cache's effective size.
	clock float64
	// scale corrects the cache's size by the measured hit rate, (0, 1].
	scale float64

	// Correction state: the predicted hits since the backend's counters
	// were last compared, and those counters then.
	pending             float64
	baseHits, baseQuery float64
	haveBase            bool
	observedAt          time.Time // the scrape last compared
	capacity            int       // the backend's KV tokens when last sent to

	// Totals for /metrics.
	predictedHits, queried float64
}

type indexEntry struct {
	hash uint64
	at   float64 // clock when last sent
}

func newPrefixIndex() *prefixIndex {
	return &prefixIndex{entries: map[uint64]*list.Element{}, scale: 1}
}

// match returns how many leading chunks of hashes the backend should still
// hold. Chained hashes make a present chunk imply its parents were sent
// with it; the LRU order keeps them at least as recent.
func (x *prefixIndex) match(hashes []uint64) int {
	return leading(hashes, func(h uint64) bool { _, ok := x.entries[h]; return ok })
}

// leading returns how many leading hashes have, for a set that holds
// every chunk's parents with it: the index (a prompt's chunks go in
// together and its tail leaves first) and the pins (a request pins all its
// chunks) are such sets, so a binary search finds the end of the run in
// O(log n) lookups, where a prompt of 6,000 tokens has 375 chunks.
func leading(hashes []uint64, has func(uint64) bool) int {
	lo, hi := 0, len(hashes)
	for lo < hi {
		mid := int(uint(lo+hi) >> 1)
		if has(hashes[mid]) {
			lo = mid + 1
		} else {
			hi = mid
		}
	}
	return lo
}

// sent records that a prompt's chunks went to the backend, which allocated
// newTokens of KV it did not find cached; capacity is its cache's size in
// tokens (0: unknown), pinned reports chunks in use there (never evicted).
func (x *prefixIndex) sent(hashes []uint64, newTokens float64, capacity int, pinned func(uint64) bool) {
	x.clock += max(newTokens, 0)
	// Last chunk first, so that the first ends most recent: vLLM frees a
	// request's blocks tail first, and evicts them in that order.
	for i := len(hashes) - 1; i >= 0; i-- {
		h := hashes[i]
		if e, ok := x.entries[h]; ok {
			e.Value.(*indexEntry).at = x.clock
			x.lru.MoveToFront(e)
			continue
		}
		x.entries[h] = x.lru.PushFront(&indexEntry{hash: h, at: x.clock})
	}
	x.evict(capacity, pinned)
}

// grew advances the clock by KV the backend allocated outside prompts:
// output tokens.
func (x *prefixIndex) grew(tokens float64, capacity int, pinned func(uint64) bool) {
	x.clock += max(tokens, 0)
	x.evict(capacity, pinned)
}

// evict forgets chunks the backend's cache has turned over since they were
// sent. With the capacity unknown it keeps at most maxIndexChunks.
func (x *prefixIndex) evict(capacity int, pinned func(uint64) bool) {
	size := x.scale * float64(capacity)
	if capacity <= 0 {
		size = math.Inf(1)
	}
	for n := x.lru.Len(); n > 0; n-- {
		e := x.lru.Back()
		ent := e.Value.(*indexEntry)
		if x.clock-ent.at <= size && len(x.entries) <= maxIndexChunks {
			return
		}
		if pinned != nil && pinned(ent.hash) {
			// In use there: still cached. It is old only in kvgate's clock.
			ent.at = x.clock
			x.lru.MoveToFront(e)
			continue
		}
		x.lru.Remove(e)
		delete(x.entries, ent.hash)
	}
}

// predicted adds a prediction of hit tokens for a prompt of query tokens.
func (x *prefixIndex) predicted(hit, query float64) {
	x.pending += hit
	x.predictedHits += hit
	x.queried += query
}

// observe compares the backend's cumulative prefix-cache counters (tokens)
// with the index's predictions since the last comparison and scales the
// cache's effective size: hits measured short of the prediction mean the
// cache turns over faster than kvgate's own traffic explains. Counters
// that went backwards mean the backend restarted with an empty cache: the
// index is cleared.
func (x *prefixIndex) observe(hits, queries float64) {
	switch {
	case !x.haveBase:
		x.baseHits, x.baseQuery, x.haveBase = hits, queries, true
		x.pending = 0
		return
	case hits < x.baseHits || queries < x.baseQuery:
		x.reset()
		x.baseHits, x.baseQuery, x.haveBase = hits, queries, true
		return
	case x.pending < correctEvery:
		return
	}
	ratio := (hits - x.baseHits) / x.pending
	switch {
	case ratio < 0.9:
		x.scale = max(minIndexScale, x.scale*max(ratio, 0.5))
	case ratio > 1:
		x.scale = min(1, x.scale*1.25)
	}
	x.baseHits, x.baseQuery, x.pending = hits, queries, 0
}

// reset forgets every chunk: the backend's cache is empty.
func (x *prefixIndex) reset() {
	clear(x.entries)
	x.lru.Init()
	x.pending = 0
}

// pin is a chunk that requests in flight on a backend hold; creator is
// the grant that brought it there.
type pin struct {
	refs    int
	tokens  int
	creator *Grant
}

// computedLeading returns how many of the first pinned chunks of p (held
// by requests in flight) the backend has computed already: vLLM shares a
// block only once it is computed and cached, so two requests whose new
// prefix is prefilled in the same steps each allocate it. A chunk counts
// as computed once the request that brought it has produced a token (its
// prefill is done) or ended; done says which have.
func (l *ledger) computedLeading(p *Prefix, pinned int, done func(*Grant) bool) int {
	var (
		last   *Grant
		lastOK bool
	)
	for i, h := range p.Hashes[:pinned] {
		c := l.pins[h].creator
		if c == nil {
			continue
		}
		if c != last {
			last, lastOK = c, done(c)
		}
		if !lastOK {
			return i
		}
	}
	return pinned
}

// pinnedLeading returns how many leading chunks of p are held on the
// backend by requests in flight.
func (l *ledger) pinnedLeading(p *Prefix) int {
	if l == nil || p == nil {
		return 0
	}
	return leading(p.Hashes, l.isPinned)
}

// pin takes a reference on each of p's chunks and returns the KV tokens
// that the chunks not held before add, and by how much the chunks held
// before changed: each takes p's tokens a chunk, the latest estimate, so
// that a chunk pinned under a cold estimate and held ever since by one
// request after another (a busy tenant's system prompt) does not keep an
// inflated size. Both are part of shared, and the caller's reserved.
func (l *ledger) pin(p *Prefix, g *Grant) (created, resized int) {
	if p == nil {
		return 0, 0
	}
	if l.pins == nil {
		l.pins = map[uint64]*pin{}
	}
	ct := p.chunkTokens()
	for _, h := range p.Hashes {
		if pn, ok := l.pins[h]; ok {
			pn.refs++
			resized += ct - pn.tokens
			pn.tokens = ct
			continue
		}
		l.pins[h] = &pin{refs: 1, tokens: ct, creator: g}
		created += ct
	}
	l.shared += created + resized
	return created, resized
}

// unpin drops p's references and returns the KV tokens of the chunks no
// request holds any more.
func (l *ledger) unpin(p *Prefix) (freed int) {
	if p == nil {
		return 0
	}
	for _, h := range p.Hashes {
		pn, ok := l.pins[h]
		if !ok {
			continue
		}
		if pn.refs--; pn.refs <= 0 {
			freed += pn.tokens
			delete(l.pins, h)
		}
	}
	l.shared -= freed
	return freed
}

func (l *ledger) isPinned(h uint64) bool {
	_, ok := l.pins[h]
	return ok
}

// Routing weighs three things for each backend that can admit a ticket:
// hit, the share of its prompt the backend should find cached (prefill it
// skips); held, the share already in memory there for requests in flight
// (KV it need not allocate); and its headroom after admission, as a share
// of the target:
//
//	score = hit + heldWeight × held + loadWeight × headroom/target
//
// With both weights under 1, a backend holding most of a prompt keeps
// getting it while it can admit it (sticky), and of two that have it, the
// one where it is in use wins unless its load is far higher: a tenant's
// requests gather on one backend rather than keep a copy of its prefix in
// use on each. A backend whose headroom has run out (admission refuses it)
// passes the ticket on (see Spilling); between backends with equal hits
// the less loaded wins; with no hits anywhere the choice is the most
// headroom, as without prefixes. Load always counts: prefix alone would
// pile a popular prefix onto one backend.
const (
	heldWeight = 0.5
	loadWeight = 0.5
)

// routeScore is a backend's routing score for a ticket it can admit.
func routeScore(hit, held, headroom, target float64) float64 {
	if target <= 0 {
		target = 1
	}
	return min(max(hit, 0), 1) + heldWeight*min(max(held, 0), 1) + loadWeight*headroom/target
}

// Placing a new prefix. A prompt that no backend holds any of (a new
// tenant's system prompt, a new conversation) decides more than where
// this one request runs: routing is sticky, so the requests that share
// its prefix will follow it there for as long as it stays cached. The
// headroom of the moment says little of that: a backend idle now because
// its tenants' last requests just ended takes the new tenant too, and
// after a few such draws one backend homes six tenants and the others
// three (seen in shared-prefix's trace), saturates first, and spills
// copies of its prefixes onto the others, each a prefix held twice. So a
// new prefix goes where the recent work is least (the prompt tokens sent
// there not expected cached plus the output budgets, decayed over the
// last recentWindow admissions to the fleet, a share of all of it), the
// headroom breaking near ties; a request without chunks, or with a prefix
// some backend holds, is routed by routeScore.
const (
	recentWindow = 128
	// placeHeadroomWeight weighs headroom (over the target) against the
	// recent share in placeScore: a share differs by 1/16 of the fleet's
	// work for one of sixteen equal tenants, the headroom of an idle and a
	// half-full backend by 0.05 in the score.
	placeHeadroomWeight = 0.1
)

// placeScore is a backend's score for a prompt new to the fleet: recent
// is its share of the fleet's recent work (recentShares).
func placeScore(recent, headroom, target float64) float64 {
	if target <= 0 {
		target = 1
	}
	return -recent + placeHeadroomWeight*headroom/target
}

// candidate is a backend that can admit a ticket, with what routing
// weighs.
type candidate struct {
	sn               *gpu.Snapshot
	hit, held        float64
	headroom, gap    float64
	pinned, computed int
}

// noteWork adds an admission's work to its backend's recent work and
// decays every backend's by one admission.
func (s *Scheduler) noteWork(backend string, tokens float64) {
	const keep = 1 - 1.0/recentWindow
	for b, w := range s.recent {
		s.recent[b] = w * keep
	}
	s.recent[backend] += max(tokens, 0)
}

// recentShares returns each backend's share of the fleet's recent work
// (nil before any admission).
func (s *Scheduler) recentShares() map[string]float64 {
	total := 0.0
	for _, w := range s.recent {
		total += w
	}
	if total <= 0 {
		return nil
	}
	out := make(map[string]float64, len(s.recent))
	for b, w := range s.recent {
		out[b] = w / total
	}
	return out
}

// Spilling. A request whose prefix is cached (or in use) on a backend that
// is only busy for now goes to another backend where hit+held is spillHit
// lower (more to prefill, or to allocate) only when waiting would cost
// more than the copy:
//
//   - never while the busy backend refuses it for a moment only (vLLM's
//     waiting queue is at its bound, or pacing spaces admissions): it takes
//     the request within a step or two, while a copy elsewhere prefills the
//     whole prefix (6,000 tokens: half a second of a 70B model's four
//     GPUs) and holds up every request behind it there;
//   - when it refuses for KV, sequences or this replica's share (saturated
//     until something ends there), only once the request has waited half
//     the starvation guard, and only where the other backend stays well
//     under its target after admission (spillHeadroom of its capacity
//     left). A backend full for the moment frees room for one more when
//     one of its requests ends (at saturation a 70B backend ends one every
//     ~0.2 s in shared-prefix), while a copy costs its prefill and then
//     6,000 tokens of KV held there for as long as the tenant's requests
//     keep going to both: in shared-prefix's trace, four of five copies
//     were made at half the top rate, by the first refusal for KV of a
//     backend that had room again within a few hundred milliseconds.
//
// A prefix lost that is short in tokens (under spillTokens) costs less to
// prefill again than a step of waiting, whatever its share of the prompt:
// a short chat prompt shares its first chunks with every other one (the
// chat template's head), a large share of a few dozen tokens. Held to its
// share alone, every such request waited for the backend it had gone to
// first while vLLM's queue there stayed at its bound: in the acceptance
// test at 1,000 jobs/s, all 4,499 of a run's jobs went to one of its two
// simulators, and each release checked the whole queue again.
//
// On a saturated fleet, spilling would copy every tenant's prefix onto
// every backend and crowd the cache with copies, as round-robin does;
// waiting keeps the hit rate and the throughput. Waiting does not starve:
// the queue is scanned in order, so the oldest waiter for a backend sees
// its room first, and once it has waited the starvation guard, later
// tickets may not take that backend's room in a pass (Scheduler.hold) —
// that backend's alone, where a ticket that fits nowhere holds up its whole
// model.
//
// spillTokens is sixteen vLLM blocks: an eighth of the smallest token
// budget of a vLLM step (max_num_batched_tokens, 2,048; 8,192 on an
// H100 or H200).
const (
	spillHit      = 0.2
	spillHeadroom = 0.2
	spillTokens   = 256
)

// spills is the spill decision, pure: whether a ticket (with prefix
// chunks or not) may go to a backend that holds lost less of its
// hit+held than a busy one (lostTokens of its prompt), with headroom
// (share of capacity) left there after admission; transient says the
// busy backend refused only for a moment (transientBusy), waited that the
// ticket has waited half the starvation guard.
func spills(hasPrefix bool, lost, lostTokens, headroom float64, transient, waited bool) bool {
	switch {
	case !hasPrefix || lost < spillHit || lostTokens < spillTokens:
		return true
	case transient || !waited:
		return false
	}
	return headroom >= spillHeadroom
}

// reasonHold is a backend kept, for the rest of a pass, for an older
// ticket waiting for it (Scheduler.hold): saturated, not transient.
const reasonHold = "held_for_older"

// transientBusy reports whether a refusal lasts only a step or two: vLLM's
// own queue at its bound, or pacing.
func transientBusy(reason string) bool {
	return reason == reasonWaiting || reason == reasonPacing
}

// busyBest is the best backend that can take a ticket only later, for the
// spill decision: its hit+held, its name, whether its refusal is
// transient, and the KV the ticket needs there.
type busyBest struct {
	value     float64
	where     string
	transient bool
	need      int
}

// noteBusy records a backend that cannot take t only for now, for reason;
// t needs need KV tokens there.
func (s *Scheduler) noteBusy(sn *gpu.Snapshot, t *Ticket, pinned int, reason string, need int, b *busyBest) {
	if v := s.expectedHit(sn, t, pinned) + t.heldShare(pinned); v > b.value {
		*b = busyBest{value: v, where: sn.Name, transient: transientBusy(reason), need: need}
	}
}

// heldShare is the share of t's prompt in memory on a backend where
// pinned of its leading chunks are held by requests in flight.
func (t *Ticket) heldShare(pinned int) float64 {
	if t.PromptTokens <= 0 || t.Prefix == nil {
		return 0
	}
	return min(1, float64(t.Prefix.tokens(pinned))/float64(t.PromptTokens))
}

// holdLocked keeps a backend's room, for the rest of a pump, for the
// oldest ticket waiting for it, which needs need KV tokens there: later
// tickets take room there only where it does not delay that one
// (delaysHolder). A later holder of the same backend in the pass does not
// replace the first.
func (s *Scheduler) holdLocked(backend string, need int) {
	if s.hold == nil {
		s.hold = map[string]int{}
	}
	if _, ok := s.hold[backend]; !ok {
		s.hold[backend] = max(need, 1)
	}
}

func (s *Scheduler) releaseHolds() { clear(s.hold) }

// busy reports whether a refusal is load that passes (the backend will
// take the ticket once something ends), not a backend out of service.
func busy(reason string) bool {
	switch reason {
	case reasonKV, reasonPacing, reasonWaiting, reasonSeqs, reasonShare, reasonHold:
		return true
	}
	return false
}

// index returns a backend's prefix index, creating it empty.
func (s *Scheduler) index(backend string) *prefixIndex {
	x := s.prefixes[backend]
	if x == nil {
		x = newPrefixIndex()
		s.prefixes[backend] = x
	}
	return x
}

// expectedHit is the share of t's prompt that backend sn should find
// cached: the chunks its index still holds, at least those pinned there
// by requests in flight. It first brings the index's correction up to the
// backend's last scrape.
func (s *Scheduler) expectedHit(sn *gpu.Snapshot, t *Ticket, pinned int) float64 {
	if t.Prefix == nil || t.PromptTokens <= 0 || sn.Metrics.NoPrefixCaching {
		return 0
	}
	x := s.index(sn.Name)
	if sn.Metrics.HasPrefix && sn.ScrapedAt.After(x.observedAt) {
		x.observedAt = sn.ScrapedAt
		x.observe(sn.Metrics.PrefixHits, sn.Metrics.PrefixQueries)
	}
	n := max(x.match(t.Prefix.Hashes), pinned)
	return min(1, float64(t.Prefix.tokens(n))/float64(t.PromptTokens))
}

// prefixSent records KV sent to a backend in its index: a prompt's chunks
// and the new tokens they cost (capacity is the backend's KV size, or 0),
// or, with hashes nil, output tokens.
func (s *Scheduler) prefixSent(backend string, hashes []uint64, newTokens float64, capacity int, pinned func(uint64) bool) {
	x := s.prefixes[backend]
	if hashes == nil {
		if x != nil { // else no prompt with chunks went there yet
			x.grew(newTokens, x.capacity, pinned)
		}
		return
	}
	x = s.index(backend)
	x.capacity = capacity
	x.sent(hashes, newTokens, capacity, pinned)
}

var (
	descPrefixPredicted = prometheus.NewDesc("kvgate_prefix_predicted_hit_tokens_total",
		"Prompt tokens kvgate predicted a backend would find in its prefix cache, for the requests it sent there (compare vllm:prefix_cache_hits_total).", []string{"backend"}, nil)
	descPrefixQueried = prometheus.NewDesc("kvgate_prefix_query_tokens_total",
		"Prompt tokens of the requests with prefix chunks kvgate sent to a backend (compare vllm:prefix_cache_queries_total).", []string{"backend"}, nil)
	descPrefixChunks = prometheus.NewDesc("kvgate_prefix_index_chunks",
		"Prompt chunks a backend's prefix index holds as likely cached there.", []string{"backend"}, nil)
	descPrefixScale = prometheus.NewDesc("kvgate_prefix_index_scale_ratio",
		"The share of a backend's KV capacity its prefix index assumes is kept cached, corrected by the measured hit rate (1: all of it).", []string{"backend"}, nil)
	descPrefixShared = prometheus.NewDesc("kvgate_scheduler_backend_shared_tokens",
		"KV tokens of prompt chunks that requests in flight on a backend share, reserved once.", []string{"backend"}, nil)
)

// prefixCollector reads the prefix indexes at scrape time.
type prefixCollector struct{ s *Scheduler }

func (c prefixCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{descPrefixPredicted, descPrefixQueried, descPrefixChunks, descPrefixScale, descPrefixShared} {
		ch <- d
	}
}

func (c prefixCollector) Collect(ch chan<- prometheus.Metric) {
	s := c.s
	s.mu.Lock()
	defer s.mu.Unlock()
	for name, x := range s.prefixes {
		ch <- prometheus.MustNewConstMetric(descPrefixPredicted, prometheus.CounterValue, x.predictedHits, name)
		ch <- prometheus.MustNewConstMetric(descPrefixQueried, prometheus.CounterValue, x.queried, name)
		ch <- prometheus.MustNewConstMetric(descPrefixChunks, prometheus.GaugeValue, float64(len(x.entries)), name)
		ch <- prometheus.MustNewConstMetric(descPrefixScale, prometheus.GaugeValue, x.scale, name)
	}
	for name, l := range s.ledgers {
		ch <- prometheus.MustNewConstMetric(descPrefixShared, prometheus.GaugeValue, float64(l.shared), name)
	}
}

// PrefixStat is one backend's prefix index, for reports.
type PrefixStat struct {
	Backend string
	// PredictedHitTokens and QueryTokens are the prompt tokens kvgate
	// predicted the backend would find cached, and all the prompt tokens
	// it sent there with chunks: their ratio is the predicted hit rate,
	// to set beside the backend's measured one.
	PredictedHitTokens, QueryTokens float64
	Chunks                          int
	Scale                           float64
}

// PrefixStats returns every backend's prefix index, by backend name.
func (s *Scheduler) PrefixStats() []PrefixStat {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]PrefixStat, 0, len(s.prefixes))
	for name, x := range s.prefixes {
		out = append(out, PrefixStat{Backend: name, PredictedHitTokens: x.predictedHits, QueryTokens: x.queried, Chunks: len(x.entries), Scale: x.scale})
	}
	slices.SortFunc(out, func(a, b PrefixStat) int { return strings.Compare(a.Backend, b.Backend) })
	return out
}

// prefilled reports, for the grants on backend sn, whether a grant's
// prefill is done: it produced a token (a stream's count, else its low
// progress estimate on the backend's step clock) or it ended.
func (s *Scheduler) prefilled(sn *gpu.Snapshot, now time.Time) func(*Grant) bool {
	stepsNow, ok := sn.StepsAt(now)
	if !ok {
		stepsNow = -1
	}
	return func(g *Grant) bool {
		if g.released {
			return true
		}
		lo, _ := g.progress(now, stepsNow, sn.DecodeRate, sn.Metrics.Generation, s.policy.ProgressFactor)
		return lo >= 1
	}
}
