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
}

type received struct {
	ID    string
	Type  string
	JobID string
	State string
	Body  []byte
}

func newReceiver(t *testing.T) *receiver {
	rc := &receiver{}
	rc.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		rc.hits.Add(1)
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
		if why := verifyStandard(rc.secrets, id, ts, sigs, body); why != "" {
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
func verifyStandard(keys [][]byte, id, ts, header string, body []byte) string {
	sec, err := strconv.ParseInt(ts, 10, 64)
	if err != nil || id == "" {
		return "no webhook-id or webhook-timestamp"
	}
	if d := time.Since(time.Unix(sec, 0)); d > 5*time.Minute || d < -5*time.Minute {
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

func (rc *receiver) received() []received {
	rc.mu.Lock()
	defer rc.mu.Unlock()
	return slices.Clone(rc.got)
}

// webhookFleet is a fleet with durable jobs, a runner, the webhook API and
// a dispatcher on a scaled retry schedule.
func webhookFleet(t *testing.T, o fleetOpts, scale time.Duration) (*fleet, *Dispatcher, *prometheus.Registry) {
	t.Helper()
	o.jobs, o.runner = true, true
	var disp *Dispatcher
	o.gateway.Webhooks = Webhooks{Guard: loopbackGuard(), Wake: func() {
		if disp != nil {
			disp.Wake()
		}
	}}
	if o.store == nil && !o.pg {
		o.store = sqliteStore(t)
	}
	if o.store == nil {
		o.store = pgtest.Open(t)
	}
	o.gateway.Webhooks.Store = o.store
	f := startFleet(t, o)
	sched := make([]time.Duration, len(DefaultRetrySchedule))
	for i, d := range DefaultRetrySchedule {
		sched[i] = d / scale
	}
	reg := prometheus.NewRegistry()
	var err error
	disp, err = NewDispatcher(DispatcherConfig{Store: f.store, Guard: loopbackGuard(), Schedule: sched, Timeout: 5 * time.Second,
		Concurrency: 32, Poll: 5 * time.Millisecond, BreakerOpen: 30 * time.Second / scale, Registerer: reg})
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

// TestWebhookOutage: the receiver is down (503) for two hours of the
// scaled schedule while jobs complete. Afterwards every job's event has
// been delivered and verified, a job's event only ever came under one
// webhook-id, and the backends ran each job once: delivery ran no
// inference.
func TestWebhookOutage(t *testing.T) {
	// Two scaled hours must cover the jobs' completion: 120 jobs take
	// well under a second, 10,000 a minute or two on two cores.
	n, scale := 120, time.Duration(10000) // two hours: 720 ms
	if os.Getenv("KVGATE_EXPERIMENTS") == "1" {
		n, scale = 10000, 40 // two hours: 3 min
	}
	f, _, reg := webhookFleet(t, fleetOpts{speedup: 200, backends: 2}, scale)
	rc := newReceiver(t)
	e := createEndpoint(t, f, rc.srv.URL+"/hook", "job.succeeded", "job.failed")
	rc.trust(e.Secret)
	rc.down.Store(true)
	outage := time.AfterFunc(2*time.Hour/scale, func() { rc.down.Store(false) })
	defer outage.Stop()
	ids := make([]string, n)
	for i := range n {
		resp, v := submitJob(t, f, fmt.Sprintf("outage-%d", i), chatJob(fmt.Sprintf("job %d", i), 2))
		if resp.StatusCode != http.StatusAccepted {
			t.Fatalf("submit %d: %d", i, resp.StatusCode)
		}
		ids[i] = v.ID
	}
	eventually.True(t, "every job to end", func() bool {
		for _, id := range ids {
			if j, err := f.store.Get(context.Background(), "default", id); err != nil || j.State != store.Succeeded {
				return false
			}
		}
		return true
	})
	if !rc.down.Load() {
		t.Logf("the jobs ended after the outage: the run was slower than two scaled hours")
	}
	if counterValue(t, reg, "kvgate_webhook_deliveries_total", "retry") == 0 {
		t.Errorf("no attempt failed while the receiver was down")
	}
	// A delivery made as the outage began is next tried 2 h 35 min in.
	eventually.Within(t, 2*time.Hour/scale+eventually.Timeout, "every event to be delivered", func() bool {
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
	if len(rc.bad) > 0 {
		t.Errorf("%d requests failed verification, first: %s", len(rc.bad), rc.bad[0])
	}
	failed, _, _ := f.store.Deliveries(context.Background(), store.DeliveryFilter{State: store.DeliveryFailed})
	if len(failed) != 0 {
		t.Errorf("%d deliveries FAILED", len(failed))
	}
	if calls := backendCalls(t, f); int(calls) != n {
		t.Errorf("the backends served %v requests for %d jobs", calls, n)
	}
	t.Logf("%d jobs: %d requests reached the receiver, %d accepted", n, rc.hits.Load(), len(rc.received()))
	if got := counterValue(t, reg, "kvgate_webhook_deliveries_total", "delivered"); int(got) != n {
		t.Errorf("kvgate_webhook_deliveries_total{outcome=delivered} = %v, want %d", got, n)
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
