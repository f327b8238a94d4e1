package gateway

import (
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvgate/kvgate/bench/eventually"
	"github.com/kvgate/kvgate/bench/vllmsim"
	"github.com/kvgate/kvgate/gateway/webhook"
	"github.com/kvgate/kvgate/store"
	"github.com/kvgate/kvgate/store/postgres/pgtest"
)

// loopbackGuard lets deliveries reach loopback receivers over plain http:
// the tests' only destinations.
func loopbackGuard() *webhook.Guard {
	return &webhook.Guard{AllowCIDRs: []netip.Prefix{netip.MustParsePrefix("127.0.0.0/8")}, AllowHTTP: true}
}

// receiver is a loopback webhook receiver that verifies every request by
// the Standard Webhooks rules (HMAC-SHA256 of "id.timestamp.body" under
// the base64-decoded whsec_ key, one v1 signature per active secret) and
// records what it accepted.
type receiver struct {
	srv     *httptest.Server
	mu      sync.Mutex
	secrets [][]byte
	down    atomic.Bool  // answer 503 without recording
	status  atomic.Int32 // when set, answer it (a 410, a 401)
	got     []received
	bad     []string // requests that failed verification
	hits    atomic.Int64
	active  atomic.Int64     // requests being answered now
	now     func() time.Time // the receiver's clock, for the timestamp tolerance
}

type received struct {
	ID    string
	Type  string
	JobID string
	State string
	Body  []byte
}

func newReceiver(t *testing.T) *receiver {
	rc := &receiver{now: time.Now}
	rc.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		rc.hits.Add(1)
		rc.active.Add(1)
		defer rc.active.Add(-1)
		body, _ := io.ReadAll(r.Body)
		if rc.down.Load() {
			w.WriteHeader(http.StatusServiceUnavailable)
			return
		}
		if s := rc.status.Load(); s != 0 {
			w.WriteHeader(int(s))
			return
		}
		id, ts, sigs := r.Header.Get("webhook-id"), r.Header.Get("webhook-timestamp"), r.Header.Get("webhook-signature")
		rc.mu.Lock()
		defer rc.mu.Unlock()
		if why := verifyStandard(rc.now(), rc.secrets, id, ts, sigs, body); why != "" {
			rc.bad = append(rc.bad, why)
			w.WriteHeader(http.StatusUnauthorized)
			return
		}
		var p struct {
			Type string `json:"type"`
			Data struct {
				JobID string `json:"job_id"`
				State string `json:"state"`
			} `json:"data"`
		}
		if err := json.Unmarshal(body, &p); err != nil {
			rc.bad = append(rc.bad, "body: "+err.Error())
			w.WriteHeader(http.StatusBadRequest)
			return
		}
		rc.got = append(rc.got, received{ID: id, Type: p.Type, JobID: p.Data.JobID, State: p.Data.State, Body: body})
		w.WriteHeader(http.StatusNoContent)
	}))
	t.Cleanup(rc.srv.Close)
	return rc
}

// verifyStandard checks one request as the spec says; "" when it passes.
func verifyStandard(now time.Time, keys [][]byte, id, ts, header string, body []byte) string {
	sec, err := strconv.ParseInt(ts, 10, 64)
	if err != nil || id == "" {
		return "no webhook-id or webhook-timestamp"
	}
	if d := now.Sub(time.Unix(sec, 0)); d > 5*time.Minute || d < -5*time.Minute {
		return "timestamp outside the tolerance"
	}
	for _, key := range keys {
		mac := hmac.New(sha256.New, key)
		fmt.Fprintf(mac, "%s.%s.", id, ts)
		mac.Write(body)
		want := "v1," + base64.StdEncoding.EncodeToString(mac.Sum(nil))
		if !slices.Contains(strings.Fields(header), want) {
			return "no signature of a known key in " + header
		}
	}
	return ""
}

func (rc *receiver) trust(secret string) {
	key, err := base64.StdEncoding.DecodeString(strings.TrimPrefix(secret, "whsec_"))
	if err != nil {
		panic(err)
	}
	rc.mu.Lock()
	rc.secrets = append(rc.secrets, key)
	rc.mu.Unlock()
}

func (rc *receiver) failures() []string {
	rc.mu.Lock()
	defer rc.mu.Unlock()
	return slices.Clone(rc.bad)
}

func (rc *receiver) received() []received {
	rc.mu.Lock()
	defer rc.mu.Unlock()
	return slices.Clone(rc.got)
}

