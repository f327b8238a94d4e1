// Package baseline holds the routers kvgate is measured against: plain
// HTTP handlers in front of a list of vLLM base URLs that pass each request
// through unchanged and decide only where it goes.
//
//   - RoundRobin sends each request to the next backend, as a Kubernetes
//     Service or a plain load balancer does.
//   - Threshold routes as the Kubernetes inference gateway's endpoint picker
//     (EPP) does with its utilization detector: it scrapes every backend's
//     /metrics, keeps those whose vLLM queue and KV-cache use are under the
//     EPP's default thresholds (waiting ≤ 5, KV ≤ 0.8), picks the least
//     loaded of them, and fails open to the least loaded of all when none
//     qualifies. Like the EPP without flow control, it never queues.
//   - Prefix routes as llm-d's endpoint picker does with its approximate
//     prefix-cache scorer: chained hashes of 64-byte prompt chunks (chat
//     template applied), an LRU of the chunks it sent each backend, and a
//     score of prefix match ×3 + queue ×2 + free KV ×2 (llm-d's
//     inference-scheduling weights), highest wins; it never queues either.
//
// None has admission, a queue, tenants or durable jobs; that is the
// point of comparing against them. The package is for benchmarks only:
// nothing in kvgate's serving path imports it.
package baseline
