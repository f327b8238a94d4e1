package bench

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"slices"
	"strings"
	"time"

	"github.com/kvgate/kvgate/gpu"
)

// Endpoints a run can call.
const (
	EndpointCompletions = "completions" // POST /v1/completions (vllm bench serve's default)
	EndpointChat        = "chat"        // POST /v1/chat/completions
)

// Arrival process kinds.
const (
	ArrivalPoisson     = "poisson"     // exponential gaps: Gamma with burstiness 1
	ArrivalGamma       = "gamma"       // Gamma(shape=burstiness, scale=1/(rate·burstiness)) gaps
	ArrivalConstant    = "constant"    // a fixed gap of 1/rate
	ArrivalConcurrency = "concurrency" // closed loop: Concurrency clients, each sends when its last answer ends
	ArrivalTrace       = "trace"       // the timestamps of a trace workload
)

// How deferred jobs are followed.
const (
	JobFollowSSE  = "sse"  // GET /v1/jobs/{id}/events until a final state
	JobFollowPoll = "poll" // GET /v1/jobs/{id} every JobPollInterval
	// JobFollowNone follows no job: a request's record ends with its
	// acceptance (202), so its latency is the acceptance's alone and it
	// carries no tokens; the jobs run on after the run.
	JobFollowNone = "none"
)

// Workload kinds (vllm bench serve's --dataset-name where they overlap).
const (
	DatasetRandom   = "random"   // synthetic prompts with lengths drawn from Input and Output
	DatasetShareGPT = "sharegpt" // conversations from a ShareGPT-format JSON file
	DatasetPrefix   = "prefix"   // synthetic prompts that share one of PrefixGroups prefixes of PrefixLen tokens
	DatasetTrace    = "trace"    // a JSONL trace replayed with its timestamps
	// DatasetSystemPrompt is chat whose every request carries one of
	// PrefixGroups system prompts of PrefixLen tokens (a tenant's) and a
	// user question drawn from Input (sessions.go).
	DatasetSystemPrompt = "system-prompt"
	// DatasetMultiTurn is PrefixGroups chat sessions, each a system
	// prompt of PrefixLen tokens, whose every turn resends the whole
	// history: earlier questions (Input) and answers (Output) (sessions.go).
	DatasetMultiTurn = "multi-turn"
)

// Length distribution kinds.
const (
	DistFixed     = "fixed"
	DistUniform   = "uniform"
	DistNormal    = "normal"
	DistLogNormal = "lognormal"
)

