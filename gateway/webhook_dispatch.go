package gateway

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvgate/kvgate/gateway/webhook"
	"github.com/kvgate/kvgate/store"
)

// The webhook dispatcher: every replica runs one. It claims due
// deliveries in bulk (leased and fenced in the store, so replicas never
// share one and a replica killed mid-send leaves it to be sent again
// under the same webhook-id), POSTs each signed, and records the attempts
// in batches. It only reads what the store holds: it never runs
// inference.

// DefaultRetrySchedule is Standard Webhooks' schedule: entry n is the
// wait before attempt n+1 (the first is immediate): ten attempts, the
// last about 75 h 35 min after the first.
var DefaultRetrySchedule = []time.Duration{0, 5 * time.Second, 5 * time.Minute, 30 * time.Minute, 2 * time.Hour,
	5 * time.Hour, 10 * time.Hour, 14 * time.Hour, 20 * time.Hour, 24 * time.Hour}

// CheckRetrySchedule refuses a retry schedule the dispatcher cannot keep:
// an empty one, or one whose first entry is not 0 (a delivery's first
// attempt is due when its event is written).
func CheckRetrySchedule(s []time.Duration) error {
	switch {
	case len(s) == 0:
		return errors.New("the retry schedule is empty")
	case s[0] != 0:
		return fmt.Errorf("the retry schedule's first entry (%s) must be 0: a delivery's first attempt goes when its event is written, the later entries are the waits before each retry", s[0])
	}
	return nil
}

// DispatcherConfig configures a Dispatcher.
type DispatcherConfig struct {
	Store store.Store
	Guard *webhook.Guard
	// Schedule is the retry schedule (DefaultRetrySchedule when nil); a
	// delivery FAILS once it has made len(Schedule) attempts.
	Schedule []time.Duration
	// Timeout is each attempt's whole deadline (15 s when zero).
	Timeout time.Duration
	// Concurrency bounds the replica's sends at once (64 when zero);
	// PerEndpoint bounds one endpoint's (a quarter of Concurrency, at
	// least 1, when zero), and PerTenant all of one tenant's endpoints'
	// (half of Concurrency, at least 1, when zero): a tenant with many
	// slow endpoints must not hold every send slot other tenants need.
	Concurrency int
	PerEndpoint int
	PerTenant   int
	// Poll is how often the store is asked for due deliveries when
	// nothing wakes the dispatcher (200 ms when zero).
	Poll time.Duration
	// ResultCap caps an inline result (64 KiB when zero); a larger one
	// is left to result_url.
	ResultCap int
	// BreakerFailures consecutive failed attempts open an endpoint's
	// breaker for BreakerOpen (5 and 30 s when zero): its due deliveries
	// wait, spending no attempt, and then one probe is sent.
	BreakerFailures int
	BreakerOpen     time.Duration
	// Now is the clock (time.Now when nil).
	Now        func() time.Time
	Log        *slog.Logger
	Registerer prometheus.Registerer
}

// Dispatcher sends webhook deliveries.
type Dispatcher struct {
	cfg    DispatcherConfig
	client *http.Client
	lease  time.Duration
	wake   chan struct{}
	done   chan store.DeliveryResult

	mu        sync.Mutex
	inflight  int
	endpoints map[string]*endpointState // by endpoint id
	tenants   map[string]int            // sends in flight by tenant; none at 0
	forgot    time.Time                 // the last sweep of idle endpoints (forget)

	outcomes     *prometheus.CounterVec
	authFailures prometheus.Counter
}

// endpointState is an endpoint's breaker and sends in flight on this
// replica.
type endpointState struct {
	inflight  int
	failures  int       // consecutive
	openUntil time.Time // breaker open until; then half-open: one probe
	last      time.Time // its last send's end
}

// forgetIdle is how long an endpoint's breaker state outlives its last
// send: an endpoint whose last send failed (disabled by a 410, deleted,
// its deliveries failed for good) is not kept for the process's life.
const forgetIdle = 10 * time.Minute

