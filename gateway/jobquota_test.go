package gateway

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvgate/kvgate/bench/eventually"
	"github.com/kvgate/kvgate/bench/vllmsim"

	"github.com/google/uuid"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/kvgate/kvgate/scheduler"
	"github.com/kvgate/kvgate/store"
	"github.com/kvgate/kvgate/store/sqlstore"
)

// jobsFleet starts a fleet whose runner runs jobs under st's tenants, on
// the quota clock given; wrap stands before the backend.
func jobsFleet(t *testing.T, st *sqlstore.Store, clock *testClock, wrap func(int, http.Handler) http.Handler, cfg Config) *fleet {
	t.Helper()
	cfg.Tenants = Tenants{Store: st, Now: clock.Now}
	return startFleet(t, fleetOpts{store: st, runner: true, speedup: 20, wrap: wrap, gateway: cfg})
}

// submitJobs submits n jobs of body for a tenant's key and returns their ids.
func submitJobs(t *testing.T, f *fleet, key, prefix, body string, n int) []string {
	t.Helper()
	var ids []string
	for i := range n {
		resp, v := submitJob(t, f, fmt.Sprintf("%s-%d", prefix, i), body, "Authorization", "Bearer "+key)
		if resp.StatusCode != http.StatusAccepted {
			t.Fatalf("submit %s-%d: %d", prefix, i, resp.StatusCode)
		}
		ids = append(ids, v.ID)
	}
	return ids
}

// succeeded counts the jobs that succeeded.
func succeeded(t *testing.T, f *fleet, tenant string, ids []string) int {
	t.Helper()
	n := 0
	for _, id := range ids {
		if j, err := f.store.Get(context.Background(), tenant, id); err == nil && j.State == store.Succeeded {
			n++
		}
	}
	return n
}

// waitJob waits for a tenant's job to reach a state, read from the store.
func waitJob(t *testing.T, f *fleet, tenant, id string, want store.State) {
	t.Helper()
	eventually.True(t, "job "+id+" to reach "+string(want), func() bool {
		j, err := f.store.Get(context.Background(), tenant, id)
		return err == nil && j.State == want
	})
}

// usageOf returns a tenant's one ledger day through GET /v1/usage, once
// nothing is in flight.
func usageOf(t *testing.T, f *fleet, operator string) UsageView {
	t.Helper()
	var days []UsageView
	eventually.True(t, "the usage", func() bool {
		_, b := send(t, f.srv.URL, http.MethodGet, "/v1/usage", operator, "")
		days = decode[struct{ Data []UsageView }](t, b).Data
		return len(days) == 1 && days[0].ReservedTokens == 0
	})
	return days[0]
}

// attemptsOf checks that each job succeeded on its first attempt and
// returns the tokens the backend reported for them all.
func attemptsOf(t *testing.T, f *fleet, tenant string, ids []string) (prompt, completion int64) {
	t.Helper()
	for _, id := range ids {
		j, err := f.store.Get(context.Background(), tenant, id)
		if err != nil {
			t.Fatal(err)
		}
		_, as := outcomes(t, f.store, id)
		if j.Attempt != 1 || len(as) != 1 || as[0].Outcome != "succeeded" {
			t.Errorf("job %s: attempt %d, attempts %+v; want one success: a quota wait spends no attempt", id, j.Attempt, as)
			continue
		}
		prompt += int64(as[0].PromptTokens)
		completion += int64(as[0].CompletionTokens)
	}
	return prompt, completion
}