// Config describes one benchmark run: where to send, what, how fast, and
// for whom. The zero value of every field but Target and Model has a
// working default (see Validate); a run with no Tenants has one tenant,
// "default", made of the top-level APIKey, Arrival and Workload.
type Config struct {
	// Target is the server's base URL (http://host:8080 or .../v1): kvgate,
	// vLLM, the simulator or any OpenAI-compatible server.
	Target string `json:"target"`
	// Model is the model id sent in every request.
	Model string `json:"model"`
	// APIKey is sent as a bearer token by tenants that have none of their own.
	APIKey string `json:"-"`
	// Endpoint is EndpointCompletions (default) or EndpointChat.
	Endpoint string `json:"endpoint"`
	// Stream asks for server-sent events with stream_options.include_usage,
	// which TTFT, TPOT and ITL need; without it only end-to-end latency is
	// measured.
	Stream bool `json:"stream"`

	Workload Workload `json:"workload"`
	Arrival  Arrival  `json:"arrival"`
	Tenants  []Tenant `json:"tenants,omitempty"`

	// NumPrompts is how many requests each load point sends (over all
	// tenants with no count of their own); Duration stops sending after that
	// long. At least one must be set; with both, whichever comes first.
	NumPrompts int           `json:"num_prompts"`
	Duration   time.Duration `json:"duration"`
	// MaxConcurrency caps requests in flight (vllm's --max-concurrency);
	// a request waiting for a slot is timed from when it gets one, as vLLM
	// does, since the cap is part of the client. 0: no cap.
	MaxConcurrency int `json:"max_concurrency"`
	// Sweep, when set, runs several load points (rates) and finds the knee.
	Sweep *Sweep `json:"sweep,omitempty"`

	SLO SLO `json:"slo"`
	// Percentiles reported for each latency (vllm's --metric-percentiles);
	// default 50, 90, 99, 99.9.
	Percentiles []float64 `json:"percentiles"`
	// Seed makes arrivals and prompts reproducible.
	Seed uint64 `json:"seed"`
	// RequestTimeout cuts a request that has not ended after this long
	// (default 10 minutes); it counts as a timeout error.
	RequestTimeout time.Duration `json:"request_timeout"`

	// Scrape lists Prometheus endpoints (kvgate's or vLLM's /metrics) read
	// every ScrapeInterval (default 1s) during the run.
	Scrape         []string      `json:"scrape,omitempty"`
	ScrapeInterval time.Duration `json:"scrape_interval"`
	// GPUs, when set, is read every ScrapeInterval for this machine's GPU
	// telemetry (a *gpu.NVML from gpu.OpenNVML); its samples have source
	// "nvml".
	GPUs GPUReader `json:"-"`
	// JobFollow is how deferred jobs are followed to their end: JobFollowSSE
	// (default; their event stream, polling where the target has none),
	// JobFollowPoll, or JobFollowNone (not at all: the acceptance's latency).
	JobFollow string `json:"job_follow"`
	// JobPollInterval is how often a polled job's state is read (100 ms).
	JobPollInterval time.Duration `json:"job_poll_interval"`

	// Label and Metadata are copied into the report (vllm's --label,
	// --metadata).
	Label    string            `json:"label,omitempty"`
	Metadata map[string]string `json:"metadata,omitempty"`

	// HTTPClient sends the requests; nil uses NewHTTPClient(MaxConnections).
	HTTPClient *http.Client `json:"-"`
	// MaxConnections caps connections per host (DefaultMaxConnections when
	// 0, none when negative), so that an open loop against a stalled
	// target queues in the client, still timed, instead of exhausting file
	// descriptors.
	MaxConnections int `json:"max_connections"`
	// Progress, when set, receives a progress bar (on a terminal) or a plain
	// line every few seconds.
	Progress io.Writer `json:"-"`
}

// GPUReader reads local GPUs; *gpu.NVML is one.
type GPUReader interface {
	Refresh()
	GPUs() []gpu.GPU
	Driver() string
}

// Tenant is one client population in a run, with its own key, class,
// arrivals and workload.
type Tenant struct {
	Name   string `json:"name"`
	APIKey string `json:"-"`
	// Class labels the tenant in reports: interactive by default, batch
	// when Deferred (kvgate derives the class from the API a request uses).
	Class string `json:"class,omitempty"`
	// Weight is the tenant's fair share, used by Jain's index (default 1).
	Weight float64 `json:"weight,omitempty"`
	// Arrival and Workload replace the run's when set (not zero).
	Arrival  Arrival  `json:"arrival"`
	Workload Workload `json:"workload"`
	// NumPrompts replaces the run's count for this tenant when positive.
	NumPrompts int `json:"num_prompts,omitempty"`
	// Deferred submits each request as a job (POST /v1/jobs) and follows it
	// by polling until it ends; its latency is submission to completion.
	Deferred bool `json:"deferred,omitempty"`
	// Batch submits the tenant's NumPrompts requests as one batch of the
	// Batch API (POST /v1/files and /v1/batches, kvgate only) at the
	// start, and follows it by polling; each request's latency is the
	// batch's. Its arrival is ignored.
	Batch bool `json:"batch,omitempty"`
}