// webhookFleet is a fleet with durable jobs, a runner, the webhook API and
// a dispatcher on a scaled retry schedule.
func webhookFleet(t *testing.T, o fleetOpts, scale time.Duration, mods ...func(*DispatcherConfig)) (*fleet, *Dispatcher, *prometheus.Registry) {
	t.Helper()
	o.jobs, o.runner = true, true
	var disp *Dispatcher
	o.gateway.Webhooks = Webhooks{Guard: loopbackGuard(), Wake: func() {
		if disp != nil {
			disp.Wake()
		}
	}}
	switch {
	case o.store != nil:
	case o.pg:
		o.store = pgtest.Open(t)
	default:
		o.store = sqliteStore(t)
	}
	o.gateway.Webhooks.Store = o.store
	f := startFleet(t, o)
	sched := make([]time.Duration, len(DefaultRetrySchedule))
	for i, d := range DefaultRetrySchedule {
		sched[i] = d / scale
	}
	reg := prometheus.NewRegistry()
	var err error
	dc := DispatcherConfig{Store: f.store, Guard: loopbackGuard(), Schedule: sched, Timeout: 5 * time.Second,
		Concurrency: 32, Poll: 5 * time.Millisecond, BreakerOpen: 30 * time.Second / scale, Registerer: reg}
	for _, m := range mods {
		m(&dc)
	}
	disp, err = NewDispatcher(dc)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); disp.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	return f, disp, reg
}

type endpointCreated struct {
	ID     string `json:"id"`
	Secret string `json:"secret"`
}

func createEndpoint(t *testing.T, f *fleet, url string, events ...string) endpointCreated {
	t.Helper()
	evs, _ := json.Marshal(events)
	resp, b := f.post(t, "/v1/webhooks/endpoints", fmt.Sprintf(`{"url":%q,"events":%s}`, url, evs))
	if resp.StatusCode != http.StatusCreated {
		t.Fatalf("create endpoint: %d %s", resp.StatusCode, b)
	}
	e := decode[endpointCreated](t, b)
	if !strings.HasPrefix(e.Secret, "whsec_") {
		t.Fatalf("secret %q", e.Secret)
	}
	return e
}

// simClock is the dispatcher's clock in the outage test: real time plus
// an offset the test advances, so that the retry schedule runs in
// simulated hours however fast the machine is.
type simClock struct{ offset atomic.Int64 }

func (c *simClock) Now() time.Time { return time.Now().Add(time.Duration(c.offset.Load())) }

// advance moves the clock on by d in steps, waiting at each until the
// dispatcher has sent everything due, or until done holds.
func (c *simClock) advance(t *testing.T, f *fleet, disp *Dispatcher, rc *receiver, d, step time.Duration, done func() bool) {
	t.Helper()
	for moved := time.Duration(0); ; moved += step {
		// Quiet first: nothing in flight may see the clock jump, at
		// either end (an attempt that timed out at kvgate may still be
		// in the receiver's hands, to be verified against its clock).
		// The dispatcher is read before and after the count of due
		// deliveries: a claim made while the count ran has moved its
		// deliveries' due_at to their lease's end, so the count misses
		// them, and only the second read sees the send it started.
		eventually.True(t, "the deliveries due to be sent", func() bool {
			busy := func() bool {
				disp.mu.Lock()
				defer disp.mu.Unlock()
				return disp.inflight > 0 || rc.active.Load() > 0
			}
			if busy() {
				return false
			}
			var n int
			err := f.store.DB().QueryRowContext(context.Background(), fmt.Sprintf(`SELECT COUNT(*) FROM webhook_deliveries
				WHERE state IN ('PENDING', 'RETRY_SCHEDULED', 'SENDING') AND due_at <= %d`, c.Now().UnixMicro())).Scan(&n)
			return err == nil && n == 0 && !busy()
		})
		if moved >= d || done() {
			return
		}
		c.offset.Add(int64(step))
		disp.Wake()
	}
}

// TestWebhookOutage: the receiver is down (503) for two simulated hours
// while jobs complete. Afterwards every job's event has been delivered and
// verified, a job's event only ever came under one webhook-id, and the
// backends ran each job once: delivery ran no inference.
func TestWebhookOutage(t *testing.T) {
	t.Run("sqlite", func(t *testing.T) { testWebhookOutage(t, false) })
	t.Run("postgres", func(t *testing.T) { testWebhookOutage(t, true) })
}

