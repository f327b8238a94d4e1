package scheduler

import (
	"math"
	"slices"
)

// defaultMaxNumSeqs stands for a backend's max_num_seqs when its metrics
// do not say (vLLM's default).
const defaultMaxNumSeqs = 256

// Room returns how many more batch tickets the routable backends could
// start soon: ClaimRoom's total.
func (s *Scheduler) Room() int {
	n, _ := s.ClaimRoom()
	return n
}

// ClaimRoom returns how many more batch tickets the routable backends
// could start soon, and the models that room is for. Per backend, its
// room is the sequences this replica's share of it may still run (its
// max_num_seqs, and its KV budget over the mean reservation in flight
// there, when known), less what kvgate has in flight there; a routable
// backend with nothing in flight always has room for one. While
// interactive work is about on a backend, its room is the batch share's
// (classRoomLocked). A model's room is that of the backends serving it,
// less its tickets already waiting in kvgate's queues; the total is the
// backends' room less the waiting tickets, each model's counted up to its
// own room: a model whose backends are full keeps its queue to itself,
// and takes no room from the others. The durable runner claims no more
// than the total, and only jobs of the models with room, so that jobs
// wait in the store, where any replica may take them, not in one
// replica's memory, and one saturated model's backlog does not hold the
// runner's slots while other models' backends stand idle.
func (s *Scheduler) ClaimRoom() (room int, models []string) {
	snaps := s.src.Snapshots()
	now := s.now()
	s.mu.Lock()
	defer s.mu.Unlock()
	perModel := map[string]int{}
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
		r := min(max(allowed-inflight, 0, 1-inflight), s.classRoomLocked(sn, l, now))
		room += r
		for _, m := range sn.Models {
			perModel[m.ID] += r
		}
	}
	for m, counts := range s.byModel {
		queued := 0
		for _, n := range counts {
			queued += n
		}
		room -= min(queued, max(perModel[m], 0))
		perModel[m] -= queued
	}
	for m, r := range perModel {
		if r > 0 {
			models = append(models, m)
		}
	}
	slices.Sort(models)
	return max(room, 0), models
}
