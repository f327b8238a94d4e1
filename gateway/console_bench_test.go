package gateway

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/kvgate/kvgate/scheduler"
	"github.com/kvgate/kvgate/store"
	"github.com/kvgate/kvgate/store/sqlite"
)

// BenchmarkConsolePages renders console pages with 100,000 jobs of the
// signed-in tenant in the store (SQLite), beside the API call the jobs
// page makes (api-v1-jobs): every page is a keyset query on an index, so
// a deep page costs what the first does.
//
//	go test -run '^$' -bench BenchmarkConsolePages -benchtime 200x -count 5 ./gateway/
func BenchmarkConsolePages(b *testing.B) {
	const n = 100_000
	ctx := context.Background()
	st, err := sqlite.Open(ctx, filepath.Join(b.TempDir(), "kvgate.db"))
	if err != nil {
		b.Fatal(err)
	}
	defer st.Close()
	if _, err := sqlite.Migrate(ctx, st); err != nil {
		b.Fatal(err)
	}
	// The durable backlog as serve.go reports it: a periodic collection's
	// (refreshed once below, after the jobs are in).
	dm := scheduler.NewDurableMetrics(scheduler.DurableMetricsConfig{Store: st, Every: time.Hour})
	f := startFleet(b, fleetOpts{store: st, keysRequired: true, gateway: Config{Tenants: Tenants{Store: st},
		Webhooks: Webhooks{Store: st, Guard: loopbackGuard()}, Backlog: dm.Backlog}})
	if err := st.CreateTenant(ctx, store.Tenant{Name: "acme", Weight: 1, CreatedAt: quotaT0, UpdatedAt: quotaT0}); err != nil {
		b.Fatal(err)
	}
	secret, k := NewAPIKey("acme", store.RoleOperator, "bench", quotaT0)
	if err := st.CreateKey(ctx, k); err != nil {
		b.Fatal(err)
	}
	// Tenant beta: a full page of jobs waiting for a review, each with a
	// withheld answer, which the Reviews page reads one API call each.
	if err := st.CreateTenant(ctx, store.Tenant{Name: "beta", Weight: 1, CreatedAt: quotaT0, UpdatedAt: quotaT0}); err != nil {
		b.Fatal(err)
	}
	betaSecret, bk := NewAPIKey("beta", store.RoleOperator, "bench", quotaT0)
	if err := st.CreateKey(ctx, bk); err != nil {
		b.Fatal(err)
	}
	t0 := time.Now()
	for i := range consolePageSize {
		if _, _, err := st.Accept(ctx, store.NewJob{ID: uuid.Must(uuid.NewV7()).String(), EventID: uuid.Must(uuid.NewV7()).String(), Tenant: "beta",
			IdempotencyKey: fmt.Sprint("review-", i), RequestHash: "h", Endpoint: "/v1/chat/completions", Model: llama,
			Body: []byte(`{"model":"m","messages":[]}`), TokenEstimate: 10, MaxAttempts: 3, Deadline: t0.Add(time.Hour), Now: t0}); err != nil {
			b.Fatal(err)
		}
	}
	held, err := st.Claim(ctx, t0, time.Minute, consolePageSize)
	if err != nil || len(held) != consolePageSize {
		b.Fatalf("claimed %d for review: %v", len(held), err)
	}
	for _, j := range held {
		res := []byte(`{"id":"c","object":"chat.completion","model":"m","choices":[{"index":0,"finish_reason":"stop",` +
			`"message":{"role":"assistant","content":"{\"total\": 30, \"currency\": \"EU"}}]}`)
		if err := st.Complete(ctx, store.Completion{JobID: j.ID, Fence: j.Fence, State: store.ReviewRequired, Result: res,
			Attempt: store.Attempt{JobID: j.ID, Attempt: j.Attempt + 1, Fence: j.Fence, Outcome: store.OutcomeSucceeded, StartedAt: t0, EndedAt: t0},
			EventID: uuid.Must(uuid.NewV7()).String(), Now: t0}); err != nil {
			b.Fatal(err)
		}
	}
	start := time.Now().Add(-time.Duration(n) * time.Millisecond)
	var ids []string
	for i := range n {
		at := start.Add(time.Duration(i) * time.Millisecond)
		u := uuid.Must(uuid.NewV7()) // made at at: its first 48 bits are at's Unix milliseconds
		ms := uint64(at.UnixMilli())
		for j := range 6 {
			u[j] = byte(ms >> (40 - 8*j))
		}
		id := u.String()
		ids = append(ids, id)
		if _, _, err := st.Accept(ctx, store.NewJob{ID: id, EventID: uuid.Must(uuid.NewV7()).String(), Tenant: "acme",
			IdempotencyKey: fmt.Sprint("bench-", i), RequestHash: "h", Endpoint: "/v1/chat/completions", Model: llama,
			Body: []byte(`{"model":"m","messages":[]}`), TokenEstimate: 10, MaxAttempts: 3, Deadline: at.Add(time.Hour), Now: at}); err != nil {
			b.Fatal(err)
		}
	}
	// An endpoint with 1,000 FAILED deliveries (webhook.test), each with
	// an attempt on record: its page reads a page of 50 and each one's
	// attempts; the dead letters page lists 50 of them.
	hook := matrixEndpointOf(b, st, "acme")
	var dlv string
	for i := range 1000 {
		d, err := st.SendTest(ctx, "acme", hook, fmt.Sprint("bench-test-", i), quotaT0)
		if err != nil {
			b.Fatal(err)
		}
		dlv = d.ID
	}
	now := time.Now()
	claimed, err := st.ClaimDeliveries(ctx, now, time.Minute, 1000)
	if err != nil || len(claimed) != 1000 {
		b.Fatalf("claimed %d: %v", len(claimed), err)
	}
	var results []store.DeliveryResult
	for _, d := range claimed {
		results = append(results, store.DeliveryResult{ID: d.ID, Fence: d.Fence, State: store.DeliveryFailed, Now: now,
			Attempt: store.DeliveryAttempt{StartedAt: now, Latency: 3 * time.Millisecond, Status: 503, Error: "503 Service Unavailable"}})
	}
	if _, err := st.FinishDeliveries(ctx, results); err != nil {
		b.Fatal(err)
	}
	dm.Refresh(ctx)
	if bl, _ := dm.Backlog(); len(bl) != 1 || bl[0].Jobs != n {
		b.Fatalf("the backlog collected: %+v", bl)
	}
	cookie := &http.Cookie{Name: consoleCookie, Value: f.api.consoleSeal.seal(consoleSession{Key: secret, Expires: time.Now().Add(time.Hour).Unix(), CSRF: "x"})}
	betaCookie := &http.Cookie{Name: consoleCookie, Value: f.api.consoleSeal.seal(consoleSession{Key: betaSecret, Expires: time.Now().Add(time.Hour).Unix(), CSRF: "x"})}
	// For scale: the collection's read of the backlog, which runs in the
	// background every metrics.backlog_interval, never per page.
	b.Run("backlog-collection", func(b *testing.B) {
		for b.Loop() {
			if _, err := st.Stats(ctx, time.Now()); err != nil {
				b.Fatal(err)
			}
		}
	})
	mid := ids[n/2]
	for _, c := range []struct{ name, path string }{
		{"api-v1-jobs", "/v1/jobs?limit=50"},
		{"jobs-first-page", "/console/jobs"},
		{"jobs-deep-page", "/console/jobs?after=" + mid},
		{"jobs-by-state", "/console/jobs?state=READY&state=RETRY_SCHEDULED"},
		{"jobs-before-time", "/console/jobs?until=" + start.Add(n/4*time.Millisecond).UTC().Format("2006-01-02T15:04")},
		{"job", "/console/jobs/" + mid},
		{"queues", "/console/queues"},
		{"reviews", "/console/reviews"},
		{"dead-letters", "/console/dead-letters"},
		{"fleet", "/console/fleet"},
		{"api-v1-fleet-queues", "/v1/fleet/queues"},
		{"webhooks", "/console/webhooks"},
		{"webhook-endpoint", "/console/webhooks/endpoints/" + hook},
		{"webhook-delivery", "/console/webhooks/deliveries/" + dlv},
		{"reviews-full-page", "/console/reviews"}, // beta's: 50 jobs with their withheld answers
	} {
		b.Run(c.name, func(b *testing.B) {
			ck := cookie
			if c.name == "reviews-full-page" {
				ck = betaCookie
			}
			for b.Loop() {
				req := httptest.NewRequest(http.MethodGet, c.path, nil)
				req.AddCookie(ck)
				req.Header.Set("Authorization", "Bearer "+secret) // for the API's own row
				w := httptest.NewRecorder()
				f.api.ServeHTTP(w, req)
				if w.Code != http.StatusOK {
					b.Fatalf("%s: %d %s", c.path, w.Code, w.Body)
				}
				if c.name == "reviews-full-page" && strings.Count(w.Body.String(), `data-field="answer"`) != consolePageSize {
					b.Fatalf("the full review page shows %d withheld answers, want %d", strings.Count(w.Body.String(), `data-field="answer"`), consolePageSize)
				}
			}
		})
	}
}
