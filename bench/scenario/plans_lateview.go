package scenario

import (
	"fmt"
	"math"
	"time"

	"github.com/kvgate/kvgate/bench"
)

// planClosedOverload keeps 64 clients in a closed loop on two backends:
// each sends its next 1,000-token prompt for 500 output tokens as its last
// answer ends, so the fleet is always asked for more KV than it has (64 ×
// 1,500 tokens against 2 × 32k): vLLM alone fills its cache and preempts;
// kvgate queues what does not fit. Its measure is the output tok/s the
// fleet keeps.
func planClosedOverload(o Options) (plan, error) {
	f, err := fleet(o, 2)
	if err != nil {
		return plan{}, err
	}
	d := sized(60*time.Second, o)
	const clients = 64
	cfg := baseConfig(o, 120*time.Second)
	// About 6 requests/s per backend complete; enough prompts to keep
	// every client busy until the sending time is up.
	cfg.Tenants = []bench.Tenant{{
		Name: "load", Arrival: bench.Arrival{Kind: bench.ArrivalConcurrency, Concurrency: clients, Rate: math.Inf(1)},
		Workload: fixedWorkload(1000, 500), NumPrompts: count(8*float64(f.backends), d),
	}}
	return plan{
		fleet: f, cfg: cfg, sending: d, measureFrom: d / 3,
		describe: fmt.Sprintf("%d simulated H100s (32k KV tokens each), %d closed-loop clients of 1,000 in / 500 out tokens, streamed, for %v simulated at %g× speed-up",
			f.backends, clients, d, o.Speedup),
	}, nil
}
