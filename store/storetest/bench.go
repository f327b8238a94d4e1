package storetest

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/kvgate/kvgate/store"
)

// BenchPermits measures quota permits, acquired and released in pairs by
// 64 goroutines (a gateway's requests), for one tenant and spread over 8,
// without limits and under a concurrency cap: pairs/s.
//
//	go test -run '^$' -bench Permits -benchtime 20000x ./store/postgres/ ./store/sqlite/
func BenchPermits(b *testing.B, s store.Tenants) {
	for _, tc := range []struct {
		name    string
		tenants int
		l       store.Limits
	}{
		{"tenants=1/unlimited", 1, store.Limits{}},
		{"tenants=8/unlimited", 8, store.Limits{}},
		{"tenants=1/concurrency", 1, store.Limits{MaxConcurrency: 1000}},
		{"tenants=8/concurrency", 8, store.Limits{MaxConcurrency: 1000}},
	} {
		b.Run(tc.name, func(b *testing.B) {
			ctx := context.Background()
			prefix := uuid.Must(uuid.NewV7()).String()
			var n atomic.Int64
			b.SetParallelism(32) // 64 goroutines on 2 cores
			b.ResetTimer()
			start := time.Now()
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					i := n.Add(1)
					now := time.Now()
					p, err := s.Acquire(ctx, store.Acquisition{
						PermitID: uuid.Must(uuid.NewV7()).String(), Tenant: fmt.Sprint(prefix, i%int64(tc.tenants)),
						Tokens: 300, Limits: tc.l, Now: now, Lease: time.Minute,
					})
					if err != nil {
						b.Error(err)
						return
					}
					if err := s.Release(ctx, store.Release{Permit: p, Outcome: store.Reported, Attempts: 1,
						PromptTokens: 200, CompletionTokens: 50, Now: now}); err != nil {
						b.Error(err)
						return
					}
				}
			})
			b.ReportMetric(float64(b.N)/time.Since(start).Seconds(), "pairs/s")
		})
	}
}
