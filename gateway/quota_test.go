package gateway

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/kvgate/kvgate/bench/eventually"

	"github.com/kvgate/kvgate/store"
	"github.com/kvgate/kvgate/store/postgres/pgtest"
	"github.com/kvgate/kvgate/store/sqlite"
	"github.com/kvgate/kvgate/store/sqlstore"
)

// testClock is an injected clock the test moves.
type testClock struct {
	mu  sync.Mutex
	now time.Time
}

func (c *testClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *testClock) Advance(d time.Duration) {
	c.mu.Lock()
	c.now = c.now.Add(d)
	c.mu.Unlock()
}

var quotaT0 = time.Date(2026, 11, 30, 12, 0, 10, 0, time.UTC)

func sqliteStore(t testing.TB) *sqlstore.Store {
	t.Helper()
	st, err := sqlite.Open(context.Background(), filepath.Join(t.TempDir(), "kvgate.db"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := sqlite.Migrate(context.Background(), st); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	return st
}

// newTenant creates a tenant with limits and a key of role for it.
func newTenant(t *testing.T, st store.Tenants, name string, l store.Limits, role store.Role) string {
	t.Helper()
	ctx := context.Background()
	if err := st.CreateTenant(ctx, store.Tenant{Name: name, Weight: 1, Limits: l, CreatedAt: quotaT0, UpdatedAt: quotaT0}); err != nil && !strings.Contains(err.Error(), "exists") {
		t.Fatal(err)
	}
	return newKey(t, st, name, role)
}

func newKey(t *testing.T, st store.Tenants, tenant string, role store.Role) string {
	t.Helper()
	secret, k := NewAPIKey(tenant, role, "test", quotaT0)
	if err := st.CreateKey(context.Background(), k); err != nil {
		t.Fatal(err)
	}
	return secret
}

func chatReq(maxTokens int) string {
	return fmt.Sprintf(`{"model":%q,"messages":[{"role":"user","content":"hello there"}],"max_tokens":%d}`, llama, maxTokens)
}

// send sends a request with a bearer key and returns the response with its
// body read.
func send(t testing.TB, base, method, path, key, body string) (*http.Response, []byte) {
	t.Helper()
	var rd io.Reader
	if body != "" {
		rd = strings.NewReader(body)
	}
	req, _ := http.NewRequest(method, base+path, rd)
	req.Header.Set("Content-Type", "application/json")
	if key != "" {
		req.Header.Set("Authorization", "Bearer "+key)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Error(err)
		return &http.Response{StatusCode: 0, Header: http.Header{}}, nil
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp, b
}

type errorBody struct {
	Error struct {
		Message string  `json:"message"`
		Type    string  `json:"type"`
		Code    *string `json:"code"`
		Param   *string `json:"param"`
	} `json:"error"`
}

func decodeError(t *testing.T, b []byte) errorBody {
	t.Helper()
	var e errorBody
	if err := json.Unmarshal(b, &e); err != nil || e.Error.Code == nil {
		t.Fatalf("not an OpenAI error body: %s", b)
	}
	return e
}

// TestQuotaRaceTwoReplicas: hundreds of concurrent requests through two
// gateways on one PostgreSQL store against a tenant's RPM of n admit
// exactly n; against a concurrency cap of n, exactly n run at once.
func TestQuotaRaceTwoReplicas(t *testing.T) {
	const n, callers = 20, 300
	st := pgtest.Open(t)
	// Few connections: the tenant's admissions are serialised anyway, and
	// the test server is shared.
	st.DB().SetMaxOpenConns(8)
	clock := &testClock{now: quotaT0}
	var atBackends atomic.Int64 // inference requests the simulators are serving
	count := func(_ int, h http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.Method == http.MethodPost {
				atBackends.Add(1)
				defer atBackends.Add(-1)
			}
			h.ServeHTTP(w, r)
		})
	}
	opts := fleetOpts{store: st, wrap: count, speedup: 1, gateway: Config{Tenants: Tenants{Store: st, Now: clock.Now}}}
	replicas := []*fleet{startFleet(t, opts), startFleet(t, opts)}

	// burst sends the callers' requests, half to each replica, and sorts
	// the answers; a request whose context ends first counts as admitted.
	var answered atomic.Int64
	burst := func(ctx context.Context, key string, maxTokens int) (ok, limited int, codes map[string]int) {
		var mu sync.Mutex
		var wg sync.WaitGroup
		codes = map[string]int{}
		for i := range callers {
			wg.Go(func() {
				reqBody := fmt.Sprintf(`{"model":%q,"messages":[{"role":"user","content":"hello there"}],"max_tokens":%d,"ignore_eos":true}`,
					llama, maxTokens)
				req, _ := http.NewRequestWithContext(ctx, http.MethodPost, replicas[i%2].srv.URL+"/v1/chat/completions",
					strings.NewReader(reqBody))
				req.Header.Set("Authorization", "Bearer "+key)
				resp, err := http.DefaultClient.Do(req)
				status, body := 0, []byte(nil)
				if err == nil {
					body, _ = io.ReadAll(resp.Body)
					resp.Body.Close()
					status = resp.StatusCode
				}
				mu.Lock()
				defer mu.Unlock()
				switch {
				case status == http.StatusOK || (status == 0 && ctx.Err() != nil):
					ok++
				case status == http.StatusTooManyRequests:
					answered.Add(1)
					limited++
					var e errorBody
					_ = json.Unmarshal(body, &e)
					if e.Error.Code != nil {
						codes[*e.Error.Code]++
					}
				default:
					answered.Add(1)
					codes[fmt.Sprintf("status %d %v: %s", status, err, body)]++
				}
			})
		}
		wg.Wait()
		return ok, limited, codes
	}
	released := func(tenant string) {
		t.Helper()
		eventually.True(t, "every permit released", func() bool {
			us, _ := st.Usage(context.Background(), tenant, quotaT0, quotaT0)
			return len(us) == 1 && us[0].ReservedTokens == 0
		})
	}

	t.Run("rpm", func(t *testing.T) {
		key := newTenant(t, st, "rpm-tenant", store.Limits{RPM: n}, store.RoleUser)
		ok, limited, codes := burst(context.Background(), key, 2)
		if ok != n || limited != callers-n || codes["rate_limit_exceeded"] != callers-n {
			t.Errorf("%d requests against an RPM of %d on two replicas: %d admitted, %d limited, %v", callers, n, ok, limited, codes)
		}
		released("rpm-tenant") // each after its response went out
		us, _ := st.Usage(context.Background(), "rpm-tenant", quotaT0, quotaT0)
		if u := us[0]; u.Requests != n || u.Attempts != n || u.CompletionTokens != 2*n || u.PromptTokens == 0 || u.Uncertain != 0 {
			t.Errorf("ledger: %+v", u)
		}
		t.Logf("rpm %d: %d of %d admitted across two replicas", n, ok, callers)
	})

	t.Run("concurrency", func(t *testing.T) {
		key := newTenant(t, st, "conc-tenant", store.Limits{MaxConcurrency: n}, store.RoleUser)
		// Long generations: the admitted requests run while the others are
		// refused; once every refusal is in, they are cancelled.
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		var ok, limited int
		var codes map[string]int
		answered.Store(0)
		done := make(chan struct{})
		go func() {
			defer close(done)
			ok, limited, codes = burst(ctx, key, 4000)
		}()
		eventually.True(t, "the refusals", func() bool { return answered.Load() >= callers-n })
		eventually.True(t, "the admitted requests at the backends", func() bool { return atBackends.Load() >= n })
		if got, refused := atBackends.Load(), answered.Load(); got != n || refused != callers-n {
			t.Errorf("%d requests at the backends at once and %d refused, want %d and %d", got, refused, n, callers-n)
		}
		cancel()
		<-done
		if ok != n || limited != callers-n || codes["rate_limit_exceeded"] != callers-n {
			t.Errorf("%d requests against a concurrency of %d on two replicas: %d admitted, %d limited, %v", callers, n, ok, limited, codes)
		}
		// Cut off after they were sent: their usage is unknown, charged as
		// uncertain; the permits come back, and the next request runs.
		released("conc-tenant")
		us, _ := st.Usage(context.Background(), "conc-tenant", quotaT0, quotaT0)
		if u := us[0]; u.Requests != n || u.Uncertain != n || u.UncertainTokens == 0 {
			t.Errorf("ledger after cancelling: %+v", u)
		}
		if resp, b := send(t, replicas[0].srv.URL, http.MethodPost, "/v1/chat/completions", key, chatReq(2)); resp.StatusCode != http.StatusOK {
			t.Errorf("after the burst: %d %s", resp.StatusCode, b)
		}
	})
}

// TestQuota429Shape: a tenant over its RPM gets OpenAI's 429, with
// Retry-After and the x-ratelimit-* headers; the admitted request carries
// the headers too; a spent daily budget is insufficient_quota.
func TestQuota429Shape(t *testing.T) {
	st := sqliteStore(t)
	clock := &testClock{now: quotaT0} // 10 s into a minute
	f := startFleet(t, fleetOpts{store: st, speedup: 50, gateway: Config{Tenants: Tenants{Store: st, Now: clock.Now}}})
	key := newTenant(t, st, "acme", store.Limits{RPM: 1, TPM: 1000}, store.RoleUser)

	resp, b := send(t, f.srv.URL, http.MethodPost, "/v1/chat/completions", key, chatReq(4))
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("first request: %d %s", resp.StatusCode, b)
	}
	for h, want := range map[string]string{"x-ratelimit-limit-requests": "1", "x-ratelimit-remaining-requests": "0",
		"x-ratelimit-reset-requests": "50s", "x-ratelimit-limit-tokens": "1000", "x-ratelimit-reset-tokens": "50s"} {
		if got := resp.Header.Get(h); got != want {
			t.Errorf("admitted: %s = %q, want %q", h, got, want)
		}
	}
	resp, b = send(t, f.srv.URL, http.MethodPost, "/v1/chat/completions", key, chatReq(4))
	e := decodeError(t, b)
	if resp.StatusCode != http.StatusTooManyRequests || e.Error.Type != "rate_limit_error" || *e.Error.Code != "rate_limit_exceeded" ||
		!strings.Contains(e.Error.Message, "requests per min (RPM): Limit 1, Used 1, Requested 1") || e.Error.Param != nil {
		t.Errorf("over RPM: %d %s", resp.StatusCode, b)
	}
	for h, want := range map[string]string{"Retry-After": "50", "retry-after-ms": "50000", "x-ratelimit-limit-requests": "1",
		"x-ratelimit-remaining-requests": "0", "x-ratelimit-reset-requests": "50s"} {
		if got := resp.Header.Get(h); got != want {
			t.Errorf("429: %s = %q, want %q", h, got, want)
		}
	}
	// The next minute admits again.
	clock.Advance(50 * time.Second)
	if resp, b := send(t, f.srv.URL, http.MethodPost, "/v1/chat/completions", key, chatReq(4)); resp.StatusCode != http.StatusOK {
		t.Errorf("next minute: %d %s", resp.StatusCode, b)
	}
	// A request larger than the TPM can never pass: tokens.
	big := newTenant(t, st, "big", store.Limits{TPM: 1000}, store.RoleUser)
	resp, b = send(t, f.srv.URL, http.MethodPost, "/v1/chat/completions", big, chatReq(2000))
	if e := decodeError(t, b); resp.StatusCode != http.StatusTooManyRequests || !strings.Contains(e.Error.Message, "Request too large for your tenant on tokens per min (TPM)") {
		t.Errorf("over TPM: %d %s", resp.StatusCode, b)
	}
	// No reset makes room for it: the SDKs are told not to retry.
	if h := resp.Header; h.Get("x-should-retry") != "false" || h.Get("Retry-After") != "" || h.Get("retry-after-ms") != "" {
		t.Errorf("over TPM: x-should-retry %q, Retry-After %q, retry-after-ms %q; want false and none", h.Get("x-should-retry"), h.Get("Retry-After"), h.Get("retry-after-ms"))
	}

	// A spent budget: insufficient_quota, and clients should not retry.
	budget := newTenant(t, st, "frugal", store.Limits{DailyTokens: 60}, store.RoleUser)
	if resp, b := send(t, f.srv.URL, http.MethodPost, "/v1/chat/completions", budget, chatReq(30)); resp.StatusCode != http.StatusOK {
		t.Fatalf("within budget: %d %s", resp.StatusCode, b)
	}
	eventually.True(t, "the release", func() bool {
		us, _ := st.Usage(context.Background(), "frugal", quotaT0, quotaT0)
		return len(us) == 1 && us[0].ReservedTokens == 0
	})
	resp, b = send(t, f.srv.URL, http.MethodPost, "/v1/chat/completions", budget, chatReq(30))
	e = decodeError(t, b)
	if resp.StatusCode != http.StatusTooManyRequests || e.Error.Type != "insufficient_quota" || *e.Error.Code != "insufficient_quota" ||
		resp.Header.Get("x-should-retry") != "false" || resp.Header.Get("Retry-After") == "" {
		t.Errorf("over the daily budget: %d %v %s", resp.StatusCode, resp.Header, b)
	}
}

