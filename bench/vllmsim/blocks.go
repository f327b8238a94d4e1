package vllmsim

// blockPool is the paged KV cache: num_gpu_blocks blocks of block_size
// tokens, as vLLM's BlockPool keeps them. Block 0 is the null block and is
// never handed out, so num_gpu_blocks-1 blocks are usable.
//
// Free blocks wait in an LRU queue. A freed block that holds a full block of
// tokens keeps its hash and stays findable by prefix lookups until it is
// handed out again (evicted) from the head of the queue; a lookup hit takes
// it out of the queue. The pool is not safe for concurrent use: the engine's
// step owns it.
type blockPool struct {
	blocks  []kvBlock
	free    int   // blocks in the free queue
	head    int32 // LRU end (next to hand out); -1 when empty
	tail    int32 // MRU end
	cached  map[uint64]int32
	caching bool

	evictions uint64
}

type kvBlock struct {
	ref        int32
	hash       uint64 // 0: not a cached full block
	prev, next int32  // free-queue links, -1 at the ends
	inFree     bool
}

func newBlockPool(numBlocks int, prefixCaching bool) *blockPool {
	p := &blockPool{
		blocks:  make([]kvBlock, numBlocks),
		head:    -1,
		tail:    -1,
		cached:  make(map[uint64]int32),
		caching: prefixCaching,
	}
	for i := 1; i < numBlocks; i++ {
		p.blocks[i].prev, p.blocks[i].next = -1, -1
		p.pushTail(int32(i))
	}
	return p
}

// usable is the number of blocks that can ever be handed out.
func (p *blockPool) usable() int { return len(p.blocks) - 1 }

// numFree counts free blocks, including evictable cached ones.
func (p *blockPool) numFree() int { return p.free }

// usage is vLLM's kv_cache_usage_perc: 1 - free/(num_gpu_blocks-1).
func (p *blockPool) usage() float64 {
	return 1 - float64(p.free)/float64(p.usable())
}

func (p *blockPool) pushTail(id int32) {
	b := &p.blocks[id]
	b.prev, b.next, b.inFree = p.tail, -1, true
	if p.tail >= 0 {
		p.blocks[p.tail].next = id
	} else {
		p.head = id
	}
	p.tail = id
	p.free++
}

func (p *blockPool) unlink(id int32) {
	b := &p.blocks[id]
	if b.prev >= 0 {
		p.blocks[b.prev].next = b.next
	} else {
		p.head = b.next
	}
	if b.next >= 0 {
		p.blocks[b.next].prev = b.prev
	} else {
		p.tail = b.prev
	}
	b.prev, b.next, b.inFree = -1, -1, false
	p.free--
}

// lookup returns the longest run of cached blocks matching hashes, in order.
func (p *blockPool) lookup(hashes []uint64) []int32 {
	if !p.caching {
		return nil
	}
	var hit []int32
	for _, h := range hashes {
		id, ok := p.cached[h]
		if !ok {
			break
		}
		hit = append(hit, id)
	}
	return hit
}

// evictableAmong counts blocks in ids that sit in the free queue: touching
// them takes them out of it, so they count against the free blocks.
func (p *blockPool) evictableAmong(ids []int32) int {
	n := 0
	for _, id := range ids {
		if p.blocks[id].ref == 0 {
			n++
		}
	}
	return n
}

// touch takes a reference on each block, taking free ones out of the queue.
func (p *blockPool) touch(ids []int32) {
	for _, id := range ids {
		b := &p.blocks[id]
		if b.ref == 0 && b.inFree {
			p.unlink(id)
		}
		b.ref++
	}
}

// take hands out n blocks from the LRU end, evicting their cached hashes.
// The caller has checked that n blocks are free.
func (p *blockPool) take(n int, into []int32) []int32 {
	for range n {
		id := p.head
		p.unlink(id)
		b := &p.blocks[id]
		if b.hash != 0 {
			if p.cached[b.hash] == id {
				delete(p.cached, b.hash)
			}
			b.hash = 0
			p.evictions++
		}
		b.ref = 1
		into = append(into, id)
	}
	return into
}

// release drops a reference on each block, in reverse order so that a
// request's tail blocks are evicted before its prefix, as vLLM does.
func (p *blockPool) release(ids []int32) {
	for i := len(ids) - 1; i >= 0; i-- {
		id := ids[i]
		b := &p.blocks[id]
		b.ref--
		if b.ref == 0 {
			p.pushTail(id)
		}
	}
}

// cacheBlock records that block id holds the full block with the given
// chained hash. A hash already cached elsewhere keeps its first block.
func (p *blockPool) cacheBlock(id int32, hash uint64) {
	if !p.caching || hash == 0 {
		return
	}
	b := &p.blocks[id]
	if b.hash != 0 {
		return
	}
	if _, dup := p.cached[hash]; dup {
		return
	}
	b.hash = hash
	p.cached[hash] = id
}

// blockHash chains a full block's tokens onto its parent's hash.
func blockHash(parent uint64, toks []int) uint64 {
	const prime = 0x100000001b3
	h := parent ^ 0xcbf29ce484222325
	for _, t := range toks {
		h ^= uint64(t)
		h *= prime
	}
	// Finalise (splitmix64) so that nearby inputs spread; 0 means "none".
	h ^= h >> 30
	h *= 0xbf58476d1ce4e5b9
	h ^= h >> 27
	h *= 0x94d049bb133111eb
	h ^= h >> 31
	if h == 0 {
		h = 1
	}
	return h
}
