package bench

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"net/http"
	"os"
	"regexp"
	"strconv"
	"strings"
	"time"
)

// Record is one request as measured. Offsets are from the start of its load
// point; latencies from its intended send time.
type Record struct {
	Tenant   string
	Point    int           // load point index
	Intended time.Duration // when it should have been sent
	Sent     time.Duration // when it was
	TTFT     time.Duration // first text chunk; 0 without streaming
	TPOT     time.Duration // (E2EL - TTFT) / (OutputTokens - 1)
	ITLs     []time.Duration
	E2EL     time.Duration
	// InputTokens and OutputTokens are the server's usage, or the counted
	// text chunks when a stream gives no usage.
	InputTokens  int
	OutputTokens int
	Status       int    // HTTP status; 0 when no answer came
	ErrorClass   string // "" on success, else an Err* class
	Error        string
	JobID        string // deferred requests
}

func (r *Record) fail(class string, status int, msg string) {
	r.ErrorClass, r.Status, r.Error = class, status, msg
}

// failErr records a transport or read error: a timeout when the
// request's deadline passed, cancelled when the run was stopped, a broken
// stream once a 200 began, a transport error before.
func (r *Record) failErr(ctx context.Context, err error) {
	class := ErrTransport
	switch {
	case errors.Is(ctx.Err(), context.DeadlineExceeded):
		class = ErrTimeout
	case ctx.Err() != nil:
		class = ErrCancelled
	case r.Status == http.StatusOK:
		class = ErrStream
	}
	msg := err.Error()
	if len(msg) > 200 {
		msg = msg[:200]
	}
	r.ErrorClass, r.Error = class, msg
}

type recordJSON struct {
	Tenant       string    `json:"tenant"`
	Point        int       `json:"point"`
	IntendedS    float64   `json:"intended_s"`
	SentS        float64   `json:"sent_s"`
	TTFTMs       float64   `json:"ttft_ms"`
	TPOTMs       float64   `json:"tpot_ms"`
	ITLMs        []float64 `json:"itl_ms,omitempty"`
	E2ELMs       float64   `json:"e2el_ms"`
	InputTokens  int       `json:"input_tokens"`
	OutputTokens int       `json:"output_tokens"`
	Status       int       `json:"status"`
	ErrorClass   string    `json:"error_class,omitempty"`
	Error        string    `json:"error,omitempty"`
	JobID        string    `json:"job_id,omitempty"`
}

// MarshalJSON writes times as seconds (offsets) and milliseconds (latencies).
func (r Record) MarshalJSON() ([]byte, error) {
	j := recordJSON{Tenant: r.Tenant, Point: r.Point, IntendedS: r.Intended.Seconds(), SentS: r.Sent.Seconds(),
		TTFTMs: ms(r.TTFT), TPOTMs: ms(r.TPOT), E2ELMs: ms(r.E2EL), InputTokens: r.InputTokens,
		OutputTokens: r.OutputTokens, Status: r.Status, ErrorClass: r.ErrorClass, Error: r.Error, JobID: r.JobID}
	for _, g := range r.ITLs {
		j.ITLMs = append(j.ITLMs, ms(g))
	}
	return json.Marshal(j)
}

// UnmarshalJSON reads what MarshalJSON writes.
func (r *Record) UnmarshalJSON(b []byte) error {
	var j recordJSON
	if err := json.Unmarshal(b, &j); err != nil {
		return err
	}
	fromMs := func(v float64) time.Duration { return time.Duration(v * float64(time.Millisecond)) }
	*r = Record{Tenant: j.Tenant, Point: j.Point, Intended: time.Duration(j.IntendedS * float64(time.Second)),
		Sent: time.Duration(j.SentS * float64(time.Second)), TTFT: fromMs(j.TTFTMs), TPOT: fromMs(j.TPOTMs),
		E2EL: fromMs(j.E2ELMs), InputTokens: j.InputTokens, OutputTokens: j.OutputTokens, Status: j.Status,
		ErrorClass: j.ErrorClass, Error: j.Error, JobID: j.JobID}
	for _, g := range j.ITLMs {
		r.ITLs = append(r.ITLs, fromMs(g))
	}
	return nil
}