// failingTenants is a store whose limiter state cannot be reached.
type failingTenants struct{ store.Tenants }

func (failingTenants) Acquire(context.Context, store.Acquisition) (store.Permit, error) {
	return store.Permit{}, fmt.Errorf("acquire quota: %w: connection refused", store.ErrUnavailable)
}

func (failingTenants) ReserveJob(context.Context, string, string, int64, store.Limits, time.Time, time.Duration) error {
	return fmt.Errorf("reserve job: %w: connection refused", store.ErrUnavailable)
}

// TestQuotaUnreachable: limiter state out of reach fails closed (503 with
// Retry-After) by default, and admits with FailOpen.
func TestQuotaUnreachable(t *testing.T) {
	for _, open := range []bool{false, true} {
		t.Run(fmt.Sprintf("fail_open=%v", open), func(t *testing.T) {
			st := sqliteStore(t)
			key := newTenant(t, st, "acme", store.Limits{RPM: 100, MaxPendingJobs: 10}, store.RoleUser)
			f := startFleet(t, fleetOpts{store: st, speedup: 50, gateway: Config{Tenants: Tenants{Store: failingTenants{st}, FailOpen: open}}})
			resp, b := send(t, f.srv.URL, http.MethodPost, "/v1/chat/completions", key, chatReq(4))
			req, _ := http.NewRequest(http.MethodPost, f.srv.URL+"/v1/jobs", strings.NewReader(chatJob("x", 4)))
			req.Header.Set("Authorization", "Bearer "+key)
			req.Header.Set("Idempotency-Key", "j1")
			job, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			jb, _ := io.ReadAll(job.Body)
			job.Body.Close()
			if open {
				if resp.StatusCode != http.StatusOK || job.StatusCode != http.StatusAccepted {
					t.Errorf("fail open: request %d %s, job %d %s", resp.StatusCode, b, job.StatusCode, jb)
				}
				return
			}
			e := decodeError(t, b)
			if resp.StatusCode != http.StatusServiceUnavailable || *e.Error.Code != "quota_unavailable" || resp.Header.Get("Retry-After") != "1" {
				t.Errorf("fail closed: %d %v %s", resp.StatusCode, resp.Header, b)
			}
			if e := decodeError(t, jb); job.StatusCode != http.StatusServiceUnavailable || *e.Error.Code != "quota_unavailable" {
				t.Errorf("fail closed, job: %d %s", job.StatusCode, jb)
			}
		})
	}
}

