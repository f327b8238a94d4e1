package chaos

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"sort"
	"strings"
	"sync"
	"time"
)

// jobBody is a job's request: a chat completion that generates exactly
// maxTokens tokens (ignore_eos), with a deadline well past the scenario.
func jobBody(key string, maxTokens int) []byte {
	b, _ := json.Marshal(map[string]any{
		"endpoint":         "/v1/chat/completions",
		"deadline_seconds": 3600,
		"body": map[string]any{
			"model":      simModel,
			"messages":   []map[string]string{{"role": "user", "content": "chaos job " + key + ": write until you are stopped."}},
			"max_tokens": maxTokens,
			"ignore_eos": true,
		},
	})
	return b
}

// batch is a set of jobs to submit: keys batch-0000, batch-0001, ...
type batch struct {
	name      string
	n         int
	maxTokens int
	bearer    string // the API key [staticKey]
	base      string // the kvgate to post to [e.gw's]
}

// submitted is a batch's outcome: the job id of each key, and what could
// not be submitted.
type submitted struct {
	ids  map[string]string
	errs []error
}

// submit posts a batch with a few workers. Each job is posted, under its
// Idempotency-Key, until kvgate answers 202 (a client that must not lose
// work retries connection errors, 5xx and 429 with the same key); any
// other answer, or ctx's end, is an error. It is safe to run in a
// goroutine of its own: it reports, it does not fail the test.
func (e *env) submit(ctx context.Context, b batch) submitted {
	if b.bearer == "" {
		b.bearer = staticKey
	}
	out := submitted{ids: map[string]string{}}
	var mu sync.Mutex
	keys := make(chan string)
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			for key := range keys {
				id, err := e.submitOne(ctx, b, key)
				mu.Lock()
				if err != nil {
					out.errs = append(out.errs, fmt.Errorf("job %s not accepted: %w", key, err))
				} else {
					out.ids[key] = id
				}
				mu.Unlock()
			}
		})
	}
	for i := range b.n {
		keys <- fmt.Sprintf("%s-%04d", b.name, i)
	}
	close(keys)
	wg.Wait()
	return out
}

func (e *env) submitOne(ctx context.Context, b batch, key string) (string, error) {
	body := jobBody(key, b.maxTokens)
	base := b.base
	if base == "" {
		base = e.gw.base()
	}
	var last string
	for {
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, base+"/v1/jobs", bytes.NewReader(body))
		if err != nil {
			return "", err
		}
		req.Header.Set("Authorization", "Bearer "+b.bearer)
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Idempotency-Key", key)
		resp, err := e.client.Do(req)
		if err == nil {
			rb, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			switch {
			case resp.StatusCode == http.StatusAccepted:
				var v struct {
					ID string `json:"id"`
				}
				if err := json.Unmarshal(rb, &v); err != nil || v.ID == "" {
					return "", fmt.Errorf("202 without a job id: %s", rb)
				}
				return v.ID, nil
			case resp.StatusCode == http.StatusTooManyRequests || resp.StatusCode >= 500:
				last = fmt.Sprintf("%s: %s", resp.Status, bytes.TrimSpace(rb))
			default:
				return "", fmt.Errorf("%s: %s", resp.Status, bytes.TrimSpace(rb))
			}
		} else {
			last = err.Error()
		}
		select {
		case <-ctx.Done():
			return "", fmt.Errorf("%w (last answer: %s)", ctx.Err(), last)
		case <-time.After(250 * time.Millisecond):
		}
	}
}

// submitAll submits a batch from the test goroutine and fails the test
// unless every job was accepted.
func (e *env) submitAll(b batch) {
	e.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	e.record(e.submit(ctx, b))
	e.mark("submitted %d jobs (%s), %d accepted in all", b.n, b.name, len(e.accepted))
}

// submitInBackground starts submitting a batch and returns the function
// that waits for it and records it; call that from the test goroutine.
func (e *env) submitInBackground(b batch) func() {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	done := make(chan submitted, 1)
	go func() { done <- e.submit(ctx, b) }()
	return func() {
		e.t.Helper()
		defer cancel()
		e.record(<-done)
		e.mark("submitted %d jobs (%s) in the background, %d accepted in all", b.n, b.name, len(e.accepted))
	}
}

