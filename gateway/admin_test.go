package gateway

import (
	"encoding/json"
	"fmt"
	"html"
	"io"
	"net/http"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvgate/kvgate/bench/eventually"

	"github.com/kvgate/kvgate/store"
)

func decode[T any](t *testing.T, b []byte) T {
	t.Helper()
	var v T
	if err := json.Unmarshal(b, &v); err != nil {
		t.Fatalf("decode %s: %v", b, err)
	}
	return v
}

// TestAdminAPIAndRoles: an admin manages tenants and keys over HTTP; the
// keys it creates work at once, with their roles; users, operators and
// admins see what their role allows; another tenant's job is a 404.
func TestAdminAPIAndRoles(t *testing.T) {
	st := sqliteStore(t)
	clock := &testClock{now: quotaT0}
	f := startFleet(t, fleetOpts{store: st, speedup: 50, gateway: Config{
		AdminKeys: map[string]string{"boot-admin": "admin"}, APIKeys: map[string]string{"static-user": "legacy"},
		Tenants: Tenants{Store: st, Now: clock.Now}}})
	admin := func(method, path, body string) (*http.Response, []byte) {
		t.Helper()
		return send(t, f.srv.URL, method, path, "boot-admin", body)
	}
	// Tenants.
	resp, b := admin(http.MethodPost, "/v1/admin/tenants", `{"name":"acme","rpm":100,"max_pending_jobs":1}`)
	if resp.StatusCode != http.StatusCreated || decode[TenantView](t, b).RPM != 100 {
		t.Fatalf("create tenant: %d %s", resp.StatusCode, b)
	}
	if resp, b := admin(http.MethodPost, "/v1/admin/tenants", `{"name":"acme"}`); resp.StatusCode != http.StatusConflict {
		t.Errorf("create twice: %d %s", resp.StatusCode, b)
	}
	admin(http.MethodPost, "/v1/admin/tenants", `{"name":"globex"}`)
	if resp, b := admin(http.MethodPost, "/v1/admin/tenants", `{"name":""}`); resp.StatusCode != http.StatusBadRequest || !strings.Contains(string(b), `"param":"name"`) {
		t.Errorf("a tenant without a name: %d %s, want 400 naming name", resp.StatusCode, b)
	}
	resp, b = admin(http.MethodPatch, "/v1/admin/tenants/acme", `{"tpm":5000,"weight":2}`)
	if v := decode[TenantView](t, b); resp.StatusCode != http.StatusOK || v.RPM != 100 || v.TPM != 5000 || v.Weight != 2 {
		t.Errorf("update tenant: %d %s", resp.StatusCode, b)
	}
	if resp, _ := admin(http.MethodGet, "/v1/admin/tenants/nobody", ""); resp.StatusCode != http.StatusNotFound {
		t.Errorf("get a missing tenant: %d", resp.StatusCode)
	}
	resp, b = admin(http.MethodGet, "/v1/admin/tenants", "")
	if l := decode[struct{ Data []TenantView }](t, b); resp.StatusCode != http.StatusOK || len(l.Data) != 2 {
		t.Errorf("list tenants: %d %s", resp.StatusCode, b)
	}
	// Keys, shown once.
	keys := map[store.Role]KeyView{}
	for _, role := range []store.Role{store.RoleUser, store.RoleOperator, store.RoleAdmin} {
		resp, b := admin(http.MethodPost, "/v1/admin/keys", `{"tenant":"acme","role":"`+string(role)+`","name":"t"}`)
		k := decode[KeyView](t, b)
		if resp.StatusCode != http.StatusCreated || !strings.HasPrefix(k.Key, KeyPrefix) || k.Role != string(role) {
			t.Fatalf("create %s key: %d %s", role, resp.StatusCode, b)
		}
		keys[role] = k
	}
	if resp, b := admin(http.MethodPost, "/v1/admin/keys", `{"tenant":"nobody"}`); resp.StatusCode != http.StatusNotFound {
		t.Errorf("a key for a missing tenant: %d %s", resp.StatusCode, b)
	}
	resp, b = admin(http.MethodGet, "/v1/admin/keys?tenant=acme", "")
	if resp.StatusCode != http.StatusOK || strings.Contains(string(b), keys[store.RoleUser].Key) || strings.Count(string(b), `"api_key"`) != 3 {
		t.Errorf("list keys shows the secrets or misses keys: %d %s", resp.StatusCode, b)
	}
	globex := newKey(t, st, "globex", store.RoleOperator)
	user, operator, adminKey := keys[store.RoleUser].Key, keys[store.RoleOperator].Key, keys[store.RoleAdmin].Key

	// Role checks.
	for _, tc := range []struct {
		key, method, path string
		want              int
	}{
		{user, http.MethodGet, "/v1/admin/tenants", http.StatusForbidden},
		{operator, http.MethodGet, "/v1/admin/tenants", http.StatusForbidden},
		{adminKey, http.MethodGet, "/v1/admin/tenants", http.StatusOK},
		{user, http.MethodGet, "/v1/usage", http.StatusForbidden},
		{operator, http.MethodGet, "/v1/usage", http.StatusOK},
		{"static-user", http.MethodGet, "/v1/usage", http.StatusForbidden},
		{"static-user", http.MethodGet, "/v1/models", http.StatusOK},
		{"kvg_not-a-key", http.MethodGet, "/v1/models", http.StatusUnauthorized},
		{"", http.MethodGet, "/v1/models", http.StatusUnauthorized},
	} {
		if resp, b := send(t, f.srv.URL, tc.method, tc.path, tc.key, ""); resp.StatusCode != tc.want {
			t.Errorf("%s %s with %.12s: %d %s, want %d", tc.method, tc.path, tc.key, resp.StatusCode, b, tc.want)
		}
	}
	// Jobs: a pending-job limit of one; attempts for operators only;
	// another tenant's job is not found.
	submit := func(key, idem string) (*http.Response, []byte) {
		req, _ := http.NewRequest(http.MethodPost, f.srv.URL+"/v1/jobs", strings.NewReader(chatJob("x", 4)))
		req.Header.Set("Authorization", "Bearer "+key)
		req.Header.Set("Idempotency-Key", idem)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp, b
	}
	resp, b = submit(user, "j1")
	if resp.StatusCode != http.StatusAccepted {
		t.Fatalf("submit: %d %s", resp.StatusCode, b)
	}
	job := decode[jobView](t, b)
	resp, b = submit(user, "j2")
	if e := decodeError(t, b); resp.StatusCode != http.StatusTooManyRequests || !strings.Contains(e.Error.Message, "pending jobs: Limit 1, Used 1") {
		t.Errorf("a second pending job: %d %s", resp.StatusCode, b)
	}
	for _, tc := range []struct {
		key  string
		want int
	}{{user, http.StatusForbidden}, {operator, http.StatusOK}, {adminKey, http.StatusOK}, {globex, http.StatusNotFound}} {
		if resp, b := send(t, f.srv.URL, http.MethodGet, "/v1/jobs/"+job.ID+"/attempts", tc.key, ""); resp.StatusCode != tc.want {
			t.Errorf("attempts with a %.12s key: %d %s, want %d", tc.key, resp.StatusCode, b, tc.want)
		}
	}
	if resp, _ := send(t, f.srv.URL, http.MethodGet, "/v1/jobs/"+job.ID, globex, ""); resp.StatusCode != http.StatusNotFound {
		t.Errorf("another tenant's job: %d, want 404", resp.StatusCode)
	}

	// Usage: the operator's own tenant; the admin's report of all.
	if resp, b := send(t, f.srv.URL, http.MethodPost, "/v1/chat/completions", user, chatReq(3)); resp.StatusCode != http.StatusOK {
		t.Fatalf("chat: %d %s", resp.StatusCode, b)
	}
	var days []UsageView
	eventually.True(t, "the usage", func() bool {
		_, b := send(t, f.srv.URL, http.MethodGet, "/v1/usage", operator, "")
		days = decode[struct{ Data []UsageView }](t, b).Data
		return len(days) == 1 && days[0].ReservedTokens == 0
	})
	if u := days[0]; u.Tenant != "acme" || u.Date != "2026-11-30" || u.Requests != 1 || u.Attempts != 1 || u.CompletionTokens != 3 ||
		u.PromptTokens == 0 || u.ChargedTokens != u.PromptTokens+3 {
		t.Errorf("usage: %+v", u)
	}
	send(t, f.srv.URL, http.MethodPost, "/v1/chat/completions", globex, chatReq(2))
	eventually.True(t, "the admin's report", func() bool {
		_, b := admin(http.MethodGet, "/v1/admin/usage?from=2026-11-01&to=2026-11-30", "")
		days = decode[struct{ Data []UsageView }](t, b).Data
		return len(days) == 2 && days[1].Tenant == "globex" && days[1].ReservedTokens == 0
	})
	if resp, _ := admin(http.MethodGet, "/v1/admin/usage?from=yesterday", ""); resp.StatusCode != http.StatusBadRequest {
		t.Errorf("a bad date: %d", resp.StatusCode)
	}
	// A report's days run forward and span a year at most; to alone ends
	// the 30 days before it.
	for q, want := range map[string]int{
		"?from=2026-12-01&to=2026-11-01": http.StatusBadRequest,
		"?from=2020-01-01&to=2026-11-30": http.StatusBadRequest,
		"?to=2026-11-30":                 http.StatusOK,
	} {
		resp, b := admin(http.MethodGet, "/v1/admin/usage"+q, "")
		if resp.StatusCode != want || (want == http.StatusOK && len(decode[struct{ Data []UsageView }](t, b).Data) != 2) {
			t.Errorf("usage%s: %d %s, want %d", q, resp.StatusCode, b, want)
		}
	}
	// A misspelled or impossible setting is refused, not ignored or
	// stored as something else.
	for body, param := range map[string]string{
		`{"max_concurency":5}`:      "max_concurency",
		`{"weight":3000000000}`:     "weight",
		`{"daily_spend":0.0000004}`: "",
		`{"weight":2} {"weight":3}`: "",
	} {
		resp, b := admin(http.MethodPatch, "/v1/admin/tenants/acme", body)
		var e errorBody
		_ = json.Unmarshal(b, &e)
		if resp.StatusCode != http.StatusBadRequest || (param != "" && (e.Error.Param == nil || *e.Error.Param != param)) {
			t.Errorf("PATCH %s: %d %s, want 400 naming %q", body, resp.StatusCode, b, param)
		}
	}

	// Rotation and deletion.
	resp, b = admin(http.MethodPost, "/v1/admin/keys/"+keys[store.RoleUser].ID+"/rotate", "")
	rotated := decode[KeyView](t, b)
	if resp.StatusCode != http.StatusCreated || rotated.Key == user || rotated.Role != "user" {
		t.Fatalf("rotate: %d %s", resp.StatusCode, b)
	}
	if resp, _ := send(t, f.srv.URL, http.MethodGet, "/v1/models", user, ""); resp.StatusCode != http.StatusUnauthorized {
		t.Errorf("the rotated-out key on the replica that rotated it: %d", resp.StatusCode)
	}
	if resp, _ := send(t, f.srv.URL, http.MethodGet, "/v1/models", rotated.Key, ""); resp.StatusCode != http.StatusOK {
		t.Errorf("the new key: %d", resp.StatusCode)
	}
	if resp, b := admin(http.MethodDelete, "/v1/admin/tenants/globex", ""); resp.StatusCode != http.StatusOK {
		t.Errorf("delete tenant: %d %s", resp.StatusCode, b)
	}
	if resp, _ := send(t, f.srv.URL, http.MethodGet, "/v1/models", globex, ""); resp.StatusCode != http.StatusUnauthorized {
		t.Errorf("a deleted tenant's key: %d", resp.StatusCode)
	}
}

