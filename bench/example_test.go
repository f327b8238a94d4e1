package bench_test

import (
	"context"
	"fmt"
	"net/http/httptest"
	"time"

	"github.com/kvgate/kvgate/bench"
	"github.com/kvgate/kvgate/bench/vllmsim"
)

// Drive 50 streaming requests at 100 a second (Poisson) against a simulated
// H100 and read the headline figures.
func ExampleRun() {
	p, _ := vllmsim.LookupProfile("h100-llama-3.1-8b")
	sim, _ := vllmsim.New(vllmsim.Config{Profile: p, Speedup: 50})
	ctx, stop := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- sim.Run(ctx) }()
	srv := httptest.NewServer(sim)
	defer func() { srv.Close(); stop(); <-done }()

	rep, err := bench.Run(context.Background(), bench.Config{
		Target: srv.URL + "/v1", Model: p.Model, Stream: true,
		Workload:   bench.Workload{Input: bench.Dist{Mean: 128}, Output: bench.Dist{Mean: 16}},
		Arrival:    bench.Arrival{Rate: 100},
		NumPrompts: 50,
		SLO:        bench.SLO{TTFT: time.Minute},
	})
	if err != nil {
		fmt.Println(err)
		return
	}
	s := rep.Summary
	fmt.Println("completed:", s.Completed, "failed:", s.Failed)
	fmt.Println("output tokens:", s.TotalOutputTokens)
	fmt.Println("all good:", s.RequestGoodput == s.RequestThroughput)
	fmt.Println("p99 TTFT measured:", s.TTFT.Percentiles[99] > 0)
	// Output:
	// completed: 50 failed: 0
	// output tokens: 800
	// all good: true
	// p99 TTFT measured: true
}
