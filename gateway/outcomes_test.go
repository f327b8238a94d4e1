package gateway

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"reflect"
	"strings"
	"testing"

	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/kvgate/kvgate/bench/eventually"
	"github.com/kvgate/kvgate/bench/vllmsim"
	"github.com/kvgate/kvgate/scheduler/validate"
	"github.com/kvgate/kvgate/store"
)

const testInvoiceSchema = `{"type":"object","required":["total","currency"],"properties":{"total":{"type":"number","minimum":0},"currency":{"type":"string","enum":["EUR","USD"]}}}`

// schemaJob is a chat job that asks for JSON to the invoice schema and
// names a policy.
func schemaJob(prompt, policy string) string {
	return fmt.Sprintf(`{"endpoint":"/v1/chat/completions","validation":{"policy":%q},"body":{"model":%q,"max_tokens":8,`+
		`"messages":[{"role":"user","content":%q}],"response_format":{"type":"json_schema","json_schema":{"name":"invoice","schema":%s}}}}`,
		policy, llama, prompt, testInvoiceSchema)
}

func (f *fleet) get(t *testing.T, path string) (int, []byte) {
	t.Helper()
	resp, err := http.Get(f.srv.URL + path)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, b
}

// backendCalls sums the simulators' vllm:request_success_total.
func backendCalls(t *testing.T, f *fleet) float64 {
	t.Helper()
	total := 0.0
	for _, u := range f.urls {
		total += scrapeSum(t, u+"/metrics", "vllm:request_success_total")
	}
	return total
}

