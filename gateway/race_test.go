//go:build race

package gateway

// raceEnabled reports a -race build, whose slowdown distorts experiments
// that measure throughput.
const raceEnabled = true
