package bench

import (
	"math"
	"slices"
	"strconv"
	"time"
)

// Percentile returns the p-th percentile (0 <= p <= 100) of sorted values,
// interpolating linearly between the two nearest ranks as numpy's default
// (and so vllm bench serve) does; 0 for no values.
func Percentile(sorted []float64, p float64) float64 {
	n := len(sorted)
	if n == 0 {
		return 0
	}
	rank := p / 100 * float64(n-1)
	lo := int(math.Floor(rank))
	if lo >= n-1 {
		return sorted[n-1]
	}
	frac := rank - float64(lo)
	return sorted[lo] + frac*(sorted[lo+1]-sorted[lo])
}

// meanStd returns the mean and the population standard deviation (numpy's
// std), 0 and 0 for no values.
func meanStd(v []float64) (mean, std float64) {
	if len(v) == 0 {
		return 0, 0
	}
	for _, x := range v {
		mean += x
	}
	mean /= float64(len(v))
	for _, x := range v {
		std += (x - mean) * (x - mean)
	}
	return mean, math.Sqrt(std / float64(len(v)))
}

// percentileKey names a percentile as vllm bench serve does: p99, p99.9.
func percentileKey(p float64, metric string) string {
	return "p" + strconv.FormatFloat(p, 'f', -1, 64) + "_" + metric + "_ms"
}

// Latency is one latency's statistics in milliseconds.
type Latency struct {
	Mean, Median, Std float64
	// Percentiles maps a percentile (99.9) to its value.
	Percentiles map[float64]float64
}

