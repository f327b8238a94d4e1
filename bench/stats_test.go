package bench

import (
	"math"
	"testing"
	"time"
)

func near(a, b float64) bool { return math.Abs(a-b) <= 1e-9*math.Max(1, math.Abs(b)) }

func TestPercentileInterpolatesAsNumpy(t *testing.T) {
	v := []float64{1, 2, 3, 4, 5}
	for _, tc := range []struct{ p, want float64 }{
		{50, 3}, {90, 4.6}, {99, 4.96}, {99.9, 4.996}, {100, 5}, {0, 1}, {25, 2},
	} {
		if got := Percentile(v, tc.p); !near(got, tc.want) {
			t.Errorf("p%v of 1..5 = %v, want %v", tc.p, got, tc.want)
		}
	}
	if got := Percentile([]float64{10, 20}, 25); !near(got, 12.5) {
		t.Errorf("p25 of 10, 20 = %v, want 12.5", got)
	}
	if Percentile([]float64{7}, 99) != 7 || Percentile(nil, 50) != 0 {
		t.Error("one value or none")
	}
}

func TestPercentileKeysAreVllms(t *testing.T) {
	for p, want := range map[float64]string{99: "p99_ttft_ms", 99.9: "p99.9_ttft_ms", 50: "p50_ttft_ms", 90: "p90_ttft_ms", 99.99: "p99.99_ttft_ms"} {
		if got := percentileKey(p, "ttft"); got != want {
			t.Errorf("percentileKey(%v) = %q, want %q", p, got, want)
		}
	}
}

func msd(v float64) time.Duration { return time.Duration(v * float64(time.Millisecond)) }

func repeat(d time.Duration, n int) []time.Duration {
	out := make([]time.Duration, n)
	for i := range out {
		out[i] = d
	}
	return out
}

// handRecords are four requests whose figures are worked out by hand in
// TestSummarizeHandComputed.
func handRecords() []Record {
	return []Record{
		{Tenant: "a", Intended: 0, Sent: 0, TTFT: msd(100), E2EL: msd(500), TPOT: msd(100), ITLs: repeat(msd(100), 4), InputTokens: 10, OutputTokens: 5, Status: 200},
		{Tenant: "a", Intended: msd(100), Sent: msd(100), TTFT: msd(300), E2EL: msd(1300), TPOT: msd(100), ITLs: repeat(msd(100), 10), InputTokens: 20, OutputTokens: 11, Status: 200},
		{Tenant: "b", Intended: msd(1000), Sent: msd(1002), TTFT: msd(50), E2EL: msd(50), InputTokens: 30, OutputTokens: 1, Status: 200},
		{Tenant: "b", Intended: msd(1200), Sent: msd(1200), E2EL: msd(10), Status: 429, ErrorClass: ErrRateLimited},
	}
}

func TestSummarizeHandComputed(t *testing.T) {
	s := Summarize(handRecords(), 2*time.Second, SLO{TTFT: msd(200), E2EL: msd(1000)}, []float64{50, 99})
	checks := []struct {
		name      string
		got, want float64
	}{
		{"completed", float64(s.Completed), 3},
		{"failed", float64(s.Failed), 1},
		{"total_input_tokens", float64(s.TotalInputTokens), 60},
		{"total_output_tokens", float64(s.TotalOutputTokens), 17},
		{"request_throughput", s.RequestThroughput, 1.5},
		// Requests 1 and 3 meet TTFT <= 200 ms and E2EL <= 1 s; request 2 misses both.
		{"request_goodput", s.RequestGoodput, 1},
		{"good_fraction", s.GoodFraction, 2.0 / 3},
		{"output_throughput", s.OutputThroughput, 8.5},
		{"total_token_throughput", s.TotalTokenThroughput, 38.5},
		{"mean_ttft_ms", s.TTFT.Mean, 150},
		{"median_ttft_ms", s.TTFT.Median, 100},
		{"std_ttft_ms", s.TTFT.Std, math.Sqrt((100*100 + 50*50 + 150*150) / 3.0)},
		{"p99_ttft_ms", s.TTFT.Percentiles[99], 100 + 0.98*200},
		// Request 3 has one output token: no TPOT.
		{"mean_tpot_ms", s.TPOT.Mean, 100},
		{"mean_itl_ms", s.ITL.Mean, 100},
		{"mean_e2el_ms", s.E2EL.Mean, (50 + 500 + 1300) / 3.0},
		{"median_e2el_ms", s.E2EL.Median, 500},
		{"max_concurrent_requests", float64(s.MaxConcurrentRequests), 2},
		// Second 0 gets request 1's five chunks (0.1..0.5 s) and request 2's
		// chunks at 0.4..0.9 s; second 1 gets the rest.
		{"max_output_tokens_per_s", s.MaxOutputTokensPerS, 11},
		{"max_send_lag_ms", s.MaxSendLagMs, 2},
		{"errors rate_limited", float64(s.Errors[ErrRateLimited]), 1},
	}
	for _, c := range checks {
		if !near(c.got, c.want) {
			t.Errorf("%s = %v, want %v", c.name, c.got, c.want)
		}
	}
	if len(s.TTFT.Percentiles) != 2 {
		t.Errorf("percentiles %v, want p50 and p99", s.TTFT.Percentiles)
	}
}