// Summary is one load point's (or tenant's) figures. In JSON its fields
// carry vllm bench serve's names: duration, completed, failed,
// total_input_tokens, total_output_tokens, request_throughput,
// request_goodput, output_throughput, total_token_throughput,
// max_output_tokens_per_s, max_concurrent_requests, and for each of ttft,
// tpot, itl and e2el: mean_X_ms, median_X_ms, std_X_ms and pNN_X_ms for
// each percentile (p99, p99.9).
type Summary struct {
	Duration              float64        `json:"duration"` // seconds
	Completed             int            `json:"completed"`
	Failed                int            `json:"failed"`
	TotalInputTokens      int            `json:"total_input_tokens"`
	TotalOutputTokens     int            `json:"total_output_tokens"`
	RequestThroughput     float64        `json:"request_throughput"`
	RequestGoodput        float64        `json:"request_goodput"`
	GoodFraction          float64        `json:"good_fraction"` // of completed requests
	OutputThroughput      float64        `json:"output_throughput"`
	TotalTokenThroughput  float64        `json:"total_token_throughput"`
	MaxOutputTokensPerS   float64        `json:"max_output_tokens_per_s"`
	MaxConcurrentRequests int            `json:"max_concurrent_requests"`
	MaxSendLagMs          float64        `json:"max_send_lag_ms"` // harness lateness; large means the harness was the bottleneck
	Errors                map[string]int `json:"error_classes,omitempty"`
	TTFT                  Latency        `json:"-"`
	TPOT                  Latency        `json:"-"`
	ITL                   Latency        `json:"-"`
	E2EL                  Latency        `json:"-"`
	// absent names the figures a file read (UnmarshalJSON) did not hold,
	// or held as null: vLLM writes only the latency families it was asked
	// for, request_goodput null without SLOs, and no good_fraction. A
	// comparison leaves them out rather than read them as 0.
	absent map[string]bool
}

// Metrics returns the summary's numeric figures by their JSON names.
func (s Summary) Metrics() map[string]float64 {
	m := map[string]float64{
		"duration": s.Duration, "completed": float64(s.Completed), "failed": float64(s.Failed),
		"total_input_tokens": float64(s.TotalInputTokens), "total_output_tokens": float64(s.TotalOutputTokens),
		"request_throughput": s.RequestThroughput, "request_goodput": s.RequestGoodput, "good_fraction": s.GoodFraction,
		"output_throughput": s.OutputThroughput, "total_token_throughput": s.TotalTokenThroughput,
		"max_output_tokens_per_s": s.MaxOutputTokensPerS, "max_concurrent_requests": float64(s.MaxConcurrentRequests),
		"max_send_lag_ms": s.MaxSendLagMs,
	}
	for name, l := range s.latencies() {
		m["mean_"+name+"_ms"] = l.Mean
		m["median_"+name+"_ms"] = l.Median
		m["std_"+name+"_ms"] = l.Std
		for p, v := range l.Percentiles {
			m[percentileKey(p, name)] = v
		}
	}
	return m
}

func (s Summary) latencies() map[string]Latency {
	return map[string]Latency{"ttft": s.TTFT, "tpot": s.TPOT, "itl": s.ITL, "e2el": s.E2EL}
}

type summaryJSON Summary

// MarshalJSON writes the summary's fields and its latency figures flat,
// with vllm's names.
func (s Summary) MarshalJSON() ([]byte, error) {
	extra := map[string]any{}
	for k, v := range s.Metrics() {
		if strings.HasSuffix(k, "_ms") && k != "max_send_lag_ms" {
			extra[k] = v
		}
	}
	return mergeJSON(summaryJSON(s), extra)
}

var percentileRE = regexp.MustCompile(`^p([0-9.]+)_(ttft|tpot|itl|e2el)_ms$`)