// TestQuotaStreamUsage: a limited tenant's stream is reconciled with the
// usage kvgate asked the backend for, which the client, who did not ask,
// never sees.
func TestQuotaStreamUsage(t *testing.T) {
	st := sqliteStore(t)
	f := startFleet(t, fleetOpts{store: st, speedup: 50, gateway: Config{Tenants: Tenants{Store: st, Now: func() time.Time { return quotaT0 }}}})
	key := newTenant(t, st, "acme", store.Limits{TPM: 100000}, store.RoleUser)
	body := fmt.Sprintf(`{"model":%q,"messages":[{"role":"user","content":"hello"}],"max_tokens":5,"stream":true,"ignore_eos":true}`, llama)
	resp, b := send(t, f.srv.URL, http.MethodPost, "/v1/chat/completions", key, body)
	if resp.StatusCode != http.StatusOK || strings.Contains(string(b), `"usage"`) || !strings.Contains(string(b), "[DONE]") {
		t.Fatalf("stream: %d\n%s", resp.StatusCode, b)
	}
	u := settledUsage(t, st, "acme")
	if u.Requests != 1 || u.Attempts != 1 || u.CompletionTokens != 5 || u.PromptTokens == 0 || u.Uncertain != 0 {
		t.Errorf("ledger after a stream: %+v", u)
	}
}

