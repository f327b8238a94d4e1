package chaos

import (
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"
)

// webhooksConfig is kvgate's webhooks section.
type webhooksConfig struct {
	AllowCIDRs    []string        `yaml:"allow_cidrs"`
	AllowHTTP     bool            `yaml:"allow_http"`
	RetrySchedule []time.Duration `yaml:"retry_schedule,omitempty"`
	Timeout       time.Duration   `yaml:"timeout,omitempty"`
}

// hookReceiver is a loopback receiver that takes a while to answer, so
// that a kill lands while deliveries are being sent, and remembers under
// which webhook-ids each job's event came.
type hookReceiver struct {
	srv  *httptest.Server
	mu   sync.Mutex
	ids  map[string]map[string]int // job id -> webhook-id -> requests
	hits int
}

func newHookReceiver(t *testing.T, delay time.Duration) *hookReceiver {
	h := &hookReceiver{ids: map[string]map[string]int{}}
	h.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var p struct {
			Data struct {
				JobID string `json:"job_id"`
			} `json:"data"`
		}
		if err := json.NewDecoder(r.Body).Decode(&p); err != nil || r.Header.Get("webhook-id") == "" || r.Header.Get("webhook-signature") == "" {
			w.WriteHeader(http.StatusBadRequest)
			return
		}
		time.Sleep(delay)
		h.mu.Lock()
		h.hits++
		if h.ids[p.Data.JobID] == nil {
			h.ids[p.Data.JobID] = map[string]int{}
		}
		h.ids[p.Data.JobID][r.Header.Get("webhook-id")]++
		h.mu.Unlock()
		w.WriteHeader(http.StatusNoContent)
	}))
	t.Cleanup(h.srv.Close)
	return h
}

func (h *hookReceiver) received() (jobs, hits int) {
	h.mu.Lock()
	defer h.mu.Unlock()
	return len(h.ids), h.hits
}

// TestWebhookKillMidBurst: kvgate is killed with -9 while it is sending a
// burst of job.succeeded deliveries, and restarted. Afterwards every job's
// event was delivered (its delivery row DELIVERED), and each job's event
// came under one webhook-id however many times it came: the killed
// replica's deliveries are sent again by the next one under their ids.
func TestWebhookKillMidBurst(t *testing.T) {
	need(t, "short")
	rc := newHookReceiver(t, 30*time.Millisecond)
	e := newEnv(t, options{webhooks: &webhooksConfig{AllowCIDRs: []string{"127.0.0.0/8"}, AllowHTTP: true,
		RetrySchedule: []time.Duration{0, 100 * time.Millisecond, time.Second, 2 * time.Second, 5 * time.Second}, Timeout: 2 * time.Second}})
	// The endpoint, as POST /v1/webhooks/endpoints writes it (the
	// scenario's static key is a user's, which may not register one).
	if _, err := e.db.Exec(`INSERT INTO webhook_endpoints (id, tenant, url, events, description, secret, created_at, updated_at)
		VALUES ('we_chaos', $1, $2, ',job.succeeded,', 'chaos', 'whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw', 0, 0)`,
		userTenant, rc.srv.URL+"/hook"); err != nil {
		t.Fatal(err)
	}
	const n = 150
	e.submitAll(batch{name: "hooks", n: n, maxTokens: 20})
	eventually(t, 2*time.Minute, 50*time.Millisecond, "deliveries under way", func() (bool, string, error) {
		jobs, _ := rc.received()
		return jobs >= 30, fmt.Sprintf("%d jobs' events received", jobs), nil
	})
	e.gw.kill()
	var sending int
	_ = e.db.QueryRow(`SELECT COUNT(*) FROM webhook_deliveries WHERE state = 'SENDING'`).Scan(&sending)
	e.mark("kill -9 kvgate with %d deliveries SENDING", sending)
	e.gw.start()
	e.mark("kvgate restarted")
	e.waitFinal(3 * time.Minute)
	eventually(t, 2*time.Minute, 100*time.Millisecond, "every delivery DELIVERED", func() (bool, string, error) {
		var total, delivered int
		if err := e.db.QueryRow(`SELECT COUNT(*), COUNT(*) FILTER (WHERE state = 'DELIVERED') FROM webhook_deliveries`).Scan(&total, &delivered); err != nil {
			return false, "", err
		}
		return total == n && delivered == n, fmt.Sprintf("%d of %d delivered", delivered, total), nil
	})
	rows, err := e.db.Query(`SELECT id, job_id FROM webhook_deliveries`)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	rc.mu.Lock()
	defer rc.mu.Unlock()
	dups := 0
	for rows.Next() {
		var id, job string
		if err := rows.Scan(&id, &job); err != nil {
			t.Fatal(err)
		}
		got := rc.ids[job]
		if len(got) != 1 || got[id] == 0 {
			t.Errorf("job %s's event came under %v, its delivery is %s", job, got, id)
		}
		dups += got[id] - 1
	}
	e.mark("%d requests for %d events: %d sent again after the kill", rc.hits, n, dups)
	e.finish(expectSucceeded)
}
