package deploy

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"testing"
)

// The Grafana dashboard, deploy/observability/grafana/kvgate.json, is
// generated from the panels below: KVGATE_UPDATE=1 go test -run
// TestDashboardGenerated rewrites it; the test fails when the file and
// the table differ. TestMetricsExposed checks every metric the panels
// name against a running kvgate's /metrics.
const dashboardFile = "observability/grafana/kvgate.json"

type target struct{ expr, legend string }

type panel struct {
	title, unit, desc string
	targets           []target
	kind              string // timeseries (default) or stat
}

func t1(expr, legend string) target { return target{expr, legend} }

// Each replica reports the shared backlog; max by (class, tenant) takes
// one replica's figure before summing.
const (
	backlogJobs   = `max by (class, tenant) (kvgate_jobs_runnable)`
	backlogTokens = `max by (class, tenant) (kvgate_jobs_runnable_tokens)`
	rateWindow    = `[$__rate_interval]`
)

var dashboardRows = []struct {
	title  string
	panels []panel
}{
	{"Fleet", []panel{
		{title: "KV headroom per backend", unit: "percentunit",
			desc: "1 - KV-cache usage as each backend last reported it; dashed: the share kvgate has reserved (prompt plus max output of what it has in flight).",
			targets: []target{
				t1(`1 - max by (backend) (kvgate_scheduler_backend_kv_usage_ratio)`, "{{backend}} free"),
				t1(`max by (backend) (kvgate_scheduler_backend_reserved_tokens) / max by (backend) (kvgate_scheduler_backend_capacity_tokens)`, "{{backend}} reserved"),
			}},
		{title: "Running and waiting per backend", unit: "short",
			desc: "vLLM's own gauges: sequences in its running batch and in its waiting queue.",
			targets: []target{
				t1(`sum by (instance) (vllm:num_requests_running)`, "{{instance}} running"),
				t1(`sum by (instance) (vllm:num_requests_waiting)`, "{{instance}} waiting"),
				t1(`sum by (backend) (kvgate_scheduler_backend_inflight_requests)`, "{{backend}} kvgate in flight"),
			}},
		{title: "Preemptions", unit: "reqps",
			desc:    "vLLM preempting sequences: its KV cache overflowed. Admission should keep this at zero.",
			targets: []target{t1(`sum by (instance) (rate(vllm:num_preemptions_total`+rateWindow+`))`, "{{instance}}")}},
		{title: "Admission refusals by reason", unit: "reqps",
			desc:    "Requests kvgate did not admit: queue_timeout, queue_full, too_large, no_backend, cancelled, shutting_down.",
			targets: []target{t1(`sum by (outcome) (rate(kvgate_scheduler_admissions_total{outcome!~"admitted|queued_admitted"}`+rateWindow+`))`, "{{outcome}}")}},
		{title: "Time to first token", unit: "s",
			desc: "vLLM's, from the engine; kvgate's, as its streaming callers see it (queueing in kvgate included).",
			targets: []target{
				t1(`histogram_quantile(0.5, sum by (le) (rate(vllm:time_to_first_token_seconds_bucket`+rateWindow+`)))`, "vLLM p50"),
				t1(`histogram_quantile(0.95, sum by (le) (rate(vllm:time_to_first_token_seconds_bucket`+rateWindow+`)))`, "vLLM p95"),
				t1(`histogram_quantile(0.95, sum by (le) (rate(kvgate_gateway_time_to_first_token_seconds_bucket`+rateWindow+`)))`, "kvgate p95"),
			}},
		{title: "Inter-token latency", unit: "s",
			targets: []target{
				t1(`histogram_quantile(0.5, sum by (le) (rate(vllm:inter_token_latency_seconds_bucket`+rateWindow+`)))`, "vLLM p50"),
				t1(`histogram_quantile(0.95, sum by (le) (rate(vllm:inter_token_latency_seconds_bucket`+rateWindow+`)))`, "vLLM p95"),
				t1(`histogram_quantile(0.95, sum by (le) (rate(kvgate_gateway_inter_token_seconds_bucket`+rateWindow+`)))`, "kvgate p95"),
			}},
		{title: "API requests by route and status", unit: "reqps",
			targets: []target{t1(`sum by (route, status) (rate(kvgate_gateway_requests_total`+rateWindow+`))`, "{{route}} {{status}}")}},
		{title: "Backend metrics age", unit: "s",
			desc: "Age of each backend's last scrape; past metrics.stale_after a backend counts as saturated.",
			targets: []target{
				t1(`max by (backend) (kvgate_scheduler_backend_metrics_age_seconds)`, "{{backend}}"),
				t1(`max by (backend) (kvgate_scheduler_backend_stale)`, "{{backend}} stale"),
			}},
		{title: "GPU health", unit: "short",
			desc: "From NVML on GPU nodes (the cgo build): 0 healthy, 1 degraded, 2 failed.",
			targets: []target{
				t1(`max by (instance, gpu) (kvgate_gpu_health)`, "{{instance}} GPU {{gpu}}"),
			}},
		{title: "GPU memory and temperature", unit: "percentunit",
			targets: []target{
				t1(`max by (instance, gpu) (kvgate_gpu_memory_used_bytes / kvgate_gpu_memory_total_bytes)`, "{{instance}} GPU {{gpu}} memory"),
				t1(`max by (instance, gpu) (kvgate_gpu_temperature_celsius) / 100`, "{{instance}} GPU {{gpu}} temperature / 100 C"),
			}},
	}},
	{"Queues", []panel{
		{title: "Interactive queue depth by class", unit: "short",
			targets: []target{t1(`sum by (class) (kvgate_scheduler_queue_depth)`, "{{class}}")}},
		{title: "Queue wait p95 by class", unit: "s",
			targets: []target{t1(`histogram_quantile(0.95, sum by (class, le) (rate(kvgate_scheduler_queue_wait_seconds_bucket`+rateWindow+`)))`, "{{class}}")}},
		{title: "Durable backlog", unit: "short",
			desc: "Runnable jobs in the store, by class; dashed: their token estimate (right axis).",
			targets: []target{
				t1(`sum by (class) (`+backlogJobs+`)`, "{{class}} jobs"),
				t1(`sum by (class) (`+backlogTokens+`)`, "{{class}} tokens"),
			}},
		{title: "Oldest runnable job", unit: "s",
			desc:    "How long the oldest job that could run has waited; KEDA scales vLLM on it.",
			targets: []target{t1(`max by (class) (kvgate_jobs_oldest_runnable_age_seconds)`, "{{class}}")}},
		{title: "Per-tenant share of the backlog", unit: "percentunit",
			targets: []target{t1(`sum by (tenant) (`+backlogTokens+`) / scalar(sum(`+backlogTokens+`))`, "{{tenant}}")}},
		{title: "Replicas and capacity share", unit: "short",
			targets: []target{
				t1(`max(kvgate_scheduler_replicas)`, "replicas"),
				t1(`min(kvgate_scheduler_capacity_share_ratio)`, "share of each backend per replica"),
			}},
	}},
	{"Durable path", []panel{
		{title: "Job acceptance rate", unit: "reqps",
			targets: []target{t1(`sum by (status) (rate(kvgate_gateway_requests_total{route="/v1/jobs",method="POST"}`+rateWindow+`))`, "{{status}}")}},
		{title: "Acceptance and completion latency", unit: "s",
			desc: "Acceptance: POST /v1/jobs until the job is durable. Completion: acceptance until its final state.",
			targets: []target{
				t1(`histogram_quantile(0.99, sum by (le) (rate(kvgate_job_acceptance_seconds_bucket`+rateWindow+`)))`, "acceptance p99"),
				t1(`histogram_quantile(0.5, sum by (le) (rate(kvgate_job_completion_seconds_bucket`+rateWindow+`)))`, "completion p50"),
				t1(`histogram_quantile(0.95, sum by (le) (rate(kvgate_job_completion_seconds_bucket`+rateWindow+`)))`, "completion p95"),
			}},
		{title: "Outbox publication", unit: "s",
			desc: "Age of the oldest job event not yet published to NATS; the relay's publish and error rates.",
			targets: []target{
				t1(`max(kvgate_outbox_oldest_unpublished_age_seconds)`, "oldest unpublished"),
				t1(`sum(rate(kvgate_scheduler_relay_published_total`+rateWindow+`))`, "published/s"),
				t1(`sum(rate(kvgate_scheduler_relay_errors_total`+rateWindow+`))`, "relay errors/s"),
			}},
		{title: "Inbox lag", unit: "short",
			desc: "Job events NATS holds for kvgate's consumer, not yet taken (broker lag).",
			targets: []target{
				t1(`max(kvgate_inbox_pending)`, "pending"),
				t1(`sum(rate(kvgate_scheduler_inbox_duplicates_total`+rateWindow+`))`, "redeliveries/s"),
			}},
		{title: "Attempts and outcomes", unit: "short",
			desc: "Jobs brought to a final state by outcome, and failed attempts retried by error class.",
			targets: []target{
				t1(`sum by (outcome) (rate(kvgate_scheduler_jobs_finished_total`+rateWindow+`))`, "{{outcome}}"),
				t1(`sum by (class) (rate(kvgate_scheduler_job_retries_total`+rateWindow+`))`, "retry: {{class}}"),
				t1(`sum(rate(kvgate_scheduler_jobs_reaped_total`+rateWindow+`))`, "leases reaped"),
			}},
		{title: "Dead letters and review", unit: "short",
			targets: []target{
				t1(`max by (class) (kvgate_dead_letters)`, "dead letters {{class}}"),
				t1(`max(kvgate_jobs_review_required)`, "review required"),
			}},
	}},
}