// heldAcquisitions is a real store whose acquisitions can be held, or
// fail, as the test says: fail is read when an acquisition begins, and a
// held one then waits until the test lets it return.
type heldAcquisitions struct {
	store.Tenants
	fail    atomic.Bool
	hold    atomic.Bool
	entered chan struct{} // a held acquisition began
	release chan struct{} // lets a held acquisition return
	held    atomic.Int32  // acquisitions held now
	// acquired and recorded count the calls of Acquire and RecordUsage.
	acquired, recorded atomic.Int32
	// usageWhileHeld: the usage was read while an acquisition was held.
	usageWhileHeld atomic.Bool
}

func (h *heldAcquisitions) Usage(ctx context.Context, tenant string, from, to time.Time) ([]store.UsageDay, error) {
	if h.held.Load() > 0 {
		h.usageWhileHeld.Store(true)
	}
	return h.Tenants.Usage(ctx, tenant, from, to)
}

func (h *heldAcquisitions) RecordUsage(ctx context.Context, r store.Release) error {
	h.recorded.Add(1)
	if h.fail.Load() {
		return fmt.Errorf("record usage: %w: connection refused", store.ErrUnavailable)
	}
	return h.Tenants.RecordUsage(ctx, r)
}

func (h *heldAcquisitions) Acquire(ctx context.Context, a store.Acquisition) (store.Permit, error) {
	h.acquired.Add(1)
	fail := h.fail.Load()
	if h.hold.Load() {
		h.held.Add(1)
		h.entered <- struct{}{}
		<-h.release
		h.held.Add(-1)
	}
	if fail {
		return store.Permit{}, fmt.Errorf("acquire quota: %w: connection refused", store.ErrUnavailable)
	}
	return h.Tenants.Acquire(ctx, a)
}