// Arrival says when requests are sent.
type Arrival struct {
	// Kind is one of the Arrival* constants; default poisson, or constant
	// when Burstiness is +Inf, or trace for a trace workload.
	Kind string `json:"kind"`
	// Rate is requests per second; +Inf (or 0) sends everything at once, as
	// vllm's --request-rate inf.
	Rate float64 `json:"-"` // written as request_rate ("inf" or a number)
	// Burstiness is the Gamma shape (default 1 = Poisson); below 1 burstier,
	// above 1 smoother.
	Burstiness float64 `json:"-"` // written as burstiness ("inf" or a number)
	// Concurrency is the number of closed-loop clients for kind concurrency.
	Concurrency int `json:"concurrency,omitempty"`
	// TimeScale stretches a trace's timestamps (2 = half as fast); default 1.
	TimeScale float64 `json:"time_scale,omitempty"`
	// Steps, above 1, makes an open-loop rate rise in that many equal
	// steps, from Rate/Steps to Rate, over a load point's NumPrompts
	// (sessions.go).
	Steps int `json:"steps,omitempty"`
}

// Workload says what requests contain.
type Workload struct {
	// Kind is one of the Dataset* constants; default random.
	Kind string `json:"kind"`
	// Input and Output are token length distributions for synthetic
	// prompts; Output also sets max_tokens (with ignore_eos) for random and
	// prefix workloads. Defaults: fixed 1024 and 128, as vllm's random.
	Input  Dist `json:"input"`
	Output Dist `json:"output"`
	// Path is the ShareGPT JSON file or the JSONL trace.
	Path string `json:"path,omitempty"`
	// PrefixLen tokens are shared by the prompts of each of PrefixGroups
	// groups (prefix workload; default 1 group).
	PrefixLen    int `json:"prefix_len,omitempty"`
	PrefixGroups int `json:"prefix_groups,omitempty"`
	// Turns is how many turns a multi-turn session has before it starts
	// over as a new conversation (default 8).
	Turns int `json:"turns,omitempty"`
	// IgnoreEOS asks the server for exactly max_tokens (vLLM's ignore_eos);
	// always on for random and prefix workloads, as vllm bench serve does.
	IgnoreEOS bool `json:"ignore_eos,omitempty"`
	// FixedOutput, when positive, replaces ShareGPT's and the trace's output
	// lengths (vllm's --sharegpt-output-len).
	FixedOutput int `json:"fixed_output,omitempty"`
}

// Dist is a distribution of token lengths, clamped to [Min, Max] and to at
// least 1.
type Dist struct {
	Kind   string  `json:"kind"` // Dist* constant; default fixed
	Mean   float64 `json:"mean"`
	StdDev float64 `json:"stddev,omitempty"` // normal and lognormal (of the length, not its log)
	Min    int     `json:"min,omitempty"`    // uniform's lower bound; a floor for the others
	Max    int     `json:"max,omitempty"`    // uniform's upper bound; a cap for the others
}

// SLO holds the service-level objectives that goodput counts (vllm's
// --goodput ttft:MS tpot:MS e2el:MS); a zero field is not checked.
type SLO struct {
	TTFT time.Duration `json:"ttft,omitempty"`
	TPOT time.Duration `json:"tpot,omitempty"`
	E2EL time.Duration `json:"e2el,omitempty"`
}

// Sweep runs one load point per rate. With Rates empty it first runs at
// full speed (rate inf) to find the saturation throughput, then Points-1
// evenly spaced rates up to it, as GuideLLM's sweep does.
type Sweep struct {
	Rates  []float64 `json:"rates,omitempty"`
	Points int       `json:"points,omitempty"` // default 6
}