// TestKeyRevocationReachesOtherReplicas: a key revoked through one replica
// stops working there at once and on another replica once its cache TTL
// has passed.
func TestKeyRevocationReachesOtherReplicas(t *testing.T) {
	st := sqliteStore(t)
	clock := &testClock{now: quotaT0}
	cfg := Config{Tenants: Tenants{Store: st, Now: clock.Now, CacheTTL: 5 * time.Second}}
	a := startFleet(t, fleetOpts{store: st, gateway: cfg})
	b := startFleet(t, fleetOpts{gateway: cfg})
	adminKey := newTenant(t, st, "ops", store.Limits{}, store.RoleAdmin)
	key := newKey(t, st, "ops", store.RoleUser)
	for _, f := range []*fleet{a, b} {
		if resp, body := send(t, f.srv.URL, http.MethodGet, "/v1/models", key, ""); resp.StatusCode != http.StatusOK {
			t.Fatalf("before revocation: %d %s", resp.StatusCode, body)
		}
	}
	// Without any key, development mode; with one, none: no anonymous call.
	if resp, _ := send(t, b.srv.URL, http.MethodGet, "/v1/models", "", ""); resp.StatusCode != http.StatusUnauthorized {
		t.Errorf("anonymous with keys in the store: %d", resp.StatusCode)
	}
	k, err := st.KeyByHash(t.Context(), HashKey(key))
	if err != nil {
		t.Fatal(err)
	}
	resp, body := send(t, a.srv.URL, http.MethodDelete, "/v1/admin/keys/"+k.ID, adminKey, "")
	if resp.StatusCode != http.StatusOK || decode[KeyView](t, body).RevokedAt == nil {
		t.Fatalf("revoke: %d %s", resp.StatusCode, body)
	}
	if resp, _ := send(t, a.srv.URL, http.MethodGet, "/v1/models", key, ""); resp.StatusCode != http.StatusUnauthorized {
		t.Errorf("the revoking replica still takes the key: %d", resp.StatusCode)
	}
	if resp, _ := send(t, b.srv.URL, http.MethodGet, "/v1/models", key, ""); resp.StatusCode != http.StatusOK {
		t.Errorf("within the TTL the other replica may still take it (cached): %d", resp.StatusCode)
	}
	clock.Advance(5 * time.Second)
	if resp, _ := send(t, b.srv.URL, http.MethodGet, "/v1/models", key, ""); resp.StatusCode != http.StatusUnauthorized {
		t.Errorf("after the TTL the other replica still takes the key: %d", resp.StatusCode)
	}
}

