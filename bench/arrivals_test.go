package bench

import (
	"math"
	"testing"
	"time"
)

// moments returns the mean and the coefficient of variation of n gaps.
func moments(g *gaps, n int) (mean, cv float64) {
	v := make([]float64, n)
	for i := range v {
		v[i] = g.next()
	}
	m, s := meanStd(v)
	return m, s / m
}

func TestArrivalRateAndBurstiness(t *testing.T) {
	// Gamma(k) gaps have mean 1/rate whatever k, and a coefficient of
	// variation 1/sqrt(k): Poisson 1, burstier above 1, smoother below.
	tests := []struct {
		kind        string
		rate, burst float64
		wantCV      float64
	}{
		{ArrivalPoisson, 50, 1, 1},
		{ArrivalGamma, 50, 0.25, 2},
		{ArrivalGamma, 10, 0.5, math.Sqrt2},
		{ArrivalGamma, 200, 4, 0.5},
		{ArrivalGamma, 5, 16, 0.25},
		{ArrivalConstant, 20, 1, 0},
	}
	const n = 200000
	for _, tc := range tests {
		a, err := Arrival{Kind: tc.kind, Rate: tc.rate, Burstiness: tc.burst}.withDefaults(Workload{Kind: DatasetRandom})
		if err != nil {
			t.Fatal(err)
		}
		mean, cv := moments(newGaps(a, newRNG(1, tc.kind)), n)
		if rate := 1 / mean; math.Abs(rate-tc.rate)/tc.rate > 0.01 {
			t.Errorf("%s rate %g burstiness %g: drawn rate %.3f, want within 1%%", tc.kind, tc.rate, tc.burst, rate)
		}
		if math.Abs(cv-tc.wantCV) > 0.02*math.Max(1, tc.wantCV) {
			t.Errorf("%s rate %g burstiness %g: gap CV %.3f, want %.3f", tc.kind, tc.rate, tc.burst, cv, tc.wantCV)
		}
	}
}

func TestGammaDrawMoments(t *testing.T) {
	// Gamma(k, 1) has mean k and variance k.
	for _, k := range []float64{0.2, 0.7, 1, 2.5, 9} {
		rng := newRNG(3, "gamma")
		v := make([]float64, 200000)
		for i := range v {
			v[i] = gammaDraw(rng, k)
		}
		m, s := meanStd(v)
		if math.Abs(m-k)/k > 0.02 || math.Abs(s*s-k)/k > 0.05 {
			t.Errorf("Gamma(%g): mean %.3f variance %.3f, want %g and %g", k, m, s*s, k, k)
		}
	}
}

func TestScheduleRescalesToTheAskedRate(t *testing.T) {
	for _, burst := range []float64{0.3, 1, 3} {
		a, _ := Arrival{Rate: 40, Burstiness: burst}.withDefaults(Workload{Kind: DatasetRandom})
		s := newGaps(a, newRNG(9, "s")).schedule(100)
		if got, want := s[99], 100*time.Second/40; got < want-time.Millisecond || got > want+time.Millisecond {
			t.Errorf("burstiness %g: last send at %v, want %v (n/rate)", burst, got, want)
		}
		for i := 1; i < len(s); i++ {
			if s[i] < s[i-1] {
				t.Fatalf("burstiness %g: schedule goes backwards at %d", burst, i)
			}
		}
	}
	inf, _ := Arrival{}.withDefaults(Workload{Kind: DatasetRandom})
	for _, at := range newGaps(inf, newRNG(1, "i")).schedule(10) {
		if at != 0 {
			t.Fatalf("rate inf sends at %v, want all at 0", at)
		}
	}
	c, _ := Arrival{Kind: ArrivalConstant, Rate: 4}.withDefaults(Workload{Kind: DatasetRandom})
	if s := newGaps(c, newRNG(1, "c")).schedule(4); s[0] != 250*time.Millisecond || s[3] != time.Second {
		t.Errorf("constant 4/s schedule %v, want 250ms steps", s)
	}
}

func TestSchedulesAreSeeded(t *testing.T) {
	a, _ := Arrival{Rate: 10}.withDefaults(Workload{Kind: DatasetRandom})
	x := newGaps(a, newRNG(5, "t")).schedule(50)
	y := newGaps(a, newRNG(5, "t")).schedule(50)
	z := newGaps(a, newRNG(6, "t")).schedule(50)
	same, differ := true, false
	for i := range x {
		same = same && x[i] == y[i]
		differ = differ || x[i] != z[i]
	}
	if !same || !differ {
		t.Errorf("same seed same schedule: %v; other seed other schedule: %v", same, differ)
	}
}

func TestArrivalDefaults(t *testing.T) {
	tests := []struct {
		in   Arrival
		w    Workload
		want string
		err  bool
	}{
		{Arrival{Rate: 5}, Workload{Kind: DatasetRandom}, ArrivalPoisson, false},
		{Arrival{Rate: 5, Burstiness: 0.5}, Workload{Kind: DatasetRandom}, ArrivalGamma, false},
		{Arrival{Rate: 5, Burstiness: math.Inf(1)}, Workload{Kind: DatasetRandom}, ArrivalConstant, false},
		{Arrival{Concurrency: 4}, Workload{Kind: DatasetRandom}, ArrivalConcurrency, false},
		{Arrival{}, Workload{Kind: DatasetTrace}, ArrivalTrace, false},
		{Arrival{Kind: ArrivalTrace}, Workload{Kind: DatasetRandom}, "", true},
		{Arrival{Kind: ArrivalConcurrency}, Workload{Kind: DatasetRandom}, "", true},
		{Arrival{Rate: -1}, Workload{Kind: DatasetRandom}, "", true},
		{Arrival{Kind: "zipf"}, Workload{Kind: DatasetRandom}, "", true},
	}
	for _, tc := range tests {
		got, err := tc.in.withDefaults(tc.w)
		if (err != nil) != tc.err || (err == nil && got.Kind != tc.want) {
			t.Errorf("%+v: kind %q err %v, want %q err %v", tc.in, got.Kind, err, tc.want, tc.err)
		}
	}
}
