package gateway

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvgate/kvgate/bench/eventually"
	"github.com/kvgate/kvgate/bench/vllmsim"
	"github.com/kvgate/kvgate/store"
)

// embedJob is an embeddings job of n chunks.
func embedJob(model string, n int) string {
	chunks := make([]string, n)
	for i := range chunks {
		chunks[i] = fmt.Sprintf("chunk %d of the pump manual: the seal is checked every %d hours, the filter every %d days.", i, 10+i%97, 1+i%13)
	}
	in, _ := json.Marshal(chunks)
	return fmt.Sprintf(`{"endpoint":"/v1/embeddings","body":{"model":%q,"input":%s}}`, model, in)
}

type embedResult struct {
	Data []struct {
		Index     int             `json:"index"`
		Embedding json.RawMessage `json:"embedding"`
	} `json:"data"`
	Usage struct {
		PromptTokens int `json:"prompt_tokens"`
	} `json:"usage"`
}

// TestEmbeddingsResumeAtMissingBatch: a job of 5,000 chunks runs as
// checkpointed batches. Run once cleanly, then again with the backend
// killed a third of the way through and revived: the second run resumes
// at the first batch without a checkpoint, costs at most 1.1 times the
// clean run's prompt tokens (vllm:prompt_tokens_total), and its result
// lists the same embeddings in input order.
func TestEmbeddingsResumeAtMissingBatch(t *testing.T) {
	p, err := vllmsim.LookupProfile("h100-bge-m3")
	if err != nil {
		t.Fatal(err)
	}
	p.EmbeddingDim = 8 // the cost is in prompt tokens; small vectors keep the results small
	var killAt atomic.Int64
	var sim atomic.Pointer[vllmsim.Sim]
	var calls atomic.Int64
	wrap := func(_ int, h http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.URL.Path == "/v1/embeddings" {
				if n := calls.Add(1); n == killAt.Load() {
					s := sim.Load()
					s.SetFaults(vllmsim.Faults{Dead: true})
					time.AfterFunc(150*time.Millisecond, func() { s.SetFaults(vllmsim.Faults{}) })
				}
			}
			h.ServeHTTP(w, r)
		})
	}
	f := startFleet(t, fleetOpts{profile: p, jobs: true, runner: true, wrap: wrap, gateway: Config{Jobs: Jobs{MaxAttempts: 20}}})
	sim.Store(f.sims[0])
	chunks := 5000
	if raceEnabled {
		chunks = 1030 // the race detector's slowdown; the figure is 5,000 chunks without it
	}
	batches := (chunks + 255) / 256

	run := func(key string) (embedResult, float64, store.Job) {
		t.Helper()
		before := scrapeSum(t, f.urls[0]+"/metrics", "vllm:prompt_tokens_total")
		resp, v := submitJob(t, f, key, embedJob(p.Model, chunks))
		if resp.StatusCode != http.StatusAccepted {
			t.Fatalf("submit: %d", resp.StatusCode)
		}
		waitJob(t, f, "default", v.ID, store.Succeeded)
		_, b := f.get(t, "/v1/jobs/"+v.ID+"/result")
		var res embedResult
		if err := json.Unmarshal(b, &res); err != nil {
			t.Fatalf("result: %v: %s", err, b[:min(len(b), 300)])
		}
		j, _ := f.store.Get(context.Background(), "default", v.ID)
		return res, scrapeSum(t, f.urls[0]+"/metrics", "vllm:prompt_tokens_total") - before, j
	}
	clean, cleanTokens, _ := run("clean")
	if got := calls.Load(); got != int64(batches) {
		t.Errorf("the clean run made %d requests, want %d batches", got, batches)
	}
	calls.Store(0)
	killAt.Store(int64(max(2, batches/3)))
	faulted, faultTokens, fj := run("faulted")

	for name, res := range map[string]embedResult{"clean": clean, "faulted": faulted} {
		if len(res.Data) != chunks {
			t.Fatalf("%s: %d embeddings for %d chunks", name, len(res.Data), chunks)
		}
		for i, d := range res.Data {
			if d.Index != i {
				t.Fatalf("%s: embedding %d has index %d", name, i, d.Index)
			}
		}
	}
	for i := range clean.Data {
		if string(clean.Data[i].Embedding) != string(faulted.Data[i].Embedding) {
			t.Fatalf("embedding %d differs between the runs", i)
		}
	}
	if clean.Usage.PromptTokens != faulted.Usage.PromptTokens || clean.Usage.PromptTokens == 0 {
		t.Errorf("usage: clean %d, faulted %d prompt tokens", clean.Usage.PromptTokens, faulted.Usage.PromptTokens)
	}
	as, _ := f.store.Attempts(context.Background(), fj.ID)
	failed := 0
	for _, a := range as {
		if a.Outcome == store.OutcomeFailed || a.Outcome == store.OutcomeWait {
			failed++
		}
	}
	ratio := faultTokens / cleanTokens
	t.Logf("%d chunks in %d batches: clean run %.0f prompt tokens; killed at batch %d and revived: %.0f (%.3fx), %d requests, %d attempts ended without success",
		chunks, batches, cleanTokens, killAt.Load(), faultTokens, ratio, calls.Load(), failed)
	if failed == 0 {
		t.Errorf("the kill did not interrupt the job: attempts %+v", as)
	}
	if ratio > 1.1 {
		t.Errorf("the interrupted run cost %.3f times the clean run's prompt tokens, want at most 1.1", ratio)
	}
	if resp, b := f.post(t, "/v1/jobs", strings.Replace(embedJob(p.Model, 10001), `"endpoint"`, `"metadata":{},"endpoint"`, 1), "Idempotency-Key", "too-many"); resp.StatusCode != http.StatusBadRequest {
		t.Errorf("10,001 inputs: %d %s", resp.StatusCode, b)
	}
	// The cap counts the key the runner and vLLM read, exactly "input":
	// another case of it, which encoding/json would match instead, hides
	// nothing.
	for i, other := range []string{`"Input":[]`, `"Input":5`} {
		body := strings.TrimSuffix(embedJob(p.Model, 10001), "}}") + "," + other + "}}"
		if resp, b := f.post(t, "/v1/jobs", body, "Idempotency-Key", fmt.Sprint("too-many-", i)); resp.StatusCode != http.StatusBadRequest {
			t.Errorf("10,001 inputs beside %s: %d %.300s", other, resp.StatusCode, b)
		}
	}
}

