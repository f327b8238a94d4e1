package bench

import (
	"context"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"time"
)

func TestOpenLoop(t *testing.T) {
	var n atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if n.Add(1)%10 == 0 {
			http.Error(w, "no", http.StatusServiceUnavailable)
			return
		}
		_, _ = w.Write([]byte("ok"))
	}))
	defer srv.Close()
	res := OpenLoop(context.Background(), srv.Client(), srv.URL, "{}", 200, 250*time.Millisecond)
	if total := len(res.Latencies) + res.Failed; total != 50 {
		t.Errorf("sent %d requests at 200/s for 250 ms, want 50", total)
	}
	if res.Failed != 5 {
		t.Errorf("failed %d, want every tenth: 5", res.Failed)
	}
	if p50, p99 := res.Percentile(0.5), res.Percentile(0.99); p50 <= 0 || p99 < p50 {
		t.Errorf("percentiles p50 %v, p99 %v", p50, p99)
	}
	var empty Result
	if empty.Percentile(0.5) != 0 {
		t.Error("percentile of nothing is not 0")
	}
}

// TestResultPercentileInterpolates: a run's percentiles are numpy's, as
// the reports' are: on 1..100 ms, p50 is 50.5 ms and p99 99.01 ms (the
// rank above, 51 and 100, was read before).
func TestResultPercentileInterpolates(t *testing.T) {
	var r Result
	for i := 1; i <= 100; i++ {
		r.Latencies = append(r.Latencies, time.Duration(i)*time.Millisecond)
	}
	for p, want := range map[float64]time.Duration{0.5: 50500 * time.Microsecond, 0.99: 99010 * time.Microsecond, 1: 100 * time.Millisecond} {
		if got := r.Percentile(p); got != want {
			t.Errorf("p%v = %s, want %s", p*100, got, want)
		}
	}
}
