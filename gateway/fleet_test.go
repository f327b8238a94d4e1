package gateway

import (
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/dgxh100"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/server"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvgate/kvgate/bench/eventually"
	"github.com/kvgate/kvgate/bench/vllmsim"
	"github.com/kvgate/kvgate/gpu"
	"github.com/kvgate/kvgate/scheduler"
	"github.com/kvgate/kvgate/store"
)

// TestFleetStreamQueues: ?include=queues follows each "fleet" event with
// a "queues" event, the body of GET /v1/fleet/queues as the key may see
// it (an operator: its own tenant's rows only); an unknown include is a
// 400 in OpenAI's shape.
func TestFleetStreamQueues(t *testing.T) {
	st := sqliteStore(t)
	op := newTenant(t, st, "acme", store.Limits{}, store.RoleOperator)
	user := newKey(t, st, "acme", store.RoleUser)
	other := newTenant(t, st, "globex", store.Limits{}, store.RoleUser)
	f := startFleet(t, fleetOpts{store: st, keysRequired: true, gateway: Config{Tenants: Tenants{Store: st}}})
	for _, key := range []string{user, other} {
		if status, b := bearer(t, f, key, http.MethodPost, "/v1/chat/completions", chatReq(4)); status != http.StatusOK {
			t.Fatalf("chat: %d %s", status, b)
		}
	}
	if status, b := bearer(t, f, op, http.MethodGet, "/v1/fleet/events?include=everything", ""); status != http.StatusBadRequest ||
		!strings.Contains(string(b), `"param":"include"`) {
		t.Errorf("an unknown include: %d %s", status, b)
	}
	s := openStream(t, f.srv.URL+"/v1/fleet/events?include=queues", "Authorization", "Bearer "+op)
	for i := range 2 {
		e, ok := s.next(t)
		if !ok || e.Event != "fleet" {
			t.Fatalf("event %d: %+v (open %v), want fleet", i, e, ok)
		}
		if e, ok = s.next(t); !ok || e.Event != "queues" {
			t.Fatalf("after a fleet event: %+v (open %v), want queues", e, ok)
		}
		var v queuesView
		if err := json.Unmarshal([]byte(e.Data), &v); err != nil {
			t.Fatal(err)
		}
		if v.Object != "fleet.queues" || len(v.Classes) != 2 {
			t.Fatalf("queues event: %s", e.Data)
		}
		tenants := map[string]int64{}
		for _, c := range v.Classes {
			for _, q := range c.Tenants {
				tenants[q.Tenant] += q.Admitted
			}
		}
		if len(tenants) != 1 || tenants["acme"] < 1 {
			t.Errorf("acme's operator's queues event shows %v, want acme's admission alone", tenants)
		}
	}
}

