package gateway

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"
)

// openLoop sends rate requests per second to url for dur, each timed from
// its intended send time (so a slow target cannot hide its latency), and
// returns the latencies of the ones answered 200.
func openLoop(client *http.Client, url, body string, rate float64, dur time.Duration) (lat []time.Duration, failed int) {
	var mu sync.Mutex
	var wg sync.WaitGroup
	interval := time.Duration(float64(time.Second) / rate)
	start := time.Now()
	for i := 0; ; i++ {
		intended := start.Add(time.Duration(i) * interval)
		if intended.Sub(start) >= dur {
			break
		}
		time.Sleep(time.Until(intended))
		wg.Go(func() {
			req, _ := http.NewRequest(http.MethodPost, url, strings.NewReader(body))
			req.Header.Set("Content-Type", "application/json")
			resp, err := client.Do(req)
			ok := err == nil && resp.StatusCode == 200
			if err == nil {
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
			}
			d := time.Since(intended)
			mu.Lock()
			if ok {
				lat = append(lat, d)
			} else {
				failed++
			}
			mu.Unlock()
		})
	}
	wg.Wait()
	return lat, failed
}

func percentile(sorted []time.Duration, p float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	return sorted[min(len(sorted)-1, int(p*float64(len(sorted))))]
}

// BenchmarkOverhead measures the latency kvgate adds over calling the
// backend directly, at 1,000 requests/s, non-streaming and streaming, with
// an unpaced (zero-delay) simulated backend. Direct and gateway traffic
// alternate in one-second slices so that both see the same machine.
//
//	go test -run '^$' -bench Overhead -benchtime 1x ./gateway/
func BenchmarkOverhead(b *testing.B) {
	f := startFleet(b, fleetOpts{})
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 512}}
	for _, stream := range []bool{false, true} {
		b.Run(fmt.Sprintf("stream=%v", stream), func(b *testing.B) {
			body := fmt.Sprintf(`{"model":"%s","prompt":"hello","max_tokens":4,"ignore_eos":true,"stream":%v}`, llama, stream)
			var direct, via []time.Duration
			failed := 0
			for range 5 {
				d, fd := openLoop(client, f.urls[0]+"/v1/completions", body, 1000, time.Second)
				v, fv := openLoop(client, f.srv.URL+"/v1/completions", body, 1000, time.Second)
				direct, via, failed = append(direct, d...), append(via, v...), failed+fd+fv
			}
			if failed > 0 {
				b.Errorf("%d requests failed", failed)
			}
			slices.Sort(direct)
			slices.Sort(via)
			ms := func(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }
			b.ReportMetric(ms(percentile(direct, 0.5)), "direct-p50-ms")
			b.ReportMetric(ms(percentile(direct, 0.99)), "direct-p99-ms")
			b.ReportMetric(ms(percentile(via, 0.5)), "kvgate-p50-ms")
			b.ReportMetric(ms(percentile(via, 0.99)), "kvgate-p99-ms")
			b.ReportMetric(ms(percentile(via, 0.5)-percentile(direct, 0.5)), "added-p50-ms")
			b.ReportMetric(ms(percentile(via, 0.99)-percentile(direct, 0.99)), "added-p99-ms")
		})
	}
}

// BenchmarkThroughput measures requests per second through one kvgate with
// 64 clients in a closed loop, against the same backend called directly.
//
//	go test -run '^$' -bench Throughput -benchtime 20000x ./gateway/
func BenchmarkThroughput(b *testing.B) {
	f := startFleet(b, fleetOpts{backends: 2})
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 512}}
	body := fmt.Sprintf(`{"model":"%s","prompt":"hello","max_tokens":1}`, llama)
	for _, target := range []struct{ name, url string }{{"direct", f.urls[0]}, {"kvgate", f.srv.URL}} {
		b.Run(target.name, func(b *testing.B) {
			const workers = 64
			var next sync.WaitGroup
			jobs := make(chan struct{}, b.N)
			for range b.N {
				jobs <- struct{}{}
			}
			close(jobs)
			b.ResetTimer()
			start := time.Now()
			for range workers {
				next.Go(func() {
					for range jobs {
						req, _ := http.NewRequestWithContext(context.Background(), http.MethodPost, target.url+"/v1/completions", strings.NewReader(body))
						req.Header.Set("Content-Type", "application/json")
						resp, err := client.Do(req)
						if err != nil {
							b.Error(err)
							return
						}
						_, _ = io.Copy(io.Discard, resp.Body)
						resp.Body.Close()
						if resp.StatusCode != 200 {
							b.Errorf("status %d", resp.StatusCode)
							return
						}
					}
				})
			}
			next.Wait()
			b.ReportMetric(float64(b.N)/time.Since(start).Seconds(), "req/s")
		})
	}
}
