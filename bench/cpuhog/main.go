// Command cpuhog keeps one CPU core busy for a bounded time, to measure
// kvgate beside a noisy neighbour (docs/benchmarks.md):
//
//	go run ./bench/cpuhog -for 5m &
//	kvgate bench scenario overload
//
// It spins one goroutine locked to one OS thread (one core's worth of
// work; the OS picks the core) and exits after -for, or at SIGINT or
// SIGTERM. -duty below 1 spins that fraction of each 10 ms period and
// sleeps the rest.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"runtime"
	"syscall"
	"time"
)

func main() {
	d := flag.Duration("for", time.Minute, "how long to spin (at most 1h)")
	duty := flag.Float64("duty", 1, "fraction of each 10 ms period to spin, in (0, 1]")
	flag.Parse()
	if *d <= 0 || *d > time.Hour || !(*duty > 0 && *duty <= 1) {
		fmt.Fprintln(os.Stderr, "cpuhog: -for must be in (0, 1h] and -duty in (0, 1]")
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	ctx, cancel := context.WithTimeout(ctx, *d)
	defer cancel()
	start := time.Now()
	spins := spin(ctx, *duty)
	fmt.Fprintf(os.Stderr, "cpuhog: spun %d loops over %v\n", spins, time.Since(start).Round(time.Millisecond))
}

// spin busy-loops on one locked OS thread until ctx is done.
func spin(ctx context.Context, duty float64) uint64 {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	const period = 10 * time.Millisecond
	busy := time.Duration(duty * float64(period))
	var n uint64
	for ctx.Err() == nil {
		end := time.Now().Add(busy)
		for time.Now().Before(end) {
			for range 1000 {
				n++
			}
		}
		if busy < period {
			time.Sleep(period - busy)
		}
	}
	return n
}