func testWebhookOutage(t *testing.T, pg bool) {
	n := 120
	if os.Getenv("KVGATE_EXPERIMENTS") == "1" {
		n = 10000
	}
	clock := &simClock{}
	// A slower poll than the other tests' 5 ms: the clock's steps wake the
	// dispatcher themselves, and advance waits for it to be idle (no claim
	// open, no send unrecorded), which a poll shorter than a claim on a
	// loaded machine never lets happen (the ticker's next tick is always
	// pending when a claim ends).
	f, disp, reg := webhookFleet(t, fleetOpts{speedup: 200, backends: 2, pg: pg}, 1, func(c *DispatcherConfig) {
		c.Now, c.Poll = clock.Now, 100*time.Millisecond
	})
	rc := newReceiver(t)
	rc.now = clock.Now
	e := createEndpoint(t, f, rc.srv.URL+"/hook", "job.succeeded", "job.failed")
	rc.trust(e.Secret)
	rc.down.Store(true)
	ids := make([]string, n)
	for i := range n {
		resp, v := submitJob(t, f, fmt.Sprintf("outage-%d", i), chatJob(fmt.Sprintf("job %d", i), 2))
		if resp.StatusCode != http.StatusAccepted {
			t.Fatalf("submit %d: %d", i, resp.StatusCode)
		}
		ids[i] = v.ID
	}
	eventually.Within(t, eventually.Timeout+time.Duration(n)*10*time.Millisecond, "every job to end", func() bool {
		for _, id := range ids {
			if j, err := f.store.Get(context.Background(), "default", id); err != nil || j.State != store.Succeeded {
				return false
			}
		}
		return true
	})
	never := func() bool { return false }
	clock.advance(t, f, disp, rc, 2*time.Hour, 5*time.Minute, never)
	if counterValue(t, reg, "kvgate_webhook_deliveries_total", "retry") == 0 || len(rc.received()) != 0 {
		t.Errorf("the outage: %v attempts retried, %d accepted", counterValue(t, reg, "kvgate_webhook_deliveries_total", "retry"), len(rc.received()))
	}
	rc.down.Store(false)
	// A delivery made as the outage began is next tried 2 h 35 min in.
	clock.advance(t, f, disp, rc, 24*time.Hour, 5*time.Minute, func() bool {
		n, err := f.store.PendingDeliveries(context.Background())
		return err == nil && n == 0
	})
	byJob := map[string]map[string]bool{}
	for _, r := range rc.received() {
		if r.Type != "job.succeeded" || r.State != string(store.Succeeded) {
			t.Errorf("received %s", r.Body)
		}
		if byJob[r.JobID] == nil {
			byJob[r.JobID] = map[string]bool{}
		}
		byJob[r.JobID][r.ID] = true
	}
	for _, id := range ids {
		if len(byJob[id]) != 1 {
			t.Errorf("job %s's event came under %d webhook-ids", id, len(byJob[id]))
		}
	}
	if bad := rc.failures(); len(bad) > 0 {
		t.Errorf("%d requests failed verification, first: %s", len(bad), bad[0])
	}
	failed, _, _ := f.store.Deliveries(context.Background(), store.DeliveryFilter{State: store.DeliveryFailed})
	if len(failed) != 0 {
		t.Errorf("%d deliveries FAILED", len(failed))
	}
	if calls := backendCalls(t, f); int(calls) != n {
		t.Errorf("the backends served %v requests for %d jobs", calls, n)
	}
	t.Logf("%d jobs: %d requests reached the receiver, %d accepted", n, rc.hits.Load(), len(rc.received()))
	// Delivery is at least once: a duplicate (same webhook-id, checked
	// above) is allowed, a missing one is not.
	got := counterValue(t, reg, "kvgate_webhook_deliveries_total", "delivered")
	if int(got) < n || len(rc.received()) < n {
		t.Errorf("kvgate_webhook_deliveries_total{outcome=delivered} = %v and %d accepted, want at least %d", got, len(rc.received()), n)
	}
	if int(got) > n {
		t.Logf("%d events delivered twice, under their one webhook-id", int(got)-n)
	}
}

// counterValue reads a counter's series of the given outcome label.
func counterValue(t *testing.T, reg *prometheus.Registry, name, outcome string) float64 {
	t.Helper()
	fams, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	sum := 0.0
	for _, fam := range fams {
		if fam.GetName() != name {
			continue
		}
		for _, m := range fam.GetMetric() {
			match := outcome == ""
			for _, l := range m.GetLabel() {
				match = match || (l.GetName() == "outcome" && l.GetValue() == outcome)
			}
			if match {
				sum += m.GetCounter().GetValue()
			}
		}
	}
	return sum
}

// TestWebhookOutcomes: what each answer does to a delivery and its
// endpoint, seen through the API: 2xx delivered, 401 retried and counted,
// the schedule spent FAILED among the dead letters, redelivered (audited)
// under the same id, 410 disabling the endpoint; a rotation signs with
// both secrets; the result inline on request; webhook.test.
// flakyFinish fails the first fails records of attempts, as a busy SQLite
// or a failing-over PostgreSQL would.
type flakyFinish struct {
	store.Store
	fails atomic.Int32
}

func (s *flakyFinish) FinishDeliveries(ctx context.Context, rs []store.DeliveryResult) ([]error, error) {
	if s.fails.Add(-1) >= 0 {
		return nil, fmt.Errorf("finish deliveries: %w", store.ErrUnavailable)
	}
	return s.Store.FinishDeliveries(ctx, rs)
}

