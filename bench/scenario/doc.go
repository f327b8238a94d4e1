// Package scenario runs kvgate's named benchmark scenarios: each starts a
// simulated vLLM fleet and, in turn, kvgate and the three baselines of
// package baseline (round-robin, threshold, prefix) in front of it, all in-process on loopback HTTP, sends
// every target the same seeded arrivals through the bench harness, and
// compares them in a short verdict table of ratios.
//
// Every target gets a fresh fleet (empty KV caches, zeroed counters), and
// the targets run one after the other, so that no run disturbs another on
// a small machine. The fleet runs its clock faster than wall time
// (Options.Speedup); arrival rates are scaled up to match and every figure
// is reported in simulated time, using the speed-up the fleet actually
// reached.
//
// The package is a benchmark harness: nothing in kvgate's serving path
// imports it.
package scenario