// NewDispatcher returns a dispatcher; Run runs it.
func NewDispatcher(cfg DispatcherConfig) (*Dispatcher, error) {
	if cfg.Store == nil || cfg.Guard == nil {
		return nil, errors.New("webhook dispatcher: a store and a guard are needed")
	}
	if cfg.Schedule == nil {
		cfg.Schedule = DefaultRetrySchedule
	}
	if err := CheckRetrySchedule(cfg.Schedule); err != nil {
		return nil, fmt.Errorf("webhook dispatcher: %w", err)
	}
	if cfg.Timeout <= 0 {
		cfg.Timeout = 15 * time.Second
	}
	if cfg.Concurrency <= 0 {
		cfg.Concurrency = 64
	}
	if cfg.PerEndpoint <= 0 {
		cfg.PerEndpoint = max(1, cfg.Concurrency/4)
	}
	if cfg.PerTenant <= 0 {
		cfg.PerTenant = max(1, cfg.Concurrency/2)
	}
	if cfg.Poll <= 0 {
		cfg.Poll = 200 * time.Millisecond
	}
	if cfg.ResultCap <= 0 {
		cfg.ResultCap = 64 << 10
	}
	if cfg.BreakerFailures <= 0 {
		cfg.BreakerFailures = 5
	}
	if cfg.BreakerOpen <= 0 {
		cfg.BreakerOpen = 30 * time.Second
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.DiscardHandler)
	}
	d := &Dispatcher{cfg: cfg, client: cfg.Guard.Client(cfg.Timeout), lease: 2*cfg.Timeout + 10*time.Second,
		wake: make(chan struct{}, 1), done: make(chan store.DeliveryResult, cfg.Concurrency),
		endpoints: map[string]*endpointState{}, tenants: map[string]int{},
		outcomes: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvgate_webhook_deliveries_total",
			Help: "Webhook delivery attempts by outcome: delivered, retry, failed (the schedule spent), gone (410: the endpoint disabled), deferred (breaker open or endpoint busy: not sent)."},
			[]string{"outcome"}),
		authFailures: prometheus.NewCounter(prometheus.CounterOpts{Name: "kvgate_webhook_auth_failures_total",
			Help: "Webhook attempts the receiver answered 401 or 403 (retried; a signing secret the receiver does not know)."}),
	}
	for _, o := range []string{"delivered", "retry", "failed", "gone", "deferred"} {
		d.outcomes.WithLabelValues(o) // every outcome from 0, so that rates and alerts see the first
	}
	if cfg.Registerer != nil {
		for _, c := range []prometheus.Collector{d.outcomes, d.authFailures, &pendingCollector{st: cfg.Store}} {
			if err := cfg.Registerer.Register(c); err != nil {
				return nil, err
			}
		}
	}
	return d, nil
}

// Wake makes the dispatcher look for due deliveries now.
func (d *Dispatcher) Wake() {
	select {
	case d.wake <- struct{}{}:
	default:
	}
}

// Run dispatches until ctx ends, then waits for the sends in flight and
// records them.
func (d *Dispatcher) Run(ctx context.Context) {
	var sends sync.WaitGroup
	recorded := make(chan struct{})
	go func() { defer close(recorded); d.record() }()
	t := time.NewTicker(d.cfg.Poll)
	defer t.Stop()
	for {
		for d.claim(ctx, &sends) {
		}
		select {
		case <-ctx.Done():
			sends.Wait()
			close(d.done)
			<-recorded
			return
		case <-t.C:
		case <-d.wake:
		}
	}
}