func (e *env) record(s submitted) {
	e.t.Helper()
	for k, id := range s.ids {
		e.accepted[k] = id
	}
	if len(s.errs) > 0 {
		msgs := make([]string, 0, len(s.errs))
		for _, err := range s.errs {
			msgs = append(msgs, err.Error())
		}
		sort.Strings(msgs)
		if len(msgs) > 10 {
			msgs = append(msgs[:10], fmt.Sprintf("... and %d more", len(s.errs)-10))
		}
		e.t.Fatalf("%d job(s) not accepted:\n%s", len(s.errs), strings.Join(msgs, "\n"))
	}
}

// states counts the store's jobs by state. A connection the server cut
// (the PostgreSQL restart) fails one query: it is asked once more.
func (e *env) states() (map[string]int, error) {
	m, err := e.statesOnce()
	if err != nil {
		m, err = e.statesOnce()
	}
	return m, err
}

func (e *env) statesOnce() (map[string]int, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	rows, err := e.db.QueryContext(ctx, `SELECT state, count(*) FROM jobs GROUP BY state`)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	m := map[string]int{}
	for rows.Next() {
		var s string
		var n int
		if err := rows.Scan(&s, &n); err != nil {
			return nil, err
		}
		m[s] = n
	}
	return m, rows.Err()
}

func finalStates(m map[string]int) int {
	return m["SUCCEEDED"] + m["REVIEW_REQUIRED"] + m["FAILED_TERMINAL"] + m["CANCELLED"]
}

func fmtStates(m map[string]int) string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	parts := make([]string, 0, len(keys))
	for _, k := range keys {
		parts = append(parts, fmt.Sprintf("%s=%d", k, m[k]))
	}
	return strings.Join(parts, " ")
}

// waitSucceeded waits until at least n jobs have SUCCEEDED (the moment a
// fault strikes mid-burst), with kvgate up throughout.
func (e *env) waitSucceeded(n int, timeout time.Duration) {
	e.t.Helper()
	eventually(e.t, timeout, 100*time.Millisecond, fmt.Sprintf("%d jobs SUCCEEDED", n), func() (bool, string, error) {
		if err := e.gw.alive(); err != nil {
			return false, "", err
		}
		m, err := e.states()
		if err != nil {
			return false, "", err
		}
		return m["SUCCEEDED"] >= n, fmtStates(m), nil
	})
}

// waitEngines waits until the simulators' engines run at least n
// requests between them, with kvgate up throughout.
func (e *env) waitEngines(n int, timeout time.Duration) {
	e.t.Helper()
	eventually(e.t, timeout, 50*time.Millisecond, fmt.Sprintf("%d requests in the engines", n), func() (bool, string, error) {
		if err := e.gw.alive(); err != nil {
			return false, "", err
		}
		running := 0.0
		for _, s := range e.sims {
			c, err := s.counters()
			if err != nil {
				return false, "", err
			}
			running += c.running
		}
		return running >= float64(n), fmt.Sprintf("%.0f running", running), nil
	})
}

// waitKeys waits until the store holds n jobs whose idempotency key
// starts with prefix: a batch submitted in the background is that far.
func (e *env) waitKeys(prefix string, n int, timeout time.Duration) {
	e.t.Helper()
	eventually(e.t, timeout, 20*time.Millisecond, fmt.Sprintf("%d jobs %s* accepted", n, prefix), func() (bool, string, error) {
		if err := e.gw.alive(); err != nil {
			return false, "", err
		}
		var got int
		err := e.db.QueryRowContext(context.Background(), `SELECT count(*) FROM jobs WHERE idempotency_key LIKE $1`, prefix+"%").Scan(&got)
		return got >= n, fmt.Sprintf("%d accepted", got), err
	})
}

// waitFinal waits until every accepted job is final, with kvgate up
// throughout, logging progress.
func (e *env) waitFinal(timeout time.Duration) {
	e.t.Helper()
	lastLog := time.Now()
	eventually(e.t, timeout, 250*time.Millisecond, "every job final", func() (bool, string, error) {
		if err := e.gw.alive(); err != nil {
			return false, "", err
		}
		m, err := e.states()
		if err != nil {
			return false, err.Error(), nil
		}
		if time.Since(lastLog) > 15*time.Second {
			lastLog = time.Now()
			e.t.Logf("waiting: %s", fmtStates(m))
		}
		total := 0
		for _, n := range m {
			total += n
		}
		return total >= len(e.accepted) && finalStates(m) == total, fmtStates(m), nil
	})
	m, _ := e.states()
	e.mark("every job final: %s", fmtStates(m))
}
