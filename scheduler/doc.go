// Package scheduler decides when and where each request runs.
//
// Every request becomes a [Ticket] that reserves KV-cache tokens: its prompt
// plus the output it may produce. [Scheduler.Acquire] admits a ticket to a
// backend only while the backend's predicted KV occupancy stays under the
// target, its running sequences stay under max_num_seqs and vLLM's own
// waiting queue stays near zero; otherwise the ticket waits in kvgate, in
// priority order, until its deadline. Queueing here, where priority and
// fairness apply, keeps vLLM from queueing (and preempting) on its own.
//
// The prediction combines two signals, because neither is enough alone:
// kvgate's ledger of what it has admitted, projected forward as each
// sequence grows by one token per engine step until it finishes, and the
// KV usage the backend last reported, which shows load kvgate did not send
// and corrects the ledger's drift. Snapshots older than the staleness bound
// count as saturated.
//
// The durable side lives here too: the [Runner] claims jobs from the store
// into the room the fleet has (room.go), admits them as the batch class,
// runs them through an [Executor] and records each attempt's end under its
// claim's fence; the [Broker] (broker.go) carries the store's outbox to
// NATS JetStream and back through the inbox (relay.go, inbox.go,
// signals.go), and counts the replicas that share the fleet (replicas.go).
// The files follow the concepts: policy.go (thresholds), ticket.go,
// grant.go (a backend's ledger and its grants), queue.go (waiting and
// admission), scheduler.go (the choice of a backend), fair.go (weighted
// fair queueing), admission.go (the pure decision), retry.go (error
// classes and backoff).
//
// The package does not speak HTTP or proxy requests (package gateway does),
// and it keeps no durable state of its own: the store does.
package scheduler