// A tenant's concurrency cap holds for its jobs: ten jobs of a tenant
// limited to two requests in flight never have more than two at the
// backends, all succeed on their first attempt, and the tenant's usage
// shows their requests, attempts and tokens.
func TestJobsRunUnderTenantConcurrency(t *testing.T) {
	st := sqliteStore(t)
	clock := &testClock{now: quotaT0}
	var inFlight, peak atomic.Int64
	count := func(_ int, h http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.URL.Path == "/v1/chat/completions" {
				n := inFlight.Add(1)
				defer inFlight.Add(-1)
				for p := peak.Load(); n > p && !peak.CompareAndSwap(p, n); p = peak.Load() {
				}
				// Slow enough that the tenant's jobs overlap.
				select {
				case <-time.After(100 * time.Millisecond):
				case <-r.Context().Done():
				}
			}
			h.ServeHTTP(w, r)
		})
	}
	user := newTenant(t, st, "acme", store.Limits{MaxConcurrency: 2}, store.RoleUser)
	operator := newKey(t, st, "acme", store.RoleOperator)
	f := jobsFleet(t, st, clock, count, Config{})

	ids := submitJobs(t, f, user, "c", chatJob("summarise the document", 16), 10)
	eventually.Within(t, 30*time.Second, "ten jobs to succeed", func() bool { return succeeded(t, f, "acme", ids) == 10 })
	if p := peak.Load(); p > 2 || p < 1 {
		t.Errorf("%d of the tenant's requests at the backends at once, want at most 2", p)
	}
	if n := testutil.ToFloat64(f.api.quota.rejected.WithLabelValues("concurrency")); n == 0 {
		t.Errorf("no job waited for the concurrency cap; the test proves nothing")
	}
	prompt, completion := attemptsOf(t, f, "acme", ids)
	u := usageOf(t, f, operator)
	if u.Requests != 10 || u.Attempts != 10 || u.PromptTokens != prompt || u.CompletionTokens != completion ||
		completion == 0 || u.UncertainRequests != 0 || u.ChargedTokens != prompt+completion {
		t.Errorf("usage %+v, want 10 requests and attempts, %d prompt and %d completion tokens", u, prompt, completion)
	}
}

// A tenant's TPM holds for its jobs: with room for one job's reservation
// a minute, jobs run one per window as the quota clock moves, each on its
// first attempt, after waiting for the window's reset.
func TestJobsWaitForTenantTPM(t *testing.T) {
	st := sqliteStore(t)
	clock := &testClock{now: quotaT0}
	body := chatJob("summarise the document", 8)
	f := jobsFleet(t, st, clock, nil, Config{TokenCount: "tokenize"})

	// The reservation, counted as Execute counts it: exactly, so that TPM
	// holds one job and not two.
	var req jobRequest
	if err := json.Unmarshal([]byte(body), &req); err != nil {
		t.Fatal(err)
	}
	c, model, err := f.api.jobCall(store.Job{ID: "probe", Endpoint: req.Endpoint, Body: req.Body})
	if err != nil {
		t.Fatal(err)
	}
	prompt, maxOut, exact := f.api.reservation(context.Background(), c, model)
	if !exact {
		t.Fatal("the simulator did not tokenize the prompt")
	}
	user := newTenant(t, st, "tiny", store.Limits{TPM: int64(prompt + maxOut)}, store.RoleUser)
	operator := newKey(t, st, "tiny", store.RoleOperator)

	ids := submitJobs(t, f, user, "t", body, 3)
	for k := 1; k <= len(ids); k++ {
		for deadline := time.Now().Add(10 * time.Second); succeeded(t, f, "tiny", ids) < k; time.Sleep(2 * time.Millisecond) {
			if time.Now().After(deadline) {
				for _, id := range ids {
					j, _ := f.store.Get(context.Background(), "tiny", id)
					_, as := outcomes(t, f.store, id)
					t.Logf("job %s: %s, attempt %d, available at %v, attempts %+v", id, j.State, j.Attempt, j.AvailableAt, as)
				}
				t.Fatalf("timed out waiting for job %d of the window to succeed", k)
			}
		}
		if n := succeeded(t, f, "tiny", ids); n != k {
			t.Fatalf("%d jobs succeeded within %d minute windows; the TPM holds one a window", n, k)
		}
		if k == 1 {
			// The other jobs are tried in the first window and refused
			// before the clock moves: on a loaded machine they could
			// otherwise first be tried after the reset, waiting for nothing.
			eventually.Within(t, 10*time.Second, "the first window's other jobs to be refused", func() bool {
				return testutil.ToFloat64(f.api.quota.rejected.WithLabelValues("tokens")) > 0
			})
		}
		clock.Advance(time.Minute)
	}
	if n := testutil.ToFloat64(f.api.quota.rejected.WithLabelValues("tokens")); n == 0 {
		t.Errorf("no job waited for the TPM window; the test proves nothing")
	}
	pt, ct := attemptsOf(t, f, "tiny", ids)
	if u := usageOf(t, f, operator); u.Requests != 3 || u.Attempts != 3 || u.PromptTokens != pt || u.CompletionTokens != ct {
		t.Errorf("usage %+v, want 3 requests and attempts, %d prompt and %d completion tokens", u, pt, ct)
	}
}