// UnmarshalJSON reads what MarshalJSON writes, and vllm bench serve's files.
func (s *Summary) UnmarshalJSON(b []byte) error {
	if err := json.Unmarshal(b, (*summaryJSON)(s)); err != nil {
		return err
	}
	var all map[string]json.RawMessage
	if err := json.Unmarshal(b, &all); err != nil {
		return err
	}
	lat := map[string]*Latency{"ttft": &s.TTFT, "tpot": &s.TPOT, "itl": &s.ITL, "e2el": &s.E2EL}
	num := func(k string) float64 {
		var v float64
		_ = json.Unmarshal(all[k], &v)
		return v
	}
	for name, l := range lat {
		l.Mean, l.Median, l.Std = num("mean_"+name+"_ms"), num("median_"+name+"_ms"), num("std_"+name+"_ms")
	}
	s.absent = map[string]bool{}
	for k := range s.Metrics() {
		if v, ok := all[k]; !ok || bytes.Equal(bytes.TrimSpace(v), []byte("null")) {
			s.absent[k] = true
		}
	}
	for k := range all {
		if m := percentileRE.FindStringSubmatch(k); m != nil {
			p, err := strconv.ParseFloat(m[1], 64)
			if err != nil {
				continue
			}
			l := lat[m[2]]
			if l.Percentiles == nil {
				l.Percentiles = map[float64]float64{}
			}
			l.Percentiles[p] = num(k)
		}
	}
	return nil
}

// mergeJSON marshals head, an object, with the summary's (or any map's)
// fields added at its top level.
func mergeJSON(head any, extra any) ([]byte, error) {
	var a, b map[string]json.RawMessage
	hb, err := json.Marshal(head)
	if err != nil {
		return nil, err
	}
	if err := json.Unmarshal(hb, &a); err != nil {
		return nil, err
	}
	eb, err := json.Marshal(extra)
	if err != nil {
		return nil, err
	}
	if err := json.Unmarshal(eb, &b); err != nil {
		return nil, err
	}
	for k, v := range b {
		a[k] = v
	}
	return json.Marshal(a)
}

// Rate is a request rate that writes +Inf as "inf", as vllm does.
type Rate float64

// MarshalJSON writes "inf" for an infinite rate.
func (r Rate) MarshalJSON() ([]byte, error) {
	if math.IsInf(float64(r), 1) {
		return []byte(`"inf"`), nil
	}
	return json.Marshal(float64(r))
}

// UnmarshalJSON reads a number or "inf".
func (r *Rate) UnmarshalJSON(b []byte) error {
	if bytes.Equal(b, []byte(`"inf"`)) {
		*r = Rate(math.Inf(1))
		return nil
	}
	var f float64
	if err := json.Unmarshal(b, &f); err != nil {
		return fmt.Errorf("a rate or burstiness (a number or \"inf\"): %w", err)
	}
	*r = Rate(f)
	return nil
}

// String formats the rate as vllm does ("inf" or the number).
func (r Rate) String() string {
	if math.IsInf(float64(r), 1) {
		return "inf"
	}
	return strconv.FormatFloat(float64(r), 'g', 6, 64)
}

// TenantSummary is one tenant's share of a load point.
type TenantSummary struct {
	Name    string  `json:"name"`
	Class   string  `json:"class"`
	Weight  float64 `json:"weight"`
	Summary Summary `json:"-"`
}

type tenantJSON TenantSummary

// MarshalJSON writes the tenant's summary fields flat beside its name.
func (t TenantSummary) MarshalJSON() ([]byte, error) { return mergeJSON(tenantJSON(t), t.Summary) }

// UnmarshalJSON reads what MarshalJSON writes.
func (t *TenantSummary) UnmarshalJSON(b []byte) error {
	if err := json.Unmarshal(b, (*tenantJSON)(t)); err != nil {
		return err
	}
	return json.Unmarshal(b, &t.Summary)
}

// LoadPoint is one offered load of a run and what it measured.
type LoadPoint struct {
	Index       int             `json:"index"`
	RequestRate Rate            `json:"request_rate"` // offered, per tenant sum; inf for all at once
	Concurrency int             `json:"concurrency,omitempty"`
	Start       float64         `json:"start_s"` // from the run's start
	Summary     Summary         `json:"-"`
	Tenants     []TenantSummary `json:"tenants"`
	// JainIndex is Jain's fairness index of the tenants' output throughput,
	// each divided by its weight.
	JainIndex float64 `json:"jain_index"`
}

type pointJSON LoadPoint

// MarshalJSON writes the point's summary fields flat beside its rate.
func (p LoadPoint) MarshalJSON() ([]byte, error) { return mergeJSON(pointJSON(p), p.Summary) }

// UnmarshalJSON reads what MarshalJSON writes.
func (p *LoadPoint) UnmarshalJSON(b []byte) error {
	if err := json.Unmarshal(b, (*pointJSON)(p)); err != nil {
		return err
	}
	return json.Unmarshal(b, &p.Summary)
}