// claim claims what the replica has room for and starts the sends; it
// reports whether it filled the room (more may be due).
func (d *Dispatcher) claim(ctx context.Context, sends *sync.WaitGroup) bool {
	if ctx.Err() != nil {
		return false
	}
	d.mu.Lock()
	room := d.cfg.Concurrency - d.inflight
	d.inflight += max(room, 0)
	d.mu.Unlock()
	if room <= 0 {
		return false
	}
	now := d.cfg.Now()
	cctx, stop := d.bounded(ctx)
	ds, err := d.cfg.Store.ClaimDeliveries(cctx, now, d.lease, room)
	stop()
	d.mu.Lock()
	d.inflight -= room - len(ds)
	d.mu.Unlock()
	if err != nil {
		if ctx.Err() == nil {
			d.cfg.Log.Warn("claiming webhook deliveries", "error", err)
		}
		return false
	}
	// One read of each endpoint per batch, not one per delivery.
	eps := map[string]*endpointRead{}
	for _, dl := range ds {
		if eps[dl.EndpointID] == nil {
			ectx, stop := d.bounded(ctx)
			e, err := d.cfg.Store.Endpoint(ectx, "", dl.EndpointID)
			stop()
			eps[dl.EndpointID] = &endpointRead{e, err}
		}
	}
	for _, dl := range ds {
		sends.Add(1)
		ep := eps[dl.EndpointID]
		go func() {
			defer sends.Done()
			d.done <- d.attempt(context.WithoutCancel(ctx), dl, ep.e, ep.err) // in flight until recorded
		}()
	}
	return len(ds) == room
}

// record writes finished attempts in batches: whatever has finished by the
// time the previous batch is written.
func (d *Dispatcher) record() {
	ctx := context.Background()
	for r := range d.done {
		batch := []store.DeliveryResult{r}
	more:
		for len(batch) < 256 {
			select {
			case r, ok := <-d.done:
				if !ok {
					break more
				}
				batch = append(batch, r)
			default:
				break more
			}
		}
		errs, err := d.finish(ctx, batch)
		d.mu.Lock()
		d.inflight -= len(batch)
		d.mu.Unlock()
		if err != nil {
			// Nothing was written, tries apart: each delivery's lease
			// expires and it is sent again under its id.
			d.cfg.Log.Warn("recording webhook attempts", "error", err, "deliveries", len(batch))
			continue
		}
		for i, e := range errs {
			if e != nil {
				d.cfg.Log.Info("a webhook attempt's record came after its lease", "delivery", batch[i].ID)
			}
		}
		d.Wake()
	}
}

// bounded is ctx limited to a third of a delivery's lease: a store call
// hung on a connection left half open (a database host that crashed) is
// given up in time for the next try, rather than holding the records, and
// so every send slot and the shutdown, until the kernel drops it.
func (d *Dispatcher) bounded(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, d.lease/3)
}

// deferEndpoint defers an endpoint's deliveries until a time, bounded.
func (d *Dispatcher) deferEndpoint(ctx context.Context, id string, until time.Time) (int, error) {
	ctx, stop := d.bounded(ctx)
	defer stop()
	return d.cfg.Store.DeferEndpoint(ctx, id, until)
}

// finishTries bounds how often a batch of attempts' records is tried
// before their deliveries are left to their leases: 50 ms, doubling, about
// 1.5 s in all, well within a lease (2 × the send timeout + 10 s).
const finishTries = 5

// finish records a batch of attempts, trying again through a short store
// outage (a busy SQLite, a PostgreSQL failover): a record lost here holds
// each delivery SENDING until its lease ends, then sends it again. The
// records are fenced (an attempt whose claim was taken over changes
// nothing), so a try whose commit did land makes the next one a no-op.
func (d *Dispatcher) finish(ctx context.Context, batch []store.DeliveryResult) ([]error, error) {
	wait := 50 * time.Millisecond
	for try := 1; ; try++ {
		fctx, stop := d.bounded(ctx)
		errs, err := d.cfg.Store.FinishDeliveries(fctx, batch)
		stop()
		if err == nil || try == finishTries {
			return errs, err
		}
		d.cfg.Log.Info("recording webhook attempts, trying again", "error", err, "deliveries", len(batch), "try", try)
		time.Sleep(wait)
		wait *= 2
	}
}

