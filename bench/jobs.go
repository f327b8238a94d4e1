package bench

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"time"

	"github.com/kvgate/kvgate/store"
)

// submitJob sends a request as a deferred job (POST /v1/jobs) and follows
// it to its end through its event stream (GET /v1/jobs/{id}/events) or,
// where the target has none or with JobFollow poll, by polling; its latency
// runs to the event or poll that saw it end, and its tokens come from the
// result's usage. With JobFollow none it ends at the acceptance: the
// latency is the submission's alone.
func (r *requester) submitJob(ctx context.Context, key, idemKey string, it item, ignoreEOS bool, start time.Time, rec *Record) {
	ctx, cancel := context.WithTimeout(ctx, r.timeout)
	defer cancel()
	job, _ := json.Marshal(struct {
		Endpoint string          `json:"endpoint"`
		Body     json.RawMessage `json:"body"`
	}{r.path(), r.body(it, ignoreEOS, false)})
	rec.Sent = time.Since(start) + rec.Intended
	var view struct {
		ID    string `json:"id"`
		State string `json:"state"`
	}
	status, err := r.jsonCall(ctx, http.MethodPost, "/v1/jobs", key, idemKey, job, &view)
	if err != nil || status != http.StatusAccepted && status != http.StatusOK {
		rec.E2EL = time.Since(start)
		if err != nil {
			rec.failErr(ctx, err)
		} else {
			rec.fail(classify(status), status, "job submission refused")
		}
		return
	}
	rec.JobID = view.ID
	if r.jobAccept {
		rec.E2EL, rec.Status = time.Since(start), status
		return
	}
	if r.jobSSE && !jobFinal(view.State) {
		if st := r.followJob(ctx, key, view.ID); st != "" {
			view.State = st
		}
	}
	tick := time.NewTicker(r.pollEvery)
	defer tick.Stop()
	for {
		switch view.State {
		case "SUCCEEDED":
			rec.E2EL = time.Since(start)
			rec.Status = http.StatusOK
			var res struct {
				Usage *usage `json:"usage"`
			}
			if st, err := r.jsonCall(ctx, http.MethodGet, "/v1/jobs/"+view.ID+"/result", key, "", nil, &res); err == nil && st == http.StatusOK && res.Usage != nil {
				rec.InputTokens, rec.OutputTokens = res.Usage.PromptTokens, res.Usage.CompletionTokens
			}
			return
		default:
			if jobFinal(view.State) {
				rec.E2EL = time.Since(start)
				rec.fail(ErrJob, rec.Status, "job ended "+view.State)
				return
			}
		}
		select {
		case <-ctx.Done():
			rec.E2EL = time.Since(start)
			rec.failErr(ctx, ctx.Err())
			return
		case <-tick.C:
		}
		st, err := r.jsonCall(ctx, http.MethodGet, "/v1/jobs/"+view.ID, key, "", nil, &view)
		if err != nil {
			rec.E2EL = time.Since(start)
			rec.failErr(ctx, err)
			return
		}
		if st != http.StatusOK {
			rec.E2EL = time.Since(start)
			rec.fail(classify(st), st, "job read refused")
			return
		}
	}
}

// jobFinal reports whether a job state is one a job never leaves.
func jobFinal(state string) bool { return store.State(state).Final() }

// followJob reads a job's event stream (GET /v1/jobs/{id}/events) until
// it shows a final state, and returns that state; "" when the target has
// no event stream or it ended early, and the caller polls instead.
func (r *requester) followJob(ctx context.Context, key, id string) string {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, r.base+"/v1/jobs/"+id+"/events", nil)
	if err != nil {
		return ""
	}
	req.Header.Set("Accept", "text/event-stream")
	if key != "" {
		req.Header.Set("Authorization", "Bearer "+key)
	}
	resp, err := r.client.Do(req)
	if err != nil {
		return ""
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 4096))
		return ""
	}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 4096), 1<<20)
	for sc.Scan() {
		data, ok := bytes.CutPrefix(sc.Bytes(), []byte("data:"))
		if !ok {
			continue
		}
		var ev struct {
			State string `json:"state"`
		}
		if json.Unmarshal(bytes.TrimSpace(data), &ev) == nil && jobFinal(ev.State) {
			return ev.State
		}
	}
	return ""
}