// TestPermitsWrittenBehind: a tenant without limits is served while its
// permit commits, its usage is exact once this replica's writes settle,
// a write-behind acquisition that failed is tried again at the release,
// and after a failure the gateway acquires first (and fails closed) until
// an acquisition succeeds.
func TestPermitsWrittenBehind(t *testing.T) {
	st := sqliteStore(t)
	h := &heldAcquisitions{Tenants: st, entered: make(chan struct{}), release: make(chan struct{})}
	f := startFleet(t, fleetOpts{store: st, speedup: 50, gateway: Config{Tenants: Tenants{Store: h, Now: func() time.Time { return quotaT0 }}}})
	f.api.permitsBehind.delay = 0 // acquisitions begin at once: the test holds them
	key := newTenant(t, st, "free", store.Limits{}, store.RoleUser)
	ctx := context.Background()
	// ended waits for n requests' releases to be under way: a response
	// with a length reaches the client before its handler's end releases.
	ended := func(n int) {
		t.Helper()
		b := f.api.permitsBehind
		eventually.True(t, fmt.Sprint(n, " releases under way"), func() bool {
			b.mu.Lock()
			defer b.mu.Unlock()
			return len(b.releasing) == n
		})
	}
	ledger := func(want int64) {
		t.Helper()
		f.api.SettleUsage(ctx)
		us, err := st.Usage(ctx, "free", quotaT0, quotaT0)
		if err != nil || len(us) != 1 {
			t.Fatalf("usage: %v %v", us, err)
		}
		if u := us[0]; u.Requests != want || u.Attempts != want || u.CompletionTokens != 4*want || u.ReservedTokens != 0 || u.Uncertain != 0 {
			t.Errorf("ledger after %d requests: %+v", want, u)
		}
	}
	type answer struct {
		status int
		body   []byte
	}
	start := func() chan answer {
		done := make(chan answer, 1)
		go func() {
			resp, b := send(t, f.srv.URL, http.MethodPost, "/v1/chat/completions", key, chatReq(4))
			done <- answer{resp.StatusCode, b}
		}()
		return done
	}

	// served waits for an answer given while an acquisition is held; a
	// request that waited for it would never be answered.
	served := func(done chan answer, what string) {
		t.Helper()
		select {
		case a := <-done:
			if a.status != http.StatusOK {
				t.Fatalf("%s: %d %s", what, a.status, a.body)
			}
		case <-time.After(10 * time.Second):
			h.hold.Store(false)
			close(h.release)
			t.Fatalf("%s: not answered while its permit's acquisition was held", what)
		}
	}

	// Served while its acquisition is held: the request did not wait.
	h.hold.Store(true)
	done := start()
	<-h.entered
	served(done, "while its permit commits")
	ended(1)
	h.hold.Store(false)
	h.release <- struct{}{}
	ledger(1)

	// An acquisition that fails after the request went on is tried again
	// once the request has ended: the store answers again, and the
	// usage is recorded.
	h.fail.Store(true)
	h.hold.Store(true)
	done = start()
	<-h.entered
	h.fail.Store(false)
	h.hold.Store(false)
	served(done, "a request whose permit then fails")
	ended(1)
	h.release <- struct{}{}
	ledger(2)

	// The failure made the gateway acquire first: with the store down, a
	// request is refused (fail closed) instead of served unrecorded.
	h.fail.Store(true)
	if resp, b := send(t, f.srv.URL, http.MethodPost, "/v1/chat/completions", key, chatReq(4)); resp.StatusCode != http.StatusServiceUnavailable {
		t.Errorf("store down after a write-behind failure: %d %s", resp.StatusCode, b)
	}
	// Until an acquisition succeeds, each is waited for.
	h.fail.Store(false)
	h.hold.Store(true)
	done = start()
	<-h.entered
	select {
	case a := <-done:
		t.Errorf("answered (%d) before its acquisition returned, after a failure", a.status)
	default:
	}
	h.hold.Store(false)
	h.release <- struct{}{}
	if a := <-done; a.status != http.StatusOK {
		t.Fatalf("after the store came back: %d %s", a.status, a.body)
	}
	// And then written behind again.
	h.hold.Store(true)
	done = start()
	<-h.entered
	served(done, "written behind again")
	ended(1)
	// The usage endpoint waits for this replica's writes itself: the held
	// acquisition goes on once the endpoint's settle waits for it, and
	// the usage is not read before.
	operator := newKey(t, st, "free", store.RoleOperator)
	var let sync.Once
	letGo := func() {
		let.Do(func() {
			h.hold.Store(false)
			h.release <- struct{}{}
		})
	}
	pb := f.api.permitsBehind
	setSettling := func(f func()) {
		pb.mu.Lock()
		pb.settling = f
		pb.mu.Unlock()
	}
	setSettling(letGo)
	resp, b := send(t, f.srv.URL, http.MethodGet, "/v1/usage", operator, "")
	letGo() // if the endpoint did not settle
	setSettling(nil)
	if resp.StatusCode != http.StatusOK || !strings.Contains(string(b), `"requests":4`) || h.usageWhileHeld.Load() {
		t.Errorf("usage read while a permit was being written (%v): %d %s", h.usageWhileHeld.Load(), resp.StatusCode, b)
	}
	ledger(4)
}

