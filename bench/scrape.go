package bench

import (
	"bufio"
	"cmp"
	"context"
	"io"
	"math"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"
)

// scrapedMetrics maps the Prometheus families a run follows to the series
// names in Sample.Values, and whether several series (engines, backends,
// GPUs) are averaged (ratios) or summed (counts).
var scrapedMetrics = map[string]struct {
	name string
	mean bool
}{
	"vllm:kv_cache_usage_perc":                   {"kv_usage", true},
	"vllm:gpu_cache_usage_perc":                  {"kv_usage", true}, // before vLLM V1
	"vllm:num_requests_running":                  {"running", false},
	"vllm:num_requests_waiting":                  {"waiting", false},
	"vllm:num_preemptions_total":                 {"preemptions_total", false},
	"kvgate_scheduler_queue_depth":               {"queue_depth", false},
	"kvgate_scheduler_backend_kv_usage_ratio":    {"kv_usage", true},
	"kvgate_scheduler_backend_inflight_requests": {"inflight", false},
	"kvgate_scheduler_backend_reserved_tokens":   {"reserved_tokens", false},
	"kvgate_gpu_utilization_ratio":               {"gpu_utilization", true},
	"kvgate_gpu_memory_used_bytes":               {"gpu_memory_used_bytes", false},
	"kvgate_gpu_power_watts":                     {"gpu_power_watts", false},
}

// parseMetrics reads Prometheus text exposition and returns the followed
// families, summed or averaged over their series, or the read's error.
func parseMetrics(r io.Reader) (map[string]float64, error) {
	sum, count := map[string]float64{}, map[string]int{}
	mean := map[string]bool{}
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 4<<20)
	for sc.Scan() {
		line := sc.Text()
		if line == "" || line[0] == '#' {
			continue
		}
		name, rest := line, ""
		if i := strings.IndexAny(line, "{ "); i >= 0 {
			name, rest = line[:i], line[i:]
		}
		m, ok := scrapedMetrics[name]
		if !ok {
			continue
		}
		if strings.HasPrefix(rest, "{") {
			j := strings.LastIndexByte(rest, '}')
			if j < 0 {
				continue
			}
			rest = rest[j+1:]
		}
		f := strings.Fields(rest)
		if len(f) == 0 {
			continue
		}
		v, err := strconv.ParseFloat(f[0], 64)
		if err != nil || math.IsNaN(v) || math.IsInf(v, 0) {
			continue // JSON has no NaN; a gauge without a value says nothing
		}
		sum[m.name] += v
		count[m.name]++
		mean[m.name] = m.mean
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	for k, n := range count {
		if mean[k] && n > 0 {
			sum[k] /= float64(n)
		}
	}
	return sum, nil
}

// scraper reads /metrics endpoints, and local GPUs, on a timer.
type scraper struct {
	client  *http.Client
	urls    []string
	gpus    GPUReader
	every   time.Duration
	t0      time.Time
	cancel  context.CancelFunc
	wg      sync.WaitGroup
	mu      sync.Mutex
	samples []Sample
}

func newScraper(client *http.Client, urls []string, gpus GPUReader, every time.Duration, t0 time.Time) *scraper {
	return &scraper{client: client, urls: urls, gpus: gpus, every: every, t0: t0}
}

// gpuSource is the Sample.Source of local GPU readings.
const gpuSource = "nvml"

// readGPUs samples the local GPUs: mean utilization, summed memory and
// power, hottest temperature.
func (s *scraper) readGPUs() {
	s.gpus.Refresh()
	gs := s.gpus.GPUs()
	if len(gs) == 0 {
		return
	}
	v := map[string]float64{}
	for _, g := range gs {
		v["gpu_utilization"] += float64(g.UtilGPU) / 100 / float64(len(gs))
		v["gpu_memory_used_bytes"] += float64(g.MemoryUsed)
		v["gpu_power_watts"] += g.PowerW
		v["gpu_temperature_c"] = max(v["gpu_temperature_c"], float64(g.TemperatureC))
	}
	s.mu.Lock()
	s.samples = append(s.samples, Sample{T: time.Since(s.t0).Seconds(), Source: gpuSource, Values: v})
	s.mu.Unlock()
}

