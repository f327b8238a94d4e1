// Package gpu knows the backends kvgate dispatches to: vLLM servers and the
// GPUs under them.
//
// A [Pool] keeps, for each configured backend, the models it serves (from
// its /v1/models), its health (from /health probes and from what the
// dispatcher reports, with outlier ejection and recovery), and a [Snapshot]
// of its engine state scraped from its Prometheus /metrics: running and
// waiting requests, KV-cache usage and capacity, preemptions. A snapshot
// older than the staleness bound is marked stale, and the scheduler treats a
// stale backend as saturated, never as empty. [NVML] reads the GPUs
// themselves through NVIDIA's management library.
//
// The package does not decide admission or route requests: that is the
// scheduler's job, which reads snapshots from here. It imports no other
// kvgate package.
package gpu