// TestEmbeddingsBatchAnswerChecked: a backend that answers one batch of
// an embeddings job with an embedding missing (a 200 that does not fit
// the batch) fails that attempt, and the answer is no checkpoint: the
// retry sends that batch again, reuses the batches before it, and the
// job succeeds with every embedding in input order. Checkpointed, the
// answer would fail every retry without a request sent, until the job
// ran out of attempts.
func TestEmbeddingsBatchAnswerChecked(t *testing.T) {
	p, err := vllmsim.LookupProfile("h100-bge-m3")
	if err != nil {
		t.Fatal(err)
	}
	p.EmbeddingDim = 4
	const chunks, batches, badCall = 600, 3, 2 // 256, 256 and 88 inputs; the second batch's first answer is short
	var calls atomic.Int64
	wrap := func(_ int, h http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.URL.Path != "/v1/embeddings" || calls.Add(1) != badCall {
				h.ServeHTTP(w, r)
				return
			}
			rec := httptest.NewRecorder()
			h.ServeHTTP(rec, r)
			var answer map[string]json.RawMessage
			var data []json.RawMessage
			if err := json.Unmarshal(rec.Body.Bytes(), &answer); err != nil || json.Unmarshal(answer["data"], &data) != nil || len(data) < 2 {
				t.Errorf("the simulator's answer: %v: %.200s", err, rec.Body.Bytes())
			} else {
				answer["data"], _ = json.Marshal(data[:len(data)-1])
			}
			b, _ := json.Marshal(answer)
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(rec.Code)
			_, _ = w.Write(b)
		})
	}
	f := startFleet(t, fleetOpts{profile: p, jobs: true, runner: true, wrap: wrap, gateway: Config{Jobs: Jobs{MaxAttempts: 3}}})
	resp, v := submitJob(t, f, "short-answer", embedJob(p.Model, chunks))
	if resp.StatusCode != http.StatusAccepted {
		t.Fatalf("submit: %d", resp.StatusCode)
	}
	var j store.Job
	eventually.True(t, "the job to end", func() bool {
		j, err = f.store.Get(context.Background(), "default", v.ID)
		return err == nil && (j.State == store.Succeeded || j.State == store.FailedTerminal || j.State == store.ReviewRequired)
	})
	as, _ := f.store.Attempts(context.Background(), v.ID)
	if j.State != store.Succeeded {
		t.Fatalf("job %s: %s (%s), attempts %+v", v.ID, j.State, j.LastError, as)
	}
	_, b := f.get(t, "/v1/jobs/"+v.ID+"/result")
	var res embedResult
	if err := json.Unmarshal(b, &res); err != nil {
		t.Fatalf("result: %v: %.300s", err, b)
	}
	if len(res.Data) != chunks {
		t.Fatalf("%d embeddings for %d chunks", len(res.Data), chunks)
	}
	for i, d := range res.Data {
		if d.Index != i {
			t.Fatalf("embedding %d has index %d", i, d.Index)
		}
	}
	// The first attempt sent batches 1 and 2 and failed at 2's answer;
	// the second reused 1 and sent 2 and 3.
	if len(as) != 2 || as[0].Outcome != store.OutcomeFailed || !as[0].Spent || as[1].Outcome != store.OutcomeSucceeded {
		t.Errorf("attempts %+v, want one failed (spent) and one succeeded", as)
	}
	if got := calls.Load(); got != batches+1 {
		t.Errorf("%d requests to the backend, want %d: each batch once and the short one again", got, batches+1)
	}
}
