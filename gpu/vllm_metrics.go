package gpu

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"math"
	"strconv"
	"sync"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

// EngineMetrics are the parts of a vLLM server's /metrics that admission
// needs, summed over the engine label (data-parallel ranks).
type EngineMetrics struct {
	Running float64 // vllm:num_requests_running
	Waiting float64 // vllm:num_requests_waiting
	// KVUsage is vllm:kv_cache_usage_perc (or the older
	// vllm:gpu_cache_usage_perc), 0..1; averaged over engines weighted by
	// their blocks.
	KVUsage    float64
	HasKVUsage bool
	// BlockSize and NumGPUBlocks come from vllm:cache_config_info; zero
	// when the server does not say.
	BlockSize    int
	NumGPUBlocks int
	// NoPrefixCaching: cache_config_info says enable_prefix_caching is
	// False (vLLM started with --no-enable-prefix-caching): requests
	// share no KV there, however alike their prompts. Unknown reads as
	// caching on, vLLM's default.
	NoPrefixCaching bool
	Preemptions     float64 // vllm:num_preemptions_total, cumulative
	Generation      float64 // vllm:generation_tokens_total, cumulative
	Prompt          float64 // vllm:prompt_tokens_total, cumulative
	// Steps is the engine steps taken so far: the sample count of the
	// vllm:iteration_tokens_total histogram, which vLLM observes once per
	// step. Each running sequence gains one token a step of its engine,
	// so admission can follow requests whose output it cannot see. With
	// data-parallel engines (one series each) it is the fewest steps any
	// engine took: a request gains its own engine's steps, which engine
	// runs it is unknown, and overstating its progress would understate
	// the KV it still needs (their sum would overstate it as many times
	// as there are engines). HasSteps is false when the server does not
	// publish it.
	Steps    float64
	HasSteps bool
	// PrefixQueries and PrefixHits are vllm:prefix_cache_queries_total and
	// _hits_total (or the older gpu_prefix_cache_*), cumulative, in
	// tokens; HasPrefix is false when the server publishes neither.
	PrefixQueries, PrefixHits float64
	HasPrefix                 bool
	Legacy                    bool // the older metric names were found
}

// CapacityTokens is the KV cache size in tokens, or 0 when unknown.
func (m EngineMetrics) CapacityTokens() int { return m.BlockSize * m.NumGPUBlocks }

// wantedFamilies are the only families ParseEngineMetrics reads; every
// other line of the page is skipped before parsing, so a large /metrics
// page costs little (llm-d saw OOMs from parsing whole pages often).
var wantedFamilies = map[string]bool{
	"vllm:num_requests_running":           true,
	"vllm:num_requests_waiting":           true,
	"vllm:kv_cache_usage_perc":            true,
	"vllm:gpu_cache_usage_perc":           true,
	"vllm:cache_config_info":              true,
	"vllm:num_preemptions_total":          true,
	"vllm:num_preemptions":                true, // counter family name as some exporters print it
	"vllm:generation_tokens_total":        true,
	"vllm:generation_tokens":              true,
	"vllm:prompt_tokens_total":            true,
	"vllm:prompt_tokens":                  true,
	"vllm:iteration_tokens_total":         true, // engine steps: its sample count
	"vllm:prefix_cache_queries_total":     true, // prefix-cache counters, in tokens
	"vllm:prefix_cache_queries":           true,
	"vllm:prefix_cache_hits_total":        true,
	"vllm:prefix_cache_hits":              true,
	"vllm:gpu_prefix_cache_queries_total": true,
	"vllm:gpu_prefix_cache_queries":       true,
	"vllm:gpu_prefix_cache_hits_total":    true,
	"vllm:gpu_prefix_cache_hits":          true,
}

// ErrNoEngineMetrics is returned for a page without vLLM's engine gauges.
var ErrNoEngineMetrics = errors.New("no vllm engine metrics on the page")

