// Package bench measures kvgate and the servers behind it: load generation
// and the statistics of what it measured. Its subpackage vllmsim is the vLLM
// simulator everything is measured against.
//
// Requests are timed from their intended send time, not from when a busy
// client got around to sending them, so a slow target cannot hide its
// latency (no coordinated omission).
//
// The package is a harness: no kvgate library package imports it outside
// tests.
package bench
