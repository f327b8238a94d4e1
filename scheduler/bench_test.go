package scheduler

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/kvgate/kvgate/gpu"
)

// BenchmarkWakeSaturated measures one pass over a queue that cannot be
// admitted: 8 backends with 256 requests in flight each and 40 tickets
// waiting. Every ticket needs the exact projection on every backend.
//
//	go test -run '^$' -bench WakeSaturated -benchmem ./scheduler/
func BenchmarkWakeSaturated(b *testing.B) {
	var snaps []*gpu.Snapshot
	for i := range 8 {
		sn := backendSnap(fmt.Sprint("b", i), 275_000) // 261k under the target: the 256 fit, a 10k ticket does not
		sn.MaxNumSeqs = 1024
		sn.Metrics.BlockSize = 16
		snaps = append(snaps, sn)
	}
	s, err := New(&staticSource{snaps: snaps}, Options{Policy: Policy{MaxQueueWait: time.Hour}})
	if err != nil {
		b.Fatal(err)
	}
	ctx := context.Background()
	for range 8 * 256 {
		if _, err := s.Acquire(ctx, &Ticket{Model: model, PromptTokens: 600, MaxTokens: 400}); err != nil {
			b.Fatal(err)
		}
	}
	benchWake(b, s, 40, &Ticket{Model: model, PromptTokens: 5000, MaxTokens: 5000})
}

// benchWake queues n tickets like tk on s, then measures one pass over
// them.
func benchWake(b *testing.B, s *Scheduler, n int, tk *Ticket) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	for range n {
		go func() {
			t := *tk
			_, _ = s.Acquire(ctx, &t)
		}()
	}
	for s.Queued()[Interactive] < n {
		time.Sleep(time.Millisecond)
	}
	b.ReportAllocs()
	b.ResetTimer()
	for b.Loop() {
		s.Wake()
	}
}

// BenchmarkWakeBackendQueue measures one pass over a queue whose backends
// all refuse for their load alone: vLLM's own queue on both of the
// model's 2 backends is over max_backend_waiting, with 64 tickets
// waiting, as in the acceptance test at 1,000 jobs/s.
//
//	go test -run '^$' -bench WakeBackendQueue -benchmem ./scheduler/
func BenchmarkWakeBackendQueue(b *testing.B) {
	var snaps []*gpu.Snapshot
	for i := range 2 {
		sn := backendSnap(fmt.Sprint("b", i), 275_000)
		sn.Metrics.Waiting = 3
		snaps = append(snaps, sn)
	}
	s, err := New(&staticSource{snaps: snaps}, Options{Policy: Policy{MaxQueueWait: time.Hour}})
	if err != nil {
		b.Fatal(err)
	}
	benchWake(b, s, 64, &Ticket{Model: model, PromptTokens: 500, MaxTokens: 100})
}