// TestShortRequestsRecordedInOneWrite: a request without limits that ends
// before its permit's acquisition begins is recorded with one write and
// no permit; when that write fails, the next request waits for its
// acquisition (and is refused while the store is down).
func TestShortRequestsRecordedInOneWrite(t *testing.T) {
	st := sqliteStore(t)
	h := &heldAcquisitions{Tenants: st}
	f := startFleet(t, fleetOpts{store: st, speedup: 50, gateway: Config{Tenants: Tenants{Store: h, Now: func() time.Time { return quotaT0 }}}})
	f.api.permitsBehind.delay = time.Hour // every request ends first
	key := newTenant(t, st, "short", store.Limits{}, store.RoleUser)
	ctx := context.Background()
	for range 3 {
		if resp, b := send(t, f.srv.URL, http.MethodPost, "/v1/chat/completions", key, chatReq(4)); resp.StatusCode != http.StatusOK {
			t.Fatalf("%d %s", resp.StatusCode, b)
		}
	}
	eventually.True(t, "three usages recorded", func() bool {
		f.api.SettleUsage(ctx)
		us, _ := st.Usage(ctx, "short", quotaT0, quotaT0)
		return len(us) == 1 && us[0].Requests == 3
	})
	us, _ := st.Usage(ctx, "short", quotaT0, quotaT0)
	if u := us[0]; u.Attempts != 3 || u.CompletionTokens != 12 || u.PromptTokens == 0 || u.ReservedTokens != 0 || u.Uncertain != 0 {
		t.Errorf("ledger: %+v", u)
	}
	if a, r := h.acquired.Load(), h.recorded.Load(); a != 0 || r != 3 {
		t.Errorf("%d acquisitions and %d recorded usages for 3 short requests; want 0 and 3", a, r)
	}
	var permits int
	if err := st.DB().QueryRowContext(ctx, `SELECT count(*) FROM quota_permits`).Scan(&permits); err != nil || permits != 0 {
		t.Errorf("%d permits stored (%v)", permits, err)
	}

	h.fail.Store(true)
	before := testutil.ToFloat64(f.api.quota.failOpen)
	if resp, b := send(t, f.srv.URL, http.MethodPost, "/v1/chat/completions", key, chatReq(4)); resp.StatusCode != http.StatusOK {
		t.Fatalf("served before the failure is known: %d %s", resp.StatusCode, b)
	}
	eventually.True(t, "the failed record counted", func() bool { return testutil.ToFloat64(f.api.quota.failOpen) == before+1 })
	if resp, b := send(t, f.srv.URL, http.MethodPost, "/v1/chat/completions", key, chatReq(4)); resp.StatusCode != http.StatusServiceUnavailable {
		t.Errorf("store down after a failed record: %d %s", resp.StatusCode, b)
	}
}

// TestRetriedRequestChargesItsCutAttempt: a request whose first backend
// stalls past the timeout (it may have computed the answer) and whose
// retry on another backend answers is charged both: the answer's usage as
// reported, and the cut attempt's reservation as uncertain usage. Both
// ways a request's usage is written: a limited tenant's permit released,
// an unlimited tenant's usage recorded behind the request.
func TestRetriedRequestChargesItsCutAttempt(t *testing.T) {
	for _, tc := range []struct {
		name   string
		limits store.Limits
	}{{"permit", store.Limits{MaxConcurrency: 10}}, {"recorded", store.Limits{}}} {
		t.Run(tc.name, func(t *testing.T) {
			st := sqliteStore(t)
			clock := &testClock{now: quotaT0}
			var first atomic.Bool // the first inference request of either backend stalls
			stallFirst := func(_ int, h http.Handler) http.Handler {
				return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
					if r.Method == http.MethodPost && strings.HasSuffix(r.URL.Path, "/completions") && first.CompareAndSwap(false, true) {
						_, _ = io.Copy(io.Discard, r.Body) // read whole, as vLLM does: the server then sees the client go
						<-r.Context().Done()
						return
					}
					h.ServeHTTP(w, r)
				})
			}
			f := startFleet(t, fleetOpts{store: st, backends: 2, wrap: stallFirst,
				gateway: Config{RequestTimeout: 200 * time.Millisecond, Tenants: Tenants{Store: st, Now: clock.Now}}})
			key := newTenant(t, st, "retried", tc.limits, store.RoleUser)
			resp, b := f.post(t, "/v1/completions", `{"model":"`+llama+`","prompt":"hello","max_tokens":5,"ignore_eos":true}`,
				"Authorization", "Bearer "+key)
			if resp.StatusCode != http.StatusOK {
				t.Fatalf("request: %d %s", resp.StatusCode, b)
			}
			got := decode[struct{ Usage usage }](t, b).Usage
			u := settledUsage(t, st, "retried")
			// The cut attempt's reservation: the prompt as kvgate counted it
			// before sending, and the 5 tokens asked for.
			if u.Requests != 1 || u.Attempts != 2 || u.PromptTokens != int64(got.PromptTokens) || u.CompletionTokens != 5 ||
				u.Uncertain != 1 || u.UncertainTokens <= 5 {
				t.Errorf("ledger %+v; want 1 request of 2 attempts, the answer's %d+5 tokens reported and the cut attempt's reservation uncertain",
					u, got.PromptTokens)
			}
		})
	}
}

