package main

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/kvgate/kvgate/bench/vllmsim"
	"github.com/kvgate/kvgate/scheduler/validate"
)

const e2eInvoiceSchema = `{"type":"object","required":["total","currency","lines"],"properties":{
	"total":{"type":"number","minimum":0},"currency":{"type":"string","enum":["EUR","USD"]},
	"lines":{"type":"array","minItems":1,"items":{"type":"object","required":["amount"],"properties":{"amount":{"type":"number"}}}}}}`

// TestServeValidatesOutcomes: kvgate serve in front of two simulators that
// break a tenth of their structured answers (invalid_json_rate 0.1) runs
// 1,000 jobs pinned to a schema policy. Every job whose answer fails the
// schema ends REVIEW_REQUIRED with its reasons and is withheld; every
// other one SUCCEEDED with an answer that conforms; and the backends
// answered exactly one request per job: validation never calls them.
func TestServeValidatesOutcomes(t *testing.T) {
	if testing.Short() {
		t.Skip("1,000 jobs through kvgate serve")
	}
	const jobs = 1000
	var urls []string
	for i := range 2 {
		p, err := vllmsim.LookupProfile("h100-llama-3.1-8b")
		if err != nil {
			t.Fatal(err)
		}
		_, srv := vllmsim.NewTestServer(t, vllmsim.Config{Profile: p, Speedup: 0, Seed: uint64(100 + i),
			Faults: vllmsim.Faults{InvalidJSONRate: 0.1}})
		urls = append(urls, srv.URL)
	}
	base, _ := startServe(t, "--data-dir", t.TempDir(), "--backend", urls[0], "--backend", urls[1])
	client := &http.Client{Timeout: 30 * time.Second}
	call := func(method, path, body string, header ...string) (int, []byte) {
		t.Helper()
		req, _ := http.NewRequest(method, base+path, strings.NewReader(body))
		req.Header.Set("Content-Type", "application/json")
		for i := 0; i+1 < len(header); i += 2 {
			req.Header.Set(header[i], header[i+1])
		}
		resp, err := client.Do(req)
		if err != nil {
			t.Fatalf("%s %s: %v", method, path, err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, b
	}
	waitReady(t, base+"/readyz")
	policy := `{"name":"invoice","rules":[{"rule":"json"},{"rule":"schema","schema":` + e2eInvoiceSchema + `},
		{"rule":"enum","pointer":"/currency","values":["EUR","USD"]}]}`
	if status, b := call(http.MethodPost, "/v1/validation-policies", policy); status != http.StatusCreated {
		t.Fatalf("policy: %d %s", status, b)
	}

	ids := make([]string, jobs)
	var wg sync.WaitGroup
	work := make(chan int)
	for range 16 {
		wg.Go(func() {
			for i := range work {
				body := fmt.Sprintf(`{"endpoint":"/v1/chat/completions","validation":{"policy":"invoice"},"body":{"model":"meta-llama/Llama-3.1-8B-Instruct",`+
					`"max_tokens":16,"messages":[{"role":"user","content":"invoice %d"}],"response_format":{"type":"json_schema","json_schema":{"name":"invoice","schema":%s}}}}`,
					i, e2eInvoiceSchema)
				status, b := call(http.MethodPost, "/v1/jobs", body, "Idempotency-Key", fmt.Sprint("inv-", i))
				var v struct{ ID string }
				if status != http.StatusAccepted || json.Unmarshal(b, &v) != nil {
					t.Errorf("submit %d: %d %s", i, status, b)
				}
				ids[i] = v.ID
			}
		})
	}
	for i := range jobs {
		work <- i
	}
	close(work)
	wg.Wait()
	if t.Failed() {
		t.FailNow()
	}

	// Wait until every job has ended.
	countIn := func(states ...string) int {
		n := 0
		q := ""
		for _, s := range states {
			q += "&state=" + s
		}
		for after := ""; ; {
			_, b := call(http.MethodGet, "/v1/jobs?limit=1000"+q+"&after="+after, "")
			var page struct {
				Data       []struct{ ID string }
				NextCursor string `json:"next_cursor"`
			}
			if err := json.Unmarshal(b, &page); err != nil {
				t.Fatalf("list: %s", b)
			}
			n += len(page.Data)
			if page.NextCursor == "" {
				return n
			}
			after = page.NextCursor
		}
	}
	for deadline := time.Now().Add(5 * time.Minute); countIn("SUCCEEDED", "REVIEW_REQUIRED") < jobs; time.Sleep(100 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("after 5 minutes, %d of %d jobs have ended", countIn("SUCCEEDED", "REVIEW_REQUIRED"), jobs)
		}
	}

	schema, err := validate.Parse([]byte(`{"name":"check","rules":[{"rule":"schema","schema":` + e2eInvoiceSchema + `}]}`))
	if err != nil {
		t.Fatal(err)
	}
	review := 0
	var mu sync.Mutex
	work = make(chan int)
	for range 16 {
		wg.Go(func() {
			for i := range work {
				_, b := call(http.MethodGet, "/v1/jobs/"+ids[i], "")
				var j struct{ State string }
				_ = json.Unmarshal(b, &j)
				status, res := call(http.MethodGet, "/v1/jobs/"+ids[i]+"/result", "")
				switch j.State {
				case "SUCCEEDED":
					answer, err := validate.Answer(res)
					if status != 200 || err != nil || len(schema.Check(validate.Input{Answer: answer})) > 0 {
						t.Errorf("job %d SUCCEEDED with an answer that fails the schema: %d %s", i, status, res)
					}
				case "REVIEW_REQUIRED":
					mu.Lock()
					review++
					mu.Unlock()
					if status != http.StatusConflict {
						t.Errorf("job %d is under review, yet its result was delivered: %d", i, status)
					}
				default:
					t.Errorf("job %d ended %s", i, j.State)
				}
			}
		})
	}
	for i := range jobs {
		work <- i
	}
	close(work)
	wg.Wait()

	// Every job under review is listed with its reasons, and its stored
	// answer does fail the schema.
	listed := 0
	for after := ""; ; {
		_, b := call(http.MethodGet, "/v1/reviews?limit=200&after="+after, "")
		var page struct {
			Data []struct {
				ID      string
				Reasons []validate.Reason
			}
			NextCursor string `json:"next_cursor"`
		}
		if err := json.Unmarshal(b, &page); err != nil {
			t.Fatalf("reviews: %s", b)
		}
		for _, r := range page.Data {
			listed++
			if len(r.Reasons) == 0 || r.Reasons[0].Rule == "" || r.Reasons[0].Code == "" {
				t.Errorf("review %s has no machine-readable reasons: %+v", r.ID, r.Reasons)
			}
		}
		if page.NextCursor == "" {
			break
		}
		after = page.NextCursor
	}
	calls := 0.0
	for _, u := range urls {
		calls += scrapeFamily(t, u+"/metrics", "vllm:request_success_total")
	}
	t.Logf("%d jobs: %d REVIEW_REQUIRED, %d SUCCEEDED; %v backend calls", jobs, review, jobs-review, calls)
	if listed != review {
		t.Errorf("/v1/reviews lists %d jobs, %d are REVIEW_REQUIRED", listed, review)
	}
	if review < 50 || review > 150 {
		t.Errorf("%d of %d answers failed validation at invalid_json_rate 0.1", review, jobs)
	}
	if calls != jobs {
		t.Errorf("the backends answered %v requests for %d jobs; validation must not call them", calls, jobs)
	}
	if got := scrapeFamily(t, base+"/metrics", "kvgate_jobs_review_required"); got != float64(review) {
		t.Errorf("kvgate_jobs_review_required %v, want %d", got, review)
	}
}

// scrapeFamily sums a metric family's series on a /metrics page.
func scrapeFamily(t *testing.T, url, name string) float64 {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	parser := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := parser.TextToMetricFamilies(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	sum := 0.0
	for _, m := range fams[name].GetMetric() {
		sum += m.GetCounter().GetValue() + m.GetGauge().GetValue()
	}
	return sum
}

// jobs.retention comes from the file; zero takes the pruner's 30 days; a
// negative one is refused.
func TestJobsRetentionConfig(t *testing.T) {
	file := t.TempDir() + "/kvgate.yaml"
	for _, tc := range []struct {
		yaml string
		want time.Duration
		ok   bool
	}{
		{"jobs: {retention: 72h}\n", 72 * time.Hour, true},
		{"jobs: {max_attempts: 3}\n", 0, true},
		{"jobs: {retention: -1h}\n", 0, false},
	} {
		if err := os.WriteFile(file, []byte(tc.yaml), 0o600); err != nil {
			t.Fatal(err)
		}
		cfg, err := loadConfig(t, []string{"--config", file}, nil)
		if (err == nil) != tc.ok || (err == nil && cfg.Jobs.Retention != tc.want) {
			t.Errorf("%q: %v, %v; want %v (ok %v)", tc.yaml, cfg, err, tc.want, tc.ok)
		}
	}
}