// Validate fills defaults into a copy of c and checks it. It returns the
// filled copy, or an error naming the first bad field.
func (c Config) Validate() (Config, error) {
	if c.Target == "" {
		return c, errors.New("bench: no target URL")
	}
	if !strings.HasPrefix(c.Target, "http://") && !strings.HasPrefix(c.Target, "https://") {
		return c, fmt.Errorf("bench: target %q is not an http(s) URL", c.Target)
	}
	if c.Model == "" {
		return c, errors.New("bench: no model")
	}
	switch c.Endpoint {
	case "":
		c.Endpoint = EndpointCompletions
	case EndpointCompletions, EndpointChat:
	default:
		return c, fmt.Errorf("bench: endpoint %q is neither %s nor %s", c.Endpoint, EndpointCompletions, EndpointChat)
	}
	if c.NumPrompts < 0 || c.Duration < 0 || c.MaxConcurrency < 0 {
		return c, errors.New("bench: negative num_prompts, duration or max_concurrency")
	}
	if len(c.Percentiles) == 0 {
		c.Percentiles = []float64{50, 90, 99, 99.9}
	}
	for _, p := range c.Percentiles {
		if !(p > 0 && p <= 100) {
			return c, fmt.Errorf("bench: percentile %v outside (0, 100]", p)
		}
	}
	if c.RequestTimeout <= 0 {
		c.RequestTimeout = 10 * time.Minute
	}
	switch {
	case c.MaxConnections == 0:
		c.MaxConnections = DefaultMaxConnections
	case c.MaxConnections < 0:
		c.MaxConnections = 0
	}
	if c.ScrapeInterval <= 0 {
		c.ScrapeInterval = time.Second
	}
	switch c.JobFollow {
	case "":
		c.JobFollow = JobFollowSSE
	case JobFollowSSE, JobFollowPoll, JobFollowNone:
	default:
		return c, fmt.Errorf("bench: job_follow %q is none of %s, %s and %s", c.JobFollow, JobFollowSSE, JobFollowPoll, JobFollowNone)
	}
	if c.JobPollInterval <= 0 {
		c.JobPollInterval = 100 * time.Millisecond
	}
	var err error
	if c.Workload, err = c.Workload.withDefaults(); err != nil {
		return c, err
	}
	if c.Arrival, err = c.Arrival.withDefaults(c.Workload); err != nil {
		return c, err
	}
	if len(c.Tenants) == 0 {
		c.Tenants = []Tenant{{Name: "default"}}
	} else {
		c.Tenants = append([]Tenant(nil), c.Tenants...)
	}
	// The run's arrival is shared by the tenants that take it, as its
	// count is: --request-rate is the rate over all of them.
	// So is --num-prompts, by the tenants without a count of their own.
	sharing, counting := 0, 0
	for _, t := range c.Tenants {
		if t.Arrival == (Arrival{}) {
			sharing++
		}
		if t.NumPrompts == 0 {
			counting++
		}
	}
	seen, shared, counted := map[string]bool{}, 0, 0
	for i := range c.Tenants {
		t := &c.Tenants[i]
		if t.Name == "" {
			t.Name = fmt.Sprintf("tenant%d", i+1)
		}
		if seen[t.Name] {
			return c, fmt.Errorf("bench: tenant %q appears twice", t.Name)
		}
		seen[t.Name] = true
		if t.APIKey == "" {
			t.APIKey = c.APIKey
		}
		if t.Class == "" {
			t.Class = "interactive"
			if t.Deferred || t.Batch {
				t.Class = "batch"
			}
		}
		if t.Weight == 0 {
			t.Weight = 1
		}
		if t.Weight < 0 || t.NumPrompts < 0 {
			return c, fmt.Errorf("bench: tenant %s: negative weight or num_prompts", t.Name)
		}
		if t.Workload == (Workload{}) {
			t.Workload = c.Workload
		} else if t.Workload, err = t.Workload.withDefaults(); err != nil {
			return c, fmt.Errorf("bench: tenant %s: %w", t.Name, err)
		}
		if t.Arrival == (Arrival{}) {
			if t.Arrival, err = c.Arrival.Share(shared, sharing); err != nil {
				return c, fmt.Errorf("bench: tenant %s: %w", t.Name, err)
			}
			shared++
		} else if t.Arrival, err = t.Arrival.withDefaults(t.Workload); err != nil {
			return c, fmt.Errorf("bench: tenant %s: %w", t.Name, err)
		}
		if t.NumPrompts == 0 && c.NumPrompts > 0 {
			t.NumPrompts = c.NumPrompts / counting
			if counted < c.NumPrompts%counting {
				t.NumPrompts++
			}
			counted++
		}
		if t.NumPrompts == 0 && c.Duration == 0 && t.Arrival.Kind != ArrivalTrace {
			return c, fmt.Errorf("bench: tenant %s: neither num_prompts nor duration bounds the run", t.Name)
		}
		if c.Sweep == nil && t.NumPrompts == 0 && math.IsInf(t.Arrival.Rate, 1) && t.Arrival.Kind != ArrivalTrace && t.Arrival.Kind != ArrivalConcurrency {
			// Everything at once is a burst of num_prompts; with the
			// duration alone it would be requests without end.
			return c, fmt.Errorf("bench: tenant %s: an infinite request rate sends its num_prompts at once and needs num_prompts; set it, or a finite request rate for a run bounded by duration", t.Name)
		}
	}
	if c.Sweep != nil {
		s := *c.Sweep
		if len(s.Rates) == 0 && s.Points == 0 {
			s.Points = 6
		}
		if len(s.Rates) == 0 && s.Points < 2 {
			return c, errors.New("bench: a sweep needs at least 2 points")
		}
		for _, r := range s.Rates {
			if !(r > 0) {
				return c, fmt.Errorf("bench: sweep rate %v is not positive", r)
			}
		}
		if len(s.Rates) == 0 || slices.ContainsFunc(s.Rates, func(r float64) bool { return math.IsInf(r, 1) }) {
			// Its first point sends everything at once: a burst of
			// num_prompts, without end when none is set.
			for _, t := range c.Tenants {
				if t.NumPrompts == 0 && t.Arrival.Kind != ArrivalTrace {
					return c, fmt.Errorf("bench: tenant %s: a sweep's point at an infinite rate sends its num_prompts at once and needs num_prompts", t.Name)
				}
			}
		}
		c.Sweep = &s
	}
	return c, nil
}