// ParseEngineMetrics reads the engine state from a Prometheus text page.
// It accepts both the current and the older vLLM metric names, sums over
// the engine label, and tolerates any extra labels on cache_config_info.
func ParseEngineMetrics(r io.Reader) (EngineMetrics, error) {
	buf := scanBuffers.Get().(*scanBuffer)
	defer scanBuffers.Put(buf)
	filtered, err := buf.filter(r)
	if err != nil {
		return EngineMetrics{}, err
	}
	parser := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := parser.TextToMetricFamilies(bytes.NewReader(filtered))
	if err != nil {
		return EngineMetrics{}, fmt.Errorf("parse vllm metrics: %w", err)
	}
	var m EngineMetrics
	running, okRun := fams["vllm:num_requests_running"]
	waiting, okWait := fams["vllm:num_requests_waiting"]
	if !okRun || !okWait {
		return EngineMetrics{}, ErrNoEngineMetrics
	}
	if err := checkValues(fams); err != nil {
		return EngineMetrics{}, err
	}
	m.Running = sum(running)
	m.Waiting = sum(waiting)

	// The server's capacity. With data-parallel engines vLLM's front end
	// adds the engines' blocks up as they start and writes that total on
	// every engine's line: the server holds the largest, not their sum
	// (and its engines' usage, below, weighs alike).
	blocksByEngine := map[string]float64{}
	if info, ok := fams["vllm:cache_config_info"]; ok {
		for _, s := range info.GetMetric() {
			bs, _ := strconv.Atoi(label(s, "block_size"))
			nb, _ := strconv.Atoi(label(s, "num_gpu_blocks"))
			if bs > 0 && nb > 0 {
				if nb > maxCapacityTokens/bs {
					return EngineMetrics{}, fmt.Errorf("parse vllm metrics: cache_config_info claims more than %d KV tokens", maxCapacityTokens)
				}
				m.BlockSize = bs
				m.NumGPUBlocks = max(m.NumGPUBlocks, nb)
				blocksByEngine[label(s, "engine")] = float64(nb)
			}
			if label(s, "enable_prefix_caching") == "False" {
				m.NoPrefixCaching = true
			}
		}
	}
	usage, ok := fams["vllm:kv_cache_usage_perc"]
	if !ok {
		usage, ok = fams["vllm:gpu_cache_usage_perc"]
		m.Legacy = ok
	}
	if ok {
		m.HasKVUsage = true
		var weighted, weights float64
		for _, s := range usage.GetMetric() {
			w := blocksByEngine[label(s, "engine")]
			if w == 0 {
				w = 1
			}
			weighted += w * value(s)
			weights += w
		}
		if weights > 0 {
			m.KVUsage = weighted / weights
		}
	}
	m.Preemptions = sumFirst(fams, "vllm:num_preemptions_total", "vllm:num_preemptions")
	m.Generation = sumFirst(fams, "vllm:generation_tokens_total", "vllm:generation_tokens")
	m.Prompt = sumFirst(fams, "vllm:prompt_tokens_total", "vllm:prompt_tokens")
	queries := []string{"vllm:prefix_cache_queries_total", "vllm:prefix_cache_queries", "vllm:gpu_prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries"}
	m.PrefixQueries = sumFirst(fams, queries...)
	m.PrefixHits = sumFirst(fams, "vllm:prefix_cache_hits_total", "vllm:prefix_cache_hits", "vllm:gpu_prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits")
	for _, n := range queries {
		_, ok := fams[n]
		m.HasPrefix = m.HasPrefix || ok
	}
	if it, ok := fams["vllm:iteration_tokens_total"]; ok {
		for _, s := range it.GetMetric() {
			if h := s.GetHistogram(); h != nil {
				n := float64(h.GetSampleCount())
				if !m.HasSteps || n < m.Steps {
					m.Steps = n
				}
				m.HasSteps = true
			}
		}
	}
	for name, v := range map[string]float64{"running": m.Running, "waiting": m.Waiting, "preemptions": m.Preemptions,
		"generation tokens": m.Generation, "prompt tokens": m.Prompt} {
		if math.IsInf(v, 0) {
			return EngineMetrics{}, fmt.Errorf("parse vllm metrics: %s sum to infinity", name)
		}
	}
	return m, nil
}

