package scenario

import (
	"context"
	"fmt"
	"math"
	"time"

	"github.com/kvgate/kvgate/bench"
)

// The fleet: simulated H100s running Llama-3.1-8B with a 32k-token KV
// cache each. One backend serves about 10 requests/s of 600 prompt and
// 400 output tokens: ~40 sequences share its 32k tokens, each ~4 s.
const perBackendRate = 10.0

const model = "meta-llama/Llama-3.1-8B-Instruct"

// sized scales a base duration, never under a floor that keeps a run
// meaningful.
func sized(base time.Duration, o Options) time.Duration {
	return max(time.Duration(float64(base)*o.Scale), 2*time.Second)
}

func count(rate float64, d time.Duration) int { return max(1, int(math.Round(rate*d.Seconds()))) }

// chatWorkload is interactive chat: prompts and answers of log-normal
// length.
var chatWorkload = bench.Workload{
	Kind:   bench.DatasetRandom,
	Input:  bench.Dist{Kind: bench.DistLogNormal, Mean: 400, StdDev: 200, Max: 2000},
	Output: bench.Dist{Kind: bench.DistLogNormal, Mean: 150, StdDev: 100, Max: 600},
}

// fixedWorkload is prompts of in tokens asking for exactly out.
func fixedWorkload(in, out int) bench.Workload {
	return bench.Workload{Kind: bench.DatasetRandom, Input: bench.Dist{Mean: float64(in)}, Output: bench.Dist{Mean: float64(out)}}
}

func fleet(o Options, backends int) (fleetSpec, error) {
	p, err := llamaProfile()
	return fleetSpec{profile: p, backends: backends, speedup: o.Speedup, seed: o.Seed}, err
}

func baseConfig(o Options, timeout time.Duration) bench.Config {
	return bench.Config{
		Model: model, Endpoint: bench.EndpointChat, Stream: true, Seed: o.Seed,
		RequestTimeout: timeout, JobPollInterval: time.Second,
		// The in-process kvgate runs without the NATS signal path (its
		// runner scans the store), so job event streams would never see a
		// published event: jobs are followed by polling their state.
		JobFollow:   bench.JobFollowPoll,
		Percentiles: []float64{50, 90, 99},
	}
}

// planOverload offers twice the fleet's capacity: vLLM fills its KV cache
// and preempts; kvgate should hold the cache under its target and shed
// what cannot be served in time.
func planOverload(o Options) (plan, error) {
	f, err := fleet(o, 2)
	if err != nil {
		return plan{}, err
	}
	d := sized(60*time.Second, o)
	rate := 2 * perBackendRate * float64(f.backends)
	cfg := baseConfig(o, 60*time.Second)
	cfg.Tenants = []bench.Tenant{{
		Name: "load", Arrival: bench.Arrival{Kind: bench.ArrivalPoisson, Rate: rate},
		Workload: fixedWorkload(600, 400), NumPrompts: count(rate, d),
	}}
	return plan{
		fleet: f, cfg: cfg, sending: d, measureFrom: d / 3,
		describe: fmt.Sprintf("%d simulated H100s (32k KV tokens each), Poisson %.0f req/s of 600 in / 400 out tokens (2× capacity), streamed, for %v simulated at %g× speed-up",
			f.backends, rate, d, o.Speedup),
	}, nil
}

// planMixed runs interactive chat at a fifth of capacity and batch work
// offered at 1.3 times what is left: kvgate runs batch as jobs below
// interactive traffic; the baselines get the same batch requests as plain
// requests.
func planMixed(o Options) (plan, error) {
	f, err := fleet(o, 2)
	if err != nil {
		return plan{}, err
	}
	d := sized(60*time.Second, o)
	capacity := perBackendRate * float64(f.backends) // of 600/400 requests
	// A chat request (400 in, 150 out on average) costs about 0.4 of one.
	interactive := 0.2 * capacity / 0.4
	batch := 1.3 * (capacity - 0.4*interactive)
	cfg := baseConfig(o, 60*time.Second)
	cfg.JobPollInterval = 2 * time.Second
	cfg.Tenants = []bench.Tenant{
		{Name: "interactive", APIKey: "sk-bench-interactive", Arrival: bench.Arrival{Kind: bench.ArrivalPoisson, Rate: interactive},
			Workload: chatWorkload, NumPrompts: count(interactive, d)},
		{Name: "batch", APIKey: "sk-bench-batch", Class: "batch", Deferred: true,
			Arrival:  bench.Arrival{Kind: bench.ArrivalPoisson, Rate: batch},
			Workload: fixedWorkload(600, 400), NumPrompts: count(batch, d)},
	}
	return plan{
		fleet: f, cfg: cfg, sending: d, measureFrom: d / 3,
		keys:  map[string]string{"sk-bench-interactive": "interactive", "sk-bench-batch": "batch"},
		focus: []string{"interactive"},
		describe: fmt.Sprintf("%d simulated H100s; interactive chat at %.0f req/s (streamed) plus batch at %.1f req/s of 600 in / 400 out "+
			"(jobs through kvgate, plain requests to the baselines), for %v simulated at %g× speed-up", f.backends, interactive, batch, d, o.Speedup),
	}, nil
}