// buildDashboard lays the rows out on Grafana's 24-column grid, two
// panels a line.
func buildDashboard() map[string]any {
	ds := map[string]any{"type": "prometheus", "uid": "${datasource}"}
	var panels []any
	id, y := 1, 0
	for _, row := range dashboardRows {
		panels = append(panels, map[string]any{
			"type": "row", "id": id, "title": row.title, "collapsed": false, "panels": []any{},
			"gridPos": map[string]int{"h": 1, "w": 24, "x": 0, "y": y},
		})
		id++
		y++
		for i, p := range row.panels {
			var targets []any
			for j, tg := range p.targets {
				targets = append(targets, map[string]any{
					"refId": string(rune('A' + j)), "datasource": ds, "expr": tg.expr, "legendFormat": tg.legend, "range": true,
				})
			}
			kind := p.kind
			if kind == "" {
				kind = "timeseries"
			}
			panels = append(panels, map[string]any{
				"type": kind, "id": id, "title": p.title, "description": p.desc, "datasource": ds,
				"gridPos":     map[string]int{"h": 8, "w": 12, "x": 12 * (i % 2), "y": y + 8*(i/2)},
				"targets":     targets,
				"fieldConfig": map[string]any{"defaults": map[string]any{"unit": p.unit}, "overrides": []any{}},
				"options": map[string]any{
					"legend":  map[string]any{"displayMode": "list", "placement": "bottom", "showLegend": true},
					"tooltip": map[string]any{"mode": "multi", "sort": "desc"},
				},
			})
			id++
		}
		y += 8 * ((len(row.panels) + 1) / 2)
	}
	return map[string]any{
		"uid": "kvgate", "title": "kvgate", "description": "kvgate's fleet, queues and durable job path. Generated by deploy/dashboard_test.go.",
		"tags": []string{"kvgate", "vllm"}, "editable": true, "schemaVersion": 39, "version": 1,
		"time": map[string]string{"from": "now-1h", "to": "now"}, "refresh": "10s", "timezone": "",
		"templating": map[string]any{"list": []any{map[string]any{
			"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus", "current": map[string]any{},
		}}},
		"annotations": map[string]any{"list": []any{}},
		"panels":      panels,
	}
}