func TestGoodputPerObjective(t *testing.T) {
	recs := handRecords()
	for _, tc := range []struct {
		slo  SLO
		good float64
	}{
		{SLO{}, 3},                             // no objective: every success is good
		{SLO{TTFT: msd(100)}, 2},               // 100 and 50 ms (equal to the bound counts)
		{SLO{TPOT: msd(99)}, 1},                // only request 3, with no TPOT
		{SLO{E2EL: msd(1300)}, 3},              // all within
		{SLO{TTFT: msd(60), E2EL: msd(60)}, 1}, // request 3 only
	} {
		s := Summarize(recs, time.Second, tc.slo, nil)
		if s.RequestGoodput != tc.good {
			t.Errorf("SLO %+v: goodput %v req/s over 1 s, want %v", tc.slo, s.RequestGoodput, tc.good)
		}
	}
	// Without streaming, the first token is the last: a TTFT objective
	// checks the end-to-end latency.
	whole := []Record{{E2EL: msd(150), OutputTokens: 3, Status: 200}, {E2EL: msd(250), OutputTokens: 3, Status: 200}}
	if s := Summarize(whole, time.Second, SLO{TTFT: msd(200)}, nil); s.RequestGoodput != 1 || s.TTFT.Mean != 0 {
		t.Errorf("non-streaming: goodput %v, mean TTFT %v; want 1 and 0", s.RequestGoodput, s.TTFT.Mean)
	}
}

func TestSummarizeNothing(t *testing.T) {
	s := Summarize(nil, 0, SLO{}, []float64{99})
	if s.Completed != 0 || s.RequestThroughput != 0 || s.TTFT.Percentiles[99] != 0 || s.Errors != nil {
		t.Errorf("empty summary %+v", s)
	}
}

func TestJainIndex(t *testing.T) {
	for _, tc := range []struct {
		x    []float64
		want float64
	}{
		{[]float64{5, 5, 5, 5}, 1},
		{[]float64{1, 0, 0, 0}, 0.25},
		{[]float64{1, 2, 3}, 36.0 / 42},
		{[]float64{7}, 1},
		{[]float64{0, 0}, 1},
	} {
		if got := JainIndex(tc.x); !near(got, tc.want) {
			t.Errorf("JainIndex(%v) = %v, want %v", tc.x, got, tc.want)
		}
	}
}

func TestFindKnee(t *testing.T) {
	pt := func(i int, rate, median, good float64, failed int) LoadPoint {
		return LoadPoint{Index: i, RequestRate: Rate(rate),
			Summary: Summary{Completed: 100 - failed, Failed: failed, GoodFraction: good, E2EL: Latency{Median: median}}}
	}
	pts := []LoadPoint{pt(0, 1, 100, 1, 0), pt(1, 2, 110, 1, 0), pt(2, 4, 140, 0.8, 0), pt(3, 8, 400, 0.2, 0), pt(4, math.Inf(1), 900, 0, 0)}
	if k := findKnee(pts, false); k != 2 {
		t.Errorf("knee without SLO = %d, want 2 (140 ms is within 1.5 × 100 ms, 400 ms is not)", k)
	}
	if k := findKnee(pts, true); k != 1 {
		t.Errorf("knee with SLO = %d, want 1 (only 80%% good at 4 req/s)", k)
	}
	pts[2].Summary.Failed, pts[2].Summary.Completed = 11, 89
	if k := findKnee(pts, false); k != 1 {
		t.Errorf("knee with 11%% failed at 4 req/s = %d, want 1", k)
	}
	if k := findKnee(pts[4:], false); k != -1 {
		t.Errorf("knee of an unpaced point alone = %d, want -1", k)
	}
}

// TestFindKneeNeedsSaturation: the only point of a single-rate run, and
// the top point of a sweep that never saturated, are not knees.
func TestFindKneeNeedsSaturation(t *testing.T) {
	pt := func(i int, rate, median float64) LoadPoint {
		return LoadPoint{Index: i, RequestRate: Rate(rate), Summary: Summary{Completed: 100, E2EL: Latency{Median: median}}}
	}
	for _, tc := range []struct {
		name string
		pts  []LoadPoint
		want int
	}{
		{"a single rate", []LoadPoint{pt(0, 5, 100)}, -1},
		{"a single rate and the full-speed point", []LoadPoint{pt(0, 5, 100), pt(1, math.Inf(1), 900)}, -1},
		{"a sweep that never saturated", []LoadPoint{pt(0, 1, 100), pt(1, 2, 105), pt(2, 4, 120)}, -1},
		{"a sweep that saturated at the top", []LoadPoint{pt(0, 1, 100), pt(1, 2, 105), pt(2, 4, 400)}, 1},
		{"a slow point, then the top recovered", []LoadPoint{pt(0, 1, 100), pt(1, 2, 400), pt(2, 4, 120)}, -1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := findKnee(tc.pts, false); got != tc.want {
				t.Errorf("findKnee = %d, want %d", got, tc.want)
			}
		})
	}
}