// start scrapes every endpoint at once and then every interval until stop.
func (s *scraper) start() {
	ctx, cancel := context.WithCancel(context.Background())
	s.cancel = cancel
	if s.gpus != nil {
		s.wg.Go(func() {
			t := time.NewTicker(s.every)
			defer t.Stop()
			for {
				s.readGPUs()
				select {
				case <-ctx.Done():
					return
				case <-t.C:
				}
			}
		})
	}
	for _, u := range s.urls {
		s.wg.Go(func() {
			t := time.NewTicker(s.every)
			defer t.Stop()
			for {
				s.scrape(ctx, u)
				select {
				case <-ctx.Done():
					return
				case <-t.C:
				}
			}
		})
	}
}

func (s *scraper) scrape(ctx context.Context, u string) {
	ctx, cancel := context.WithTimeout(ctx, max(s.every, 5*time.Second))
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
	if err != nil {
		return
	}
	resp, err := s.client.Do(req)
	if err != nil {
		return
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return
	}
	vals, err := parseMetrics(resp.Body)
	if err != nil || len(vals) == 0 {
		return
	}
	s.mu.Lock()
	s.samples = append(s.samples, Sample{T: time.Since(s.t0).Seconds(), Source: u, Values: vals})
	s.mu.Unlock()
}

// stop ends scraping, after one last scrape of each endpoint, and returns
// the samples in time order.
func (s *scraper) stop() []Sample {
	s.cancel()
	s.wg.Wait()
	for _, u := range s.urls {
		s.scrape(context.Background(), u)
	}
	if s.gpus != nil {
		s.readGPUs()
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	out := s.samples
	slices.SortStableFunc(out, func(a, b Sample) int { return cmp.Compare(a.T, b.T) })
	return out
}

// serverInfo reads what a /metrics page says of its deployment: vLLM's
// cache_config_info labels (block_size, num_gpu_blocks, ...) and kvgate's
// per-backend KV capacity, for the report's provenance.
func serverInfo(r io.Reader) map[string]string {
	info := map[string]string{}
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 4<<20)
	for sc.Scan() {
		line := sc.Text()
		switch {
		case strings.HasPrefix(line, "vllm:cache_config_info{"):
			labels := parseLabels(line[len("vllm:cache_config_info{"):])
			engine := labels["engine"]
			for k, v := range labels {
				if k == "engine" || k == "model_name" {
					continue
				}
				if engine != "" && engine != "0" {
					k = "engine" + engine + "." + k
				}
				info[k] = v
			}
		case strings.HasPrefix(line, "kvgate_scheduler_backend_capacity_tokens{"):
			labels := parseLabels(line[len("kvgate_scheduler_backend_capacity_tokens{"):])
			if f := strings.Fields(line[strings.LastIndexByte(line, '}')+1:]); len(f) > 0 {
				info["capacity_tokens."+labels["backend"]] = f[0]
			}
		}
	}
	return info
}

// parseLabels reads Prometheus labels (k="v",...) up to the closing brace.
func parseLabels(s string) map[string]string {
	out := map[string]string{}
	for len(s) > 0 && s[0] != '}' {
		eq := strings.IndexByte(s, '=')
		if eq < 0 || eq+1 >= len(s) || s[eq+1] != '"' {
			break
		}
		key := strings.TrimLeft(s[:eq], ", ")
		var val strings.Builder
		i := eq + 2
		for ; i < len(s) && s[i] != '"'; i++ {
			if s[i] == '\\' && i+1 < len(s) {
				i++
				switch s[i] {
				case 'n':
					val.WriteByte('\n')
					continue
				}
			}
			val.WriteByte(s[i])
		}
		out[key] = val.String()
		if i+1 > len(s) {
			break
		}
		s = strings.TrimLeft(s[i+1:], ",")
	}
	return out
}