// A spent daily budget hands the job back for a retry when the budget
// resets (the next UTC day), an attempt that says so; a job bigger than
// the whole budget fails at once.
func TestJobsWaitForTenantBudget(t *testing.T) {
	st := sqliteStore(t)
	clock := &testClock{now: quotaT0}
	f := jobsFleet(t, st, clock, nil, Config{TokenCount: "tokenize"})
	body := chatJob("summarise the document", 8)
	var req jobRequest
	if err := json.Unmarshal([]byte(body), &req); err != nil {
		t.Fatal(err)
	}
	c, model, err := f.api.jobCall(store.Job{ID: "probe", Endpoint: req.Endpoint, Body: req.Body})
	if err != nil {
		t.Fatal(err)
	}
	prompt, maxOut, _ := f.api.reservation(context.Background(), c, model)
	res := int64(prompt + maxOut)
	user := newTenant(t, st, "frugal", store.Limits{DailyTokens: res + res/2}, store.RoleUser)
	big := newTenant(t, st, "tight", store.Limits{DailyTokens: res - 1}, store.RoleUser)

	first := submitJobs(t, f, user, "b1", body, 1)
	waitJob(t, f, "frugal", first[0], store.Succeeded)
	second := submitJobs(t, f, user, "b2", body, 1)
	waitJob(t, f, "frugal", second[0], store.RetryScheduled)
	j, err := f.store.Get(context.Background(), "frugal", second[0])
	if err != nil {
		t.Fatal(err)
	}
	untilReset := time.Date(2026, 12, 1, 0, 0, 0, 0, time.UTC).Sub(quotaT0)
	if wait := time.Until(j.AvailableAt); wait < untilReset-time.Minute {
		t.Errorf("retry in %s, want at the budget's reset, in %s", wait, untilReset)
	}
	if _, as := outcomes(t, f.store, j.ID); len(as) != 1 || as[0].ErrorClass != string(scheduler.ClassQuota) || !strings.Contains(as[0].Error, "daily_tokens") {
		t.Errorf("attempts %+v, want one %s on daily_tokens", as, scheduler.ClassQuota)
	}

	tooBig := submitJobs(t, f, big, "b3", body, 1)
	waitJob(t, f, "tight", tooBig[0], store.FailedTerminal)
	if _, as := outcomes(t, f.store, tooBig[0]); len(as) != 1 || as[0].ErrorClass != string(scheduler.ClassInvalid) {
		t.Errorf("attempts %+v, want one %s", as, scheduler.ClassInvalid)
	}
}

// A job whose request was sent and never answered stays charged to its
// tenant as uncertain usage, one attempt each time; a job refused by the
// backend is refunded.
func TestJobsTimeoutsChargeUncertainUsage(t *testing.T) {
	st := sqliteStore(t)
	clock := &testClock{now: quotaT0}
	stall := func(_ int, h http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			b, _ := io.ReadAll(r.Body)
			if bytes.Contains(b, []byte("never answered")) {
				<-r.Context().Done() // the job's request: never answered
				return
			}
			r.Body = io.NopCloser(bytes.NewReader(b))
			h.ServeHTTP(w, r)
		})
	}
	user := newTenant(t, st, "acme", store.Limits{MaxConcurrency: 4}, store.RoleUser)
	operator := newKey(t, st, "acme", store.RoleOperator)
	f := jobsFleet(t, st, clock, stall, Config{RequestTimeout: 200 * time.Millisecond, Jobs: Jobs{MaxAttempts: 2}})

	ids := submitJobs(t, f, user, "s", chatJob("never answered", 8), 1)
	waitJob(t, f, "acme", ids[0], store.FailedTerminal)
	if u := usageOf(t, f, operator); u.Requests != 2 || u.Attempts != 2 || u.UncertainRequests != 2 || u.UncertainTokens == 0 ||
		u.PromptTokens != 0 || u.ChargedTokens != u.UncertainTokens {
		t.Errorf("usage %+v, want 2 requests, attempts and uncertain requests, charged as uncertain", u)
	}
}

// countingTenants counts the limiter's writes that reach the tenants'
// store.
type countingTenants struct {
	store.Tenants
	acquires, releases, records atomic.Int64
}