// admit takes a send slot of the delivery's endpoint, or says until when
// to defer it: while its breaker is open, or while its sends at once, or
// its tenant's, are spent.
func (d *Dispatcher) admit(tenant, endpointID string, now time.Time) (time.Time, bool) {
	d.mu.Lock()
	defer d.mu.Unlock()
	busy := now.Add(min(d.cfg.Poll*5, time.Second))
	if d.tenants[tenant] >= d.cfg.PerTenant {
		return busy, false
	}
	e := d.endpoints[endpointID]
	if e == nil {
		e = &endpointState{}
		d.endpoints[endpointID] = e
	}
	limit := d.cfg.PerEndpoint
	if e.failures >= d.cfg.BreakerFailures {
		if now.Before(e.openUntil) {
			return e.openUntil, false
		}
		limit = 1 // half-open: one probe
	}
	if e.inflight >= limit {
		return busy, false
	}
	e.inflight++
	d.tenants[tenant]++
	return time.Time{}, true
}

// release returns an endpoint's slot with the attempt's verdict, and says
// until when the breaker opened, if it did.
func (d *Dispatcher) release(tenant, endpointID string, ok bool, now time.Time) time.Time {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.tenants[tenant]--; d.tenants[tenant] <= 0 {
		delete(d.tenants, tenant)
	}
	e := d.endpoints[endpointID]
	e.inflight--
	if ok {
		e.failures, e.openUntil = 0, time.Time{} // closed
		if e.inflight == 0 {
			delete(d.endpoints, endpointID)
		}
		return time.Time{}
	}
	e.failures, e.last = e.failures+1, now
	if e.inflight == 0 {
		d.forget(now)
	}
	if e.failures >= d.cfg.BreakerFailures {
		e.openUntil = now.Add(d.cfg.BreakerOpen)
		return e.openUntil
	}
	return time.Time{}
}

// forget drops the breaker state of endpoints idle past forgetIdle, at
// most once per forgetIdle; d.mu is held.
func (d *Dispatcher) forget(now time.Time) {
	if now.Sub(d.forgot) < forgetIdle {
		return
	}
	d.forgot = now
	for id, e := range d.endpoints {
		if e.inflight == 0 && now.Sub(e.last) > forgetIdle && !now.Before(e.openUntil) {
			delete(d.endpoints, id)
		}
	}
}

// payload is the JSON body of a delivery.
type payload struct {
	Type      string      `json:"type"`
	Timestamp string      `json:"timestamp"`
	Data      payloadData `json:"data"`
}

type payloadData struct {
	EventID         string          `json:"event_id"`
	JobID           string          `json:"job_id,omitempty"`
	State           string          `json:"state,omitempty"`
	StateVersion    int64           `json:"state_version,omitempty"`
	JobURL          string          `json:"job_url,omitempty"`
	ResultURL       string          `json:"result_url,omitempty"`
	Result          json.RawMessage `json:"result,omitempty"`
	ResultTruncated bool            `json:"result_omitted,omitempty"` // larger than the inline cap: fetch result_url
	EndpointID      string          `json:"endpoint_id,omitempty"`    // webhook.test's
	// A batch's events (batch.completed, failed, expired, cancelled).
	BatchID  string `json:"batch_id,omitempty"`
	Status   string `json:"status,omitempty"`
	BatchURL string `json:"batch_url,omitempty"`
}

