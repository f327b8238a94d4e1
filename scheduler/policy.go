package scheduler

import (
	"cmp"
	"errors"
	"fmt"
	"time"
)

// Class is a ticket's priority class; lower runs first.
type Class int

// The classes: interactive requests hold a connection open; batch work is
// durable and fills what interactive traffic leaves.
const (
	Interactive Class = iota
	Batch
	numClasses
)

func (c Class) String() string {
	if c == Interactive {
		return "interactive"
	}
	return "batch"
}

// Policy sets the admission thresholds. Zero values take the defaults in
// brackets.
type Policy struct {
	// KVTarget is the share of a backend's KV capacity that admitted work
	// may be predicted to fill [0.95]. The prediction counts whole KV
	// blocks, as vLLM allocates them, so the target need only cover
	// what the prediction cannot see: prompt estimates and progress.
	KVTarget float64 `yaml:"kv_target"`
	// DegradedFactor scales KVTarget for a backend whose GPUs are degraded
	// (throttling, running hot) [0.7].
	DegradedFactor float64 `yaml:"degraded_factor"`
	// MaxBackendWaiting is how many requests may wait in vLLM's own queue
	// before kvgate stops sending more [2].
	MaxBackendWaiting int `yaml:"max_backend_waiting"`
	// MaxQueue caps the tickets waiting in kvgate, per class; beyond it,
	// 503 [4096].
	MaxQueue int `yaml:"max_queue"`
	// MaxQueueWait is how long a ticket may wait when it has no deadline
	// of its own [30s].
	MaxQueueWait time.Duration `yaml:"max_queue_wait"`
	// StarvationGuard is how long the oldest ticket of a model may be
	// passed over by smaller ones before it blocks them [2s].
	StarvationGuard time.Duration `yaml:"starvation_guard"`
	// ProgressFactor sets how wide admission brackets the decode progress
	// of a request that does not report it (non-streaming): from factor to
	// 2-factor times the estimate, since a request may wait in vLLM's
	// queue before its first step [0.95].
	ProgressFactor float64 `yaml:"progress_factor"`
	// BatchShare is the part of each backend's KV budget and sequences
	// up to which batch-class work (durable jobs, Batch API lines) is
	// admitted while interactive work is about on the backend (waiting
	// in kvgate for a model it serves, or arrived for one within
	// batch_share_hold): a batch ticket goes only where everything on the
	// backend, interactive work included, stays within it, and never into
	// vLLM's own queue. The rest is kept free for interactive arrivals;
	// with no interactive work about, batch work fills whole backends.
	// 1 turns the cap off [0.7].
	BatchShare float64 `yaml:"batch_share"`
	// BatchShareHold is how long after an interactive arrival the batch
	// share still applies to the backends serving its model [30s].
	BatchShareHold time.Duration `yaml:"batch_share_hold"`
}

func (p *Policy) defaults() {
	p.KVTarget = cmp.Or(p.KVTarget, 0.95)
	p.DegradedFactor = cmp.Or(p.DegradedFactor, 0.7)
	p.MaxBackendWaiting = cmp.Or(p.MaxBackendWaiting, 2)
	p.MaxQueue = cmp.Or(p.MaxQueue, 4096)
	p.MaxQueueWait = cmp.Or(p.MaxQueueWait, 30*time.Second)
	p.StarvationGuard = cmp.Or(p.StarvationGuard, 2*time.Second)
	p.ProgressFactor = cmp.Or(p.ProgressFactor, 0.95)
	p.BatchShare = cmp.Or(p.BatchShare, 0.7)
	p.BatchShareHold = cmp.Or(p.BatchShareHold, 30*time.Second)
}

// Validate reports a policy that cannot work.
func (p Policy) Validate() error {
	switch { // written so that NaN, which compares false, fails
	case !(p.KVTarget >= 0 && p.KVTarget <= 1):
		return fmt.Errorf("kv_target %g must be in (0, 1]", p.KVTarget)
	case !(p.DegradedFactor >= 0 && p.DegradedFactor <= 1):
		return fmt.Errorf("degraded_factor %g must be in (0, 1]", p.DegradedFactor)
	case !(p.ProgressFactor >= 0 && p.ProgressFactor <= 1) || (p.ProgressFactor != 0 && p.ProgressFactor < 0.5):
		return fmt.Errorf("progress_factor %g must be in [0.5, 1]", p.ProgressFactor)
	case !(p.BatchShare >= 0 && p.BatchShare <= 1):
		return fmt.Errorf("batch_share %g must be in (0, 1]", p.BatchShare)
	case p.MaxQueue < 0 || p.MaxBackendWaiting < 0 || p.MaxQueueWait < 0 || p.StarvationGuard < 0 || p.BatchShareHold < 0:
		return errors.New("max_queue, max_backend_waiting, max_queue_wait, starvation_guard and batch_share_hold must not be negative")
	}
	return nil
}