// A tenant's weight reaches the scheduler's tickets; tenants the store
// does not know weigh 1.
func TestTenantWeightOnTickets(t *testing.T) {
	st := sqliteStore(t)
	if err := st.CreateTenant(t.Context(), store.Tenant{Name: "heavy", Weight: 3, CreatedAt: quotaT0}); err != nil {
		t.Fatal(err)
	}
	f := startFleet(t, fleetOpts{store: st, speedup: 50, gateway: Config{Tenants: Tenants{Store: st}}})
	if w := f.api.weight(t.Context(), "heavy"); w != 3 {
		t.Errorf("heavy's weight %v, want 3", w)
	}
	if w := f.api.weight(t.Context(), "stranger"); w != 1 {
		t.Errorf("an unknown tenant's weight %v, want 1", w)
	}
	c, err := f.api.Prepare(t.Context(), store.Job{ID: "j", Tenant: "heavy", Endpoint: "/v1/completions",
		Body: []byte(`{"model":"` + llama + `","prompt":"hi","max_tokens":4}`)})
	if err != nil || c.Ticket.Weight != 3 {
		t.Fatalf("a job's ticket: %+v, %v", c, err)
	}
	c.Release()
}

// TestAdminListsPage: the admin API's tenants and keys come in pages
// (?limit=, ?after=, has_more, first_id and last_id), every one once and
// in order across the pages, and the console's tenants page links to the
// next page of each list.
func TestAdminListsPage(t *testing.T) {
	st := sqliteStore(t)
	const n = consolePageSize + 5
	var admin string
	for i := range n {
		key := newTenant(t, st, fmt.Sprintf("t%03d", i), store.Limits{}, store.RoleAdmin)
		if i == 0 {
			admin = key
		}
	}
	f := startFleet(t, fleetOpts{store: st, speedup: 50, keysRequired: true, gateway: Config{Tenants: Tenants{Store: st}}})
	type page struct {
		Data    []map[string]any `json:"data"`
		FirstID *string          `json:"first_id"`
		LastID  *string          `json:"last_id"`
		HasMore bool             `json:"has_more"`
	}
	walk := func(path, id string, limit int) []string {
		t.Helper()
		var all []string
		after := ""
		for range n + 1 {
			resp, b := send(t, f.srv.URL, http.MethodGet, fmt.Sprintf("%s?limit=%d&after=%s", path, limit, after), admin, "")
			p := decode[page](t, b)
			if resp.StatusCode != http.StatusOK || len(p.Data) == 0 || len(p.Data) > limit || p.FirstID == nil || p.LastID == nil ||
				*p.FirstID != p.Data[0][id] || *p.LastID != p.Data[len(p.Data)-1][id] {
				t.Fatalf("%s after %q: %d %.300s", path, after, resp.StatusCode, b)
			}
			for _, v := range p.Data {
				all = append(all, v[id].(string))
			}
			if !p.HasMore {
				return all
			}
			after = *p.LastID
		}
		t.Fatalf("%s: more pages than items", path)
		return nil
	}
	tenants := walk("/v1/admin/tenants", "name", 7)
	keys := walk("/v1/admin/keys", "id", 7)
	ks, _, err := st.ListKeys(t.Context(), "", "", n+1)
	if err != nil {
		t.Fatal(err)
	}
	var wantKeys, wantTenants []string
	for i, k := range ks {
		wantKeys = append(wantKeys, k.ID)
		wantTenants = append(wantTenants, fmt.Sprintf("t%03d", i))
	}
	if !slices.Equal(tenants, wantTenants) {
		t.Errorf("tenants in pages of 7: %v, want %v", tenants, wantTenants)
	}
	if !slices.Equal(keys, wantKeys) {
		t.Errorf("keys in pages of 7: %v, want %v", keys, wantKeys)
	}
	if resp, b := send(t, f.srv.URL, http.MethodGet, "/v1/admin/tenants", admin, ""); resp.StatusCode != http.StatusOK || len(decode[page](t, b).Data) != n {
		t.Errorf("tenants without a limit: %d, want all %d (100 a page by default)", len(decode[page](t, b).Data), n)
	}
	for _, l := range []string{"0", "1001", "x"} {
		if resp, b := send(t, f.srv.URL, http.MethodGet, "/v1/admin/keys?limit="+l, admin, ""); resp.StatusCode != http.StatusBadRequest || !strings.Contains(string(b), `"param":"limit"`) {
			t.Errorf("limit=%s: %d %s, want 400 naming limit", l, resp.StatusCode, b)
		}
	}

	// The console: a page of each list, and a link to the next of each.
	b := newBrowser(t, f.srv.URL)
	if status, page := b.signIn(admin); status != http.StatusOK {
		t.Fatalf("sign in: %d %.300s", status, page)
	}
	// tenantsOf is the tenants table of a console page.
	tenantsOf := func(page string) string {
		start, end := strings.Index(page, `id="tenants-h"`), strings.Index(page, `id="keys-h"`)
		if start < 0 || end < start {
			t.Fatalf("no tenants table: %.300s", page)
		}
		return page[start:end]
	}
	_, first := b.get("/console/tenants")
	next := regexp.MustCompile(`<a href="([^"]+)" rel="next">More tenants</a>`).FindStringSubmatch(first)
	if ts := tenantsOf(first); next == nil || !strings.Contains(ts, ">t049<") || strings.Contains(ts, ">t050<") || !strings.Contains(first, "More keys") {
		t.Fatalf("the first tenants page: tenants t000-t049 and a link to each next page: %.2000s", first)
	}
	_, second := b.get(html.UnescapeString(next[1]))
	if ts := tenantsOf(second); !strings.Contains(ts, ">t050<") || !strings.Contains(ts, ">t054<") || strings.Contains(ts, ">t049<") || strings.Contains(second, "More tenants") {
		t.Errorf("the second page of tenants: t050-t054 and no further link: %.2000s", ts)
	}
}
