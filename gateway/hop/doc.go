// Package hop is the HTTP/1.1 client kvgate forwards requests to its
// backends with: each exchange runs on the goroutine that asked for it.
//
// net/http's Transport hands every request to a writing goroutine and
// every answer back from a reading one, and that reading goroutine also
// watches idle connections. Each handoff is a wake-up, and on a small,
// busy host the wake-ups are most of what a hop costs (docs/benchmarks.md,
// the gateway's overhead). Transport here writes the request, reads the
// answer and hands the connection back to its pool on the caller's
// goroutine, and checks an idle connection with one non-blocking peek
// before it reuses it, in place of a watcher. net/http's Request.Write and
// ReadResponse do the wire format.
//
// It is for plain-HTTP backends that read a request whole before they
// answer, as vLLM does, and for bodies of known length up to MaxBody
// (64 KiB): one goroutine that writes and then reads could be held by a
// server that answers early and then neither reads nor closes, and the
// bound keeps such a write short. An answer that arrives before the body
// was written whole, a refusal, is still read and returned. Everything
// else (https, bodies of unknown length or over MaxBody, upgrades,
// Expect, platforms without the peek) goes to Fallback, a net/http
// Transport.
//
// It is not a general HTTP client: no proxies, no HTTP/2, no
// 100-continue, no compression, and no retries but of a request that
// never left a reused connection.
package hop