func (c *countingTenants) Acquire(ctx context.Context, a store.Acquisition) (store.Permit, error) {
	c.acquires.Add(1)
	return c.Tenants.Acquire(ctx, a)
}

func (c *countingTenants) Release(ctx context.Context, r store.Release) error {
	c.releases.Add(1)
	return c.Tenants.Release(ctx, r)
}

func (c *countingTenants) RecordUsage(ctx context.Context, r store.Release) error {
	c.records.Add(1)
	return c.Tenants.RecordUsage(ctx, r)
}

// The jobs of a tenant that nothing limits take no permits: each
// attempt's usage is charged by the transaction that records its end
// (store.Charge), so the ledger holds a job's usage the moment the job is
// SUCCEEDED, with nothing written behind it and nothing to settle. Every
// attempt in the ledger is one of the jobs' attempt records.
func TestJobsChargeWithTheirAttempts(t *testing.T) {
	st := sqliteStore(t)
	user := newTenant(t, st, "acme", store.Limits{MaxPendingJobs: 100}, store.RoleUser) // limits jobs, not requests
	counted := &countingTenants{Tenants: st}
	f := startFleet(t, fleetOpts{store: st, runner: true, speedup: 50, gateway: Config{Tenants: Tenants{Store: counted}}})

	ids := submitJobs(t, f, user, "c", chatJob("summarise the document", 16), 8)
	for _, id := range ids {
		waitJob(t, f, "acme", id, store.Succeeded)
	}
	prompt, completion := attemptsOf(t, f, "acme", ids)
	if u := ledgerOf(t, st, "acme"); u.Requests != 8 || u.Attempts != 8 || u.PromptTokens != prompt ||
		u.CompletionTokens != completion || completion == 0 || u.ReservedTokens != 0 || u.Uncertain != 0 {
		t.Errorf("ledger %+v as the jobs succeeded, want 8 requests and attempts, %d prompt and %d completion tokens", u, prompt, completion)
	}
	if a, r, rec := counted.acquires.Load(), counted.releases.Load(), counted.records.Load(); a+r+rec != 0 {
		t.Errorf("%d acquisitions, %d releases and %d records of the limiter, want none", a, r, rec)
	}
}

// An embeddings job split into batches charges them with its attempts
// too: each attempt's end carries the batches it ran, checkpointed or
// not. The backend dies at the second batch of three, after the first
// was checkpointed; the retry reuses that checkpoint and pays only the
// rest. The ledger then holds every batch's prompt tokens exactly once
// (the result's usage), a request and an attempt per backend call, and
// the limiter was never called.
func TestEmbeddingBatchesChargeWithTheirAttempts(t *testing.T) {
	p, err := vllmsim.LookupProfile("h100-bge-m3")
	if err != nil {
		t.Fatal(err)
	}
	p.EmbeddingDim = 8
	var sim atomic.Pointer[vllmsim.Sim]
	var calls atomic.Int64
	wrap := func(_ int, h http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.URL.Path == "/v1/embeddings" && calls.Add(1) == 2 {
				s := sim.Load()
				s.SetFaults(vllmsim.Faults{Dead: true})
				time.AfterFunc(150*time.Millisecond, func() { s.SetFaults(vllmsim.Faults{}) })
			}
			h.ServeHTTP(w, r)
		})
	}
	st := sqliteStore(t)
	user := newTenant(t, st, "acme", store.Limits{MaxPendingJobs: 100}, store.RoleUser) // limits jobs, not requests
	counted := &countingTenants{Tenants: st}
	f := startFleet(t, fleetOpts{store: st, profile: p, runner: true, wrap: wrap,
		gateway: Config{Tenants: Tenants{Store: counted}, Jobs: Jobs{MaxAttempts: 20}}})
	sim.Store(f.sims[0])

	const chunks = 700 // three batches
	id := submitJobs(t, f, user, "e", embedJob(p.Model, chunks), 1)[0]
	waitJob(t, f, "acme", id, store.Succeeded)
	_, b := bearer(t, f, user, http.MethodGet, "/v1/jobs/"+id+"/result", "")
	var res embedResult
	if err := json.Unmarshal(b, &res); err != nil || len(res.Data) != chunks {
		t.Fatalf("result: %v, %d embeddings: %s", err, len(res.Data), b[:min(len(b), 300)])
	}
	as, err := f.store.Attempts(context.Background(), id)
	if err != nil || len(as) < 2 {
		t.Fatalf("attempts %+v, %v: want the interrupted one and the one that succeeded", as, err)
	}
	u := ledgerOf(t, st, "acme")
	if u.PromptTokens != int64(res.Usage.PromptTokens) || res.Usage.PromptTokens == 0 || u.ReservedTokens != 0 {
		t.Errorf("ledger %+v, want the result's %d prompt tokens and nothing reserved", u, res.Usage.PromptTokens)
	}
	if u.Requests != calls.Load() || u.Attempts != calls.Load() {
		t.Errorf("ledger %+v, want a request and an attempt for each of the %d backend calls", u, calls.Load())
	}
	if a, r, rec := counted.acquires.Load(), counted.releases.Load(), counted.records.Load(); a+r+rec != 0 {
		t.Errorf("%d acquisitions, %d releases and %d records of the limiter, want none", a, r, rec)
	}
	t.Logf("%d chunks, %d backend calls, %d attempts; ledger %d requests, %d prompt tokens, %d uncertain",
		chunks, calls.Load(), len(as), u.Requests, u.PromptTokens, u.Uncertain)
}