// TestFleetStream: GET /v1/fleet and its stream show every backend to an
// operator; the stream ends with an error event once its key is revoked,
// as the job streams do; a user key gets 403.
func TestFleetStream(t *testing.T) {
	st := sqliteStore(t)
	clock := &testClock{now: time.Now()} // the key cache's clock
	op := newTenant(t, st, "acme", store.Limits{}, store.RoleOperator)
	user := newKey(t, st, "acme", store.RoleUser)
	f := startFleet(t, fleetOpts{store: st, backends: 2, keysRequired: true,
		gateway: Config{Tenants: Tenants{Store: st, Now: clock.Now, CacheTTL: time.Minute}}})

	if status, b := bearer(t, f, user, http.MethodGet, "/v1/fleet", ""); status != http.StatusForbidden {
		t.Errorf("a user key's fleet: %d %s", status, b)
	}
	status, b := bearer(t, f, op, http.MethodGet, "/v1/fleet", "")
	fv := decode[fleetView](t, b)
	if status != http.StatusOK || len(fv.Backends) != 2 || fv.Backends[0].Name != "sim0" || fv.Backends[1].Name != "sim1" || fv.KVTarget <= 0 {
		t.Fatalf("the fleet: %d %s", status, b)
	}

	s := openStream(t, f.srv.URL+"/v1/fleet/events", "Authorization", "Bearer "+op)
	// The backends' capacity shows once they are scraped.
	for {
		e, ok := s.next(t)
		if !ok || e.Event != "fleet" {
			t.Fatalf("the stream sent %+v (open %v), want fleet events", e, ok)
		}
		var v fleetView
		if err := json.Unmarshal([]byte(e.Data), &v); err != nil {
			t.Fatal(err)
		}
		if len(v.Backends) == 2 && v.Backends[0].CapacityTokens > 0 && v.Backends[0].Routable && len(v.Backends[0].Models) == 1 {
			break
		}
	}
	keys, _, err := st.ListKeys(context.Background(), "acme", "", 100)
	if err != nil {
		t.Fatal(err)
	}
	for _, k := range keys {
		if k.Hash == HashKey(op) {
			if err := st.RevokeKey(context.Background(), k.ID, time.Now()); err != nil {
				t.Fatal(err)
			}
		}
	}
	clock.Advance(2 * time.Minute) // past the TTL of every cached lookup
	for {
		e, ok := s.next(t)
		if !ok {
			t.Fatal("the stream ended without an error event")
		}
		if e.Event == "fleet" {
			continue // sent before the revocation came into force
		}
		var body errorBody
		if e.Event != "error" || json.Unmarshal([]byte(e.Data), &body) != nil || body.Error.Code == nil || *body.Error.Code != "invalid_api_key" {
			t.Fatalf("%+v, want an error event with code invalid_api_key", e)
		}
		break
	}
	if e, ok := s.next(t); ok {
		t.Errorf("the stream went on after its error event: %+v", e)
	}
}

