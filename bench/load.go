package bench

import (
	"context"
	"io"
	"net/http"
	"slices"
	"strings"
	"sync"
	"time"
)

// Result is what an open-loop run measured.
type Result struct {
	Latencies []time.Duration // of the requests answered 200, sorted
	Failed    int             // other statuses and transport errors
}

// Percentile returns the p-th latency (0 < p <= 1), interpolated as the
// reports' percentiles are (numpy's), or 0 without any.
func (r Result) Percentile(p float64) time.Duration {
	if len(r.Latencies) == 0 {
		return 0
	}
	lo := int(p * float64(len(r.Latencies)-1))
	if lo >= len(r.Latencies)-1 {
		return r.Latencies[len(r.Latencies)-1]
	}
	frac := p*float64(len(r.Latencies)-1) - float64(lo)
	return r.Latencies[lo] + time.Duration(frac*float64(r.Latencies[lo+1]-r.Latencies[lo]))
}

// Merge adds another run's measurements.
func (r *Result) Merge(o Result) {
	r.Latencies = append(r.Latencies, o.Latencies...)
	slices.Sort(r.Latencies)
	r.Failed += o.Failed
}

// OpenLoop posts body to url at a constant rate for dur, whatever the
// target's speed, reads each response whole, and times it from its
// intended send time. It returns when every request has ended.
func OpenLoop(ctx context.Context, client *http.Client, url, body string, rate float64, dur time.Duration) Result {
	var (
		mu  sync.Mutex
		wg  sync.WaitGroup
		res Result
	)
	interval := time.Duration(float64(time.Second) / rate)
	start := time.Now()
	for i := 0; ctx.Err() == nil; i++ {
		intended := start.Add(time.Duration(i) * interval)
		if intended.Sub(start) >= dur {
			break
		}
		time.Sleep(time.Until(intended))
		wg.Go(func() {
			req, _ := http.NewRequestWithContext(ctx, http.MethodPost, url, strings.NewReader(body))
			req.Header.Set("Content-Type", "application/json")
			resp, err := client.Do(req)
			ok := err == nil && resp.StatusCode == http.StatusOK
			if err == nil {
				_, err = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				ok = ok && err == nil
			}
			d := time.Since(intended)
			mu.Lock()
			if ok {
				res.Latencies = append(res.Latencies, d)
			} else {
				res.Failed++
			}
			mu.Unlock()
		})
	}
	wg.Wait()
	slices.Sort(res.Latencies)
	return res
}
