package gateway

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/kvgate/kvgate/store"
	"github.com/kvgate/kvgate/store/postgres/pgtest"
)

// BenchmarkWebhookDispatch measures deliveries per second on PostgreSQL
// against a zero-delay loopback receiver: b.N pending deliveries, then one
// dispatcher sends and records them all (claims in bulk, attempts recorded
// in batches).
//
//	go test -run '^$' -bench BenchmarkWebhookDispatch -benchtime 20000x -count 5 ./gateway/
func BenchmarkWebhookDispatch(b *testing.B) {
	st := pgtest.Open(b)
	b.Cleanup(func() { st.Close() })
	ctx := context.Background()
	rcv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusNoContent) }))
	defer rcv.Close()
	ep := store.WebhookEndpoint{ID: "we_bench", Tenant: "bench", URL: rcv.URL + "/hook", Events: []string{"job.succeeded"},
		Secret: "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", CreatedAt: time.Now()}
	if err := st.CreateEndpoint(ctx, ep); err != nil {
		b.Fatal(err)
	}
	now := time.Now().UnixMicro()
	if _, err := st.DB().ExecContext(ctx, fmt.Sprintf(`INSERT INTO webhook_deliveries (id, endpoint_id, tenant, event_id, job_id, type,
		job_state, state_version, event_at, state, due_at, created_at, updated_at)
		SELECT 'msg_' || i, 'we_bench', 'bench', 'ev_' || i, 'job_' || i, 'job.succeeded', 'SUCCEEDED', 3, %d, 'PENDING', %d, %d, %d
		FROM generate_series(1, %d) AS i`, now, now, now, now, b.N)); err != nil {
		b.Fatal(err)
	}
	d, err := NewDispatcher(DispatcherConfig{Store: st, Guard: loopbackGuard(), Concurrency: 128, PerEndpoint: 128, Poll: time.Millisecond})
	if err != nil {
		b.Fatal(err)
	}
	runCtx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	b.ResetTimer()
	start := time.Now()
	go func() { defer close(done); d.Run(runCtx) }()
	for {
		n, err := st.PendingDeliveries(ctx)
		if err != nil {
			b.Fatal(err)
		}
		if n == 0 {
			break
		}
		time.Sleep(5 * time.Millisecond)
	}
	elapsed := time.Since(start)
	b.StopTimer()
	cancel()
	<-done
	var delivered int
	if err := st.DB().QueryRowContext(ctx, `SELECT COUNT(*) FROM webhook_deliveries WHERE state = 'DELIVERED'`).Scan(&delivered); err != nil || delivered != b.N {
		b.Fatalf("%d of %d delivered, %v", delivered, b.N, err)
	}
	b.ReportMetric(float64(b.N)/elapsed.Seconds(), "deliveries/s")
}