// body renders a delivery's payload: the same bytes on every attempt but
// for an inline result read anew (a review may have corrected it).
func (d *Dispatcher) body(ctx context.Context, dl store.Delivery, ep store.WebhookEndpoint) ([]byte, error) {
	p := payload{Type: dl.Type, Timestamp: dl.EventAt.UTC().Format(time.RFC3339Nano), Data: payloadData{EventID: dl.EventID}}
	if dl.Type == store.WebhookTest {
		p.Data.EndpointID = ep.ID
		return json.Marshal(p)
	}
	if strings.HasPrefix(dl.Type, "batch.") {
		// The batch's status is its event's state; its output and error
		// files are named by the batch object.
		p.Data.BatchID, p.Data.Status, p.Data.BatchURL = dl.JobID, string(dl.JobState), "/v1/batches/"+dl.JobID
		return json.Marshal(p)
	}
	p.Data.JobID, p.Data.State, p.Data.StateVersion = dl.JobID, string(dl.JobState), dl.StateVersion
	p.Data.JobURL = "/v1/jobs/" + dl.JobID
	// Only a success carries its result: a job under review has its answer
	// withheld from its tenant until a reviewer passes it (its result
	// route answers 409 meanwhile, and a rejection keeps the answer).
	if dl.JobState == store.Succeeded {
		p.Data.ResultURL = p.Data.JobURL + "/result"
		if ep.IncludeResult {
			rctx, stop := d.bounded(ctx)
			res, err := d.cfg.Store.Result(rctx, dl.Tenant, dl.JobID)
			stop()
			switch {
			case err == nil && len(res) <= d.cfg.ResultCap:
				p.Data.Result = res
			case err == nil:
				p.Data.ResultTruncated = true
			case !errors.Is(err, store.ErrNotFound):
				return nil, err
			}
		}
	}
	return json.Marshal(p)
}

// endpointRead is an endpoint as a claim's batch read it.
type endpointRead struct {
	e   store.WebhookEndpoint
	err error
}

// attempt sends one claimed delivery to its endpoint (ep, as read with
// the claim, or the error of that read) and says how it ended.
func (d *Dispatcher) attempt(ctx context.Context, dl store.Delivery, ep store.WebhookEndpoint, err error) store.DeliveryResult {
	now := d.cfg.Now()
	r := store.DeliveryResult{ID: dl.ID, Fence: dl.Fence, Now: now}
	deferTo := func(at time.Time, why string) store.DeliveryResult {
		r.Deferred, r.RetryAt = true, at
		d.outcomes.WithLabelValues("deferred").Inc()
		d.cfg.Log.Debug("webhook delivery deferred", "delivery", dl.ID, "until", at, "why", why)
		return r
	}
	if errors.Is(err, store.ErrNotFound) {
		r.Deferred = true // deleted with its deliveries: the record finds nothing
		return r
	}
	if err != nil {
		return deferTo(now.Add(time.Second), err.Error())
	}
	if ep.Disabled {
		// Disabled since the claim: the delivery waits, no attempt spent,
		// until the endpoint is enabled again (claims skip it till then).
		return deferTo(now, "endpoint disabled: "+ep.DisabledReason)
	}
	until, ok := d.admit(dl.Tenant, ep.ID, now)
	if !ok {
		if opened := until.Sub(now) > time.Second; opened {
			if _, err := d.deferEndpoint(ctx, ep.ID, until); err != nil {
				d.cfg.Log.Warn("deferring a webhook endpoint", "endpoint", ep.ID, "error", err)
			}
		}
		return deferTo(until, "endpoint or tenant busy, or the endpoint's breaker open")
	}
	status, retryAfter, attempt := d.post(ctx, dl, ep)
	done := d.cfg.Now()
	attempt.StartedAt, attempt.Latency = now, done.Sub(now)
	r.Attempt, r.Now = attempt, done
	ok = status >= 200 && status < 300
	if opened := d.release(dl.Tenant, ep.ID, ok, done); !opened.IsZero() {
		if _, err := d.deferEndpoint(ctx, ep.ID, opened); err != nil {
			d.cfg.Log.Warn("deferring a webhook endpoint", "endpoint", ep.ID, "error", err)
		}
	}
	switch {
	case ok:
		r.State = store.DeliveryDelivered
		d.outcomes.WithLabelValues("delivered").Inc()
		return r
	case status == http.StatusGone:
		r.State, r.DisableEndpoint = store.DeliveryFailed, "the receiver answered 410 Gone"
		d.outcomes.WithLabelValues("gone").Inc()
		return r
	case status == http.StatusUnauthorized || status == http.StatusForbidden:
		d.authFailures.Inc()
	}
	n := dl.Attempts - dl.Base + 1 // attempts made in this round, this one included
	if n >= len(d.cfg.Schedule) {
		r.State = store.DeliveryFailed
		d.outcomes.WithLabelValues("failed").Inc()
		return r
	}
	wait := max(d.cfg.Schedule[n], min(retryAfter, 24*time.Hour))
	r.State, r.RetryAt = store.DeliveryRetryScheduled, done.Add(wait)
	d.outcomes.WithLabelValues("retry").Inc()
	return r
}

