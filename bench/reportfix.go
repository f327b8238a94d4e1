package bench

import (
	"fmt"
	"math"
	"strings"
)

// arrivalHeader says how requests arrived, for a report's header: a sweep
// names its rates, not the run's configured one (which a sweep replaces
// point by point, so that "poisson at inf req/s" would be wrong).
func arrivalHeader(r *Report) string {
	c := r.Config
	if c.Sweep == nil || len(r.LoadPoints) < 2 {
		if c.Arrival.Kind == ArrivalConcurrency {
			return fmt.Sprintf("arrivals %s of %d closed-loop clients", c.Arrival.Kind, c.Arrival.Concurrency)
		}
		return fmt.Sprintf("arrivals %s at %s req/s", c.Arrival.Kind, Rate(c.Arrival.Rate))
	}
	rates := make([]string, 0, len(r.LoadPoints))
	for _, p := range sortedByRate(r.LoadPoints) {
		if math.IsInf(float64(p.RequestRate), 1) {
			rates = append(rates, "inf (full speed)")
			continue
		}
		rates = append(rates, fmtRate(float64(p.RequestRate)))
	}
	return fmt.Sprintf("arrivals %s, a sweep of %d rates: %s req/s", c.Arrival.Kind, len(r.LoadPoints), strings.Join(rates, ", "))
}

// fmtRate writes a rate with the digits it needs.
func fmtRate(v float64) string {
	switch {
	case v >= 100:
		return fmt.Sprintf("%.0f", v)
	case v >= 10:
		return trimZeros(fmt.Sprintf("%.1f", v))
	}
	return trimZeros(fmt.Sprintf("%.2f", v))
}

func trimZeros(s string) string {
	if strings.Contains(s, ".") {
		s = strings.TrimRight(strings.TrimRight(s, "0"), ".")
	}
	return s
}

// kneeNote says why a report has no knee, or "" when it has one.
func kneeNote(r *Report) string {
	switch {
	case r.Knee >= 0:
		return ""
	case len(r.LoadPoints) < 2:
		return "one load point: no knee (a sweep finds it)"
	}
	return "no knee: latency never turned up over the rates swept (offer more load)"
}

// settingsDiffer lists the settings in which two runs differ, each as
// "name: A → B": a comparison of such runs measures the settings as much
// as the targets, so its verdicts come with a warning. Reports without
// the harness's settings (a vllm bench serve result file) are compared on
// what they have: the request rate, concurrency and prompt count.
func settingsDiffer(a, b *Report) []string {
	var out []string
	add := func(name string, x, y any) {
		if sx, sy := fmt.Sprint(x), fmt.Sprint(y); sx != sy {
			out = append(out, fmt.Sprintf("%s: %s → %s", name, sx, sy))
		}
	}
	add("model", a.ModelID, b.ModelID)
	add("request rate", a.RequestRate, b.RequestRate)
	// The top-level max_concurrency: the one a vllm bench serve file has.
	mc := func(r *Report) int {
		if r.MaxConcurrency == nil {
			return 0
		}
		return *r.MaxConcurrency
	}
	add("max concurrency", mc(a), mc(b))
	add("prompts", a.NumPrompts, b.NumPrompts)
	add("load points", len(a.LoadPoints), len(b.LoadPoints))
	ca, cb := a.Config, b.Config
	if ca.Model == "" || cb.Model == "" {
		return out // not both from kvgate bench: nothing more is known
	}
	add("endpoint", ca.Endpoint, cb.Endpoint)
	add("streaming", ca.Stream, cb.Stream)
	add("workload", workloadString(ca.Workload), workloadString(cb.Workload))
	add("arrivals", arrivalString(ca.Arrival), arrivalString(cb.Arrival))
	add("sweep", sweepString(ca.Sweep), sweepString(cb.Sweep))
	add("seed", ca.Seed, cb.Seed)
	add("SLOs", fmt.Sprintf("ttft %v tpot %v e2el %v", ca.SLO.TTFT, ca.SLO.TPOT, ca.SLO.E2EL), fmt.Sprintf("ttft %v tpot %v e2el %v", cb.SLO.TTFT, cb.SLO.TPOT, cb.SLO.E2EL))
	add("tenants", tenantsString(ca.Tenants), tenantsString(cb.Tenants))
	return out
}

func workloadString(w Workload) string {
	s := fmt.Sprintf("%s in %s out %s", w.Kind, distString(w.Input), distString(w.Output))
	if w.Path != "" {
		s += " from " + w.Path
	}
	if w.PrefixLen > 0 {
		s += fmt.Sprintf(" prefix %d×%d", w.PrefixLen, w.PrefixGroups)
	}
	return s
}

func arrivalString(a Arrival) string {
	return fmt.Sprintf("%s rate %s burstiness %s clients %d", a.Kind, Rate(a.Rate), Rate(a.Burstiness), a.Concurrency)
}

func sweepString(s *Sweep) string {
	if s == nil {
		return "none"
	}
	return fmt.Sprintf("rates %v points %d", s.Rates, s.Points)
}

func tenantsString(ts []Tenant) string {
	parts := make([]string, len(ts))
	for i, t := range ts {
		parts[i] = fmt.Sprintf("%s(%s, %s, %d)", t.Name, arrivalString(t.Arrival), workloadString(t.Workload), t.NumPrompts)
	}
	return "[" + strings.Join(parts, " ") + "]"
}