// TestDeletedTenantsWorkIsRefused: another replica deleted the tenant, and
// this one still has its key cached. Once it reads the tenant's record
// again, a request or a job submission on that key is refused (401
// tenant_deleted), and a job accepted in the delete's window (by a replica
// that had read nothing yet) fails at its attempt: read as a tenant the
// store does not know, either would have run with no limits.
func TestDeletedTenantsWorkIsRefused(t *testing.T) {
	st := sqliteStore(t)
	clock := &testClock{now: quotaT0}
	user := newTenant(t, st, "acme", store.Limits{RPM: 1000, MaxPendingJobs: 100}, store.RoleUser)
	f := jobsFleet(t, st, clock, nil, Config{})
	before := submitJobs(t, f, user, "before", chatJob("summarise the document", 8), 1)
	waitJob(t, f, "acme", before[0], store.Succeeded)

	if err := st.DeleteTenant(context.Background(), "acme", clock.Now()); err != nil {
		t.Fatal(err)
	}
	f.api.forgetTenant("acme") // the tenant's record expires before the key's
	if resp, _ := submitJob(t, f, "after", chatJob("summarise the document", 8), "Authorization", "Bearer "+user); resp.StatusCode != http.StatusUnauthorized {
		t.Errorf("a job submitted on a deleted tenant's cached key: %d, want 401", resp.StatusCode)
	}
	resp, b := send(t, f.srv.URL, http.MethodPost, "/v1/chat/completions", user, chatReq(4))
	if resp.StatusCode != http.StatusUnauthorized || !strings.Contains(string(b), "tenant_deleted") {
		t.Errorf("a request on a deleted tenant's cached key: %d %s, want 401 tenant_deleted", resp.StatusCode, b)
	}
	// Not only where a quota is taken: any call.
	for _, path := range []string{"/v1/models", "/v1/jobs", "/v1/files"} {
		if resp, b := send(t, f.srv.URL, http.MethodGet, path, user, ""); resp.StatusCode != http.StatusUnauthorized || !strings.Contains(string(b), "tenant_deleted") {
			t.Errorf("GET %s on a deleted tenant's cached key: %d %s, want 401 tenant_deleted", path, resp.StatusCode, b)
		}
	}

	// Accepted by another replica as the tenant was deleted.
	now := time.Now()
	id := "job-in-the-window"
	if _, _, err := st.Accept(context.Background(), store.NewJob{ID: id, EventID: "ev-in-the-window", Tenant: "acme",
		IdempotencyKey: "window", RequestHash: "h", Endpoint: "/v1/chat/completions", Model: llama,
		Body: []byte(chatReq(4)), TokenEstimate: 10, MaxAttempts: 3, Deadline: now.Add(time.Hour), Now: now}); err != nil {
		t.Fatal(err)
	}
	waitJob(t, f, "acme", id, store.FailedTerminal)
	if j, _ := st.Get(context.Background(), "acme", id); !strings.Contains(j.LastError, "tenant deleted") {
		t.Errorf("the job accepted in the window failed with %q, want for its deleted tenant", j.LastError)
	}
}