// maxCapacityTokens bounds the KV capacity a page may claim: far above any
// GPU's, and low enough that admission's sums cannot overflow.
const maxCapacityTokens = 1 << 40

// checkValues refuses a page whose engine families hold a value no engine
// can have: NaN, an infinity, a negative count, or a cache usage outside
// 0..1. Admission trusts these numbers (a NaN usage would read as an empty
// cache); refused, the scrape fails and the backend's snapshot goes stale,
// which counts as saturated.
func checkValues(fams map[string]*dto.MetricFamily) error {
	for name, f := range fams {
		hi := math.Inf(1)
		if name == "vllm:kv_cache_usage_perc" || name == "vllm:gpu_cache_usage_perc" {
			hi = 1
		}
		for _, s := range f.GetMetric() {
			if s.Histogram != nil || s.Summary != nil {
				continue // only the sample count is read, an unsigned integer
			}
			if v := value(s); !(v >= 0 && v <= hi) || math.IsInf(v, 1) {
				return fmt.Errorf("parse vllm metrics: %s has the value %v", name, v)
			}
		}
	}
	return nil
}

// scanBuffer holds the buffers of one parse, reused across scrapes.
type scanBuffer struct {
	line []byte
	out  bytes.Buffer
}

var scanBuffers = sync.Pool{New: func() any { return &scanBuffer{line: make([]byte, 64<<10)} }}

// filter keeps the comment and sample lines of the wanted families (a
// histogram's _bucket, _count and _sum lines belong to its family). The
// result is valid until the buffer is reused.
func (b *scanBuffer) filter(r io.Reader) ([]byte, error) {
	b.out.Reset()
	out := &b.out
	sc := bufio.NewScanner(r)
	sc.Buffer(b.line, 1<<20)
	for sc.Scan() {
		line := bytes.TrimLeft(sc.Bytes(), " \t")
		name := line
		if rest, ok := cutComment(line); ok {
			name = rest
		} else if len(line) == 0 || line[0] == '#' {
			continue
		}
		if i := bytes.IndexAny(name, "{ \t"); i >= 0 {
			name = name[:i]
		}
		if wanted(name) {
			out.Write(line)
			out.WriteByte('\n')
		}
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("read vllm metrics: %w", err)
	}
	return out.Bytes(), nil
}

// cutComment returns what follows "# HELP" or "# TYPE" and its blanks.
// Like the Prometheus parser, it takes any blanks (or none) after the '#'.
func cutComment(line []byte) ([]byte, bool) {
	line, ok := bytes.CutPrefix(line, []byte("#"))
	if !ok {
		return nil, false
	}
	line = bytes.TrimLeft(line, " \t")
	for _, p := range [][]byte{[]byte("HELP"), []byte("TYPE")} {
		if rest, ok := bytes.CutPrefix(line, p); ok && len(rest) > 0 && (rest[0] == ' ' || rest[0] == '\t') {
			return bytes.TrimLeft(rest, " \t"), true
		}
	}
	return nil, false
}

func wanted(name []byte) bool {
	if wantedFamilies[string(name)] {
		return true
	}
	for _, suffix := range []string{"_bucket", "_count", "_sum"} {
		if base, ok := bytes.CutSuffix(name, []byte(suffix)); ok && wantedFamilies[string(base)] {
			return true
		}
	}
	return false
}

func label(m *dto.Metric, name string) string {
	for _, l := range m.GetLabel() {
		if l.GetName() == name {
			return l.GetValue()
		}
	}
	return ""
}

func value(m *dto.Metric) float64 {
	switch {
	case m.Gauge != nil:
		return m.GetGauge().GetValue()
	case m.Counter != nil:
		return m.GetCounter().GetValue()
	case m.Untyped != nil:
		return m.GetUntyped().GetValue()
	}
	return 0
}

func sum(f *dto.MetricFamily) float64 {
	var s float64
	for _, m := range f.GetMetric() {
		s += value(m)
	}
	return s
}

func sumFirst(fams map[string]*dto.MetricFamily, names ...string) float64 {
	for _, n := range names {
		if f, ok := fams[n]; ok {
			return sum(f)
		}
	}
	return 0
}