// TestWebhookRecordTriedAgain: an attempt's record that the store refuses
// twice is tried again at once, not left SENDING for its lease (70 s here,
// past the wait) to run out and the event to be sent again.
func TestWebhookRecordTriedAgain(t *testing.T) {
	var flaky *flakyFinish
	f, _, _ := webhookFleet(t, fleetOpts{speedup: 200}, 1, func(c *DispatcherConfig) {
		flaky = &flakyFinish{Store: c.Store}
		flaky.fails.Store(2)
		c.Store, c.Timeout = flaky, 30*time.Second
	})
	rc := newReceiver(t)
	e := createEndpoint(t, f, rc.srv.URL+"/hook", "job.succeeded")
	rc.trust(e.Secret)
	resp, v := submitJob(t, f, "flaky-record", chatJob("recorded late", 2))
	if resp.StatusCode != http.StatusAccepted {
		t.Fatalf("submit: %d", resp.StatusCode)
	}
	waitJob(t, f, "default", v.ID, store.Succeeded)
	eventually.True(t, "the delivery recorded", func() bool {
		n, err := f.store.PendingDeliveries(context.Background())
		return err == nil && n == 0
	})
	if flaky.fails.Load() >= 0 {
		t.Errorf("the store's refusals were not met (%d left)", flaky.fails.Load()+1)
	}
	if got := rc.received(); len(got) != 1 {
		t.Errorf("the receiver got %d requests, want the event once", len(got))
	}
}

// hungFinish's first record of attempts never answers (a connection a
// crashed database host left half open) until its caller gives up.
type hungFinish struct {
	store.Store
	hung atomic.Bool
}

func (s *hungFinish) FinishDeliveries(ctx context.Context, rs []store.DeliveryResult) ([]error, error) {
	if s.hung.CompareAndSwap(false, true) {
		<-ctx.Done()
		return nil, ctx.Err()
	}
	return s.Store.FinishDeliveries(ctx, rs)
}

// TestWebhookRecordOutlastsAHungCall: a record of attempts hung on its
// connection is given up after a third of the deliveries' lease and tried
// again; it held every send slot's record, and the shutdown, until the
// kernel dropped the connection.
func TestWebhookRecordOutlastsAHungCall(t *testing.T) {
	var hung *hungFinish
	f, _, _ := webhookFleet(t, fleetOpts{speedup: 200}, 1, func(c *DispatcherConfig) {
		hung = &hungFinish{Store: c.Store}
		c.Store, c.Timeout = hung, 500*time.Millisecond // a lease of 11 s: a try of 3.7 s
	})
	rc := newReceiver(t)
	e := createEndpoint(t, f, rc.srv.URL+"/hook", "job.succeeded")
	rc.trust(e.Secret)
	resp, v := submitJob(t, f, "hung-record", chatJob("recorded late", 2))
	if resp.StatusCode != http.StatusAccepted {
		t.Fatalf("submit: %d", resp.StatusCode)
	}
	waitJob(t, f, "default", v.ID, store.Succeeded)
	eventually.Within(t, 8*time.Second, "the delivery recorded", func() bool {
		n, err := f.store.PendingDeliveries(context.Background())
		return err == nil && n == 0
	})
	if !hung.hung.Load() || len(rc.received()) != 1 {
		t.Errorf("hung %v, the receiver got %d requests; want the record hung once and the event sent once", hung.hung.Load(), len(rc.received()))
	}
}

// TestWebhookWithholdsAReviewedAnswer: a job whose answer its policy sent
// to review has it withheld from its tenant; its job.review_required
// delivery carries no result, nor a result_url that would answer 409,
// even to an endpoint that asks for results inline.
func TestWebhookWithholdsAReviewedAnswer(t *testing.T) {
	f, _, _ := webhookFleet(t, fleetOpts{speedup: 200}, 1)
	rc := newReceiver(t)
	resp, b := f.post(t, "/v1/webhooks/endpoints", fmt.Sprintf(`{"url":%q,"events":["job.review_required"],"include_result":true}`, rc.srv.URL+"/hook"))
	if resp.StatusCode != http.StatusCreated {
		t.Fatalf("create endpoint: %d %s", resp.StatusCode, b)
	}
	rc.trust(decode[endpointCreated](t, b).Secret)
	if resp, b := f.post(t, "/v1/validation-policies", `{"name":"eur","rules":[{"rule":"json"},{"rule":"schema"},{"rule":"enum","pointer":"/currency","values":["EUR"]}]}`); resp.StatusCode != http.StatusCreated {
		t.Fatalf("policy: %d %s", resp.StatusCode, b)
	}
	f.sims[0].SetFaults(vllmsim.Faults{InvalidJSONRate: 1})
	resp, v := submitJob(t, f, "withheld", schemaJob("invoice: total 30 EUR", "eur"))
	if resp.StatusCode != http.StatusAccepted {
		t.Fatalf("submit: %d", resp.StatusCode)
	}
	waitJob(t, f, "default", v.ID, store.ReviewRequired)
	eventually.True(t, "the review_required delivery", func() bool { return len(rc.received()) == 1 })
	got := rc.received()[0]
	if body := string(got.Body); strings.Contains(body, `"result"`) || strings.Contains(body, `"result_url"`) || got.State != "REVIEW_REQUIRED" {
		t.Errorf("the review_required delivery: %s; want no result and no result_url", body)
	}
}

