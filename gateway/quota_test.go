package gateway

import (
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

func sqliteStore(t *testing.T) *sqlstore.Store {
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
	clock := &testClock{now: quotaT0}
	release := make(chan struct{})
	var once sync.Once
	unblock := func() { once.Do(func() { close(release) }) }
	t.Cleanup(unblock)
	var holding bool
	var hmu sync.Mutex
	// hold keeps inference requests at the backend while holding is set.
	hold := func(_ int, h http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			hmu.Lock()
			wait := holding && r.Method == http.MethodPost
			hmu.Unlock()
			if wait {
				<-release
			}
			h.ServeHTTP(w, r)
		})
	}
	opts := fleetOpts{store: st, speedup: 50, wrap: hold, gateway: Config{Tenants: Tenants{Store: st, Now: clock.Now}}}
	replicas := []*fleet{startFleet(t, opts), startFleet(t, opts)}

	var answered atomic.Int64
	burst := func(key string) (ok, limited int, codes map[string]int) {
		var mu sync.Mutex
		var wg sync.WaitGroup
		codes = map[string]int{}
		for i := range callers {
			wg.Go(func() {
				resp, b := send(t, replicas[i%2].srv.URL, http.MethodPost, "/v1/chat/completions", key, chatReq(2))
				answered.Add(1)
				mu.Lock()
				defer mu.Unlock()
				switch resp.StatusCode {
				case http.StatusOK:
					ok++
				case http.StatusTooManyRequests:
					limited++
					var e errorBody
					_ = json.Unmarshal(b, &e)
					if e.Error.Code != nil {
						codes[*e.Error.Code]++
					}
				default:
					codes[fmt.Sprintf("status %d: %s", resp.StatusCode, b)]++
				}
			})
		}
		wg.Wait()
		return ok, limited, codes
	}

	t.Run("rpm", func(t *testing.T) {
		key := newTenant(t, st, "rpm-tenant", store.Limits{RPM: n}, store.RoleUser)
		ok, limited, codes := burst(key)
		if ok != n || limited != callers-n || codes["rate_limit_exceeded"] != callers-n {
			t.Errorf("%d requests against an RPM of %d on two replicas: %d admitted, %d limited, %v", callers, n, ok, limited, codes)
		}
		// Each permit is released after its response went out.
		var us []store.UsageDay
		waitFor(t, "every permit released", func() bool {
			us, _ = st.Usage(context.Background(), "rpm-tenant", quotaT0, quotaT0)
			return len(us) == 1 && us[0].ReservedTokens == 0
		})
		if u := us[0]; u.Requests != n || u.Attempts != n || u.CompletionTokens != 2*n || u.PromptTokens == 0 || u.Uncertain != 0 {
			t.Errorf("ledger: %+v", u)
		}
		t.Logf("rpm %d: %d of %d admitted across two replicas", n, ok, callers)
	})

	t.Run("concurrency", func(t *testing.T) {
		key := newTenant(t, st, "conc-tenant", store.Limits{MaxConcurrency: n}, store.RoleUser)
		hmu.Lock()
		holding = true
		hmu.Unlock()
		var ok, limited int
		var codes map[string]int
		answered.Store(0)
		done := make(chan struct{})
		go func() {
			defer close(done)
			ok, limited, codes = burst(key)
		}()
		// Every refused request has its answer while the admitted ones
		// wait at the backend (had more been admitted, fewer would be
		// answered, and this would time out); then they may finish.
		waitFor(t, "the refusals", func() bool { return answered.Load() == callers-n })
		if got := replicas[0].inflight() + replicas[1].inflight(); got != n {
			t.Errorf("%d requests in flight at the backends, want %d", got, n)
		}
		unblock()
		<-done
		if ok != n || limited != callers-n || codes["rate_limit_exceeded"] != callers-n {
			t.Errorf("%d requests against a concurrency of %d on two replicas: %d admitted, %d limited, %v", callers, n, ok, limited, codes)
		}
		// The permits come back: the next request runs.
		waitFor(t, "every permit released", func() bool {
			us, _ := st.Usage(context.Background(), "conc-tenant", quotaT0, quotaT0)
			return len(us) == 1 && us[0].ReservedTokens == 0
		})
		if resp, b := send(t, replicas[0].srv.URL, http.MethodPost, "/v1/chat/completions", key, chatReq(2)); resp.StatusCode != http.StatusOK {
			t.Errorf("after the burst: %d %s", resp.StatusCode, b)
		}
	})
}
