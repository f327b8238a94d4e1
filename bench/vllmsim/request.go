package vllmsim

import (
	"math/rand/v2"
	"sync"
	"time"
)

type reqState uint8

const (
	stateNew reqState = iota
	stateWaiting
	stateRunning
	stateFinished
)

// Request is one request inside the engine. The engine writes it; readers
// follow it with Notify and Read, which are safe for concurrent use.
type Request struct {
	// Set at submission, read-only afterwards.
	prompt    []int
	maxTokens int
	target    int // output tokens to generate (the stand-in for EOS)
	seq       uint64
	arrival   time.Duration

	// Owned by the engine's step loop.
	rng              *rand.Rand
	tokens           []int // prompt then output: the sequence whose KV is computed
	hashes           []uint64
	cachedBlocks     int
	numComputed      int
	blocks           []int32
	state            reqState
	scheduledAt      time.Duration
	firstScheduledAt time.Duration
	firstTokenAt     time.Duration
	lastTokenAt      time.Duration
	finishing        string
	preemptions      int

	notify chan struct{}
	doneCh chan struct{}

	mu       sync.Mutex // guards the fields below
	out      []int
	times    []time.Duration
	finished bool
	reason   string
	err      error
}

// PromptTokens returns the number of prompt tokens.
func (r *Request) PromptTokens() int { return len(r.prompt) }

// Arrival returns the simulated time the engine received the request.
func (r *Request) Arrival() time.Duration { return r.arrival }

// Notify returns a channel that receives a value after new output or the
// request's end becomes readable. Values coalesce: after each receive, Read
// everything.
func (r *Request) Notify() <-chan struct{} { return r.notify }

// Done returns a channel that is closed when the request has ended.
func (r *Request) Done() <-chan struct{} { return r.doneCh }

// Target returns the number of output tokens the request will produce
// unless it is aborted: the stand-in for the model's end of sequence.
func (r *Request) Target() int { return r.target }

// Read returns the output tokens from index from on and, once the request
// has ended, its finish reason and error (ErrEngineDead when the engine
// died under it).
func (r *Request) Read(from int) (toks []int, finished bool, reason string, err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if from < len(r.out) {
		toks = r.out[from:len(r.out):len(r.out)]
	}
	return toks, r.finished, r.reason, r.err
}

// TokenTimes returns the simulated time each output token was produced.
func (r *Request) TokenTimes() []time.Duration {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]time.Duration(nil), r.times...)
}

// Preemptions returns how often the request was preempted; read it after
// the request has finished.
func (r *Request) Preemptions() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.preemptions
}

func (r *Request) generated() int { return len(r.tokens) - len(r.prompt) }

// emit publishes one output token and reports whether it was the first.
func (r *Request) emit(tok int, now time.Duration) bool {
	r.mu.Lock()
	first := len(r.out) == 0
	if first {
		r.firstTokenAt = now
	}
	r.out = append(r.out, tok)
	r.times = append(r.times, now)
	r.mu.Unlock()
	r.wake()
	return first
}

func (r *Request) done(reason string, err error) {
	r.mu.Lock()
	r.finished, r.reason, r.err = true, reason, err
	r.mu.Unlock()
	close(r.doneCh)
	r.wake()
}

func (r *Request) wake() {
	select {
	case r.notify <- struct{}{}:
	default:
	}
}

// blockHashes returns the chained hashes of the first n full blocks of the
// request's known tokens, computing only the ones not yet known.
func (r *Request) blockHashes(blockSize, n int) []uint64 {
	for i := len(r.hashes); i < n; i++ {
		var parent uint64
		if i > 0 {
			parent = r.hashes[i-1]
		}
		r.hashes = append(r.hashes, blockHash(parent, r.tokens[i*blockSize:(i+1)*blockSize]))
	}
	return r.hashes[:n]
}
