package gateway

import (
	"bytes"
	"context"
	"log/slog"
	"maps"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvgate/kvgate/store"
	"github.com/kvgate/kvgate/store/sqlstore"
)

// keyID returns the stored id of a key.
func keyID(t *testing.T, st store.Tenants, key string) string {
	t.Helper()
	k, err := st.KeyByHash(context.Background(), HashKey(key))
	if err != nil {
		t.Fatal(err)
	}
	return k.ID
}

// wantLockedOut checks that a gateway whose store holds no valid key
// answers 401 to everyone: anonymous callers, old keys, the admin API,
// and an attempt to mint a key; and that no key was minted.
func wantLockedOut(t *testing.T, base string, st *sqlstore.Store, oldKeys ...string) {
	t.Helper()
	for _, key := range append([]string{"", "kvg_guessed"}, oldKeys...) {
		for _, c := range []struct{ method, path, body string }{
			{http.MethodGet, "/v1/models", ""},
			{http.MethodPost, "/v1/chat/completions", chatReq(2)},
			{http.MethodGet, "/v1/admin/tenants", ""},
			{http.MethodGet, "/v1/admin/keys", ""},
			{http.MethodPost, "/v1/admin/tenants", `{"name":"intruder"}`},
			{http.MethodPost, "/v1/admin/keys", `{"tenant":"ops","role":"admin"}`},
			{http.MethodGet, "/v1/usage", ""},
		} {
			if resp, b := send(t, base, c.method, c.path, key, c.body); resp.StatusCode != http.StatusUnauthorized {
				t.Errorf("%s %s with key %.12q and no valid key left: %d %s, want 401", c.method, c.path, key, resp.StatusCode, b)
			}
		}
	}
	if n, err := st.ActiveKeys(context.Background()); err != nil || n != 0 {
		t.Errorf("keys after the attempts: %d %v, want none minted", n, err)
	}
	if _, err := st.GetTenant(context.Background(), "intruder"); err == nil {
		t.Error("an anonymous caller created a tenant")
	}
}

// TestNoKeyLeftIsNoEntry: outside development mode, a store whose only key
// was revoked, rotated away or lost with its tenant answers 401 to every
// caller, the admin API included; nobody anonymous mints a key, on a store
// that never held one either.
func TestNoKeyLeftIsNoEntry(t *testing.T) {
	for _, tc := range []struct {
		name string
		// lose makes the store hold no valid key, through the gateway at
		// base, with the only key there is; it returns the keys lost.
		lose func(t *testing.T, base string, st *sqlstore.Store, key string) []string
	}{
		{"revoke", func(t *testing.T, base string, st *sqlstore.Store, key string) []string {
			if resp, b := send(t, base, http.MethodDelete, "/v1/admin/keys/"+keyID(t, st, key), key, ""); resp.StatusCode != http.StatusOK {
				t.Fatalf("revoke the only key: %d %s", resp.StatusCode, b)
			}
			return []string{key}
		}},
		{"rotate", func(t *testing.T, base string, st *sqlstore.Store, key string) []string {
			resp, b := send(t, base, http.MethodPost, "/v1/admin/keys/"+keyID(t, st, key)+"/rotate", key, "")
			if resp.StatusCode != http.StatusCreated {
				t.Fatalf("rotate the only key: %d %s", resp.StatusCode, b)
			}
			next := decode[KeyView](t, b).Key
			if resp, _ := send(t, base, http.MethodGet, "/v1/admin/tenants", key, ""); resp.StatusCode != http.StatusUnauthorized {
				t.Errorf("the rotated-out key: %d, want 401", resp.StatusCode)
			}
			if resp, b := send(t, base, http.MethodDelete, "/v1/admin/keys/"+keyID(t, st, next), next, ""); resp.StatusCode != http.StatusOK {
				t.Fatalf("revoke the rotated key: %d %s", resp.StatusCode, b)
			}
			return []string{key, next}
		}},
		{"delete tenant", func(t *testing.T, base string, st *sqlstore.Store, key string) []string {
			if resp, b := send(t, base, http.MethodDelete, "/v1/admin/tenants/ops", key, ""); resp.StatusCode != http.StatusOK {
				t.Fatalf("delete the only key's tenant: %d %s", resp.StatusCode, b)
			}
			return []string{key}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			st := sqliteStore(t)
			key := newTenant(t, st, "ops", store.Limits{}, store.RoleAdmin)
			f := startFleet(t, fleetOpts{store: st, speedup: 50, keysRequired: true, gateway: Config{Tenants: Tenants{Store: st}}})
			if resp, b := send(t, f.srv.URL, http.MethodGet, "/v1/admin/tenants", key, ""); resp.StatusCode != http.StatusOK {
				t.Fatalf("the admin key before: %d %s", resp.StatusCode, b)
			}
			lost := tc.lose(t, f.srv.URL, st, key)
			wantLockedOut(t, f.srv.URL, st, lost...)
		})
	}
	t.Run("never held a key", func(t *testing.T) {
		st := sqliteStore(t)
		if err := st.CreateTenant(context.Background(), store.Tenant{Name: "ops", Weight: 1, CreatedAt: quotaT0, UpdatedAt: quotaT0}); err != nil {
			t.Fatal(err)
		}
		f := startFleet(t, fleetOpts{store: st, speedup: 50, keysRequired: true, gateway: Config{Tenants: Tenants{Store: st}}})
		wantLockedOut(t, f.srv.URL, st)
	})
}