// scrapeSum reads a metric family from a /metrics page, summed over its
// series.
func scrapeSum(t *testing.T, url, name string) float64 {
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

type reviewPage struct {
	Data []reviewEntry `json:"data"`
}

type reviewEntry struct {
	ID            string            `json:"id"`
	State         string            `json:"state"`
	Policy        string            `json:"policy"`
	PolicyVersion int               `json:"policy_version"`
	Reasons       []validate.Reason `json:"reasons"`
}

// TestValidationPolicyReviewFlow: policies are versioned; jobs pinned to
// the latest version run inference then validation; answers the
// simulator broke end REVIEW_REQUIRED with reasons and are withheld,
// the rest SUCCEEDED, with one backend call per job. Reviews approve
// (with a corrected result, validated again) or reject; a replay
// re-validates without calling the backend unless asked to; every
// decision is audited.
func TestValidationPolicyReviewFlow(t *testing.T) {
	f := startFleet(t, fleetOpts{jobs: true, runner: true})
	policy := `{"name":"invoice","rules":[{"rule":"json"},{"rule":"schema"},{"rule":"enum","pointer":"/currency","values":["EUR","USD"]}]}`
	for i, want := range []int{1, 2} {
		resp, b := f.post(t, "/v1/validation-policies", policy)
		if p := decode[policyView](t, b); resp.StatusCode != http.StatusCreated || p.Version != want || p.Name != "invoice" {
			t.Fatalf("put %d: %d %s", i, resp.StatusCode, b)
		}
	}
	if status, b := f.get(t, "/v1/validation-policies/invoice?version=1"); status != 200 || decode[policyView](t, b).Version != 1 {
		t.Errorf("version 1: %d %s", status, b)
	}
	if status, b := f.get(t, "/v1/validation-policies/invoice/versions"); status != 200 || strings.Count(string(b), `"validation_policy"`) != 2 {
		t.Errorf("versions: %d %s", status, b)
	}
	for _, bad := range []string{`{"name":"x","rules":[{"rule":"regex"}]}`, `{"name":"bad name","rules":[{"rule":"json"}]}`, `{"rules":[{"rule":"json"}]}`} {
		if resp, b := f.post(t, "/v1/validation-policies", bad); resp.StatusCode != http.StatusBadRequest {
			t.Errorf("policy %s: %d %s", bad, resp.StatusCode, b)
		}
	}
	// Submissions the policy cannot judge are refused up front.
	if resp, b := f.post(t, "/v1/jobs", strings.Replace(chatJob("x", 4), `"metadata"`, `"validation":{"policy":"invoice"},"metadata"`, 1),
		"Idempotency-Key", "no-schema"); resp.StatusCode != http.StatusBadRequest || !strings.Contains(string(b), "response_format") {
		t.Errorf("a schema rule without a schema: %d %s", resp.StatusCode, b)
	}
	if resp, b := f.post(t, "/v1/jobs", schemaJob("x", "nope"), "Idempotency-Key", "nope"); resp.StatusCode != http.StatusNotFound ||
		!strings.Contains(string(b), "policy_not_found") {
		t.Errorf("an unknown policy: %d %s", resp.StatusCode, b)
	}

	f.sims[0].SetFaults(vllmsim.Faults{InvalidJSONRate: 0.4})
	const n = 30
	ids := make([]string, n)
	for i := range n {
		resp, v := submitJob(t, f, fmt.Sprint("inv-", i), schemaJob(fmt.Sprintf("invoice %d: total 30 EUR", i), "invoice"))
		if resp.StatusCode != http.StatusAccepted {
			t.Fatalf("submit %d: %d", i, resp.StatusCode)
		}
		ids[i] = v.ID
	}
	states := map[string][]string{}
	for _, id := range ids {
		eventually.True(t, "job "+id+" to end", func() bool {
			j, err := f.store.Get(context.Background(), "default", id)
			return err == nil && j.State.Final()
		})
		j, _ := f.store.Get(context.Background(), "default", id)
		states[string(j.State)] = append(states[string(j.State)], id)
	}
	review, ok := states[string(store.ReviewRequired)], states[string(store.Succeeded)]
	if len(review)+len(ok) != n || len(review) == 0 || len(ok) == 0 {
		t.Fatalf("states %v; want every job SUCCEEDED or REVIEW_REQUIRED, some of each", states)
	}
	t.Logf("review %d, succeeded %d", len(review), len(ok))
	if calls := backendCalls(t, f); calls != n {
		t.Errorf("%v backend calls for %d jobs; validation must not call the backend", calls, n)
	}
	schema := mustPolicy(t, `{"name":"s","rules":[{"rule":"schema","schema":`+testInvoiceSchema+`}]}`)
	for _, id := range ok {
		status, b := f.get(t, "/v1/jobs/"+id+"/result")
		answer, err := validate.Answer(b)
		if status != 200 || err != nil || len(schema.Check(validate.Input{Answer: answer})) != 0 {
			t.Errorf("succeeded job %s: %d %s", id, status, b)
		}
	}
	if _, v := getJob(t, f, ok[0]); v.Validation == nil || v.Validation.Policy != "invoice" || v.Validation.Version != 2 {
		t.Errorf("the job's view does not name its pinned policy: %+v", v.Validation)
	}
	if _, b := f.get(t, "/v1/jobs/"+review[0]+"/attempts"); !strings.Contains(string(b), `"policy_version":2`) {
		t.Errorf("the attempts do not record the policy version: %s", b)
	}
	for _, id := range review {
		if status, b := f.get(t, "/v1/jobs/"+id+"/result"); status != http.StatusConflict {
			t.Errorf("a result under review was delivered: %d %s", status, b)
		}
	}
	status, b := f.get(t, "/v1/reviews")
	rp := decode[reviewPage](t, b)
	if status != 200 || len(rp.Data) != len(review) {
		t.Fatalf("reviews: %d, %d listed, want %d: %s", status, len(rp.Data), len(review), b)
	}
	for _, r := range rp.Data {
		if r.Policy != "invoice" || r.PolicyVersion != 2 || len(r.Reasons) == 0 || r.Reasons[0].Code == "" {
			t.Errorf("review %+v: want policy invoice v2 and reasons", r)
		}
	}
	// One job's entry, as the list has it; 404 for a job not in review.
	for _, r := range rp.Data {
		status, b := f.get(t, "/v1/jobs/"+r.ID+"/review")
		if one := decode[reviewEntry](t, b); status != http.StatusOK || one.ID != r.ID || one.PolicyVersion != 2 || !reflect.DeepEqual(one.Reasons, r.Reasons) {
			t.Errorf("GET /v1/jobs/%s/review: %d %s, want the list's entry", r.ID, status, b)
		}
	}
	if status, b := f.get(t, "/v1/jobs/no-such-job/review"); status != http.StatusNotFound {
		t.Errorf("the review of no job: %d %s, want 404", status, b)
	}
	if got := scrapeSum(t, f.srv.URL+"/metrics", "kvgate_jobs_review_required"); got != float64(len(review)) {
		t.Errorf("kvgate_jobs_review_required %v, want %d", got, len(review))
	}

	// Approve with a corrected result that fails the policy: refused.
	resp, b := f.post(t, "/v1/jobs/"+review[0]+"/review", `{"decision":"approve","result":{"total":5,"currency":"GBP"}}`)
	if resp.StatusCode != http.StatusUnprocessableEntity || !strings.Contains(string(b), "not_allowed") {
		t.Errorf("a failing correction: %d %s", resp.StatusCode, b)
	}
	// With a good one: SUCCEEDED, and the result carries the correction.
	resp, b = f.post(t, "/v1/jobs/"+review[0]+"/review", `{"decision":"approve","result":{"total":5,"currency":"EUR"}}`)
	if resp.StatusCode != 200 || decode[jobView](t, b).State != string(store.Succeeded) {
		t.Fatalf("approve: %d %s", resp.StatusCode, b)
	}
	_, b = f.get(t, "/v1/jobs/"+review[0]+"/result")
	if a, err := validate.Answer(b); err != nil || a != `{"total":5,"currency":"EUR"}` {
		t.Errorf("the corrected result: %q, %v (%s)", a, err, b)
	}
	if resp, b := f.post(t, "/v1/jobs/"+review[0]+"/review", `{"decision":"approve"}`); resp.StatusCode != http.StatusConflict {
		t.Errorf("deciding twice: %d %s", resp.StatusCode, b)
	}
	if resp, b := f.post(t, "/v1/jobs/"+ok[0]+"/review", `{"decision":"reject","reason":"no"}`); resp.StatusCode != http.StatusConflict {
		t.Errorf("reviewing a succeeded job: %d %s", resp.StatusCode, b)
	}
	if len(review) < 2 {
		return
	}
	rejected := review[1]
	if resp, b := f.post(t, "/v1/jobs/"+rejected+"/review", `{"decision":"reject"}`); resp.StatusCode != http.StatusBadRequest {
		t.Errorf("a rejection without a reason: %d %s", resp.StatusCode, b)
	}
	resp, b = f.post(t, "/v1/jobs/"+rejected+"/review", `{"decision":"reject","reason":"the total is invented"}`)
	if resp.StatusCode != 200 || decode[jobView](t, b).State != string(store.FailedTerminal) {
		t.Fatalf("reject: %d %s", resp.StatusCode, b)
	}
	_, b = f.get(t, "/v1/dead-letters?class=rejected")
	dl := decode[struct {
		Data []deadLetterView `json:"data"`
	}](t, b)
	if len(dl.Data) != 1 || dl.Data[0].ID != rejected || dl.Data[0].Decision != store.AuditReject || dl.Data[0].PolicyVersion != 2 ||
		len(dl.Data[0].Attempts) == 0 || strings.Contains(string(b), "invoice 1") {
		t.Errorf("dead letters: %s", b)
	}

	// Replay the rejected job with the backend healthy: the validation
	// runs again on the answer it has (the same broken one), no call.
	f.sims[0].SetFaults(vllmsim.Faults{})
	before := backendCalls(t, f)
	resp, b = f.post(t, "/v1/jobs/"+rejected+"/replay", ``)
	replayed := decode[jobView](t, b)
	if resp.StatusCode != http.StatusAccepted || replayed.State != string(store.Ready) {
		t.Fatalf("replay: %d %s", resp.StatusCode, b)
	}
	waitJob(t, f, "default", rejected, store.ReviewRequired)
	if calls := backendCalls(t, f); calls != before {
		t.Errorf("a replay from validation called the backend: %v calls, was %v", calls, before)
	}
	// From inference: one more call, and the model answers well now.
	resp, b = f.post(t, "/v1/jobs/"+rejected+"/replay", `{"from":"inference"}`)
	if resp.StatusCode != http.StatusAccepted || decode[jobView](t, b).StateVersion <= replayed.StateVersion {
		t.Fatalf("replay from inference: %d %s", resp.StatusCode, b)
	}
	waitJob(t, f, "default", rejected, store.Succeeded)
	if calls := backendCalls(t, f); calls != before+1 {
		t.Errorf("a replay from inference made %v calls, want 1", calls-before)
	}
	if resp, b := f.post(t, "/v1/jobs/"+rejected+"/replay", `{"from":"validation"}`); resp.StatusCode != http.StatusBadRequest {
		t.Errorf("from validation: %d %s", resp.StatusCode, b)
	}
	if resp, b := f.post(t, "/v1/jobs/"+rejected+"/replay", ``); resp.StatusCode != http.StatusConflict {
		t.Errorf("replaying a succeeded job: %d %s", resp.StatusCode, b)
	}
	_, b = f.get(t, "/v1/jobs/"+rejected+"/audit")
	audit := decode[struct {
		Data []auditView `json:"data"`
	}](t, b)
	var actions []string
	for _, a := range audit.Data {
		actions = append(actions, a.Action+":"+a.From+">"+a.To)
	}
	want := []string{"review.reject:REVIEW_REQUIRED>FAILED_TERMINAL", "replay:FAILED_TERMINAL>READY", "replay:REVIEW_REQUIRED>READY"}
	if strings.Join(actions, ",") != strings.Join(want, ",") {
		t.Errorf("audit %v, want %v", actions, want)
	}
}

func mustPolicy(t *testing.T, doc string) *validate.Policy {
	t.Helper()
	p, err := validate.Parse([]byte(doc))
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// TestReplayAfterOutage: a backend failing every request dead-letters the
// jobs; once it recovers, replaying them succeeds, each with its audit
// record and a rising state_version.
func TestReplayAfterOutage(t *testing.T) {
	f := startFleet(t, fleetOpts{jobs: true, runner: true, gateway: Config{Jobs: Jobs{MaxAttempts: 2}}})
	f.sims[0].SetFaults(vllmsim.Faults{ServerErrorRate: 1})
	var ids []string
	for i := range 5 {
		_, v := submitJob(t, f, fmt.Sprint("out-", i), chatJob(fmt.Sprint("doc ", i), 4))
		ids = append(ids, v.ID)
	}
	for _, id := range ids {
		waitJob(t, f, "default", id, store.FailedTerminal)
	}
	if got := scrapeSum(t, f.srv.URL+"/metrics", "kvgate_dead_letters"); got != 5 {
		t.Errorf("kvgate_dead_letters %v, want 5", got)
	}
	_, b := f.get(t, "/v1/dead-letters?limit=2")
	pg := decode[struct {
		Data       []deadLetterView `json:"data"`
		HasMore    bool             `json:"has_more"`
		NextCursor string           `json:"next_cursor"`
	}](t, b)
	seen := len(pg.Data)
	for pg.HasMore {
		_, b = f.get(t, "/v1/dead-letters?limit=2&after="+pg.NextCursor)
		pg = decode[struct {
			Data       []deadLetterView `json:"data"`
			HasMore    bool             `json:"has_more"`
			NextCursor string           `json:"next_cursor"`
		}](t, b)
		seen += len(pg.Data)
	}
	if seen != 5 {
		t.Errorf("paged through %d dead letters, want 5", seen)
	}
	f.sims[0].SetFaults(vllmsim.Faults{})
	versions := map[string]int64{}
	for _, id := range ids {
		_, v := getJob(t, f, id)
		versions[id] = v.StateVersion
		if resp, b := f.post(t, "/v1/jobs/"+id+"/replay", `{"deadline_seconds":600}`); resp.StatusCode != http.StatusAccepted {
			t.Fatalf("replay %s: %d %s", id, resp.StatusCode, b)
		}
	}
	for _, id := range ids {
		v := waitState(t, f, id, store.Succeeded)
		if v.StateVersion <= versions[id] {
			t.Errorf("%s: state_version %d after the replay, was %d", id, v.StateVersion, versions[id])
		}
		_, b := f.get(t, "/v1/jobs/"+id+"/audit")
		if strings.Count(string(b), `"action":"replay"`) != 1 {
			t.Errorf("audit of %s: %s", id, b)
		}
	}
	if got := scrapeSum(t, f.srv.URL+"/metrics", "kvgate_dead_letters"); got != 0 {
		t.Errorf("kvgate_dead_letters %v after the replays, want 0", got)
	}
}

// TestMetricsWithTheStoreAway: the gauges read from the job store at a
// scrape are left out while the store cannot answer; every other series
// is still served, 200. The handler answered 500 with none, so that a
// store outage silenced every alert and read as zero to autoscalers.
func TestMetricsWithTheStoreAway(t *testing.T) {
	st := sqliteStore(t)
	f := startFleet(t, fleetOpts{store: st})
	get := func() (int, string) {
		resp, err := http.Get(f.srv.URL + "/metrics")
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	f.post(t, "/v1/completions", `{"model":"`+llama+`","prompt":"hi","max_tokens":2}`) // a request's series
	if status, b := get(); status != http.StatusOK || !strings.Contains(b, "kvgate_jobs_review_required") {
		t.Fatalf("/metrics with the store up: %d, review gauge %v", status, strings.Contains(b, "kvgate_jobs_review_required"))
	}
	st.Close()
	status, b := get()
	if status != http.StatusOK || strings.Contains(b, "kvgate_jobs_review_required") || !strings.Contains(b, "kvgate_gateway_requests_total") {
		t.Errorf("/metrics with the store away: %d, review gauge %v, request series %v; want 200 without the store's gauges",
			status, strings.Contains(b, "kvgate_jobs_review_required"), strings.Contains(b, "kvgate_gateway_requests_total"))
	}
}
