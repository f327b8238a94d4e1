package scheduler

import (
	"math"
)

// defaultMaxNumSeqs stands for a backend's max_num_seqs when its metrics
// do not say (vLLM's default).
const defaultMaxNumSeqs = 256

// Room returns how many more batch tickets the routable backends could
// start soon: per backend, the sequences this replica's share of it may
// still run (its max_num_seqs, and its KV budget over the mean
// reservation in flight there, when known), less what kvgate has in
// flight there; less every ticket already waiting in kvgate's queues.
// The durable runner claims no more than this, so that jobs wait in the
// store, where any replica may take them, not in one replica's memory.
// A routable backend with nothing in flight always has room for one.
// While interactive work is about on a backend, its room is the batch
// share's (classRoomLocked).
func (s *Scheduler) Room() int {
	snaps := s.src.Snapshots()
	now := s.now()
	s.mu.Lock()
	defer s.mu.Unlock()
	room := 0
	for _, sn := range snaps {
		if !sn.Routable() {
			continue
		}
		seqs := sn.MaxNumSeqs
		if seqs <= 0 {
			seqs = defaultMaxNumSeqs
		}
		allowed := int(float64(seqs) * s.share)
		inflight := 0
		l := s.ledgers[sn.Name]
		if l != nil {
			inflight = len(l.grants)
			if sn.CapacityTokens > 0 && inflight > 0 {
				mean := float64(l.reserved) / float64(inflight)
				budget := s.policy.KVTarget * s.share * float64(sn.CapacityTokens)
				allowed = min(allowed, int(math.Floor(budget/max(mean, 1))))
			}
		}
		room += min(max(allowed-inflight, 0, 1-inflight), s.classRoomLocked(sn, l, now))
	}
	return max(room-s.queued, 0)
}