// heldLookups is a real store whose key lookups of chosen keys stop, once
// they have read the store, until the test lets them go on.
type heldLookups struct {
	store.Tenants
	mu   sync.Mutex
	hold map[string]chan struct{} // by key hash: closed to let the lookup go on
	read chan struct{}            // a held lookup has read the store
}

func (h *heldLookups) KeyByHash(ctx context.Context, hash string) (store.APIKey, error) {
	k, err := h.Tenants.KeyByHash(ctx, hash)
	h.mu.Lock()
	release, ok := h.hold[hash]
	delete(h.hold, hash)
	h.mu.Unlock()
	if ok {
		h.read <- struct{}{}
		<-release
	}
	return k, err
}

// holdNext holds the next lookup of key; closing the channel returned
// lets it go on.
func (h *heldLookups) holdNext(key string) chan struct{} {
	release := make(chan struct{})
	h.mu.Lock()
	h.hold[HashKey(key)] = release
	h.mu.Unlock()
	return release
}

// TestRevocationDuringLookup: a lookup that read a key from the store
// before its revocation, and stores its answer after the revocation
// through the same replica, does not bring the key back: the next request
// with it is refused at once, within the cache's TTL (the clock does not
// move), for a revocation, a rotation and a tenant's deletion.
func TestRevocationDuringLookup(t *testing.T) {
	for _, tc := range []struct {
		name   string
		revoke func(t *testing.T, base, admin, id string) // through base, with an admin key
	}{
		{"revoke", func(t *testing.T, base, admin, id string) {
			if resp, b := send(t, base, http.MethodDelete, "/v1/admin/keys/"+id, admin, ""); resp.StatusCode != http.StatusOK {
				t.Fatalf("revoke: %d %s", resp.StatusCode, b)
			}
		}},
		{"rotate", func(t *testing.T, base, admin, id string) {
			if resp, b := send(t, base, http.MethodPost, "/v1/admin/keys/"+id+"/rotate", admin, ""); resp.StatusCode != http.StatusCreated {
				t.Fatalf("rotate: %d %s", resp.StatusCode, b)
			}
		}},
		{"delete tenant", func(t *testing.T, base, admin, _ string) {
			if resp, b := send(t, base, http.MethodDelete, "/v1/admin/tenants/acme", admin, ""); resp.StatusCode != http.StatusOK {
				t.Fatalf("delete tenant: %d %s", resp.StatusCode, b)
			}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			st := sqliteStore(t)
			admin := newTenant(t, st, "ops", store.Limits{}, store.RoleAdmin)
			key := newTenant(t, st, "acme", store.Limits{}, store.RoleUser)
			held := &heldLookups{Tenants: st, hold: map[string]chan struct{}{}, read: make(chan struct{})}
			clock := &testClock{now: quotaT0}
			f := startFleet(t, fleetOpts{store: st, speedup: 50, keysRequired: true,
				gateway: Config{Tenants: Tenants{Store: held, Now: clock.Now, CacheTTL: time.Minute}}})

			release := held.holdNext(key)
			first := make(chan int, 1)
			go func() {
				resp, _ := send(t, f.srv.URL, http.MethodGet, "/v1/models", key, "")
				first <- resp.StatusCode
			}()
			<-held.read // the lookup found the key, and waits to cache it
			tc.revoke(t, f.srv.URL, admin, keyID(t, st, key))
			close(release)
			<-first // in flight across the revocation: either answer is right
			if resp, b := send(t, f.srv.URL, http.MethodGet, "/v1/models", key, ""); resp.StatusCode != http.StatusUnauthorized {
				t.Errorf("the revoked key after a lookup that raced the revocation: %d %s, want 401", resp.StatusCode, b)
			}
			if p, found, err := f.api.lookupKey(t.Context(), key); found || err != nil {
				t.Errorf("lookupKey of the revoked key: %+v %v %v, want not found", p, found, err)
			}
		})
	}
}

