package scenario

import (
	"fmt"
	"time"

	"github.com/kvgate/kvgate/bench"
	"github.com/kvgate/kvgate/bench/vllmsim"
)

// Scenarios of shared prefixes, after llm-d's "KV-cache wins you can see"
// benchmark (b2b-saas: 150 tenants with 6,000-token system prompts, 5
// users each asking 1,200-token questions, Poisson arrivals rising from 3
// to 60 QPS on 8 pods of 307k KV tokens). Scaled to the simulated fleet:
// 4 backends, each a simulated 4×H100 server running Llama-3.1-70B (a
// large model, as llm-d's Qwen3-32B on 2 GPUs a pod, so that prefill is
// what runs out), with 64k KV tokens each, and the tenants' prefixes
// together ~1.5 times one backend's cache and ~0.4 of the fleet's, as in
// llm-d's setup (900k of prefixes over 2.46M tokens): no backend can hold
// every tenant, the fleet can, if each tenant keeps to a few backends.

// prefixFleetBlocks is each backend's KV cache for the prefix scenarios:
// 4,096 blocks of 16 tokens.
const prefixFleetBlocks = 4096

// prefixFleet is the prefix scenarios' fleet and the load's base
// configuration for its model.
func prefixFleet(o Options) (fleetSpec, bench.Config, error) {
	p, err := vllmsim.LookupProfile("h100x4-llama-3.1-70b")
	if err != nil {
		return fleetSpec{}, bench.Config{}, err
	}
	p.NumGPUBlocks, p.MaxModelLen = prefixFleetBlocks, 16384
	cfg := baseConfig(o, 60*time.Second)
	cfg.Model = p.Model
	return fleetSpec{profile: p, backends: 4, speedup: o.Speedup, seed: o.Seed}, cfg, nil
}

// steppedTenant is one tenant whose Poisson arrivals rise in 4 steps to
// top req/s over d.
func steppedTenant(name string, w bench.Workload, top float64, d time.Duration) bench.Tenant {
	const steps = 4
	mean := top * (steps + 1) / (2 * steps)
	return bench.Tenant{Name: name, Workload: w,
		Arrival:    bench.Arrival{Kind: bench.ArrivalPoisson, Rate: top, Steps: steps},
		NumPrompts: count(mean, d)}
}

// sharedPrefixTop is the top step's rate of shared-prefix, in requests
// per simulated second: about what the fleet serves with every tenant's
// prefix cached (~1,300 new prompt tokens at 88 µs each, ~8 req/s a
// backend), five times what it serves without (7,300 tokens, ~1.5 req/s).
const sharedPrefixTop = 32.0

func planSharedPrefix(o Options) (plan, error) {
	f, cfg, err := prefixFleet(o)
	if err != nil {
		return plan{}, err
	}
	d := sized(80*time.Second, o)
	const tenants, users = 16, 5
	w := bench.Workload{
		Kind: bench.DatasetSystemPrompt, PrefixLen: 6000, PrefixGroups: tenants,
		Input:  bench.Dist{Kind: bench.DistNormal, Mean: 1200, StdDev: 100, Min: 800, Max: 1600},
		Output: bench.Dist{Kind: bench.DistNormal, Mean: 100, StdDev: 20, Min: 50, Max: 150},
	}
	cfg.Tenants = []bench.Tenant{steppedTenant("b2b-saas", w, sharedPrefixTop, d)}
	return plan{
		fleet: f, cfg: cfg, sending: d, measureFrom: d / 4,
		describe: fmt.Sprintf("%d simulated 4×H100 servers of Llama-3.1-70B (%dk KV tokens each); %d tenants, each a 6,000-token system prompt and %d users "+
			"asking ~1,200-token questions for ~100 output tokens, streamed; Poisson arrivals rising in 4 steps to %.0f req/s "+
			"(past saturation) over %v simulated at %g× speed-up",
			f.backends, prefixFleetBlocks*16/1000, tenants, users, sharedPrefixTop, d, o.Speedup),
	}, nil
}

// multiTurnTop is the top step's rate of multi-turn, in turns per
// simulated second.
const multiTurnTop = 40.0

func planMultiTurn(o Options) (plan, error) {
	f, cfg, err := prefixFleet(o)
	if err != nil {
		return plan{}, err
	}
	d := sized(80*time.Second, o)
	const sessions, turns = 64, 8
	w := bench.Workload{
		Kind: bench.DatasetMultiTurn, PrefixLen: 1000, PrefixGroups: sessions, Turns: turns,
		Input:  bench.Dist{Kind: bench.DistLogNormal, Mean: 300, StdDev: 150, Max: 1000},
		Output: bench.Dist{Kind: bench.DistLogNormal, Mean: 200, StdDev: 100, Max: 600},
	}
	cfg.Tenants = []bench.Tenant{steppedTenant("chat", w, multiTurnTop, d)}
	return plan{
		fleet: f, cfg: cfg, sending: d, measureFrom: d / 4,
		describe: fmt.Sprintf("%d simulated 4×H100 servers of Llama-3.1-70B (%dk KV tokens each); %d chat sessions of up to %d turns, each turn resending "+
			"its 1,000-token system prompt and the history (~300-token questions, ~200-token answers), streamed; "+
			"Poisson arrivals rising in 4 steps to %.0f turns/s (past saturation) over %v simulated at %g× speed-up",
			f.backends, prefixFleetBlocks*16/1000, sessions, turns, multiTurnTop, d, o.Speedup),
	}, nil
}