// Sample is one scrape of one /metrics endpoint.
type Sample struct {
	T      float64            `json:"t"` // seconds from the run's start
	Source string             `json:"source"`
	Values map[string]float64 `json:"values"`
}

// Provenance says what was measured, with what.
type Provenance struct {
	Harness       string   `json:"harness"` // kvgate bench and its build revision
	GoVersion     string   `json:"go_version"`
	Host          string   `json:"host"`
	NumCPU        int      `json:"num_cpu"`
	Target        string   `json:"target"`
	Models        []string `json:"models,omitempty"`         // the target's /v1/models
	ServerVersion string   `json:"server_version,omitempty"` // the target's /version (vLLM, the simulator)
	// Servers holds, per scraped /metrics URL, what it says of its
	// deployment: vLLM's cache_config_info labels, kvgate's per-backend
	// KV capacity.
	Servers map[string]map[string]string `json:"servers,omitempty"`
	// GPUs and Driver describe this machine's GPUs when Config.GPUs is set.
	GPUs   []string          `json:"gpus,omitempty"`
	Driver string            `json:"nvidia_driver,omitempty"`
	Seed   uint64            `json:"seed"`
	Start  time.Time         `json:"start"`
	Extra  map[string]string `json:"extra,omitempty"` // backend profiles and such, from the caller
}

// Report is a run's result. Its JSON has vllm bench serve's top-level
// fields (date, backend, model_id, request_rate, completed, mean_ttft_ms,
// ..., and the per-request arrays input_lens, output_lens, ttfts, itls,
// errors) for the headline load point, which is the only one or, for a
// sweep, the knee (the highest rate before latency turns up, see
// knee_index; the last point when none qualifies); then load_points,
// tenants, jain_index, time_series, provenance, config and requests.
type Report struct {
	Date           string      `json:"date"` // YYYYMMDD-HHMMSS, as vllm
	EndpointType   string      `json:"endpoint_type"`
	Backend        string      `json:"backend"` // openai or openai-chat, vllm's names
	Label          string      `json:"label,omitempty"`
	ModelID        string      `json:"model_id"`
	TokenizerID    string      `json:"tokenizer_id"`
	NumPrompts     int         `json:"num_prompts"`
	RequestRate    Rate        `json:"request_rate"`
	Burstiness     Rate        `json:"burstiness"` // "inf" for constant arrivals
	MaxConcurrency *int        `json:"max_concurrency"`
	Summary        Summary     `json:"-"`
	InputLens      []int       `json:"input_lens"`
	OutputLens     []int       `json:"output_lens"`
	TTFTs          []float64   `json:"ttfts"` // seconds, as vllm
	ITLs           [][]float64 `json:"itls"`  // seconds, as vllm
	Errors         []string    `json:"errors"`

	Tenants    []TenantSummary    `json:"tenants"`
	JainIndex  float64            `json:"jain_index"`
	LoadPoints []LoadPoint        `json:"load_points"`
	Knee       int                `json:"knee_index"` // into LoadPoints; -1 when none
	Headline   int                `json:"headline_index"`
	SLO        map[string]float64 `json:"goodput_slo_ms,omitempty"`
	TimeSeries []Sample           `json:"time_series"`
	Provenance Provenance         `json:"provenance"`
	Metadata   map[string]string  `json:"metadata,omitempty"`
	Config     Config             `json:"config"`
	Requests   []Record           `json:"requests"`
}

type reportJSON Report

// MarshalJSON writes the headline summary's fields at the top level.
func (r Report) MarshalJSON() ([]byte, error) { return mergeJSON(reportJSON(r), r.Summary) }

// UnmarshalJSON reads what MarshalJSON writes; a vllm bench serve result
// file reads as a report with one load point's summary and no records.
func (r *Report) UnmarshalJSON(b []byte) error {
	if err := json.Unmarshal(b, (*reportJSON)(r)); err != nil {
		return err
	}
	return json.Unmarshal(b, &r.Summary)
}

// ReadReport reads a report written by WriteJSON (or a vllm bench serve
// result file).
func ReadReport(path string) (*Report, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("bench: read report: %w", err)
	}
	var r Report
	if err := json.Unmarshal(b, &r); err != nil {
		return nil, fmt.Errorf("bench: parse report %s: %w", path, err)
	}
	return &r, nil
}
