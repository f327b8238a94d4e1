package bench

import (
	"bytes"
	"context"
	"encoding/json"
	"encoding/xml"
	"io"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// smallRun is a short streaming run against the simulator.
func smallRun(t *testing.T, mod func(*Config)) *Report {
	t.Helper()
	_, url := newSim(t, 50)
	cfg := Config{Target: url, Model: "meta-llama/Llama-3.1-8B-Instruct", Stream: true,
		Workload: Workload{Input: Dist{Mean: 32}, Output: Dist{Mean: 8}}, Arrival: Arrival{Rate: 400},
		NumPrompts: 20, Seed: 1, SLO: SLO{TTFT: time.Minute}, Percentiles: []float64{50, 90, 99, 99.9}}
	if mod != nil {
		mod(&cfg)
	}
	rep, err := Run(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	return rep
}

func TestReportJSONUsesVllmFieldNames(t *testing.T) {
	rep := smallRun(t, nil)
	var buf bytes.Buffer
	if err := rep.WriteJSON(&buf); err != nil {
		t.Fatal(err)
	}
	var m map[string]any
	if err := json.Unmarshal(buf.Bytes(), &m); err != nil {
		t.Fatal(err)
	}
	want := []string{"date", "endpoint_type", "backend", "model_id", "tokenizer_id", "num_prompts", "request_rate",
		"burstiness", "max_concurrency", "duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
		"request_throughput", "request_goodput", "output_throughput", "total_token_throughput", "max_output_tokens_per_s",
		"max_concurrent_requests", "input_lens", "output_lens", "ttfts", "itls", "errors"}
	for _, metric := range []string{"ttft", "tpot", "itl", "e2el"} {
		for _, stat := range []string{"mean", "median", "std", "p50", "p90", "p99", "p99.9"} {
			want = append(want, stat+"_"+metric+"_ms")
		}
	}
	for _, k := range want {
		if _, ok := m[k]; !ok {
			t.Errorf("report JSON lacks %q", k)
		}
	}
	if m["request_rate"] != 400.0 || m["max_concurrency"] != nil || m["backend"] != "openai" || m["num_prompts"] != 20.0 {
		t.Errorf("request_rate %v, max_concurrency %v, backend %v, num_prompts %v", m["request_rate"], m["max_concurrency"], m["backend"], m["num_prompts"])
	}
	if ttfts := m["ttfts"].([]any); len(ttfts) != 20 || ttfts[0].(float64) <= 0 || ttfts[0].(float64) > 10 {
		t.Errorf("ttfts (seconds, as vllm) = %v", ttfts)
	}
	if m["mean_ttft_ms"].(float64) <= 0 || m["p99.9_e2el_ms"].(float64) < m["median_e2el_ms"].(float64) {
		t.Errorf("mean_ttft_ms %v p99.9_e2el_ms %v median_e2el_ms %v", m["mean_ttft_ms"], m["p99.9_e2el_ms"], m["median_e2el_ms"])
	}
	pt := m["load_points"].([]any)[0].(map[string]any)
	if pt["completed"] != 20.0 || pt["p99_ttft_ms"] == nil || pt["request_rate"] != 400.0 {
		t.Errorf("load point JSON %v", pt)
	}
	tn := m["tenants"].([]any)[0].(map[string]any)
	if tn["name"] != "default" || tn["completed"] != 20.0 || tn["mean_itl_ms"] == nil {
		t.Errorf("tenant JSON %v", tn)
	}

	// It reads back whole.
	path := filepath.Join(t.TempDir(), "r.json")
	if err := os.WriteFile(path, buf.Bytes(), 0o644); err != nil {
		t.Fatal(err)
	}
	back, err := ReadReport(path)
	if err != nil {
		t.Fatal(err)
	}
	if back.Summary.Completed != 20 || !near(back.Summary.TTFT.Percentiles[99.9], rep.Summary.TTFT.Percentiles[99.9]) ||
		!near(back.Summary.ITL.Mean, rep.Summary.ITL.Mean) || len(back.Requests) != 20 ||
		back.Requests[3].OutputTokens != rep.Requests[3].OutputTokens || len(back.LoadPoints[0].Tenants) != 1 ||
		back.Config.Arrival.Rate != 400 {
		t.Errorf("read back %+v, want %+v", back.Summary, rep.Summary)
	}
}

func TestReadVllmResultFile(t *testing.T) {
	r, err := ReadReport("testdata/vllm-result.json")
	if err != nil {
		t.Fatal(err)
	}
	if !math.IsInf(float64(r.RequestRate), 1) || r.Summary.Completed != 200 || r.Summary.TTFT.Percentiles[99] != 1502.3 ||
		r.Summary.ITL.Percentiles[99.9] != 95.5 || r.Summary.TPOT.Median != 30.9 || r.Summary.RequestGoodput != 9.5 {
		t.Errorf("read %+v", r.Summary)
	}
}

func TestWriteFiles(t *testing.T) {
	rep := smallRun(t, func(c *Config) {
		c.Tenants = []Tenant{{Name: "acme"}, {Name: "globex", Weight: 2}}
	})
	dir := t.TempDir()
	if err := rep.WriteFiles(dir); err != nil {
		t.Fatal(err)
	}
	read := func(name string) string {
		b, err := os.ReadFile(filepath.Join(dir, name))
		if err != nil {
			t.Fatal(err)
		}
		return string(b)
	}
	csv := strings.Split(strings.TrimSpace(read(FileSummaryCSV)), "\n")
	if len(csv) != 4 || !strings.HasPrefix(csv[0], "point,request_rate,tenant,class,jain_index,duration,completed") ||
		!strings.Contains(csv[0], "p99.9_ttft_ms") || !strings.Contains(csv[2], ",acme,interactive,") {
		t.Errorf("summary.csv:\n%s", strings.Join(csv, "\n"))
	}
	if lines := strings.Count(read(FileRequestsCSV), "\n"); lines != 21 {
		t.Errorf("requests.csv has %d lines, want a header and 20", lines)
	}
	md := read(FileMarkdown)
	for _, want := range []string{"| Successful requests | 20 |", "| TTFT |", "## Tenants", "| globex | interactive | 2 |"} {
		if !strings.Contains(md, want) {
			t.Errorf("report.md lacks %q:\n%s", want, md)
		}
	}
	html := read(FileHTML)
	for _, want := range []string{"<svg", "Latency against throughput", "Latency CDFs", "Output tokens/s per tenant", "<table>"} {
		if !strings.Contains(html, want) {
			t.Errorf("report.html lacks %q", want)
		}
	}
	// Every chart is well-formed SVG.
	for rest := html; ; {
		i := strings.Index(rest, "<svg")
		if i < 0 {
			break
		}
		j := strings.Index(rest[i:], "</svg>") + i + len("</svg>")
		dec := xml.NewDecoder(strings.NewReader(rest[i:j]))
		for {
			if _, err := dec.Token(); err == io.EOF {
				break
			} else if err != nil {
				t.Fatalf("chart is not well-formed: %v\n%s", err, rest[i:j])
			}
		}
		rest = rest[j:]
	}
	for _, bad := range []string{"<script", "http://cdn", "https://"} {
		if strings.Contains(html, bad) {
			t.Errorf("report.html contains %q: it must read offline", bad)
		}
	}
}

func TestRateJSON(t *testing.T) {
	for _, r := range []Rate{Rate(math.Inf(1)), 2.5} {
		b, _ := json.Marshal(r)
		var back Rate
		if err := json.Unmarshal(b, &back); err != nil || back != r {
			t.Errorf("%v -> %s -> %v (%v)", r, b, back, err)
		}
	}
}

func TestMarkdownWarnsOfALateHarness(t *testing.T) {
	for _, tc := range []struct {
		lag  float64
		warn bool
	}{{3, false}, {120, true}} {
		var b strings.Builder
		r := &Report{Summary: Summary{MaxSendLagMs: tc.lag}, LoadPoints: []LoadPoint{{}}}
		if err := r.WriteMarkdown(&b); err != nil {
			t.Fatal(err)
		}
		if got := strings.Contains(b.String(), "fell behind its schedule by up to"); got != tc.warn {
			t.Errorf("send lag %v ms: warning %v, want %v", tc.lag, got, tc.warn)
		}
	}
}