// planBurst has tenant A submit 10,000 jobs (times Scale) at once while
// tenant B chats: B's latency is the measure. Every request may take until
// A's backlog has drained, so the targets are compared on the same
// completed work.
func planBurst(o Options) (plan, error) {
	f, err := fleet(o, 2)
	if err != nil {
		return plan{}, err
	}
	d := sized(60*time.Second, o)
	jobs := max(10, int(math.Round(10000*o.Scale)))
	chat := 0.1 * perBackendRate * float64(f.backends) / 0.4
	// A's 600/200 requests go at about 14 per second per backend.
	drain := time.Duration(float64(jobs) / (14 * float64(f.backends)) * float64(time.Second))
	// A minute on top covers the fixed costs (acceptance, the runner's
	// scan, the harness's polls) that dominate small runs.
	cfg := baseConfig(o, d+2*drain+time.Minute)
	// The harness follows each job by polling it: at most ~250 polls per
	// wall second over all of A's jobs, so that polling does not become
	// the load.
	cfg.JobPollInterval = max(time.Second, time.Duration(float64(jobs)/250*o.Speedup*float64(time.Second)))
	cfg.Tenants = []bench.Tenant{
		{Name: "tenant-a", APIKey: "sk-tenant-a", Class: "batch", Deferred: true,
			Arrival: bench.Arrival{Rate: math.Inf(1)}, Workload: fixedWorkload(600, 200), NumPrompts: jobs},
		{Name: "tenant-b", APIKey: "sk-tenant-b", Arrival: bench.Arrival{Kind: bench.ArrivalPoisson, Rate: chat},
			Workload: chatWorkload, NumPrompts: count(chat, d)},
	}
	return plan{
		fleet: f, cfg: cfg, sending: d, measureFrom: 0,
		keys:  map[string]string{"sk-tenant-a": "tenant-a", "sk-tenant-b": "tenant-b"},
		focus: []string{"tenant-b"},
		describe: fmt.Sprintf("%d simulated H100s; tenant A submits %d jobs of 600 in / 200 out at once (jobs through kvgate, plain requests to the baselines) "+
			"while tenant B chats at %.0f req/s (streamed) for %v; %g× speed-up", f.backends, jobs, chat, d, o.Speedup),
	}, nil
}

// planBackendFailure loads three backends to 60% and kills one a third of
// the way in: the other two then run at 90%.
func planBackendFailure(o Options) (plan, error) {
	f, err := fleet(o, 3)
	if err != nil {
		return plan{}, err
	}
	d := sized(60*time.Second, o)
	rate := 0.6 * perBackendRate * float64(f.backends)
	cfg := baseConfig(o, 60*time.Second)
	cfg.Tenants = []bench.Tenant{{
		Name: "load", Arrival: bench.Arrival{Kind: bench.ArrivalPoisson, Rate: rate},
		Workload: fixedWorkload(600, 400), NumPrompts: count(rate, d),
	}}
	kill := event{at: d / 3, what: "backend 0 dies", do: func(ctx context.Context, s *stack) error {
		return putFaults(ctx, s.backends[0], `{"dead":true}`)
	}}
	return plan{
		fleet: f, cfg: cfg, sending: d, measureFrom: d / 3, events: []event{kill},
		describe: fmt.Sprintf("%d simulated H100s, Poisson %.0f req/s of 600 in / 400 out (60%% of capacity), streamed; backend 0 dies at %v; "+
			"%v simulated at %g× speed-up", f.backends, rate, d/3, d, o.Speedup),
	}, nil
}

// planBatchAPI runs interactive chat at a fifth of capacity beside one
// batch of the Batch API, submitted at the start, whose lines would keep
// the whole fleet busy for the run: kvgate runs the lines as jobs below
// the interactive traffic; the baselines get them as plain requests, all
// at once. Interactive TTFT is the measure (docs/batches.md).
func planBatchAPI(o Options) (plan, error) {
	f, err := fleet(o, 2)
	if err != nil {
		return plan{}, err
	}
	d := sized(60*time.Second, o)
	capacity := perBackendRate * float64(f.backends)
	interactive := 0.2 * capacity / 0.4
	lines := count(1.3*(capacity-0.4*interactive), d)
	cfg := baseConfig(o, 2*d+time.Minute)
	cfg.JobPollInterval = 2 * time.Second
	cfg.Tenants = []bench.Tenant{
		{Name: "interactive", APIKey: "sk-bench-interactive", Arrival: bench.Arrival{Kind: bench.ArrivalPoisson, Rate: interactive},
			Workload: chatWorkload, NumPrompts: count(interactive, d)},
		{Name: "batch", APIKey: "sk-bench-batch", Class: "batch", Deferred: true, Batch: true,
			Arrival: bench.Arrival{Rate: math.Inf(1)}, Workload: fixedWorkload(600, 400), NumPrompts: lines},
	}
	return plan{
		fleet: f, cfg: cfg, sending: d, measureFrom: d / 3,
		keys:  map[string]string{"sk-bench-interactive": "interactive", "sk-bench-batch": "batch"},
		focus: []string{"interactive"},
		describe: fmt.Sprintf("%d simulated H100s; interactive chat at %.0f req/s (streamed) beside one Batch API batch of %d lines of 600 in / 400 out "+
			"submitted at the start (a batch through kvgate, plain requests all at once to the baselines), for %v simulated at %g× speed-up",
			f.backends, interactive, lines, d, o.Speedup),
	}, nil
}

// planInteractiveAlone is planBatchAPI's interactive traffic without the
// batch: the unloaded reference for its TTFT.
func planInteractiveAlone(o Options) (plan, error) {
	p, err := planBatchAPI(o)
	if err != nil {
		return p, err
	}
	p.cfg.Tenants = p.cfg.Tenants[:1]
	delete(p.keys, "sk-bench-batch")
	p.describe = fmt.Sprintf("batch-api's interactive chat alone: %d simulated H100s, %.0f req/s (streamed), for %v simulated at %g× speed-up",
		p.fleet.backends, p.cfg.Tenants[0].Arrival.Rate, p.sending, o.Speedup)
	return p, nil
}
