package bench

import (
	"math"
	"math/rand/v2"
	"time"
)

// gaps draws inter-arrival gaps for an open-loop arrival process.
type gaps struct {
	kind       string
	rate       float64
	burstiness float64
	steps      int
	rng        *rand.Rand
}

func newGaps(a Arrival, rng *rand.Rand) *gaps {
	return &gaps{kind: a.Kind, rate: a.Rate, burstiness: a.Burstiness, steps: a.Steps, rng: rng}
}

// next returns the next gap in seconds: 0 at an infinite rate, 1/rate for
// constant arrivals, and otherwise a Gamma(shape=burstiness,
// scale=1/(rate·burstiness)) draw, whose mean is 1/rate whatever the
// burstiness (burstiness 1 is the exponential gap of a Poisson process).
func (g *gaps) next() float64 {
	if math.IsInf(g.rate, 1) {
		return 0
	}
	if g.kind == ArrivalConstant || math.IsInf(g.burstiness, 1) {
		return 1 / g.rate
	}
	return gammaDraw(g.rng, g.burstiness) / (g.rate * g.burstiness)
}

// schedule returns n send offsets from the start of a load point. As vllm
// bench serve does, the cumulative offsets of a random process are rescaled
// so that the last request lands at n/rate: the load point's mean rate is the
// one asked for, not one drawn.
func (g *gaps) schedule(n int) []time.Duration {
	if g.steps > 1 && !math.IsInf(g.rate, 1) {
		return g.stepped(n)
	}
	at := make([]float64, n)
	t := 0.0
	for i := range at {
		t += g.next()
		at[i] = t
	}
	if n > 0 && t > 0 && !math.IsInf(g.rate, 1) && g.kind != ArrivalConstant {
		scale := float64(n) / g.rate / t
		for i := range at {
			at[i] *= scale
		}
	}
	out := make([]time.Duration, n)
	for i, s := range at {
		out[i] = time.Duration(s * float64(time.Second))
	}
	return out
}

// gammaDraw draws from Gamma(shape, 1) by Marsaglia and Tsang's method,
// boosting shapes below 1 with a uniform power.
func gammaDraw(rng *rand.Rand, shape float64) float64 {
	if shape < 1 {
		u := rng.Float64()
		for u == 0 {
			u = rng.Float64()
		}
		return gammaDraw(rng, shape+1) * math.Pow(u, 1/shape)
	}
	d := shape - 1.0/3
	c := 1 / math.Sqrt(9*d)
	for {
		x := rng.NormFloat64()
		v := 1 + c*x
		if v <= 0 {
			continue
		}
		v = v * v * v
		u := rng.Float64()
		if u < 1-0.0331*x*x*x*x {
			return d * v
		}
		if u > 0 && math.Log(u) < 0.5*x*x+d*(1-v+math.Log(v)) {
			return d * v
		}
	}
}

// newRNG returns a PCG generator for a seed and a stream name, so that each
// tenant and load point draws its own reproducible sequence.
func newRNG(seed uint64, stream string) *rand.Rand {
	h := uint64(14695981039346656037)
	for i := 0; i < len(stream); i++ {
		h ^= uint64(stream[i])
		h *= 1099511628211
	}
	return rand.New(rand.NewPCG(seed, h))
}