// TestStreamUsageAsVLLMDefaultsIt: a stream's stream_options without
// include_usage asks for usage (vLLM's default), so the client gets its
// usage chunk even where kvgate asks for usage itself to settle a permit;
// include_usage false, or null (vLLM's None), still gets none, and the
// permit is settled by the usage kvgate asked for.
func TestStreamUsageAsVLLMDefaultsIt(t *testing.T) {
	st := sqliteStore(t)
	var mu sync.Mutex
	var sent []byte // the last chat body the backend got
	f := startFleet(t, fleetOpts{store: st, gateway: Config{Tenants: Tenants{Store: st}},
		wrap: func(_ int, h http.Handler) http.Handler {
			return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if strings.HasSuffix(r.URL.Path, "/chat/completions") {
					b, _ := io.ReadAll(r.Body)
					mu.Lock()
					sent = b
					mu.Unlock()
					r.Body = io.NopCloser(bytes.NewReader(b))
				}
				h.ServeHTTP(w, r)
			})
		}})
	key := newTenant(t, st, "streamer", store.Limits{MaxConcurrency: 10}, store.RoleUser)
	for opts, want := range map[string]bool{`{}`: true, `{"continuous_usage_stats":false}`: true, `{"include_usage":false}`: false, `{"include_usage":null}`: false} {
		resp, b := f.post(t, "/v1/chat/completions", `{"model":"`+llama+`","messages":[{"role":"user","content":"hi"}],"max_tokens":3,"stream":true,"stream_options":`+opts+`}`,
			"Authorization", "Bearer "+key)
		got := strings.Contains(string(b), `"choices":[],`) && strings.Contains(string(b), `"usage":{`)
		if resp.StatusCode != http.StatusOK || got != want {
			t.Errorf("stream_options %s: %d, usage chunk %v, want %v: %s", opts, resp.StatusCode, got, want, b)
		}
		// The permit is settled by the backend's usage: the backend was
		// asked for it, by the client or by kvgate.
		var body struct {
			StreamOptions map[string]any `json:"stream_options"`
		}
		mu.Lock()
		err := json.Unmarshal(sent, &body)
		mu.Unlock()
		if v, ok := body.StreamOptions["include_usage"]; err != nil || body.StreamOptions == nil || (ok && v != true) {
			t.Errorf("stream_options %s: the backend got stream_options %v (%v), which asks for no usage", opts, body.StreamOptions, err)
		}
	}
}

// TestStreamEndingInABackendError: vLLM ends a stream whose request its
// engine failed with an error event and then [DONE]. The client gets the
// error event; the attempt is a failure, not a success charged its whole
// reservation as reported usage: what it used is unknown, so uncertain.
func TestStreamEndingInABackendError(t *testing.T) {
	st := sqliteStore(t)
	clock := &testClock{now: quotaT0}
	f := startFleet(t, fleetOpts{store: st, gateway: Config{Tenants: Tenants{Store: st, Now: clock.Now}},
		wrap: scriptedChatStream(`data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"`+llama+
			`","choices":[{"index":0,"delta":{"content":"Hel"},"finish_reason":null}]}`+"\n\n"+
			`data: {"error":{"message":"engine failed","type":"InternalServerError","param":null,"code":500}}`+"\n\n"+
			"data: [DONE]\n\n", nil)})
	key := newTenant(t, st, "errs", store.Limits{MaxConcurrency: 10}, store.RoleUser)
	resp, b := f.post(t, "/v1/chat/completions", `{"model":"`+llama+`","messages":[{"role":"user","content":"hi"}],"max_tokens":20,"stream":true}`,
		"Authorization", "Bearer "+key)
	if resp.StatusCode != http.StatusOK || !strings.Contains(string(b), `"engine failed"`) {
		t.Fatalf("stream: %d %s", resp.StatusCode, b)
	}
	u := settledUsage(t, st, "errs")
	if u.Uncertain != 1 || u.CompletionTokens != 0 || u.PromptTokens != 0 {
		t.Errorf("ledger %+v: want the request uncertain, nothing reported", u)
	}
}