// TestFleetShowsGPUs: a backend's GPUs, read through NVML (go-nvml's DGX
// H100 mock), reach /v1/fleet and the console's Fleet page.
func TestFleetShowsGPUs(t *testing.T) {
	lib := dgxh100.New()
	lib.EventSetCreateFunc = func() (nvml.EventSet, nvml.Return) { return nil, nvml.ERROR_NOT_SUPPORTED }
	for i, d := range lib.Devices {
		d := d.(*server.Device)
		temp := uint32(35)
		if i == 0 {
			temp = 91 // hot: degraded
		}
		d.GetUtilizationRatesFunc = func() (nvml.Utilization, nvml.Return) { return nvml.Utilization{Gpu: 87}, nvml.SUCCESS }
		d.GetTemperatureFunc = func(nvml.TemperatureSensors) (uint32, nvml.Return) { return temp, nvml.SUCCESS }
		d.GetPowerUsageFunc = func() (uint32, nvml.Return) { return 72_000, nvml.SUCCESS }
		d.GetEnforcedPowerLimitFunc = func() (uint32, nvml.Return) { return 700_000, nvml.SUCCESS }
		d.GetCurrentClocksEventReasonsFunc = func() (uint64, nvml.Return) { return nvml.ClocksEventReasonGpuIdle, nvml.SUCCESS }
		d.GetCurrentClocksThrottleReasonsFunc = func() (uint64, nvml.Return) { return nvml.ClocksThrottleReasonGpuIdle, nvml.SUCCESS }
		d.GetTotalEccErrorsFunc = func(nvml.MemoryErrorType, nvml.EccCounterType) (uint64, nvml.Return) { return 0, nvml.SUCCESS }
		d.RegisterEventsFunc = func(uint64, nvml.EventSet) nvml.Return { return nvml.ERROR_NOT_SUPPORTED }
	}
	n := gpu.OpenNVML(lib, gpu.NVMLConfig{Interval: 20 * time.Millisecond})
	_, sim := vllmsim.NewTestServer(t, vllmsim.Config{Profile: llamaProfile(t), Speedup: 50})
	pool, err := gpu.NewPool([]gpu.BackendConfig{{Name: "sim0", URL: sim.URL, GPUs: []string{"0", "1"}}},
		gpu.PoolConfig{ScrapeInterval: 20 * time.Millisecond, ProbeInterval: 50 * time.Millisecond, NVML: n})
	if err != nil {
		t.Fatal(err)
	}
	sched, err := scheduler.New(pool, scheduler.Options{})
	if err != nil {
		t.Fatal(err)
	}
	api, err := New(Config{OperatorKeys: map[string]string{"op-key": "acme"}}, pool, sched, prometheus.NewRegistry(), nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Go(func() { _ = n.Run(ctx) })
	wg.Go(func() { _ = pool.Run(ctx) })
	wg.Go(func() { _ = sched.Run(ctx) })
	defer wg.Wait()
	defer cancel()

	get := func(path string, header ...string) (int, string) {
		req := httptest.NewRequest(http.MethodGet, path, nil)
		for i := 0; i+1 < len(header); i += 2 {
			req.Header.Set(header[i], header[i+1])
		}
		req.AddCookie(&http.Cookie{Name: consoleCookie, Value: api.consoleSeal.seal(consoleSession{Key: "op-key", Expires: time.Now().Add(time.Hour).Unix(), CSRF: "x"})})
		w := httptest.NewRecorder()
		api.ServeHTTP(w, req)
		return w.Code, w.Body.String()
	}
	var fv fleetView
	eventually.True(t, "the fleet to show sim0's GPUs", func() bool {
		_, b := get("/v1/fleet", "Authorization", "Bearer op-key")
		return json.Unmarshal([]byte(b), &fv) == nil && len(fv.Backends) == 1 && len(fv.Backends[0].GPUs) == 2
	})
	b := fv.Backends[0]
	if g := b.GPUs[0]; g.TemperatureC != 91 || g.UtilGPU != 87 || g.Health != "degraded" || g.MemoryTotal == 0 || b.GPUHealth != "degraded" ||
		len(g.Reasons) != 1 || !strings.Contains(g.Reasons[0], "temperature 91C") {
		t.Errorf("GPU 0: %+v (backend's GPU health %q)", g, b.GPUHealth)
	}
	if g := b.GPUs[1]; g.TemperatureC != 35 || g.Health != "healthy" {
		t.Errorf("GPU 1: %+v", g)
	}
	status, page := get("/console/fleet")
	if status != http.StatusOK || !strings.Contains(page, "GPUs (degraded)") || !strings.Contains(page, "91 °C") {
		t.Errorf("the Fleet page: %d, want the GPUs in %.600s", status, page)
	}
}

// TestFleetKVUsageNotPublished: a backend whose metrics page has no KV
// cache usage shows it as unknown (null, "not published"), not as an
// empty cache; the other backend's shows as read.
func TestFleetKVUsageNotPublished(t *testing.T) {
	strip := func(i int, h http.Handler) http.Handler {
		if i != 0 {
			return h
		}
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.URL.Path != "/metrics" {
				h.ServeHTTP(w, r)
				return
			}
			rec := httptest.NewRecorder()
			h.ServeHTTP(rec, r)
			var kept []string
			for _, l := range strings.Split(rec.Body.String(), "\n") {
				if !strings.Contains(l, "cache_usage_perc") {
					kept = append(kept, l)
				}
			}
			w.Header().Set("Content-Type", rec.Header().Get("Content-Type"))
			_, _ = w.Write([]byte(strings.Join(kept, "\n")))
		})
	}
	f := startFleet(t, fleetOpts{backends: 2, wrap: strip})
	var v fleetView
	eventually.True(t, "both backends scraped", func() bool {
		_, b := f.get(t, "/v1/fleet")
		v = fleetView{}
		return json.Unmarshal(b, &v) == nil && len(v.Backends) == 2 && !v.Backends[0].Stale && !v.Backends[1].Stale
	})
	byName := map[string]fleetBackendView{}
	for _, b := range v.Backends {
		byName[b.Name] = b
	}
	if b := byName["sim0"]; b.KVUsage != nil {
		t.Errorf("the backend without KV usage shows %v, want null", *b.KVUsage)
	}
	if b := byName["sim1"]; b.KVUsage == nil {
		t.Error("the backend with KV usage shows null")
	}
}