// acquireBeside takes and gives back a permit of tenant under a
// concurrency cap of one: nil when nothing else holds the tenant's.
func acquireBeside(st store.Store, tenant string, lease time.Duration) error {
	a := store.Acquisition{PermitID: uuid.Must(uuid.NewV7()).String(), Tenant: tenant, Tokens: 1,
		Limits: store.Limits{MaxConcurrency: 1}, Now: time.Now(), Lease: lease}
	p, err := st.Acquire(context.Background(), a)
	if err == nil {
		_ = st.Release(context.Background(), store.Release{Permit: p, Outcome: store.NotSent, Now: time.Now()})
	}
	return err
}

// TestJobPermitKeptWhileItWaits: a job's quota permit is renewed while
// the job holds it (waiting for a backend may take longer than a lease),
// so the tenant's concurrency cap holds: an acquisition past the first
// lease finds the permit still counting, not swept; released, it counts
// no more.
func TestJobPermitKeptWhileItWaits(t *testing.T) {
	st := sqliteStore(t)
	const lease = 200 * time.Millisecond
	f := startFleet(t, fleetOpts{store: st, gateway: Config{Tenants: Tenants{Store: st, PermitLease: lease}}})
	key := newTenant(t, st, "tiny", store.Limits{MaxConcurrency: 1}, store.RoleUser)
	ids := submitJobs(t, f, key, "held", chatJob("wait for a backend", 2), 1)
	j, err := f.store.Get(context.Background(), "tiny", ids[0])
	if err != nil {
		t.Fatal(err)
	}
	call, err := f.api.Prepare(context.Background(), j)
	if err != nil {
		t.Fatal(err)
	}
	if err := call.Admit(context.Background()); err != nil {
		t.Fatal(err)
	}
	another := func() error { return acquireBeside(st, "tiny", lease) }
	time.Sleep(4 * lease) // the job waits past its permit's first lease
	var qe *store.QuotaError
	if err := another(); !errors.As(err, &qe) || qe.Limit != "concurrency" {
		t.Errorf("another request past the held permit's first lease: %v, want refused for concurrency", err)
	}
	call.Release()
	if err := another(); err != nil {
		t.Errorf("another request once the job let its permit go: %v", err)
	}
}

// TestRequestPermitKeptWhileItRuns: an interactive request's permit is
// renewed while the request runs, however long that is (a long
// max_queue_wait, retries, a slow stream): the tenant's concurrency cap
// holds past the permit's first lease.
func TestRequestPermitKeptWhileItRuns(t *testing.T) {
	st := sqliteStore(t)
	const lease = 200 * time.Millisecond
	// The request is known to hold its permit once the backend has it:
	// probing with a second acquisition before then could take the only
	// permit first and have the request refused.
	arrived := make(chan struct{}, 1)
	wrap := func(_ int, h http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.URL.Path == "/v1/chat/completions" {
				select {
				case arrived <- struct{}{}:
				default:
				}
			}
			h.ServeHTTP(w, r)
		})
	}
	f := startFleet(t, fleetOpts{store: st, backends: 1, wrap: wrap, gateway: Config{Tenants: Tenants{Store: st, PermitLease: lease}}})
	key := newTenant(t, st, "tiny", store.Limits{MaxConcurrency: 1}, store.RoleUser)
	f.sims[0].SetFaults(vllmsim.Faults{HangRate: 1, Match: "hold me"})
	another := func() error { return acquireBeside(st, "tiny", lease) }
	refused := func() bool {
		var qe *store.QuotaError
		return errors.As(another(), &qe) && qe.Limit == "concurrency"
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, f.srv.URL+"/v1/chat/completions",
			strings.NewReader(`{"model":"`+llama+`","messages":[{"role":"user","content":"hold me"}],"max_tokens":2}`))
		req.Header.Set("Authorization", "Bearer "+key)
		req.Header.Set("Content-Type", "application/json")
		if resp, err := http.DefaultClient.Do(req); err == nil {
			resp.Body.Close()
		}
	}()
	select {
	case <-arrived:
	case <-done:
		t.Fatal("the request ended before it reached the backend")
	}
	if !refused() {
		t.Fatal("another request was admitted beside the running one")
	}
	time.Sleep(4 * lease) // the request runs past its permit's first lease
	if !refused() {
		t.Error("another request past the running request's first lease was admitted beside it")
	}
	cancel()
	<-done
	eventually.True(t, "the permit is let go once the client leaves", func() bool { return another() == nil })
}
