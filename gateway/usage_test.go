package gateway

import (
	"net/http"
	"testing"

	"github.com/kvgate/kvgate/bench/eventually"
)

// TestStaticKeysUsage: the tenants of static keys, which the store does
// not know, have their usage recorded like the store's tenants: a chat
// request of a static user key shows in its tenant's GET /v1/usage, read
// with a static operator key of that tenant, and in the admin's report.
func TestStaticKeysUsage(t *testing.T) {
	st := sqliteStore(t)
	clock := &testClock{now: quotaT0}
	f := startFleet(t, fleetOpts{store: st, speedup: 50, keysRequired: true, gateway: Config{
		APIKeys: map[string]string{"static-user": "legacy"}, OperatorKeys: map[string]string{"static-op": "legacy"},
		AdminKeys: map[string]string{"static-admin": "root"},
		Tenants:   Tenants{Store: st, Now: clock.Now}}})
	for range 2 {
		if resp, b := send(t, f.srv.URL, http.MethodPost, "/v1/chat/completions", "static-user", chatReq(3)); resp.StatusCode != http.StatusOK {
			t.Fatalf("chat: %d %s", resp.StatusCode, b)
		}
	}
	var days []UsageView
	eventually.True(t, "the static tenant's usage", func() bool {
		resp, b := send(t, f.srv.URL, http.MethodGet, "/v1/usage", "static-op", "")
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("usage: %d %s", resp.StatusCode, b)
		}
		days = decode[struct{ Data []UsageView }](t, b).Data
		return len(days) == 1 && days[0].ReservedTokens == 0
	})
	if u := days[0]; u.Tenant != "legacy" || u.Date != "2026-11-30" || u.Requests != 2 || u.Attempts != 2 || u.CompletionTokens != 6 ||
		u.PromptTokens == 0 || u.ChargedTokens != u.PromptTokens+6 {
		t.Errorf("static tenant's usage: %+v", u)
	}
	_, b := send(t, f.srv.URL, http.MethodGet, "/v1/admin/usage?from=2026-11-30&to=2026-11-30", "static-admin", "")
	if all := decode[struct{ Data []UsageView }](t, b).Data; len(all) != 1 || all[0] != days[0] {
		t.Errorf("admin's report: %s, want the static tenant's day", b)
	}
}