// Share is the part of a that the i-th of n tenants taking it gets: an
// n-th of its rate, and of its closed-loop clients (the first ones get
// one more where they do not divide evenly).
func (a Arrival) Share(i, n int) (Arrival, error) {
	if n <= 1 {
		return a, nil
	}
	a.Rate /= float64(n)
	if a.Kind == ArrivalConcurrency || a.Kind == "" && a.Concurrency > 0 {
		if a.Concurrency < n {
			return a, fmt.Errorf("%d clients cannot be shared by %d tenants; give each its own concurrency, or more clients", a.Concurrency, n)
		}
		c := a.Concurrency / n
		if i < a.Concurrency%n {
			c++
		}
		a.Concurrency = c
	}
	return a, nil
}

type arrivalJSON Arrival

// MarshalJSON writes the rate as request_rate and the burstiness, each
// "inf" when infinite (constant arrivals' burstiness).
func (a Arrival) MarshalJSON() ([]byte, error) {
	return mergeJSON(arrivalJSON(a), map[string]Rate{"request_rate": Rate(a.Rate), "burstiness": Rate(a.Burstiness)})
}

// UnmarshalJSON reads what MarshalJSON writes.
func (a *Arrival) UnmarshalJSON(b []byte) error {
	if err := json.Unmarshal(b, (*arrivalJSON)(a)); err != nil {
		return err
	}
	var r struct {
		Rate       *Rate `json:"request_rate"`
		Burstiness *Rate `json:"burstiness"`
	}
	if err := json.Unmarshal(b, &r); err != nil {
		return err
	}
	if r.Rate != nil {
		a.Rate = float64(*r.Rate)
	}
	if r.Burstiness != nil {
		a.Burstiness = float64(*r.Burstiness)
	}
	return nil
}

