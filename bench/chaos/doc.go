// Package chaos is kvgate's chaos suite: scripted faults against real
// processes, each followed by the same invariant checks over the job store
// and the simulated backends' counters.
//
// The suite is tests only (make chaos, make chaos-short). TestMain builds
// the kvgate binary once, starts a private PostgreSQL cluster (initdb into
// a temporary directory, on a free port) and runs each scenario against
// its own database, its own nats-server with JetStream and its own
// `kvgate sim` backends, all started as child processes. The faults are
// real: kill -9 of kvgate, kill -9 and restart of nats-server, pg_ctl
// restart of the private cluster, backends that are not listening yet,
// SIGTERM, and the simulators' injected 429s, hangs, malformed answers and
// dropped connections. The machine's shared PostgreSQL and NATS are never
// touched.
//
// After each scenario, checkInvariants reads the jobs, attempts and outbox
// tables and the simulators' /metrics and reports, per invariant and per
// job, every one that does not hold:
//
//   - accounted: every accepted job is in the store, and is final or still
//     runnable; the store holds no job the client was not given.
//   - no_silent_terminal: a FAILED_TERMINAL job spent an attempt that
//     reached a backend and failed there (or its deadline passed), and
//     spent its budget or failed for good.
//   - completed_once: no job completed twice (attempt records and outbox
//     events); a SUCCEEDED job has its one success and its result.
//   - explained: every attempt record has an outcome and an error class;
//     only attempts whose request was sent (or whose input is invalid)
//     spend, waits and interruptions never do, and the job's attempt
//     counter equals its spent attempts.
//   - backend_budget: the requests the simulators' engines saw are no more
//     than the attempt records that may have sent one (spent ones, plus the
//     uncertain ones: a lease that expired, an interruption) and the jobs
//     still running.
//   - served: every SUCCEEDED job's result was produced by an engine.
//
// Which scenarios run is chosen by KVGATE_CHAOS (full, short or off); see
// docs/chaos.md. The package is not a load test or a benchmark: it
// asserts no speed, only that no admitted job is lost, duplicated or
// failed without cause.
package chaos