func latencyOf(ms []float64, percentiles []float64) Latency {
	slices.Sort(ms)
	l := Latency{Median: Percentile(ms, 50), Percentiles: map[float64]float64{}}
	l.Mean, l.Std = meanStd(ms)
	for _, p := range percentiles {
		l.Percentiles[p] = Percentile(ms, p)
	}
	return l
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// Summarize computes a load point's figures from its records, as vllm bench
// serve defines them: throughputs over dur (first intended send to last
// answer); TTFT, ITL and E2EL over successful requests; TPOT over successful
// requests with more than one output token; goodput counts the successful
// requests that meet every objective in slo (for a request that did not
// stream, its first token is its last, so TTFT is its E2EL).
func Summarize(recs []Record, dur time.Duration, slo SLO, percentiles []float64) Summary {
	s := Summary{Duration: dur.Seconds(), Errors: map[string]int{}}
	var ttft, tpot, itl, e2el []float64
	good := 0
	for i := range recs {
		r := &recs[i]
		if r.ErrorClass != "" {
			s.Failed++
			s.Errors[r.ErrorClass]++
			continue
		}
		s.Completed++
		s.TotalInputTokens += r.InputTokens
		s.TotalOutputTokens += r.OutputTokens
		e2el = append(e2el, ms(r.E2EL))
		first := r.E2EL
		if r.TTFT > 0 {
			ttft = append(ttft, ms(r.TTFT))
			first = r.TTFT
			for _, g := range r.ITLs {
				itl = append(itl, ms(g))
			}
		}
		if r.OutputTokens > 1 && r.TTFT > 0 {
			tpot = append(tpot, ms(r.TPOT))
		}
		if (slo.TTFT == 0 || first <= slo.TTFT) && (slo.TPOT == 0 || r.TPOT <= slo.TPOT) && (slo.E2EL == 0 || r.E2EL <= slo.E2EL) {
			good++
		}
	}
	if len(s.Errors) == 0 {
		s.Errors = nil
	}
	if dur > 0 {
		sec := dur.Seconds()
		s.RequestThroughput = float64(s.Completed) / sec
		s.RequestGoodput = float64(good) / sec
		s.OutputThroughput = float64(s.TotalOutputTokens) / sec
		s.TotalTokenThroughput = float64(s.TotalInputTokens+s.TotalOutputTokens) / sec
	}
	if s.Completed > 0 {
		s.GoodFraction = float64(good) / float64(s.Completed)
	}
	s.TTFT = latencyOf(ttft, percentiles)
	s.TPOT = latencyOf(tpot, percentiles)
	s.ITL = latencyOf(itl, percentiles)
	s.E2EL = latencyOf(e2el, percentiles)
	s.MaxOutputTokensPerS, s.MaxConcurrentRequests = peaks(recs)
	for i := range recs {
		s.MaxSendLagMs = max(s.MaxSendLagMs, ms(recs[i].Sent-recs[i].Intended))
	}
	return s
}

// peaks returns the most output tokens finished in one second (tokens
// counted at their chunk's arrival, a non-streamed answer's all at its end)
// and the most requests in flight at once.
func peaks(recs []Record) (tokPerS float64, concurrent int) {
	perSec := map[int64]float64{}
	type edge struct {
		t     time.Duration
		delta int
	}
	edges := make([]edge, 0, 2*len(recs))
	for i := range recs {
		r := &recs[i]
		edges = append(edges, edge{r.Sent, 1}, edge{r.Intended + r.E2EL, -1})
		if r.ErrorClass != "" || r.OutputTokens == 0 {
			continue
		}
		if r.TTFT == 0 {
			perSec[int64((r.Intended+r.E2EL)/time.Second)] += float64(r.OutputTokens)
			continue
		}
		// Spread the counted tokens over the chunks that carried them.
		per := float64(r.OutputTokens) / float64(len(r.ITLs)+1)
		t := r.Intended + r.TTFT
		perSec[int64(t/time.Second)] += per
		for _, g := range r.ITLs {
			t += g
			perSec[int64(t/time.Second)] += per
		}
	}
	for _, v := range perSec {
		tokPerS = max(tokPerS, v)
	}
	slices.SortFunc(edges, func(a, b edge) int {
		if a.t != b.t {
			return int(a.t - b.t)
		}
		return a.delta - b.delta // ends before starts at the same instant
	})
	n := 0
	for _, e := range edges {
		n += e.delta
		concurrent = max(concurrent, n)
	}
	return tokPerS, concurrent
}

// JainIndex returns Jain's fairness index of x: (Σx)² / (n·Σx²), 1 when
// all are equal, 1/n when one gets everything; 1 for fewer than two values
// or all zero.
func JainIndex(x []float64) float64 {
	if len(x) < 2 {
		return 1
	}
	var sum, sq float64
	for _, v := range x {
		sum += v
		sq += v * v
	}
	if sq == 0 {
		return 1
	}
	return sum * sum / (float64(len(x)) * sq)
}

// findKnee returns the index of the highest-rate load point before
// latency turns up: its median end-to-end latency at most 1.5 times the
// lowest-rate point's, at most 10% of its requests failed and, with SLOs,
// at least 90% of them good, and a point above it that does not qualify.
// Points are in increasing rate order; -1 when none qualifies, and when
// the top (finite) point does: a single point, or a sweep that never
// saturated, has no knee. (A throughput test, achieved against offered, misjudges
// short points, whose last answers stretch the duration.)
func findKnee(points []LoadPoint, withSLO bool) int {
	knee, base, saturated := -1, -1.0, false
	for i, p := range points {
		if math.IsInf(float64(p.RequestRate), 1) {
			continue
		}
		s := p.Summary
		if base < 0 {
			base = s.E2EL.Median
		}
		total := s.Completed + s.Failed
		if total == 0 || s.Completed == 0 {
			continue
		}
		if s.E2EL.Median <= 1.5*base && float64(s.Failed) <= 0.1*float64(total) && (!withSLO || s.GoodFraction >= 0.9) {
			knee, saturated = i, false
		} else {
			saturated = true
		}
	}
	// A knee is the last point before latency turns up: a run with one
	// point, or a sweep whose every point qualified, never saw it turn.
	if !saturated {
		return -1
	}
	return knee
}