// maxResponseBody caps the response body kept in an attempt's record.
const maxResponseBody = 1 << 10

// post makes the HTTP request: the status (0 without an answer), the
// receiver's Retry-After, and the attempt's record.
func (d *Dispatcher) post(ctx context.Context, dl store.Delivery, ep store.WebhookEndpoint) (int, time.Duration, store.DeliveryAttempt) {
	var a store.DeliveryAttempt
	body, err := d.body(ctx, dl, ep)
	if err != nil {
		a.Error = "rendering the payload: " + err.Error()
		return 0, 0, a
	}
	now := d.cfg.Now()
	var keys [][]byte
	for _, s := range ep.Secrets(now) {
		k, err := webhook.ParseSecret(s)
		if err != nil {
			a.Error = "the endpoint's secret: " + err.Error()
			return 0, 0, a
		}
		keys = append(keys, k)
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, ep.URL, bytes.NewReader(body))
	if err != nil {
		a.Error = err.Error()
		return 0, 0, a
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("User-Agent", "kvgate-webhooks")
	req.Header.Set("webhook-id", dl.ID)
	req.Header.Set("webhook-timestamp", strconv.FormatInt(now.Unix(), 10))
	req.Header.Set("webhook-signature", webhook.Sign(keys, dl.ID, now, body))
	resp, err := d.client.Do(req)
	if err != nil {
		a.Error = err.Error()
		return 0, 0, a
	}
	defer resp.Body.Close()
	b, truncated, _ := webhook.ReadCapped(resp.Body, maxResponseBody)
	a.Status, a.Body = resp.StatusCode, string(b)
	if truncated {
		a.Body += "…"
	}
	if resp.StatusCode < 200 || resp.StatusCode >= 300 {
		a.Error = resp.Status
	}
	return resp.StatusCode, retryAfter(resp.Header.Get("Retry-After"), now), a
}

// retryAfter reads a Retry-After header: seconds or an HTTP date.
func retryAfter(v string, now time.Time) time.Duration {
	if v == "" {
		return 0
	}
	if s, err := strconv.Atoi(v); err == nil && s > 0 {
		return time.Duration(s) * time.Second
	}
	if t, err := http.ParseTime(v); err == nil && t.After(now) {
		return t.Sub(now)
	}
	return 0
}

// pendingCollector reports kvgate_webhook_pending.
type pendingCollector struct{ st store.Store }

var webhookPendingDesc = prometheus.NewDesc("kvgate_webhook_pending",
	"Webhook deliveries not yet ended (PENDING, SENDING or RETRY_SCHEDULED), across replicas.", nil, nil)

func (c *pendingCollector) Describe(ch chan<- *prometheus.Desc) { ch <- webhookPendingDesc }

func (c *pendingCollector) Collect(ch chan<- prometheus.Metric) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	n, err := c.st.PendingDeliveries(ctx)
	if err != nil {
		ch <- prometheus.NewInvalidMetric(webhookPendingDesc, fmt.Errorf("pending webhook deliveries: %w", err))
		return
	}
	ch <- prometheus.MustNewConstMetric(webhookPendingDesc, prometheus.GaugeValue, float64(n))
}