// TestStreamCutAfterItsUsage: a stream whose backend reported its usage
// (the last chunk before [DONE]) and then dropped the connection is
// charged that usage, not its whole reservation as uncertain.
func TestStreamCutAfterItsUsage(t *testing.T) {
	st := sqliteStore(t)
	clock := &testClock{now: quotaT0}
	f := startFleet(t, fleetOpts{store: st, gateway: Config{Tenants: Tenants{Store: st, Now: clock.Now}},
		wrap: scriptedChatStream(`data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"`+llama+
			`","choices":[{"index":0,"delta":{"content":"Hello"},"finish_reason":"stop"}]}`+"\n\n"+
			`data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"`+llama+
			`","choices":[],"usage":{"prompt_tokens":7,"completion_tokens":2,"total_tokens":9}}`+"\n\n",
			func(*http.Request) { panic(http.ErrAbortHandler) })}) // the connection drops before [DONE]
	key := newTenant(t, st, "cut-late", store.Limits{MaxConcurrency: 10}, store.RoleUser)
	resp, b := f.post(t, "/v1/chat/completions", `{"model":"`+llama+`","messages":[{"role":"user","content":"hi"}],"max_tokens":20,"stream":true}`,
		"Authorization", "Bearer "+key)
	if resp.StatusCode != http.StatusOK || !strings.Contains(string(b), `"Hello"`) || !strings.Contains(string(b), `"error"`) {
		t.Fatalf("stream: %d %s", resp.StatusCode, b)
	}
	u := settledUsage(t, st, "cut-late")
	if u.PromptTokens != 7 || u.CompletionTokens != 2 || u.Uncertain != 0 {
		t.Errorf("ledger %+v: want the reported 7+2 tokens, nothing uncertain", u)
	}
}

// settledUsage waits for tenant's one ledger day of quotaT0 to hold no
// reservation (every request released) and returns it.
func settledUsage(t *testing.T, st store.Tenants, tenant string) store.UsageDay {
	t.Helper()
	var u store.UsageDay
	eventually.True(t, tenant+"'s requests settled in the ledger", func() bool {
		us, _ := st.Usage(context.Background(), tenant, quotaT0, quotaT0)
		if len(us) == 1 {
			u = us[0]
		}
		return len(us) == 1 && u.ReservedTokens == 0
	})
	return u
}

// TestAnswerOverTheLimit: a backend's answer to a request that is not
// streamed, over gateway.max_answer_bytes, is a 502 answer_too_large that
// the SDKs are told not to retry; kvgate does not ask another backend
// (it would answer the same), and the usage, unread, is charged as
// uncertain. A stream of the same answer passes.
func TestAnswerOverTheLimit(t *testing.T) {
	st := sqliteStore(t)
	var calls atomic.Int64
	clock := &testClock{now: quotaT0}
	f := startFleet(t, fleetOpts{store: st, backends: 2, gateway: Config{MaxAnswerBytes: 300, Tenants: Tenants{Store: st, Now: clock.Now}},
		wrap: countChats(&calls)})
	key := newTenant(t, st, "big", store.Limits{MaxConcurrency: 10}, store.RoleUser)
	req := `{"model":"` + llama + `","messages":[{"role":"user","content":"hi"}],"max_tokens":200,"ignore_eos":true`
	resp, b := f.post(t, "/v1/chat/completions", req+`}`, "Authorization", "Bearer "+key)
	if resp.StatusCode != http.StatusBadGateway || !strings.Contains(string(b), `"code":"answer_too_large"`) ||
		resp.Header.Get("x-should-retry") != "false" {
		t.Fatalf("an answer over the limit: %d, x-should-retry %q: %s", resp.StatusCode, resp.Header.Get("x-should-retry"), b)
	}
	if n := calls.Load(); n != 1 {
		t.Errorf("the backends were asked %d times, want once", n)
	}
	if u := settledUsage(t, st, "big"); u.Uncertain != 1 {
		t.Errorf("ledger %+v: want the request uncertain", u)
	}
	resp, b = f.post(t, "/v1/chat/completions", req+`,"stream":true}`, "Authorization", "Bearer "+key)
	if resp.StatusCode != http.StatusOK || !strings.Contains(string(b), "[DONE]") {
		t.Errorf("the same answer streamed: %d %s", resp.StatusCode, tail(b))
	}
}

// countChats stands before a backend and counts the chat requests it gets.
func countChats(calls *atomic.Int64) func(int, http.Handler) http.Handler {
	return func(_ int, h http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if strings.HasSuffix(r.URL.Path, "/chat/completions") {
				calls.Add(1)
			}
			h.ServeHTTP(w, r)
		})
	}
}
