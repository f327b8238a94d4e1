package gateway

import (
	"encoding/json"
	"fmt"
	"io"
	"math"
	"net/http"
	"strings"
	"testing"

	"github.com/kvgate/kvgate/bench/eventually"
	"github.com/kvgate/kvgate/store"
)

// TestCostsAndSpendBudgets: with a price per model, the usage reports
// carry the cost of what each request used beside its tokens; a tenant's
// daily spending budget admits a request whose price fits and refuses the
// next with insufficient_quota (429, x-should-retry false), before it is
// admitted; a job of a tenant whose budget is spent is refused at
// submission; the admin API sets and shows the budgets in the currency.
func TestCostsAndSpendBudgets(t *testing.T) {
	st := sqliteStore(t)
	// 10 and 20 per million tokens: 10 and 20 micro-units a token.
	f := startFleet(t, fleetOpts{store: st, jobs: true, speedup: 50, keysRequired: true,
		gateway: Config{Tenants: Tenants{Store: st}, Prices: map[string]Price{llama: {Prompt: 10, Completion: 20}}, Currency: "EUR"}})
	admin := newTenant(t, st, "root", store.Limits{}, store.RoleAdmin)
	probe := newTenant(t, st, "probe", store.Limits{}, store.RoleUser)
	chat := `{"model":"` + llama + `","messages":[{"role":"user","content":"hello there, what does it cost?"}],"max_tokens":4,"ignore_eos":true}`

	// What one such request uses, and so costs.
	resp, b := send(t, f.srv.URL, http.MethodPost, "/v1/chat/completions", probe, chat)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("probe: %d %s", resp.StatusCode, b)
	}
	u := decode[struct{ Usage usage }](t, b).Usage
	cost := int64(u.PromptTokens*10 + u.CompletionTokens*20)

	// A budget of 1.5 requests: the first passes, the second does not.
	budget := float64(cost) * 1.5 / 1e6
	resp, b = send(t, f.srv.URL, http.MethodPost, "/v1/admin/tenants", admin, fmt.Sprintf(`{"name":"acme","daily_spend":%v,"monthly_spend":100}`, budget))
	if resp.StatusCode != http.StatusCreated {
		t.Fatalf("create tenant: %d %s", resp.StatusCode, b)
	}
	tv := decode[TenantView](t, b)
	if math.Abs(tv.DailySpend-budget) > 1e-6 || tv.MonthlySpend != 100 {
		t.Errorf("tenant view: %s", b)
	}
	user := newKey(t, st, "acme", store.RoleUser)
	operator := newKey(t, st, "acme", store.RoleOperator)
	if resp, b := send(t, f.srv.URL, http.MethodPost, "/v1/chat/completions", user, chat); resp.StatusCode != http.StatusOK {
		t.Fatalf("first request: %d %s", resp.StatusCode, b)
	}
	var days list[UsageView]
	eventually.True(t, "the first request's cost lands in the ledger", func() bool {
		resp, b := send(t, f.srv.URL, http.MethodGet, "/v1/usage", operator, "")
		if resp.StatusCode != http.StatusOK || json.Unmarshal(b, &days) != nil || len(days.Data) != 1 {
			return false
		}
		return days.Data[0].ReservedCost == 0
	})
	d := days.Data[0]
	if d.Currency != "EUR" || math.Abs(d.Cost-float64(cost)/1e6) > 1e-9 || d.ChargedCost != d.Cost || d.PromptTokens != int64(u.PromptTokens) {
		t.Errorf("usage: %+v, want a cost of %d micro-units", d, cost)
	}
	resp, b = send(t, f.srv.URL, http.MethodPost, "/v1/chat/completions", user, chat)
	e := errorKeys(t, "over the spend", b)
	if resp.StatusCode != http.StatusTooManyRequests || e["type"] != "insufficient_quota" || e["code"] != "insufficient_quota" ||
		resp.Header.Get("x-should-retry") != "false" || !strings.Contains(e["message"].(string), "spending per day") {
		t.Errorf("over the daily spend: %d %v %s", resp.StatusCode, resp.Header, b)
	}
	// Refused in the same transaction that would have admitted it: not
	// in the ledger, never sent.
	if got := ledgerOf(t, st, "acme"); got.Requests != 1 || got.ReservedCost != 0 {
		t.Errorf("after the refusal the ledger holds %+v, want the first request only", got)
	}
	// A job of the spent tenant is refused at submission.
	req, _ := http.NewRequest(http.MethodPost, f.srv.URL+"/v1/jobs", strings.NewReader(`{"endpoint":"/v1/chat/completions","body":`+chat+`}`))
	req.Header.Set("Authorization", "Bearer "+user)
	req.Header.Set("Idempotency-Key", "spent")
	hr, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	b, _ = io.ReadAll(hr.Body)
	hr.Body.Close()
	resp = hr
	if e := errorKeys(t, "job over the spend", b); resp.StatusCode != http.StatusTooManyRequests || e["code"] != "insufficient_quota" {
		t.Errorf("job over the spend: %d %s", resp.StatusCode, b)
	}
	// Raising the budget admits again.
	if resp, b := send(t, f.srv.URL, http.MethodPatch, "/v1/admin/tenants/acme", admin, `{"daily_spend":1}`); resp.StatusCode != http.StatusOK {
		t.Fatalf("patch: %d %s", resp.StatusCode, b)
	}
	f.api.forgetTenant("acme")
	if resp, b := send(t, f.srv.URL, http.MethodPost, "/v1/chat/completions", user, chat); resp.StatusCode != http.StatusOK {
		t.Errorf("after raising the budget: %d %s", resp.StatusCode, b)
	}
	if resp, b := send(t, f.srv.URL, http.MethodPatch, "/v1/admin/tenants/acme", admin, `{"daily_spend":-1}`); resp.StatusCode != http.StatusBadRequest {
		t.Errorf("a negative budget: %d %s", resp.StatusCode, b)
	}
	if err := checkPrices(map[string]Price{"m": {Prompt: -1}}); err == nil {
		t.Error("a negative price was accepted")
	}
}
