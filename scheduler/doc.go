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
// The package does not speak HTTP or proxy requests (package gateway does),
// and it keeps no durable state.
package scheduler