func TestWebhookOutcomes(t *testing.T) {
	f, _, reg := webhookFleet(t, fleetOpts{speedup: 200}, 1, func(c *DispatcherConfig) {
		c.Schedule = []time.Duration{0, time.Millisecond, time.Millisecond}
		c.BreakerFailures, c.BreakerOpen = 100, time.Millisecond
	})
	ctx := context.Background()
	rc := newReceiver(t)
	e := createEndpoint(t, f, rc.srv.URL+"/hook", "job.succeeded")
	rc.trust(e.Secret)
	getJSON := func(path string, v any) {
		t.Helper()
		status, b := f.get(t, path)
		if status != http.StatusOK {
			t.Fatalf("GET %s: %d %s", path, status, b)
		}
		if err := json.Unmarshal(b, v); err != nil {
			t.Fatal(err)
		}
	}
	deliveryOf := func(jobID string) deliveryView {
		t.Helper()
		var p struct{ Data []deliveryView }
		getJSON("/v1/webhooks/endpoints/"+e.ID+"/deliveries", &p)
		for _, d := range p.Data {
			if d.JobID == jobID {
				var one deliveryView
				getJSON("/v1/webhooks/deliveries/"+d.ID, &one)
				return one
			}
		}
		return deliveryView{}
	}
	runJob := func(key string) string {
		t.Helper()
		resp, v := submitJob(t, f, key, chatJob(key, 2))
		if resp.StatusCode != http.StatusAccepted {
			t.Fatalf("submit: %d", resp.StatusCode)
		}
		waitJob(t, f, "default", v.ID, store.Succeeded)
		return v.ID
	}

	// Delivered, signed.
	j1 := runJob("ok")
	eventually.True(t, "the first delivery", func() bool { return deliveryOf(j1).State == store.DeliveryDelivered })
	if d := deliveryOf(j1); len(d.Attempts) != 1 || d.Attempts[0].Status != http.StatusNoContent {
		t.Errorf("delivered: %+v", d)
	}

	// 401 three times: the schedule is spent, FAILED, a dead letter.
	rc.status.Store(http.StatusUnauthorized)
	j2 := runJob("unauthorized")
	eventually.True(t, "the schedule to be spent", func() bool { return deliveryOf(j2).State == store.DeliveryFailed })
	d2 := deliveryOf(j2)
	if len(d2.Attempts) != 3 || d2.LastStatus != http.StatusUnauthorized {
		t.Errorf("failed delivery: %+v", d2)
	}
	if got := counterValue(t, reg, "kvgate_webhook_auth_failures_total", ""); got != 3 {
		t.Errorf("kvgate_webhook_auth_failures_total = %v, want 3", got)
	}
	var dead struct{ Data []deliveryView }
	getJSON("/v1/dead-letters?kind=webhook_delivery", &dead)
	if len(dead.Data) != 1 || dead.Data[0].ID != d2.ID {
		t.Errorf("dead letters: %+v", dead.Data)
	}
	// Redelivered under the same id once the receiver knows us again.
	rc.status.Store(0)
	resp, b := f.post(t, "/v1/webhooks/deliveries/"+d2.ID+"/redeliver", "")
	if resp.StatusCode != http.StatusAccepted {
		t.Fatalf("redeliver: %d %s", resp.StatusCode, b)
	}
	eventually.True(t, "the redelivery", func() bool { return deliveryOf(j2).State == store.DeliveryDelivered })
	var ids []string
	for _, r := range rc.received() {
		if r.JobID == j2 {
			ids = append(ids, r.ID)
		}
	}
	if len(ids) != 1 || ids[0] != d2.ID {
		t.Errorf("the redelivery came as %v, want one under %s", ids, d2.ID)
	}
	if resp, b := f.post(t, "/v1/webhooks/deliveries/"+d2.ID+"/redeliver", ""); resp.StatusCode != http.StatusAccepted {
		t.Errorf("redeliver a delivered one: %d %s", resp.StatusCode, b)
	}
	eventually.True(t, "the second redelivery", func() bool {
		d := deliveryOf(j2)
		return d.State == store.DeliveryDelivered && d.AttemptCount == 5
	})
	var audited int
	if err := f.store.DB().QueryRowContext(ctx, `SELECT COUNT(*) FROM webhook_audit WHERE delivery_id = ? AND action = ?`,
		d2.ID, store.AuditRedeliver).Scan(&audited); err != nil || audited != 2 {
		t.Errorf("audit records of the redeliveries: %d, %v", audited, err)
	}

	// Rotation: both secrets sign, a receiver knowing either verifies.
	resp, b = f.post(t, "/v1/webhooks/endpoints/"+e.ID+"/rotate-secret", "")
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("rotate: %d %s", resp.StatusCode, b)
	}
	rot := decode[endpointView](t, b)
	if rot.Secret == e.Secret || rot.PreviousSecretExpiresAt == 0 {
		t.Fatalf("rotation: %+v", rot)
	}
	rc.trust(rot.Secret) // verifyStandard requires a signature of every trusted key
	j3 := runJob("rotated")
	eventually.True(t, "the delivery after the rotation", func() bool { return deliveryOf(j3).State == store.DeliveryDelivered })
	if bad := rc.failures(); len(bad) > 0 {
		t.Errorf("verification failures: %v", bad)
	}

	// The result inline, on request.
	resp, b = doRequest(t, f, http.MethodPatch, "/v1/webhooks/endpoints/"+e.ID, `{"include_result":true}`)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("patch: %d %s", resp.StatusCode, b)
	}
	j4 := runJob("inline")
	eventually.True(t, "the inline delivery", func() bool { return deliveryOf(j4).State == store.DeliveryDelivered })
	for _, r := range rc.received() {
		if r.JobID == j4 && !strings.Contains(string(r.Body), `"result":{`) {
			t.Errorf("no inline result: %s", r.Body)
		}
		if r.JobID == j1 && strings.Contains(string(r.Body), `"result":`) {
			t.Errorf("an inline result without the option: %s", r.Body)
		}
	}

	// webhook.test.
	resp, b = f.post(t, "/v1/webhooks/endpoints/"+e.ID+"/test", "")
	if resp.StatusCode != http.StatusAccepted {
		t.Fatalf("test: %d %s", resp.StatusCode, b)
	}
	test := decode[deliveryView](t, b)
	eventually.True(t, "the test delivery", func() bool {
		var d deliveryView
		getJSON("/v1/webhooks/deliveries/"+test.ID, &d)
		return d.State == store.DeliveryDelivered
	})

	// 410: the endpoint is disabled; its later events' deliveries wait
	// for it to be enabled again, neither sent nor failed.
	rc.status.Store(http.StatusGone)
	j5 := runJob("gone")
	eventually.True(t, "the 410", func() bool { return deliveryOf(j5).State == store.DeliveryFailed })
	var ep endpointView
	getJSON("/v1/webhooks/endpoints/"+e.ID, &ep)
	if !ep.Disabled || !strings.Contains(ep.DisabledReason, "410") {
		t.Errorf("endpoint after a 410: %+v", ep)
	}
	j6 := runJob("after-gone")
	if resp, b := f.post(t, "/v1/webhooks/endpoints/"+e.ID+"/test", ""); resp.StatusCode != http.StatusConflict {
		t.Errorf("test of a disabled endpoint: %d %s", resp.StatusCode, b)
	}
	if d := deliveryOf(j6); d.State != store.DeliveryPending || d.AttemptCount != 0 {
		t.Errorf("a disabled endpoint's delivery: %+v, want it pending, never tried", d)
	}
	rc.status.Store(http.StatusOK)
	if resp, b := doRequest(t, f, http.MethodPatch, "/v1/webhooks/endpoints/"+e.ID, `{"disabled":false}`); resp.StatusCode != http.StatusOK {
		t.Fatalf("enable: %d %s", resp.StatusCode, b)
	}
	eventually.True(t, "the held delivery goes once the endpoint is enabled", func() bool {
		return deliveryOf(j6).State == store.DeliveryDelivered
	})
	if calls := backendCalls(t, f); calls != 6 {
		t.Errorf("the backends served %v requests for 6 jobs", calls)
	}
}

