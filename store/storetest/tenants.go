package storetest

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/kvgate/kvgate/store"
)

func createTenant(t *testing.T, s store.Store, name string, l store.Limits) store.Tenant {
	t.Helper()
	tn := store.Tenant{Name: name, Weight: 1, Limits: l, CreatedAt: t0, UpdatedAt: t0}
	if err := s.CreateTenant(context.Background(), tn); err != nil {
		t.Fatalf("create tenant %s: %v", name, err)
	}
	return tn
}

func testTenants(t *testing.T, s store.Store) {
	ctx := context.Background()
	acme := createTenant(t, s, "acme", store.Limits{RPM: 10, TPM: 1000, DailyTokens: 5})
	if err := s.CreateTenant(ctx, acme); !errors.Is(err, store.ErrExists) {
		t.Errorf("create acme twice: %v, want ErrExists", err)
	}
	createTenant(t, s, "globex", store.Limits{})
	got, err := s.GetTenant(ctx, "acme")
	if err != nil || got.Limits != acme.Limits || got.Weight != 1 || !got.CreatedAt.Equal(t0) {
		t.Errorf("get acme: %+v, %v", got, err)
	}
	acme.Limits.RPM, acme.Weight, acme.UpdatedAt = 20, 3, t0.Add(time.Hour)
	up, err := s.UpdateTenant(ctx, "acme", acme.UpdatedAt, func(tn *store.Tenant) error {
		if tn.Limits != got.Limits {
			t.Errorf("update is given %+v, want the stored %+v", tn.Limits, got.Limits)
		}
		tn.Limits.RPM, tn.Weight, tn.Name = 20, 3, "renamed"
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if up.Name != "acme" || up.Limits != acme.Limits || up.Weight != 3 || !up.UpdatedAt.Equal(acme.UpdatedAt) {
		t.Errorf("update returned %+v, want %+v", up, acme)
	}
	if got, _ := s.GetTenant(ctx, "acme"); got.Limits.RPM != 20 || got.Weight != 3 || !got.UpdatedAt.Equal(acme.UpdatedAt) {
		t.Errorf("updated acme: %+v", got)
	}
	if _, err := s.UpdateTenant(ctx, "nobody", t0, func(*store.Tenant) error { return nil }); !errors.Is(err, store.ErrNotFound) {
		t.Errorf("update a missing tenant: %v, want ErrNotFound", err)
	}
	refused := errors.New("refused")
	if _, err := s.UpdateTenant(ctx, "acme", t0.Add(2*time.Hour), func(tn *store.Tenant) error {
		tn.Limits.RPM = 1
		return refused
	}); err != refused {
		t.Errorf("a change that fails: %v, want its own error", err)
	}
	if got, _ := s.GetTenant(ctx, "acme"); got.Limits.RPM != 20 || !got.UpdatedAt.Equal(acme.UpdatedAt) {
		t.Errorf("a change that failed was written: %+v", got)
	}
	// Two updates at once, the second begun while the first holds the
	// tenant: each keeps the other's change (a plain read, change, write
	// loses the first one's TPM, or the second's RPM).
	second := make(chan error, 1)
	if _, err := s.UpdateTenant(ctx, "acme", t0.Add(3*time.Hour), func(tn *store.Tenant) error {
		go func() {
			_, err := s.UpdateTenant(ctx, "acme", t0.Add(3*time.Hour), func(tn *store.Tenant) error {
				tn.Limits.RPM = 555
				return nil
			})
			second <- err
		}()
		select { // it must wait for this one; if it does not, this one overwrites it
		case err := <-second:
			second <- err
		case <-time.After(100 * time.Millisecond):
		}
		tn.Limits.TPM = 777
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	if err := <-second; err != nil {
		t.Fatal(err)
	}
	if got, _ := s.GetTenant(ctx, "acme"); got.Limits.RPM != 555 || got.Limits.TPM != 777 {
		t.Errorf("two updates at once: rpm %d tpm %d, want 555 and 777", got.Limits.RPM, got.Limits.TPM)
	}
	// An empty name would read as every tenant where a tenant narrows a
	// read (usage, keys): refused, as is one past 128 bytes.
	for _, name := range []string{"", strings.Repeat("n", 129)} {
		if err := s.CreateTenant(ctx, store.Tenant{Name: name, Weight: 1, CreatedAt: t0, UpdatedAt: t0}); !errors.Is(err, store.ErrTenantName) {
			t.Errorf("a tenant named %d bytes: %v, want ErrTenantName", len(name), err)
		}
	}
	list, more, err := s.ListTenants(ctx, "", 10)
	if err != nil || more || len(list) != 2 || list[0].Name != "acme" || list[1].Name != "globex" {
		t.Errorf("list tenants: %+v, %v, %v", list, more, err)
	}
	// Pages of one: the cursor is the last name seen.
	if list, more, err := s.ListTenants(ctx, "", 1); err != nil || !more || len(list) != 1 || list[0].Name != "acme" {
		t.Errorf("the first page of one tenant: %+v, %v, %v; want acme and more", list, more, err)
	}
	if list, more, err := s.ListTenants(ctx, "acme", 1); err != nil || more || len(list) != 1 || list[0].Name != "globex" {
		t.Errorf("the page after acme: %+v, %v, %v; want globex and no more", list, more, err)
	}
	k := store.APIKey{ID: "key_1", Hash: "h1", Prefix: "kvg_abcd", Tenant: "globex", Role: store.RoleOperator, CreatedAt: t0}
	if err := s.CreateKey(ctx, k); err != nil {
		t.Fatal(err)
	}
	// With a job not yet ended, the delete is refused, and nothing
	// changes: deleted, the tenant's work would run without its limits.
	j := accept(t, s, newJob("globex", "pending"))
	var busy *store.TenantBusyError
	if err := s.DeleteTenant(ctx, "globex", t0); !errors.As(err, &busy) || busy.Jobs != 1 || busy.Batches != 0 {
		t.Fatalf("delete a tenant with a job pending: %v, want a TenantBusyError for 1 job", err)
	}
	if _, err := s.GetTenant(ctx, "globex"); err != nil {
		t.Errorf("the busy tenant after the refused delete: %v", err)
	}
	if _, err := s.KeyByHash(ctx, "h1"); err != nil {
		t.Errorf("the busy tenant's key after the refused delete: %v", err)
	}
	if _, err := s.Cancel(ctx, "globex", j.ID, uuid.Must(uuid.NewV7()).String(), t0); err != nil {
		t.Fatal(err)
	}
	if err := s.DeleteTenant(ctx, "globex", t0); err != nil {
		t.Fatal(err)
	}
	if _, err := s.GetTenant(ctx, "globex"); !errors.Is(err, store.ErrTenantDeleted) || !errors.Is(err, store.ErrNotFound) {
		t.Errorf("get a deleted tenant: %v, want ErrTenantDeleted, an ErrNotFound", err)
	}
	if _, err := s.GetTenant(ctx, "never"); !errors.Is(err, store.ErrNotFound) || errors.Is(err, store.ErrTenantDeleted) {
		t.Errorf("get a tenant never made: %v, want ErrNotFound alone", err)
	}
	// Its name stays with its jobs: a new tenant of the name would see them.
	if err := s.CreateTenant(ctx, store.Tenant{Name: "globex", Weight: 1, CreatedAt: t0, UpdatedAt: t0}); !errors.Is(err, store.ErrTenantNameRetired) || !errors.Is(err, store.ErrExists) {
		t.Errorf("create a deleted tenant's name again: %v, want ErrTenantNameRetired, an ErrExists", err)
	}
	if err := s.CreateTenant(ctx, store.Tenant{Name: "acme", Weight: 1, CreatedAt: t0, UpdatedAt: t0}); !errors.Is(err, store.ErrExists) || errors.Is(err, store.ErrTenantNameRetired) {
		t.Errorf("create a live tenant's name again: %v, want ErrExists alone", err)
	}
	if _, err := s.UpdateTenant(ctx, "globex", t0, func(*store.Tenant) error { return nil }); !errors.Is(err, store.ErrNotFound) {
		t.Errorf("update a deleted tenant: %v, want ErrNotFound", err)
	}
	if err := s.CreateKey(ctx, store.APIKey{ID: "key_late", Hash: "hlate", Prefix: "kvg_late", Tenant: "globex", Role: store.RoleUser, CreatedAt: t0}); !errors.Is(err, store.ErrNotFound) {
		t.Errorf("a key for a deleted tenant: %v, want ErrNotFound", err)
	}
	if list, _, err := s.ListTenants(ctx, "", 10); err != nil || len(list) != 1 || list[0].Name != "acme" {
		t.Errorf("list tenants after a delete: %+v, %v; want acme alone", list, err)
	}
	if got, err := s.Get(ctx, "globex", j.ID); err != nil || got.State != store.Cancelled {
		t.Errorf("a deleted tenant's job: %+v, %v; want it kept", got, err)
	}
	if _, err := s.KeyByHash(ctx, "h1"); !errors.Is(err, store.ErrNotFound) {
		t.Errorf("a deleted tenant's key: %v, want ErrNotFound (revoked)", err)
	}
	if err := s.DeleteTenant(ctx, "globex", t0); !errors.Is(err, store.ErrNotFound) {
		t.Errorf("delete twice: %v, want ErrNotFound", err)
	}
}

func testKeys(t *testing.T, s store.Store) {
	ctx := context.Background()
	createTenant(t, s, "acme", store.Limits{})
	if err := s.CreateKey(ctx, store.APIKey{ID: "key_x", Hash: "hx", Tenant: "nobody", Role: store.RoleUser, CreatedAt: t0}); !errors.Is(err, store.ErrNotFound) {
		t.Errorf("a key of a missing tenant: %v, want ErrNotFound", err)
	}
	k1 := store.APIKey{ID: "key_1", Hash: "h1", Prefix: "kvg_1", Tenant: "acme", Role: store.RoleUser, Name: "ci",
		Limits: store.Limits{RPM: 5, TPM: 50, MaxConcurrency: 2}, CreatedAt: t0}
	k2 := store.APIKey{ID: "key_2", Hash: "h2", Prefix: "kvg_2", Tenant: "acme", Role: store.RoleAdmin, CreatedAt: t0.Add(time.Second)}
	for _, k := range []store.APIKey{k1, k2} {
		if err := s.CreateKey(ctx, k); err != nil {
			t.Fatal(err)
		}
	}
	got, err := s.KeyByHash(ctx, "h1")
	if err != nil || got.ID != "key_1" || got.Tenant != "acme" || got.Role != store.RoleUser || got.Limits != k1.Limits ||
		got.Name != "ci" || got.Prefix != "kvg_1" || !got.RevokedAt.IsZero() {
		t.Errorf("key by hash: %+v, %v", got, err)
	}
	if n, err := s.ActiveKeys(ctx); err != nil || n != 2 {
		t.Errorf("active keys: %d, %v, want 2", n, err)
	}
	if err := s.RevokeKey(ctx, "key_1", t0.Add(time.Minute)); err != nil {
		t.Fatal(err)
	}
	if err := s.RevokeKey(ctx, "key_1", t0.Add(time.Minute)); !errors.Is(err, store.ErrNotFound) {
		t.Errorf("revoke twice: %v, want ErrNotFound", err)
	}
	if _, err := s.KeyByHash(ctx, "h1"); !errors.Is(err, store.ErrNotFound) {
		t.Errorf("a revoked key: %v, want ErrNotFound", err)
	}
	keys, more, err := s.ListKeys(ctx, "acme", "", 10)
	if err != nil || more || len(keys) != 2 || keys[0].ID != "key_1" || !keys[0].RevokedAt.Equal(t0.Add(time.Minute)) || keys[1].ID != "key_2" {
		t.Errorf("list keys: %+v, %v, %v", keys, more, err)
	}
	if all, _, _ := s.ListKeys(ctx, "", "", 10); len(all) != 2 {
		t.Errorf("all keys: %d, want 2", len(all))
	}
	if got, err := s.GetKey(ctx, "key_1"); err != nil || got.Hash != "h1" || got.Limits != k1.Limits || !got.RevokedAt.Equal(t0.Add(time.Minute)) {
		t.Errorf("get a revoked key: %+v, %v", got, err)
	}
	if _, err := s.GetKey(ctx, "key_none"); !errors.Is(err, store.ErrNotFound) {
		t.Errorf("get a key never made: %v, want ErrNotFound", err)
	}
	if n, _ := s.ActiveKeys(ctx); n != 1 {
		t.Errorf("active keys after a revocation: %d, want 1", n)
	}
	// A rotation revokes the old key and makes the new one at once; a
	// second rotation of the same key finds it revoked and makes nothing.
	k3 := store.APIKey{ID: "key_3", Hash: "h3", Prefix: "kvg_3", Tenant: "acme", Role: store.RoleAdmin, CreatedAt: t0.Add(2 * time.Minute)}
	if err := s.RotateKey(ctx, "key_2", k3, t0.Add(2*time.Minute)); err != nil {
		t.Fatal(err)
	}
	if _, err := s.KeyByHash(ctx, "h2"); !errors.Is(err, store.ErrNotFound) {
		t.Errorf("the rotated key: %v, want ErrNotFound (revoked)", err)
	}
	if got, err := s.KeyByHash(ctx, "h3"); err != nil || got.ID != "key_3" {
		t.Errorf("the rotation's new key: %+v, %v", got, err)
	}
	k4 := store.APIKey{ID: "key_4", Hash: "h4", Prefix: "kvg_4", Tenant: "acme", Role: store.RoleAdmin, CreatedAt: t0.Add(2 * time.Minute)}
	if err := s.RotateKey(ctx, "key_2", k4, t0.Add(2*time.Minute)); !errors.Is(err, store.ErrNotFound) {
		t.Errorf("rotate a rotated key: %v, want ErrNotFound", err)
	}
	if _, err := s.KeyByHash(ctx, "h4"); !errors.Is(err, store.ErrNotFound) {
		t.Errorf("a second rotation of one key made a key: %v", err)
	}
	if n, _ := s.ActiveKeys(ctx); n != 1 {
		t.Errorf("active keys after two rotations of one key: %d, want 1", n)
	}

	// Pages, oldest first; keys made in one instant go by id.
	createTenant(t, s, "globex", store.Limits{})
	for _, k := range []store.APIKey{
		{ID: "key_g", Hash: "hg", Prefix: "kvg_g", Tenant: "globex", Role: store.RoleUser, CreatedAt: t0.Add(30 * time.Second)},
		{ID: "key_0", Hash: "h0", Prefix: "kvg_0", Tenant: "acme", Role: store.RoleUser, CreatedAt: t0.Add(2 * time.Minute)},
	} {
		if err := s.CreateKey(ctx, k); err != nil {
			t.Fatal(err)
		}
	}
	pages := func(tenant string) [][]string {
		var out [][]string
		after := ""
		for range 10 {
			page, more, err := s.ListKeys(ctx, tenant, after, 2)
			if err != nil {
				t.Fatal(err)
			}
			var ids []string
			for _, k := range page {
				ids = append(ids, k.ID)
			}
			out = append(out, ids)
			if !more {
				return out
			}
			after = page[len(page)-1].ID
		}
		t.Fatalf("%q's keys: more pages than there are keys: %v", tenant, out)
		return nil
	}
	for tenant, want := range map[string][][]string{
		"":     {{"key_1", "key_2"}, {"key_g", "key_0"}, {"key_3"}},
		"acme": {{"key_1", "key_2"}, {"key_0", "key_3"}},
	} {
		if got := pages(tenant); !reflect.DeepEqual(got, want) {
			t.Errorf("%q's keys in pages of two: %v, want %v", tenant, got, want)
		}
	}
	if page, more, err := s.ListKeys(ctx, "", "key_none", 2); err != nil || more || len(page) != 0 {
		t.Errorf("keys after an unknown id: %+v, %v, %v; want none", page, more, err)
	}
}

func acquisition(tenant string, tokens int64, l store.Limits, now time.Time) store.Acquisition {
	return store.Acquisition{PermitID: uuid.Must(uuid.NewV7()).String(), Tenant: tenant, Tokens: tokens, Limits: l, Now: now, Lease: time.Minute}
}

func quotaLimit(err error) string {
	var q *store.QuotaError
	if errors.As(err, &q) {
		return q.Limit
	}
	return fmt.Sprint(err)
}

func usageOn(t *testing.T, s store.Store, tenant string, day time.Time) store.UsageDay {
	t.Helper()
	us, err := s.Usage(context.Background(), tenant, day, day)
	if err != nil || len(us) > 1 {
		t.Fatalf("usage: %+v, %v", us, err)
	}
	if len(us) == 0 {
		return store.UsageDay{}
	}
	return us[0]
}

// testQuotaWindowCutAttempts: a request retried after attempts cut with
// no answer keeps a reservation in its minute's token window for each of
// them, as the ledger charges them (store.Release.EarlierUncertain).
func testQuotaWindowCutAttempts(t *testing.T, s store.Store) {
	ctx := context.Background()
	l := store.Limits{TPM: 100}
	createTenant(t, s, "cut", l)
	now := t0.Add(10 * time.Second)
	p, err := s.Acquire(ctx, acquisition("cut", 40, l, now))
	if err != nil {
		t.Fatal(err)
	}
	// 10 tokens of answer, and one attempt cut before it: 50 in the window.
	if err := s.Release(ctx, store.Release{Permit: p, Outcome: store.Reported, Attempts: 2, EarlierUncertain: 1,
		PromptTokens: 5, CompletionTokens: 5, Now: now}); err != nil {
		t.Fatal(err)
	}
	q, err := s.Acquire(ctx, acquisition("cut", 50, l, now))
	if err != nil {
		t.Fatalf("50 tokens after 50 used: %v", err)
	}
	if q.Window.RemainingTokens != 0 {
		t.Errorf("window after a request of 10 tokens with a cut attempt of 40, and 50 more: %+v, want none left", q.Window)
	}
}

func testQuotaWindow(t *testing.T, s store.Store) {
	ctx := context.Background()
	l := store.Limits{RPM: 3, TPM: 100}
	now := t0.Add(10 * time.Second)
	var permits []store.Permit
	for i := range 2 {
		p, err := s.Acquire(ctx, acquisition("acme", 40, l, now))
		if err != nil {
			t.Fatalf("acquisition %d: %v", i, err)
		}
		permits = append(permits, p)
	}
	w := permits[1].Window
	if w.LimitRequests != 3 || w.RemainingRequests != 1 || w.LimitTokens != 100 || w.RemainingTokens != 20 || w.Reset != 50*time.Second {
		t.Errorf("window after two: %+v", w)
	}
	// 40 more tokens do not fit; the refusal takes nothing.
	_, err := s.Acquire(ctx, acquisition("acme", 40, l, now))
	var q *store.QuotaError
	if !errors.As(err, &q) || q.Limit != "tokens" || q.Max != 100 || q.Used != 80 || q.Reset != 50*time.Second ||
		q.Window.RemainingTokens != 20 || q.Window.RemainingRequests != 1 {
		t.Fatalf("over TPM: %v (%+v): want 20 tokens and 1 request left, the refused request not counted", err, q)
	}
	if _, err := s.Acquire(ctx, acquisition("acme", 20, l, now)); err != nil {
		t.Fatalf("the last 20 tokens: %v", err)
	}
	if _, err := s.Acquire(ctx, acquisition("acme", 1, l, now)); quotaLimit(err) != "requests" {
		t.Fatalf("fourth request: %v, want requests", err)
	}
	// Releasing with usage gives unused tokens back to the window.
	if err := s.Release(ctx, store.Release{Permit: permits[0], Outcome: store.Reported, Attempts: 1, PromptTokens: 5, CompletionTokens: 5, Now: now}); err != nil {
		t.Fatal(err)
	}
	// Not sent: the request and its tokens come back too.
	if err := s.Release(ctx, store.Release{Permit: permits[1], Outcome: store.NotSent, Now: now}); err != nil {
		t.Fatal(err)
	}
	p, err := s.Acquire(ctx, acquisition("acme", 70, l, now))
	if err != nil {
		t.Fatalf("after the releases: %v", err)
	}
	if p.Window.RemainingRequests != 0 || p.Window.RemainingTokens != 0 {
		t.Errorf("window after the releases: %+v", p.Window)
	}
	// The next minute is a new window.
	if _, err := s.Acquire(ctx, acquisition("acme", 100, l, t0.Add(time.Minute))); err != nil {
		t.Fatalf("next window: %v", err)
	}
	// A replica whose clock lags counts in the newer window, never resets it.
	if _, err := s.Acquire(ctx, acquisition("acme", 1, l, now)); quotaLimit(err) != "tokens" {
		t.Errorf("a lagging clock: %v, want tokens", err)
	}
	// Another tenant has its own windows.
	if _, err := s.Acquire(ctx, acquisition("globex", 100, l, now)); err != nil {
		t.Errorf("another tenant: %v", err)
	}
}

// testQuotaRefusalWindow: a refused request takes nothing, and the window
// it reports (its x-ratelimit-remaining-* headers) does not count it,
// whichever limit refused it; a key's refusal reports the tenant's window
// too where it has less room.
func testQuotaRefusalWindow(t *testing.T, s store.Store) {
	ctx := context.Background()
	now := t0.Add(10 * time.Second)
	l := store.Limits{RPM: 10, TPM: 1000, MaxConcurrency: 1}
	p1, err := s.Acquire(ctx, acquisition("acme", 100, l, now))
	if err != nil {
		t.Fatal(err)
	}
	if w := p1.Window; w.RemainingRequests != 9 || w.RemainingTokens != 900 {
		t.Fatalf("window after one: %+v", w)
	}
	_, err = s.Acquire(ctx, acquisition("acme", 50, l, now))
	var q *store.QuotaError
	if !errors.As(err, &q) || q.Limit != "concurrency" || q.Window.RemainingRequests != 9 || q.Window.RemainingTokens != 900 {
		t.Fatalf("second in flight: %v (%+v); want concurrency, with 9 requests and 900 tokens left", err, q)
	}
	if err := s.Release(ctx, store.Release{Permit: p1, Outcome: store.Reported, Attempts: 1, PromptTokens: 60, CompletionTokens: 40, Now: now}); err != nil {
		t.Fatal(err)
	}
	keyed := func(tokens int64) store.Acquisition {
		a := acquisition("acme", tokens, l, now)
		a.KeyID, a.KeyLimits = "key_refusal", store.Limits{RPM: 1}
		return a
	}
	p3, err := s.Acquire(ctx, keyed(10))
	if err != nil {
		t.Fatal(err)
	}
	if w := p3.Window; w.LimitRequests != 1 || w.RemainingRequests != 0 || w.LimitTokens != 1000 || w.RemainingTokens != 890 {
		t.Errorf("window under the key: %+v; want the key's requests (0 of 1 left), the tenant's tokens (890 left)", w)
	}
	if err := s.Release(ctx, store.Release{Permit: p3, Outcome: store.Reported, Attempts: 1, PromptTokens: 5, CompletionTokens: 5, Now: now}); err != nil {
		t.Fatal(err)
	}
	_, err = s.Acquire(ctx, keyed(10))
	if !errors.As(err, &q) || q.Limit != "requests" || q.Scope != "key" {
		t.Fatalf("second under the key: %v, want the key's requests", err)
	}
	if w := q.Window; w.LimitRequests != 1 || w.RemainingRequests != 0 || w.LimitTokens != 1000 || w.RemainingTokens != 890 {
		t.Errorf("the key's refusal reports %+v; want the key's requests (0 of 1 left) and the tenant's tokens (890 of 1000 left)", w)
	}
}

// testQuotaKeyWindowRelease: a permit taken while its key had no limits
// of its own was never counted in the key's window, and its release gives
// nothing back there, even when the key, given limits mid-minute, has a
// window by then: otherwise it would free a slot another request took.
func testQuotaKeyWindowRelease(t *testing.T, s store.Store) {
	ctx := context.Background()
	now := t0.Add(10 * time.Second)
	l := store.Limits{RPM: 100}
	before := acquisition("acme", 10, l, now)
	before.KeyID = "key_later_limited"
	p1, err := s.Acquire(ctx, before)
	if err != nil {
		t.Fatal(err)
	}
	limited := func() store.Acquisition {
		a := acquisition("acme", 10, l, now)
		a.KeyID, a.KeyLimits = "key_later_limited", store.Limits{RPM: 1}
		return a
	}
	if _, err := s.Acquire(ctx, limited()); err != nil {
		t.Fatalf("the key's first request under its limit: %v", err)
	}
	if err := s.Release(ctx, store.Release{Permit: p1, Outcome: store.NotSent, Now: now}); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Acquire(ctx, limited()); quotaLimit(err) != "requests" {
		t.Errorf("the key's second request in the minute, RPM 1: %v, want refused (the first permit's release freed a slot it never took)", err)
	}
}

// testPermitRenewal: a permit renewed past its first lease (a job's,
// waiting for a backend) keeps counting against its tenant's concurrency
// when an acquisition after that lease would have swept it; released, it
// can no longer be renewed.
func testPermitRenewal(t *testing.T, s store.Store) {
	ctx := context.Background()
	l := store.Limits{MaxConcurrency: 1}
	held, err := s.Acquire(ctx, acquisition("acme", 10, l, t0))
	if err != nil {
		t.Fatal(err)
	}
	lease := time.Minute // acquisition's
	if err := s.RenewPermit(ctx, held.ID, t0.Add(3*lease)); err != nil {
		t.Fatal(err)
	}
	later := t0.Add(2 * lease) // past the first lease, within the renewed one
	if _, err := s.Acquire(ctx, acquisition("acme", 10, l, later)); quotaLimit(err) != "concurrency" {
		t.Fatalf("an acquisition past the first lease of a renewed permit: %v, want concurrency", err)
	}
	if err := s.Release(ctx, store.Release{Permit: held, Outcome: store.NotSent, Now: later}); err != nil {
		t.Fatal(err)
	}
	if err := s.RenewPermit(ctx, held.ID, later.Add(lease)); !errors.Is(err, store.ErrNotFound) {
		t.Errorf("renew a released permit: %v, want ErrNotFound", err)
	}
	if _, err := s.Acquire(ctx, acquisition("acme", 10, l, later)); err != nil {
		t.Errorf("an acquisition once the renewed permit is released: %v", err)
	}
}

func testQuotaConcurrencyAndLedger(t *testing.T, s store.Store) {
	ctx := context.Background()
	l := store.Limits{MaxConcurrency: 2}
	a1, a2 := acquisition("acme", 10, l, t0), acquisition("acme", 20, l, t0)
	a1.KeyID = "key_1"
	p1, err := s.Acquire(ctx, a1)
	if err != nil {
		t.Fatal(err)
	}
	p2, err := s.Acquire(ctx, a2)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.Acquire(ctx, acquisition("acme", 1, l, t0)); quotaLimit(err) != "concurrency" {
		t.Fatalf("third in flight: %v, want concurrency", err)
	}
	if u := usageOn(t, s, "acme", t0); u.Requests != 2 || u.ReservedTokens != 30 {
		t.Errorf("ledger with two in flight: %+v", u)
	}
	// A timeout after sending: the permit ends, its tokens stay charged.
	if err := s.Release(ctx, store.Release{Permit: p1, Outcome: store.Uncertain, Attempts: 1, Now: t0}); err != nil {
		t.Fatal(err)
	}
	// Releasing twice changes nothing more.
	if err := s.Release(ctx, store.Release{Permit: p1, Outcome: store.Reported, PromptTokens: 3, Now: t0}); err != nil {
		t.Fatal(err)
	}
	u := usageOn(t, s, "acme", t0)
	if u.Requests != 2 || u.Attempts != 1 || u.ReservedTokens != 20 || u.Uncertain != 1 || u.UncertainTokens != 10 || u.PromptTokens != 0 {
		t.Errorf("ledger after an uncertain release: %+v", u)
	}
	// p2's replica dies: its permit counts until its lease ends, then the
	// next acquisition sweeps it and its reservation turns uncertain.
	later := t0.Add(30 * time.Second)
	p3, err := s.Acquire(ctx, acquisition("acme", 5, l, later))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.Acquire(ctx, acquisition("acme", 5, l, later)); quotaLimit(err) != "concurrency" {
		t.Fatalf("p2 and p3 in flight: %v, want concurrency", err)
	}
	expired := t0.Add(61 * time.Second)
	p4, err := s.Acquire(ctx, acquisition("acme", 5, l, expired))
	if err != nil {
		t.Fatalf("after p2's lease: %v", err)
	}
	u = usageOn(t, s, "acme", t0)
	if u.Uncertain != 2 || u.UncertainTokens != 30 || u.ReservedTokens != 10 {
		t.Errorf("ledger after the sweep: %+v", u)
	}
	// p2 reports after all: reconciled from the uncertain usage.
	if err := s.Release(ctx, store.Release{Permit: p2, Outcome: store.Reported, Attempts: 2, PromptTokens: 7, CompletionTokens: 8, Now: expired}); err != nil {
		t.Fatal(err)
	}
	for _, p := range []store.Permit{p3, p4} {
		if err := s.Release(ctx, store.Release{Permit: p, Outcome: store.Reported, Attempts: 1, PromptTokens: 1, CompletionTokens: 1, Now: expired}); err != nil {
			t.Fatal(err)
		}
	}
	u = usageOn(t, s, "acme", t0)
	want := store.UsageDay{Tenant: "acme", Day: t0.Truncate(24 * time.Hour), Requests: 4, Attempts: 5, PromptTokens: 9,
		CompletionTokens: 10, Uncertain: 1, UncertainTokens: 10}
	if u != want {
		t.Errorf("final ledger:\n got %+v\nwant %+v", u, want)
	}
	if u.Charged() != 29 {
		t.Errorf("charged %d, want 29", u.Charged())
	}
	// Key concurrency: a key limited to one in flight.
	k := acquisition("globex", 1, store.Limits{}, t0)
	k.KeyID, k.KeyLimits = "key_9", store.Limits{MaxConcurrency: 1}
	if _, err := s.Acquire(ctx, k); err != nil {
		t.Fatal(err)
	}
	k.PermitID = uuid.Must(uuid.NewV7()).String()
	if _, err := s.Acquire(ctx, k); quotaLimit(err) != "concurrency" {
		t.Errorf("second on a one-request key: %v, want concurrency", err)
	}
	other := acquisition("globex", 1, store.Limits{}, t0)
	if _, err := s.Acquire(ctx, other); err != nil {
		t.Errorf("the tenant without that key: %v", err)
	}
}

func testQuotaBudgets(t *testing.T, s store.Store) {
	ctx := context.Background()
	l := store.Limits{DailyTokens: 100, MonthlyTokens: 150}
	day1 := time.Date(2026, 11, 1, 9, 0, 0, 0, time.UTC)
	p, err := s.Acquire(ctx, acquisition("acme", 100, l, day1))
	if err != nil {
		t.Fatal(err)
	}
	_, err = s.Acquire(ctx, acquisition("acme", 1, l, day1))
	var q *store.QuotaError
	if !errors.As(err, &q) || q.Limit != "daily_tokens" || !q.Budget() || q.Reset != 15*time.Hour {
		t.Fatalf("over the day's budget: %v", err)
	}
	if err := s.Release(ctx, store.Release{Permit: p, Outcome: store.Reported, Attempts: 1, PromptTokens: 30, CompletionTokens: 30, Now: day1}); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Acquire(ctx, acquisition("acme", 40, l, day1)); err != nil {
		t.Fatalf("within the day after reconciling: %v", err)
	}
	day2 := day1.Add(24 * time.Hour)
	if _, err := s.Acquire(ctx, acquisition("acme", 50, l, day2)); err != nil {
		t.Fatalf("a new day: %v", err)
	}
	if _, err := s.Acquire(ctx, acquisition("acme", 1, l, day2)); quotaLimit(err) != "monthly_tokens" {
		t.Fatalf("over the month's budget: %v", err)
	}
	if _, err := s.Acquire(ctx, acquisition("acme", 100, l, time.Date(2026, 12, 1, 0, 0, 0, 0, time.UTC))); err != nil {
		t.Fatalf("a new month: %v", err)
	}
	us, err := s.Usage(ctx, "", day1, day2)
	if err != nil || len(us) != 2 || us[0].Charged() != 100 || us[1].Charged() != 50 || !us[1].Day.Equal(day2.Truncate(24*time.Hour)) {
		t.Errorf("usage report: %+v, %v", us, err)
	}
}

// testQuotaRace: many concurrent acquisitions against a quota of n admit
// exactly n.
func testQuotaRace(t *testing.T, s store.Store) {
	const n, callers = 25, 200
	for _, tc := range []struct {
		name string
		l    store.Limits
	}{{"rpm", store.Limits{RPM: n}}, {"concurrency", store.Limits{MaxConcurrency: n}}, {"tpm", store.Limits{TPM: n * 10}}} {
		t.Run(tc.name, func(t *testing.T) {
			var wg sync.WaitGroup
			var mu sync.Mutex
			admitted, refused := 0, 0
			var other []error
			for range callers {
				wg.Go(func() {
					_, err := s.Acquire(context.Background(), acquisition("race-"+tc.name, 10, tc.l, t0))
					mu.Lock()
					defer mu.Unlock()
					switch {
					case err == nil:
						admitted++
					case quotaLimit(err) != fmt.Sprint(err):
						refused++
					default:
						other = append(other, err)
					}
				})
			}
			wg.Wait()
			if admitted != n || refused != callers-n || len(other) > 0 {
				t.Errorf("%d callers against %d: %d admitted, %d refused, errors %v", callers, n, admitted, refused, other)
			}
		})
	}
}

func testJobReservations(t *testing.T, s store.Store) {
	ctx := context.Background()
	l := store.Limits{MaxPendingJobs: 2, MaxPendingTokens: 250}
	accept(t, s, newJob("acme", "k1")) // 100 tokens pending
	if err := s.ReserveJob(ctx, "r1", "acme", 100, l, t0, time.Minute); err != nil {
		t.Fatal(err)
	}
	if err := s.ReserveJob(ctx, "r2", "acme", 10, l, t0, time.Minute); quotaLimit(err) != "pending_jobs" {
		t.Fatalf("a third pending job: %v, want pending_jobs", err)
	}
	accept(t, s, newJob("acme", "k2"))
	if err := s.EndJobReservation(ctx, "r1"); err != nil {
		t.Fatal(err)
	}
	if err := s.ReserveJob(ctx, "r3", "acme", 1, l, t0, time.Minute); quotaLimit(err) != "pending_jobs" {
		t.Fatalf("two jobs pending: %v, want pending_jobs", err)
	}
	j := claimOne(t, s, t0)
	// A running job is still pending, and so are its tokens.
	if err := s.ReserveJob(ctx, "r3", "acme", 1, l, t0, time.Minute); quotaLimit(err) != "pending_jobs" {
		t.Fatalf("one job running, one ready: %v, want pending_jobs", err)
	}
	if err := s.ReserveJob(ctx, "r3", "acme", 51, store.Limits{MaxPendingTokens: 250}, t0, time.Minute); quotaLimit(err) != "pending_tokens" {
		t.Fatalf("200 tokens running or ready: %v, want pending_tokens", err)
	}
	if err := s.Complete(ctx, store.Completion{JobID: j.ID, Fence: j.Fence, State: store.Succeeded, Result: []byte(`{}`),
		Attempt: store.Attempt{JobID: j.ID, Attempt: 1, Fence: j.Fence, Outcome: "succeeded"}, Now: t0}); err != nil {
		t.Fatal(err)
	}
	if err := s.ReserveJob(ctx, "r4", "acme", 151, l, t0, time.Minute); quotaLimit(err) != "pending_tokens" {
		t.Fatalf("over pending tokens: %v, want pending_tokens", err)
	}
	if err := s.ReserveJob(ctx, "r5", "acme", 150, l, t0, time.Minute); err != nil {
		t.Fatalf("one job done: %v", err)
	}
	// A reservation never ended (its replica died) lapses with its lease.
	if err := s.ReserveJob(ctx, "r6", "acme", 1, l, t0.Add(2*time.Minute), time.Minute); err != nil {
		t.Fatalf("after r5's lease: %v", err)
	}
	// Other tenants are not counted.
	if err := s.ReserveJob(ctx, "r7", "globex", 250, l, t0, time.Minute); err != nil {
		t.Fatal(err)
	}
}

// testQuotaTogether: acquisitions and releases of several tenants and keys
// made at once (which a store may commit together) each keep their own
// outcome: a key's refusals, a call that fails (a permit id used twice)
// and the others' successes, and the ledger counts each exactly once;
// some calls say that no caller waits for them (Behind), as the gateway's
// write-behind permits do.
func testQuotaTogether(t *testing.T, s store.Store) {
	ctx := context.Background()
	const tenants, callers, keyRPM = 4, 40, 15
	var wg sync.WaitGroup
	var mu sync.Mutex
	var permits []store.Permit
	refused, dupFailed := map[string]int{}, 0
	dup := uuid.Must(uuid.NewV7()).String()
	for i := range tenants * callers {
		wg.Go(func() {
			a := acquisition(fmt.Sprint("together-", i%tenants), 10, store.Limits{}, t0)
			if (i/tenants)%2 == 0 { // half of each tenant's calls under a key with its own limit
				a.KeyID, a.KeyLimits = fmt.Sprint("key-together-", i%tenants), store.Limits{RPM: keyRPM}
			}
			duplicate := i == tenants || i == tenants+1 // two tenants' calls, without a key
			if duplicate {
				a.PermitID = dup
			}
			a.Behind = a.KeyID == "" && i%3 == 0 // unrefusable, and no caller waits: a store may hold it (the duplicates apart)
			p, err := s.Acquire(ctx, a)
			mu.Lock()
			defer mu.Unlock()
			switch {
			case err == nil:
				permits = append(permits, p)
			case quotaLimit(err) == "requests" && a.KeyID != "":
				refused[a.Tenant]++
			case duplicate:
				dupFailed++
			default:
				t.Errorf("acquisition %d: %v", i, err)
			}
		})
	}
	wg.Wait()
	// Each tenant: callers/2 calls without a key, all admitted, callers/2
	// under its key, keyRPM admitted; one of the two duplicates failed.
	if want := tenants*(callers/2+keyRPM) - 1; len(permits) != want || dupFailed != 1 {
		t.Fatalf("%d permits (want %d), %d duplicates failed (want 1)", len(permits), want, dupFailed)
	}
	for i := range tenants {
		if n := refused[fmt.Sprint("together-", i)]; n != callers/2-keyRPM {
			t.Errorf("tenant %d: %d refused by its key, want %d", i, n, callers/2-keyRPM)
		}
	}
	for i, p := range permits {
		wg.Go(func() {
			r := store.Release{Permit: p, Outcome: store.Reported, Attempts: 1, PromptTokens: 3, CompletionTokens: 4, Now: t0}
			if i%5 == 0 {
				r = store.Release{Permit: p, Outcome: store.NotSent, Now: t0}
			}
			r.Behind = i%2 == 0
			if err := s.Release(ctx, r); err != nil {
				t.Errorf("release %d: %v", i, err)
			}
		})
	}
	wg.Wait()
	var requests, prompt, completion, reserved int64
	for i := range tenants {
		u := usageOn(t, s, fmt.Sprint("together-", i), t0)
		requests, prompt, completion, reserved = requests+u.Requests, prompt+u.PromptTokens, completion+u.CompletionTokens, reserved+u.ReservedTokens
	}
	reported := int64(len(permits) - (len(permits)+4)/5)
	if requests != reported || prompt != 3*reported || completion != 4*reported || reserved != 0 {
		t.Errorf("ledger: %d requests, %d prompt, %d completion, %d reserved; want %d, %d, %d, 0",
			requests, prompt, completion, reserved, reported, 3*reported, 4*reported)
	}
}

// testRecordUsage: RecordUsage leaves the ledger as an acquisition and
// its release would have, for each way a request ends, twice over on one
// day (the first creates the ledger row, the second adds to it; a request
// never sent may leave no row at all), and stores no permit: a release of
// that permit changes nothing. Records also sweep expired permits.
func testRecordUsage(t *testing.T, s store.Store) {
	ctx := context.Background()
	ends := map[string]store.Release{
		"reported":  {Outcome: store.Reported, Attempts: 2, PromptTokens: 7, CompletionTokens: 5, Cost: 40},
		"uncertain": {Outcome: store.Uncertain, Attempts: 1},
		"not-sent":  {Outcome: store.NotSent},
		"retried":   {Outcome: store.Reported, Attempts: 2, EarlierUncertain: 1, PromptTokens: 7, CompletionTokens: 5, Cost: 40},
		"stalled":   {Outcome: store.Uncertain, Attempts: 2, EarlierUncertain: 1},
	}
	for name, end := range ends {
		for range 2 {
			a := acquisition("acquired-"+name, 30, store.Limits{}, t0)
			a.Cost = 90
			p, err := s.Acquire(ctx, a)
			if err != nil {
				t.Fatal(err)
			}
			r := end
			r.Permit, r.Now = p, t0
			if err := s.Release(ctx, r); err != nil {
				t.Fatal(err)
			}
			b := acquisition("recorded-"+name, 30, store.Limits{}, t0)
			b.Cost = 90
			r.Permit, r.Behind = b.Permit(), true
			if err := s.RecordUsage(ctx, r); err != nil {
				t.Fatal(err)
			}
			if err := s.Release(ctx, r); err != nil { // no permit was stored: nothing to release
				t.Fatal(err)
			}
		}
		want, got := usageOn(t, s, "acquired-"+name, t0), usageOn(t, s, "recorded-"+name, t0)
		want.Tenant, got.Tenant = "", ""
		if end.Outcome == store.NotSent {
			want.Day, got.Day = time.Time{}, time.Time{} // a row of zeros, or none
		}
		if got != want {
			t.Errorf("%s: recorded %+v, want %+v as acquired and released", name, got, want)
		}
		// Each of the two requests: its reservation (30, cost 90) charged
		// uncertain for each attempt cut with no answer.
		if w := map[string]store.UsageDay{
			"retried": {Requests: 2, Attempts: 4, PromptTokens: 14, CompletionTokens: 10, Cost: 80, Uncertain: 2, UncertainTokens: 60, UncertainCost: 180},
			"stalled": {Requests: 2, Attempts: 4, Uncertain: 4, UncertainTokens: 120, UncertainCost: 360},
		}[name]; w.Requests > 0 {
			w.Day = want.Day
			if want != w {
				t.Errorf("%s: %+v, want %+v", name, want, w)
			}
		}
	}

	// Records sweep their tenant's expired permits now and then, as
	// acquisitions do: a permit whose replica died (never released) of a
	// tenant whose later requests are all recorded still becomes
	// uncertain usage. One record in 64 sweeps; 1,000 leave a chance of
	// about 1e-7 that none did.
	if _, err := s.Acquire(ctx, acquisition("recorded-only", 30, store.Limits{}, t0)); err != nil {
		t.Fatal(err)
	}
	later := t0.Add(2 * time.Minute) // past the permit's lease
	var wg sync.WaitGroup
	for w := range 8 {
		wg.Go(func() {
			for range 125 {
				b := acquisition("recorded-only", 30, store.Limits{}, later)
				if err := s.RecordUsage(ctx, store.Release{Permit: b.Permit(), Outcome: store.NotSent, Now: later, Behind: w%2 == 0}); err != nil {
					t.Error(err)
					return
				}
			}
		})
	}
	wg.Wait()
	if u := usageOn(t, s, "recorded-only", t0); u.Uncertain != 1 || u.UncertainTokens != 30 || u.ReservedTokens != 0 {
		t.Errorf("the expired permit after 1,000 records: %+v, want it swept into uncertain usage", u)
	}
}

// testQuotaPlainTogether: calls that take no window (unlimited
// acquisitions, releases of every outcome, one of a permit swept since and
// one of yesterday's, records of usage), made one at a time, and again
// arriving together and written behind their requests, so that a store
// may batch them (two tenants' at once), leave the ledger that
// store.Tenants describes, worked out here call by call.
func testQuotaPlainTogether(t *testing.T, s store.Store) {
	ctx := context.Background()
	const n = 48
	yesterday, later := t0.Add(-24*time.Hour), t0.Add(2*time.Minute)
	// The ledger the calls should leave, by day.
	want := map[int]*store.UsageDay{}
	day := func(d int) *store.UsageDay {
		if want[d] == nil {
			want[d] = &store.UsageDay{}
		}
		return want[d]
	}
	acquired := func(a store.Acquisition) {
		u := day(store.DayOf(a.Now))
		u.Requests++
		u.ReservedTokens += a.Tokens
		u.ReservedCost += a.Cost
	}
	sweep := func(p store.Permit) { // its reservation becomes uncertain usage
		u := day(p.Day)
		u.ReservedTokens, u.ReservedCost = u.ReservedTokens-p.Tokens, u.ReservedCost-p.Cost
		u.Uncertain, u.UncertainTokens, u.UncertainCost = u.Uncertain+1, u.UncertainTokens+p.Tokens, u.UncertainCost+p.Cost
	}
	ended := func(r store.Release, stored, swept bool) { // a release (stored), or a record
		u := day(r.Permit.Day)
		u.Attempts += int64(r.Attempts)
		p := r.Permit
		n := int64(r.EarlierUncertain) // each charged the reservation, uncertain
		u.Uncertain, u.UncertainTokens, u.UncertainCost = u.Uncertain+n, u.UncertainTokens+n*p.Tokens, u.UncertainCost+n*p.Cost
		if stored && swept { // back from uncertain usage, then as if never swept
			u.Uncertain, u.UncertainTokens, u.UncertainCost = u.Uncertain-1, u.UncertainTokens-p.Tokens, u.UncertainCost-p.Cost
			u.ReservedTokens, u.ReservedCost = u.ReservedTokens+p.Tokens, u.ReservedCost+p.Cost
		}
		if stored {
			u.Requests--
			u.ReservedTokens, u.ReservedCost = u.ReservedTokens-p.Tokens, u.ReservedCost-p.Cost
		}
		switch r.Outcome {
		case store.Reported:
			u.Requests++
			u.PromptTokens, u.CompletionTokens, u.Cost = u.PromptTokens+r.PromptTokens, u.CompletionTokens+r.CompletionTokens, u.Cost+r.Cost
		case store.Uncertain:
			u.Requests++
			u.Uncertain, u.UncertainTokens, u.UncertainCost = u.Uncertain+1, u.UncertainTokens+p.Tokens, u.UncertainCost+p.Cost
		}
	}
	// run makes the calls for tenant, each step's calls at once when
	// together is set, else one after another and into want.
	run := func(tenant string, together bool) {
		var swept *store.Permit // the permit the limited acquisition sweeps
		step := func(calls []func(behind bool) error) {
			var wg sync.WaitGroup
			for i, call := range calls {
				if !together {
					if err := call(false); err != nil {
						t.Fatalf("%s: call %d: %v", tenant, i, err)
					}
					continue
				}
				wg.Go(func() {
					if err := call(true); err != nil {
						t.Errorf("%s: call %d: %v", tenant, i, err)
					}
				})
			}
			wg.Wait()
		}
		acquire := func(a store.Acquisition, into *store.Permit) func(bool) error {
			return func(behind bool) (err error) {
				a.Behind = behind && a.Unrefusable()
				if *into, err = s.Acquire(ctx, a); err == nil && !together {
					acquired(a)
				}
				return err
			}
		}
		release := func(p *store.Permit, r store.Release) func(bool) error {
			return func(behind bool) error {
				r.Permit, r.Behind = *p, behind
				err := s.Release(ctx, r)
				if err == nil && !together {
					ended(r, true, p == swept)
				}
				return err
			}
		}
		ends := []store.Release{
			{Outcome: store.Reported, Attempts: 1, PromptTokens: 3, CompletionTokens: 8, Cost: 11, Now: later},
			{Outcome: store.NotSent, Now: later},
			{Outcome: store.NotSent, Attempts: 2, Now: later},
			{Outcome: store.Uncertain, Attempts: 1, Now: later},
			// Retried after attempts cut with no answer.
			{Outcome: store.Reported, Attempts: 2, EarlierUncertain: 1, PromptTokens: 2, CompletionTokens: 1, Cost: 5, Now: later},
			{Outcome: store.Uncertain, Attempts: 3, EarlierUncertain: 2, Now: later},
		}
		// A permit whose lease will have ended, one of yesterday's, and
		// n of today's with long leases.
		var expired, old store.Permit
		a := acquisition(tenant, 30, store.Limits{}, t0)
		a.Cost = 70
		b := acquisition(tenant, 20, store.Limits{}, yesterday)
		b.Cost, b.Lease = 50, 48*time.Hour
		step([]func(bool) error{acquire(a, &expired), acquire(b, &old)})
		ps := make([]store.Permit, n)
		var calls []func(bool) error
		for i := range ps {
			a := acquisition(tenant, int64(10+i), store.Limits{}, t0)
			a.Cost, a.Lease = int64(i), time.Hour
			calls = append(calls, acquire(a, &ps[i]))
		}
		step(calls)
		// A limited acquisition sweeps the expired permit.
		var limited store.Permit
		step([]func(bool) error{acquire(acquisition(tenant, 5, store.Limits{MaxConcurrency: 1000}, later), &limited)})
		if swept = &expired; !together {
			sweep(expired)
		}
		// Half of today's permits end, each way; the swept one, yesterday's
		// and the limited one end too; usage is recorded; more permits are
		// acquired.
		calls = []func(bool) error{release(&expired, ends[0]), release(&old, ends[0]), release(&limited, ends[3])}
		for i := range n / 2 {
			calls = append(calls, release(&ps[i], ends[i%len(ends)]))
		}
		more := make([]store.Permit, n/4)
		for i := range more {
			a := acquisition(tenant, 7, store.Limits{}, later)
			a.Cost, a.Lease = 3, time.Hour
			calls = append(calls, acquire(a, &more[i]))
			r := ends[i%len(ends)]
			p := acquisition(tenant, 9, store.Limits{}, later).Permit()
			p.Cost = 4
			calls = append(calls, func(behind bool) error {
				r.Permit, r.Behind = p, behind
				err := s.RecordUsage(ctx, r)
				if err == nil && !together {
					ended(r, false, false)
				}
				return err
			})
		}
		step(calls)
		calls = nil
		for i := n / 2; i < n; i++ {
			calls = append(calls, release(&ps[i], ends[i%len(ends)]))
		}
		for i := range more {
			calls = append(calls, release(&more[i], ends[0]))
		}
		step(calls)
	}
	run("plain-alone", false)
	var wg sync.WaitGroup
	together := []string{"plain-together-a", "plain-together-b"} // two tenants' calls in the same batches
	for _, tenant := range together {
		wg.Go(func() { run(tenant, true) })
	}
	wg.Wait()
	for _, tenant := range append(together, "plain-alone") {
		for _, d := range []time.Time{yesterday, t0} {
			got, w := usageOn(t, s, tenant, d), *day(store.DayOf(d))
			got.Tenant, got.Day = "", time.Time{}
			if got != w || w.Requests == 0 {
				t.Errorf("%s, %s: %+v, want %+v", tenant, d.Format(time.DateOnly), got, w)
			}
		}
	}
}