func (a Arrival) withDefaults(w Workload) (Arrival, error) {
	if a.Rate == 0 {
		a.Rate = math.Inf(1)
	}
	if a.Rate < 0 || math.IsNaN(a.Rate) {
		return a, fmt.Errorf("bench: request rate %v is negative", a.Rate)
	}
	if a.Burstiness == 0 {
		a.Burstiness = 1
	}
	if a.Burstiness < 0 || math.IsNaN(a.Burstiness) {
		return a, fmt.Errorf("bench: burstiness %v is not a number >= 0", a.Burstiness)
	}
	if a.Steps < 0 {
		return a, fmt.Errorf("bench: steps %d is negative", a.Steps)
	}
	if a.TimeScale == 0 {
		a.TimeScale = 1
	}
	if a.Kind == "" {
		switch {
		case w.Kind == DatasetTrace:
			a.Kind = ArrivalTrace
		case a.Concurrency > 0:
			a.Kind = ArrivalConcurrency
		case math.IsInf(a.Burstiness, 1):
			a.Kind = ArrivalConstant
		case a.Burstiness != 1:
			a.Kind = ArrivalGamma
		default:
			a.Kind = ArrivalPoisson
		}
	}
	switch a.Kind {
	case ArrivalPoisson:
		a.Burstiness = 1
	case ArrivalConstant:
		a.Burstiness = math.Inf(1) // vLLM's name for even gaps
	case ArrivalGamma:
	case ArrivalConcurrency:
		if a.Concurrency <= 0 {
			return a, errors.New("bench: concurrency arrivals need a positive concurrency")
		}
	case ArrivalTrace:
		if w.Kind != DatasetTrace {
			return a, errors.New("bench: trace arrivals need a trace workload")
		}
		if a.TimeScale < 0 {
			return a, errors.New("bench: negative time scale")
		}
	default:
		return a, fmt.Errorf("bench: unknown arrival kind %q", a.Kind)
	}
	return a, nil
}

func (w Workload) withDefaults() (Workload, error) {
	if w.Kind == "" {
		w.Kind = DatasetRandom
	}
	if w.Input.Mean == 0 && w.Input.Kind == "" {
		w.Input = Dist{Kind: DistFixed, Mean: 1024}
	}
	if w.Output.Mean == 0 && w.Output.Kind == "" {
		w.Output = Dist{Kind: DistFixed, Mean: 128}
	}
	var err error
	if w.Input, err = w.Input.withDefaults("input"); err != nil {
		return w, err
	}
	if w.Output, err = w.Output.withDefaults("output"); err != nil {
		return w, err
	}
	switch w.Kind {
	case DatasetRandom:
		w.IgnoreEOS = true
	case DatasetPrefix, DatasetSystemPrompt, DatasetMultiTurn:
		w.IgnoreEOS = true
		if w.PrefixGroups <= 0 {
			w.PrefixGroups = 1
		}
		if w.Turns <= 0 {
			w.Turns = 8
		}
		if w.PrefixLen <= 0 {
			return w, fmt.Errorf("bench: a %s workload needs prefix_len", w.Kind)
		}
	case DatasetShareGPT, DatasetTrace:
		if w.Path == "" {
			return w, fmt.Errorf("bench: a %s workload needs a dataset path", w.Kind)
		}
	default:
		return w, fmt.Errorf("bench: unknown dataset %q", w.Kind)
	}
	return w, nil
}

func (d Dist) withDefaults(what string) (Dist, error) {
	if d.Kind == "" {
		d.Kind = DistFixed
	}
	switch d.Kind {
	case DistFixed, DistNormal, DistLogNormal:
		if !(d.Mean >= 1) {
			return d, fmt.Errorf("bench: %s length mean %v is below 1", what, d.Mean)
		}
	case DistUniform:
		if d.Min < 1 || d.Max < d.Min {
			return d, fmt.Errorf("bench: %s uniform length needs 1 <= min <= max", what)
		}
	default:
		return d, fmt.Errorf("bench: unknown %s length distribution %q", what, d.Kind)
	}
	if d.StdDev < 0 || (d.Max > 0 && d.Max < d.Min) {
		return d, fmt.Errorf("bench: bad %s length bounds", what)
	}
	return d, nil
}