func doRequest(t *testing.T, f *fleet, method, path, body string) (*http.Response, []byte) {
	t.Helper()
	req, _ := http.NewRequest(method, f.srv.URL+path, strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp, b
}

// TestWebhookRegistration: URLs the egress guard refuses are a 400 at
// registration, in OpenAI's error shape; a name is checked where it
// resolves: a delivery to a name of a refused address never reaches it.
func TestWebhookRegistration(t *testing.T) {
	f, _, _ := webhookFleet(t, fleetOpts{}, 1, func(c *DispatcherConfig) {
		c.Guard = &webhook.Guard{AllowHTTP: true} // loopback refused at connect time
		c.Schedule = []time.Duration{0}
	})
	for _, body := range []string{
		`{"url":"http://10.0.0.1/hook","events":["job.succeeded"]}`,
		`{"url":"http://169.254.169.254/latest/meta-data","events":["job.succeeded"]}`,
		`{"url":"http://[::ffff:10.0.0.1]/","events":["job.succeeded"]}`,
		`{"url":"ftp://example.com/","events":["job.succeeded"]}`,
		`{"url":"http://127.0.0.1:1/","events":[]}`,
		`{"url":"http://127.0.0.1:1/","events":["job.accepted"]}`,
		`{"events":["job.succeeded"]}`,
		`{"url":"http://127.0.0.1:1/","events":["job.succeeded"],"description":"n\u0000ul"}`, // PostgreSQL refuses the NUL: a 500
	} {
		resp, b := f.post(t, "/v1/webhooks/endpoints", body)
		var eb errorBody
		if resp.StatusCode != http.StatusBadRequest || json.Unmarshal(b, &eb) != nil || eb.Error.Message == "" {
			t.Errorf("%s: %d %s, want a 400", body, resp.StatusCode, b)
		}
	}
	rc := newReceiver(t)
	port := rc.srv.URL[strings.LastIndex(rc.srv.URL, ":")+1:]
	e := createEndpoint(t, f, "http://localhost:"+port+"/hook", "job.succeeded")
	resp, b := f.post(t, "/v1/webhooks/endpoints/"+e.ID+"/test", "")
	if resp.StatusCode != http.StatusAccepted {
		t.Fatalf("test: %d %s", resp.StatusCode, b)
	}
	id := decode[deliveryView](t, b).ID
	var d deliveryView
	eventually.True(t, "the refused delivery to fail", func() bool {
		_, b := f.get(t, "/v1/webhooks/deliveries/"+id)
		d = decode[deliveryView](t, b)
		return d.State == store.DeliveryFailed
	})
	if rc.hits.Load() != 0 || len(d.Attempts) != 1 || !strings.Contains(d.Attempts[0].Error, "refused") {
		t.Errorf("a name of loopback: %d requests reached it; %+v", rc.hits.Load(), d)
	}
}

// TestWebhookIdempotencyKeys: an endpoint's creation or rotation sent
// again with the same Idempotency-Key (a retry after a lost answer) makes
// nothing a second time and answers what the first made; the key with
// another request is refused. Without a key, each call makes its own.
func TestWebhookIdempotencyKeys(t *testing.T) {
	f, _, _ := webhookFleet(t, fleetOpts{}, 1)
	body := `{"url":"http://127.0.0.1:9/hook","events":["job.succeeded","job.failed"],"description":"one"}`
	resp, b := f.post(t, "/v1/webhooks/endpoints", body, "Idempotency-Key", "create-1")
	first := decode[endpointView](t, b)
	if resp.StatusCode != http.StatusCreated || first.Secret == "" {
		t.Fatalf("create: %d %s", resp.StatusCode, b)
	}
	resp, b = f.post(t, "/v1/webhooks/endpoints", `{"url":"http://127.0.0.1:9/hook","events":["job.failed","job.succeeded"],"description":"one"}`,
		"Idempotency-Key", "create-1")
	if again := decode[endpointView](t, b); resp.StatusCode != http.StatusOK || resp.Header.Get("Idempotent-Replayed") != "true" ||
		again.ID != first.ID || again.Secret != first.Secret {
		t.Errorf("the same creation again: %d %s, want %s replayed", resp.StatusCode, b, first.ID)
	}
	if resp, b := f.post(t, "/v1/webhooks/endpoints", `{"url":"http://127.0.0.1:9/other","events":["job.failed"]}`,
		"Idempotency-Key", "create-1"); resp.StatusCode != http.StatusUnprocessableEntity || !strings.Contains(string(b), "idempotency_key_reused") {
		t.Errorf("another creation with the key: %d %s, want 422 idempotency_key_reused", resp.StatusCode, b)
	}
	if resp, b := f.post(t, "/v1/webhooks/endpoints", body, "Idempotency-Key", strings.Repeat("k", 256)); resp.StatusCode != http.StatusBadRequest {
		t.Errorf("a key of 256 bytes: %d %s, want 400", resp.StatusCode, b)
	}
	if _, b := f.post(t, "/v1/webhooks/endpoints", body); decode[endpointView](t, b).ID == first.ID {
		t.Error("a creation without a key took the keyed one's id")
	}

	rot := "/v1/webhooks/endpoints/" + first.ID + "/rotate-secret"
	_, b = f.post(t, rot, "", "Idempotency-Key", "rotate-1")
	r1 := decode[endpointView](t, b)
	resp, b = f.post(t, rot, "", "Idempotency-Key", "rotate-1")
	if r2 := decode[endpointView](t, b); r1.Secret == first.Secret || r2.Secret != r1.Secret || resp.Header.Get("Idempotent-Replayed") != "true" {
		t.Errorf("a rotation sent twice: %q then %q (created with %q), want one rotation", r1.Secret, r2.Secret, first.Secret)
	}
	if _, b = f.post(t, rot, "", "Idempotency-Key", "rotate-2"); decode[endpointView](t, b).Secret == r1.Secret {
		t.Error("a rotation with another key did not rotate")
	}

	// Deleted, the endpoint is not made again by its creation's key.
	if status, b := bsend(t, http.MethodDelete, f.srv.URL+"/v1/webhooks/endpoints/"+first.ID, "", ""); status != http.StatusOK {
		t.Fatalf("delete: %d %s", status, b)
	}
	if resp, b := f.post(t, "/v1/webhooks/endpoints", body, "Idempotency-Key", "create-1"); resp.StatusCode != http.StatusConflict ||
		!strings.Contains(string(b), `"endpoint_deleted"`) {
		t.Errorf("the deleted endpoint's creation again: %d %s, want 409 endpoint_deleted", resp.StatusCode, b)
	}
	if status, _ := f.get(t, "/v1/webhooks/endpoints/"+first.ID); status != http.StatusNotFound {
		t.Errorf("the deleted endpoint reads %d, want 404", status)
	}
}

// TestDeliveryToAnEndpointDisabledSinceItsClaim: a delivery claimed just
// before its endpoint was disabled is handed back, no attempt spent and
// nothing sent, to wait for the endpoint to be enabled again.
func TestDeliveryToAnEndpointDisabledSinceItsClaim(t *testing.T) {
	d, err := NewDispatcher(DispatcherConfig{Store: sqliteStore(t), Guard: loopbackGuard()})
	if err != nil {
		t.Fatal(err)
	}
	r := d.attempt(context.Background(), store.Delivery{ID: "msg_1", Fence: 3, Attempts: 2},
		store.WebhookEndpoint{ID: "we_1", URL: "http://127.0.0.1:1/never", Disabled: true, DisabledReason: "by its owner"}, nil)
	if !r.Deferred || r.State == store.DeliveryFailed || r.Attempt.StartedAt != (time.Time{}) {
		t.Errorf("result %+v, want it handed back untried", r)
	}
}

// TestDispatcherSlotsPerTenant: one tenant's endpoints together take at
// most PerTenant of the replica's send slots (half by default), however
// many endpoints it has, so another tenant's deliveries still go; a slot
// given back is the tenant's again.
func TestDispatcherSlotsPerTenant(t *testing.T) {
	d, err := NewDispatcher(DispatcherConfig{Store: sqliteStore(t), Guard: loopbackGuard(), Concurrency: 8})
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	for i := range 4 { // two endpoints of acme's, two sends each
		if _, ok := d.admit("acme", fmt.Sprint("e", i%2), now); !ok {
			t.Fatalf("acme's send %d refused under its half", i)
		}
	}
	if until, ok := d.admit("acme", "e2", now); ok || !until.After(now) {
		t.Errorf("acme's fifth send at once, on a third endpoint: admitted %v (until %v), want deferred", ok, until)
	}
	if _, ok := d.admit("globex", "g0", now); !ok {
		t.Error("globex's send refused while acme holds its half")
	}
	d.release("acme", "e0", true, now)
	if _, ok := d.admit("acme", "e2", now); !ok {
		t.Error("acme's send refused after one of its sends ended")
	}
}

// TestDispatcherForgetsIdleEndpoints: the breaker state of an endpoint
// whose last send failed goes once it has been idle for forgetIdle, so
// endpoints disabled, deleted or given up on are not kept for good.
func TestDispatcherForgetsIdleEndpoints(t *testing.T) {
	d, err := NewDispatcher(DispatcherConfig{Store: sqliteStore(t), Guard: loopbackGuard()})
	if err != nil {
		t.Fatal(err)
	}
	t0 := time.Now()
	fail := func(ep string, at time.Time) {
		if _, ok := d.admit("acme", ep, at); !ok {
			t.Fatalf("%s refused", ep)
		}
		d.release("acme", ep, false, at)
	}
	fail("gone", t0)
	fail("live", t0.Add(forgetIdle+time.Minute))
	d.mu.Lock()
	defer d.mu.Unlock()
	if _, ok := d.endpoints["gone"]; ok || d.endpoints["live"] == nil || len(d.tenants) != 0 {
		t.Errorf("endpoints kept %v, tenants %v: want only the one that failed lately", d.endpoints, d.tenants)
	}
}