func renderDashboard(t *testing.T) []byte {
	t.Helper()
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetIndent("", "  ")
	enc.SetEscapeHTML(false)
	if err := enc.Encode(buildDashboard()); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

func TestDashboardGenerated(t *testing.T) {
	want := renderDashboard(t)
	if os.Getenv("KVGATE_UPDATE") == "1" {
		if err := os.MkdirAll(filepath.Dir(dashboardFile), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(dashboardFile, want, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	got, err := os.ReadFile(dashboardFile)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		t.Errorf("%s is stale: regenerate it with KVGATE_UPDATE=1 go test -run TestDashboardGenerated (in deploy/)", dashboardFile)
	}
}

// TestDashboardLayout: the file is a dashboard Grafana can lay out: unique
// panel ids, every panel inside the 24-column grid and none overlapping,
// every non-row panel with a Prometheus query on the datasource variable.
func TestDashboardLayout(t *testing.T) {
	raw, err := os.ReadFile(dashboardFile)
	if err != nil {
		t.Fatal(err)
	}
	var d struct {
		UID        string `json:"uid"`
		Templating struct {
			List []struct{ Name, Type string } `json:"list"`
		} `json:"templating"`
		Panels []struct {
			ID      int                      `json:"id"`
			Type    string                   `json:"type"`
			Title   string                   `json:"title"`
			GridPos struct{ H, W, X, Y int } `json:"gridPos"`
			Targets []struct {
				Expr       string               `json:"expr"`
				Datasource struct{ UID string } `json:"datasource"`
			} `json:"targets"`
		} `json:"panels"`
	}
	if err := json.Unmarshal(raw, &d); err != nil {
		t.Fatal(err)
	}
	if d.UID == "" || len(d.Templating.List) == 0 || d.Templating.List[0].Type != "datasource" {
		t.Errorf("uid %q, templating %+v: want a uid and a datasource variable", d.UID, d.Templating.List)
	}
	ids := map[int]bool{}
	type cell struct{ x, y int }
	taken := map[cell]string{}
	rows := 0
	for _, p := range d.Panels {
		if ids[p.ID] {
			t.Errorf("panel id %d twice", p.ID)
		}
		ids[p.ID] = true
		g := p.GridPos
		if g.W <= 0 || g.H <= 0 || g.X < 0 || g.X+g.W > 24 {
			t.Errorf("panel %q: gridPos %+v outside the 24-column grid", p.Title, g)
		}
		for x := g.X; x < g.X+g.W; x++ {
			for y := g.Y; y < g.Y+g.H; y++ {
				if other, ok := taken[cell{x, y}]; ok {
					t.Fatalf("panels %q and %q overlap at %d,%d", other, p.Title, x, y)
				}
				taken[cell{x, y}] = p.Title
			}
		}
		if p.Type == "row" {
			rows++
			continue
		}
		if len(p.Targets) == 0 {
			t.Errorf("panel %q has no query", p.Title)
		}
		for _, tg := range p.Targets {
			if tg.Expr == "" || tg.Datasource.UID != "${datasource}" {
				t.Errorf("panel %q: target %+v, want a query on ${datasource}", p.Title, tg)
			}
		}
	}
	if rows != 3 {
		t.Errorf("%d rows, want Fleet, Queues and Durable path", rows)
	}
}
