// Package store owns durable job state: the contract every backend
// implements, its types and its errors.
//
// A job is accepted once per tenant and idempotency key, with a hash of
// every result-affecting input; the same key with the same hash returns the
// same job, a different hash is ErrConflict. The acceptance writes the job
// and its outbox event in one transaction. Execution ownership moves by
// short transactions: Claim leases runnable jobs (fence+1; it spends no
// attempt), Heartbeat and MarkSent extend a lease only while the claim
// owns the job, and Complete and Fail change a job only while state, fence
// and lease still hold, writing the attempt record and the outbox event
// with the state change. An attempt counts only when its request reached a
// backend (or the input is invalid): a wait or an interruption hands the
// job back without spending one. A stale worker gets ErrLeaseLost and its
// result is discarded. The reaper turns expired leases into retries (with
// a new fence) or terminal failures, by the same rule as Fail: the lost
// attempt counts when its claim had marked the request sent. No restart
// resets an attempt counter. Stages checkpoint intermediate results
// (the inference output) so that a retry of a later stage does not pay for
// an earlier one again. The inbox records each delivered event once.
//
// Two implementations satisfy the contract: store/postgres (pgx, for
// production and several replicas) and store/sqlite (pure Go, the embedded
// single-process default). store/storetest is the one suite both pass.
//
// The package does not schedule, call models or publish events: it records
// what the scheduler and the relay decide.
package store