// TestDevModeUntilFirstKey: in development mode a caller without a key is
// the default tenant's admin until the first key exists, then never again:
// revoking that key leaves a store that answers 401 to everyone, on this
// replica and on one started afresh; a static key ends development mode
// from the start.
func TestDevModeUntilFirstKey(t *testing.T) {
	st := sqliteStore(t)
	cfg := Config{Dev: true, Tenants: Tenants{Store: st}}
	f := startFleet(t, fleetOpts{store: st, speedup: 50, gateway: cfg})
	if resp, b := send(t, f.srv.URL, http.MethodPost, "/v1/chat/completions", "", chatReq(2)); resp.StatusCode != http.StatusOK {
		t.Fatalf("anonymous chat in development mode: %d %s", resp.StatusCode, b)
	}
	if resp, b := send(t, f.srv.URL, http.MethodPost, "/v1/admin/tenants", "", `{"name":"ops"}`); resp.StatusCode != http.StatusCreated {
		t.Fatalf("anonymous admin in development mode: %d %s", resp.StatusCode, b)
	}
	resp, b := send(t, f.srv.URL, http.MethodPost, "/v1/admin/keys", "", `{"tenant":"ops","role":"admin"}`)
	if resp.StatusCode != http.StatusCreated {
		t.Fatalf("the first key: %d %s", resp.StatusCode, b)
	}
	key := decode[KeyView](t, b).Key
	if resp, _ := send(t, f.srv.URL, http.MethodGet, "/v1/models", "", ""); resp.StatusCode != http.StatusUnauthorized {
		t.Errorf("anonymous after the first key: %d, want 401", resp.StatusCode)
	}
	if resp, b := send(t, f.srv.URL, http.MethodDelete, "/v1/admin/keys/"+keyID(t, st, key), key, ""); resp.StatusCode != http.StatusOK {
		t.Fatalf("revoke the only key: %d %s", resp.StatusCode, b)
	}
	wantLockedOut(t, f.srv.URL, st, key)
	restarted := startFleet(t, fleetOpts{speedup: 50, gateway: cfg})
	wantLockedOut(t, restarted.srv.URL, st, key)

	static := startFleet(t, fleetOpts{speedup: 50, gateway: Config{Dev: true, AdminKeys: map[string]string{"boot": "admin"},
		Tenants: Tenants{Store: sqliteStore(t)}}})
	if resp, _ := send(t, static.srv.URL, http.MethodGet, "/v1/admin/tenants", "", ""); resp.StatusCode != http.StatusUnauthorized {
		t.Errorf("anonymous in development mode with a static key: %d, want 401", resp.StatusCode)
	}
}

// TestDevModeIsExplicit: a gateway nobody could call does not start, and
// development mode says so in the log when it starts.
func TestDevModeIsExplicit(t *testing.T) {
	if _, err := New(Config{}, nil, nil, prometheus.NewRegistry(), nil); err == nil {
		t.Error("a gateway without keys, store or development mode started")
	}
	var log bytes.Buffer
	if _, err := New(Config{Dev: true}, nil, nil, prometheus.NewRegistry(), slog.New(slog.NewTextHandler(&log, nil))); err != nil {
		t.Fatal(err)
	}
	if n := strings.Count(log.String(), "level=WARN msg=\"development mode:"); n != 1 {
		t.Errorf("development mode logged %d warnings, want 1:\n%s", n, log.String())
	}
}

// countedLookups is a real store that counts its key lookups by hash.
type countedLookups struct {
	store.Tenants
	mu sync.Mutex
	n  map[string]int
}

func (c *countedLookups) KeyByHash(ctx context.Context, hash string) (store.APIKey, error) {
	c.mu.Lock()
	c.n[hash]++
	c.mu.Unlock()
	return c.Tenants.KeyByHash(ctx, hash)
}

func (c *countedLookups) lookups() (total int, of map[string]int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, n := range c.n {
		total += n
	}
	return total, maps.Clone(c.n)
}

// TestWrongTokensDoNotEvictKeys: a flood of wrong tokens, more than the
// key cache holds, leaves the valid keys in use cached (no store lookup
// for them within the TTL); a token no key could be is refused without
// asking the store.
func TestWrongTokensDoNotEvictKeys(t *testing.T) {
	st := sqliteStore(t)
	key := newTenant(t, st, "acme", store.Limits{}, store.RoleUser)
	counted := &countedLookups{Tenants: st, n: map[string]int{}}
	clock := &testClock{now: quotaT0}
	s, err := New(Config{Tenants: Tenants{Store: counted, Now: clock.Now, CacheTTL: time.Minute}}, nil, nil, prometheus.NewRegistry(), nil)
	if err != nil {
		t.Fatal(err)
	}
	lookup := func(token string) bool {
		t.Helper()
		p, found, err := s.lookupKey(t.Context(), token)
		if err != nil {
			t.Fatal(err)
		}
		return found && p.tenant == "acme"
	}
	if !lookup(key) {
		t.Fatal("the valid key was not found")
	}
	for _, bad := range []string{"", "kvg_guessed", key + "x", key[:len(key)-1], strings.Replace(key, key[5:6], "!", 1), "sk-" + key[4:]} {
		if lookup(bad) {
			t.Errorf("token %q was taken for a key", bad)
		}
	}
	if total, _ := counted.lookups(); total != 1 {
		t.Errorf("tokens no key could be made %d store lookups, want none", total-1)
	}
	for i := range keyCacheMax + 10 {
		wrong, _ := NewAPIKey("acme", store.RoleUser, "", quotaT0)
		if lookup(wrong) {
			t.Fatalf("wrong token %d was taken for a key", i)
		}
	}
	if !lookup(key) {
		t.Fatal("the valid key was not found after the flood")
	}
	if _, of := counted.lookups(); of[HashKey(key)] != 1 {
		t.Errorf("the valid key was read from the store %d times within its TTL, with a flood of wrong tokens beside it; want once", of[HashKey(key)])
	}
}
