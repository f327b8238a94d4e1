package gateway

import (
	"context"
	"html"
	"net/http"
	"net/url"
	"strings"
	"testing"

	"github.com/kvgate/kvgate/bench/eventually"
	"github.com/kvgate/kvgate/scheduler/validate"
	"github.com/kvgate/kvgate/store"
)

// TestConsoleWebhooks: the withheld answer of a job under review, read by
// its operator only; the webhook pages (endpoints, deliveries with their
// attempts, a job's deliveries, the failed ones among the dead letters)
// and a redelivery to a receiver back up; the queues by tenant. Another
// tenant's operator sees none of it.
func TestConsoleWebhooks(t *testing.T) {
	e := startConsoleEnv(t)
	base, st := e.f.srv.URL, e.f.store
	ctx := context.Background()

	// The candidate read: operators of the job's tenant only, while it
	// waits for its review.
	stored, err := st.Result(ctx, "acme", e.reviewJob)
	if err != nil {
		t.Fatal(err)
	}
	answer, err := validate.Answer(stored)
	if err != nil || answer == "" {
		t.Fatalf("the review job's stored answer %q: %v", answer, err)
	}
	cand := "/v1/jobs/" + e.reviewJob + "/result?candidate=true"
	for _, c := range []struct {
		key  string
		want int
	}{{e.user, http.StatusForbidden}, {e.otherOp, http.StatusNotFound}, {e.operator, http.StatusOK}, {e.admin, http.StatusOK}} {
		status, b := bearer(t, e.f, c.key, http.MethodGet, cand, "")
		if status != c.want {
			t.Errorf("%s: %d %s, want %d", cand, status, b, c.want)
		}
		if status == http.StatusOK && string(b) != string(stored) {
			t.Errorf("the candidate read %s, want the stored result %s", b, stored)
		}
		if status != http.StatusOK && strings.Contains(string(b), answer) {
			t.Errorf("a refused candidate read shows the answer: %s", b)
		}
	}
	if status, b := bearer(t, e.f, e.user, http.MethodGet, "/v1/jobs/"+e.reviewJob+"/result", ""); status != http.StatusConflict || strings.Contains(string(b), answer) {
		t.Errorf("a user's result read of a job under review: %d %s, want 409 without the answer", status, b)
	}
	if status, _ := bearer(t, e.f, e.operator, http.MethodGet, "/v1/jobs/"+e.doneJob+"/result?candidate=true", ""); status != http.StatusConflict {
		t.Errorf("a candidate read of a SUCCEEDED job: %d, want 409", status)
	}
	if status, _ := bearer(t, e.f, e.operator, http.MethodGet, "/v1/jobs/"+e.reviewJob+"/result?candidate=yes", ""); status != http.StatusBadRequest {
		t.Errorf("candidate=yes: %d, want 400", status)
	}

	// Listings with their attempts: the review job's one delivery, its
	// one attempt answered 503.
	for _, path := range []string{"/v1/webhooks/endpoints/" + e.endpoint + "/deliveries?include=attempts", "/v1/jobs/" + e.reviewJob + "/deliveries?include=attempts"} {
		status, b := bearer(t, e.f, e.operator, http.MethodGet, path, "")
		var pg struct {
			Data []deliveryView `json:"data"`
		}
		found := false
		if status == http.StatusOK {
			pg = decode[struct {
				Data []deliveryView `json:"data"`
			}](t, b)
		}
		for _, d := range pg.Data {
			if d.ID == e.reviewDlv {
				found = len(d.Attempts) == 1 && d.Attempts[0].Status == http.StatusServiceUnavailable && d.State == store.DeliveryFailed
			}
		}
		if !found {
			t.Errorf("%s: %d %s, want the review job's FAILED delivery with its 503 attempt", path, status, b)
		}
	}
	if status, _ := bearer(t, e.f, e.operator, http.MethodGet, "/v1/jobs/"+e.reviewJob+"/deliveries?include=body", ""); status != http.StatusBadRequest {
		t.Errorf("include=body: %d, want 400", status)
	}

	op := newBrowser(t, base)
	if status, _ := op.signIn(e.operator); status != http.StatusOK {
		t.Fatalf("sign-in: %d", status)
	}
	esc := html.EscapeString(answer)
	for path, wants := range map[string][]string{
		"/console/reviews":                            {esc, "Withheld answer"},
		"/console/jobs/" + e.reviewJob:                {esc, "Withheld answer", "Validation reasons", e.reviewDlv, `aria-label="Redeliver ` + e.reviewDlv + `"`},
		"/console/webhooks":                           {e.endpoint, e.hook.srv.URL},
		"/console/webhooks/endpoints/" + e.endpoint:   {e.reviewDlv, "FAILED", "503"},
		"/console/webhooks/deliveries/" + e.reviewDlv: {"job.review_required", "503", "Redeliver"},
		"/console/dead-letters":                       {"Failed webhook deliveries", e.reviewDlv},
		"/console/queues":                             {"Durable backlog", `data-tenant="acme"`},
	} {
		status, page := op.get(path)
		for _, w := range wants {
			if status != http.StatusOK || !strings.Contains(page, w) {
				t.Errorf("%s: %d, want %q in %.400s", path, status, w, page)
			}
		}
		if strings.Contains(page, `data-tenant="globex"`) {
			t.Errorf("%s: acme's operator sees globex's queues", path)
		}
	}
	if _, page := op.get("/console/jobs/" + e.doneJob); strings.Contains(page, "Withheld answer") {
		t.Error("a SUCCEEDED job's page shows a withheld answer")
	}

	// Redeliver: refused without the CSRF token; with it, the receiver,
	// back up, gets the delivery under its id, and the pages show it.
	_, page := op.get("/console/jobs/" + e.reviewJob)
	token := op.csrf(page)
	if status, _ := op.postForm("/console/webhooks/deliveries/"+e.reviewDlv+"/redeliver", url.Values{}); status != http.StatusForbidden {
		t.Errorf("a redelivery without a CSRF token: %d, want 403", status)
	}
	e.hook.down.Store(false)
	status, page := op.postForm("/console/webhooks/deliveries/"+e.reviewDlv+"/redeliver", url.Values{"csrf": {token}, "back": {"/console/jobs/" + e.reviewJob}})
	if status != http.StatusOK || !strings.Contains(page, "redelivered") {
		t.Fatalf("the redelivery: %d %.300s", status, page)
	}
	eventually.True(t, "the redelivery delivered", func() bool {
		d, err := st.Delivery(ctx, "acme", e.reviewDlv)
		return err == nil && d.State == store.DeliveryDelivered
	})
	got := false
	for _, r := range e.hook.received() {
		got = got || (r.ID == e.reviewDlv && r.JobID == e.reviewJob && r.Type == "job.review_required")
	}
	if !got || len(e.hook.failures()) != 0 {
		t.Errorf("the receiver got %+v (failures %v), want the review job's delivery under %s", e.hook.received(), e.hook.failures(), e.reviewDlv)
	}
	if _, page := op.get("/console/webhooks/deliveries/" + e.reviewDlv); !strings.Contains(page, "DELIVERED") || !strings.Contains(page, "204") {
		t.Errorf("the delivery's page after the redelivery: %.600s", page)
	}

	// Endpoint actions: disable and enable, a rotated secret shown once,
	// a new endpoint with its secret.
	if status, page := op.postForm("/console/webhooks/endpoints/"+e.endpoint+"/state", url.Values{"csrf": {token}, "disabled": {"true"}, "back": {"/console/webhooks"}}); status != http.StatusOK || !strings.Contains(page, "disabled") {
		t.Errorf("disable: %d %.300s", status, page)
	}
	if ep, _ := st.Endpoint(ctx, "acme", e.endpoint); !ep.Disabled {
		t.Error("the endpoint is not disabled")
	}
	if status, _ := op.postForm("/console/webhooks/endpoints/"+e.endpoint+"/state", url.Values{"csrf": {token}, "disabled": {"false"}, "back": {"/console/webhooks"}}); status != http.StatusOK {
		t.Errorf("enable: %d", status)
	}
	if ep, _ := st.Endpoint(ctx, "acme", e.endpoint); ep.Disabled {
		t.Error("the endpoint is still disabled")
	}
	if status, page := op.postForm("/console/webhooks/endpoints/"+e.endpoint+"/rotate", url.Values{"csrf": {token}}); status != http.StatusOK ||
		!strings.Contains(page, `id="newsecret-value" readonly value="whsec_`) {
		t.Errorf("rotate: %d %.400s", status, page)
	}
	_, page = op.get("/console/webhooks")
	if strings.Contains(page, "whsec_") {
		t.Error("the endpoints page shows a secret again")
	}
	if n := strings.Count(page, `name="form_key" value="`); n != 2 {
		t.Errorf("the endpoints page has %d form keys, want one for the rotation and one for the new endpoint", n)
	}
	// A form posted again (a reload) does nothing a second time: the same
	// rotation's secret, the earlier one still in its overlap; one endpoint.
	before, _ := st.Endpoint(ctx, "acme", e.endpoint)
	secretOn := func(page string) string {
		_, rest, _ := strings.Cut(page, `id="newsecret-value" readonly value="`)
		v, _, _ := strings.Cut(rest, `"`)
		return html.UnescapeString(v)
	}
	rotate := url.Values{"csrf": {token}, "form_key": {"reload-rotate"}}
	_, first := op.postForm("/console/webhooks/endpoints/"+e.endpoint+"/rotate", rotate)
	_, again := op.postForm("/console/webhooks/endpoints/"+e.endpoint+"/rotate", rotate)
	if after, _ := st.Endpoint(ctx, "acme", e.endpoint); secretOn(first) == "" || secretOn(again) != secretOn(first) ||
		after.Secret != secretOn(first) || after.PrevSecret != before.Secret {
		t.Errorf("a rotation posted twice: secrets %q then %q, stored %q after %q; want one rotation", secretOn(first), secretOn(again), after.Secret, after.PrevSecret)
	}
	create := url.Values{"csrf": {token}, "form_key": {"reload-create"}, "url": {e.hook.srv.URL + "/second"},
		"events": {"job.failed", "batch.completed"}, "description": {"a second one"}}
	status, first = op.postForm("/console/webhooks/endpoints", create)
	if status != http.StatusOK || !strings.Contains(first, "whsec_") || !strings.Contains(first, "a second one") {
		t.Errorf("create: %d %.400s", status, first)
	}
	if status, again = op.postForm("/console/webhooks/endpoints", create); status != http.StatusOK || secretOn(again) != secretOn(first) {
		t.Errorf("the creation posted again: %d, secret %q; want the first one's %q", status, secretOn(again), secretOn(first))
	}
	if list, _ := st.Endpoints(ctx, "acme"); len(list) != 2 {
		t.Errorf("%d endpoints after a creation posted twice, want 2 (the first and the new one)", len(list))
	}
	if status, page := op.postForm("/console/webhooks/endpoints", url.Values{"csrf": {token}, "url": {"http://127.0.0.1:9/x"}}); status != http.StatusBadRequest ||
		!strings.Contains(page, "events") {
		t.Errorf("create without events: %d %.300s, want the API's 400", status, page)
	}

	// Another tenant's operator: none of acme's endpoints, deliveries or
	// queue rows.
	other := newBrowser(t, base)
	if status, _ := other.signIn(e.otherOp); status != http.StatusOK {
		t.Fatalf("globex's sign-in: %d", status)
	}
	if _, page := other.get("/console/webhooks"); strings.Contains(page, e.endpoint) {
		t.Error("globex's operator sees acme's endpoint")
	}
	for _, path := range []string{"/console/webhooks/endpoints/" + e.endpoint, "/console/webhooks/deliveries/" + e.reviewDlv} {
		if status, _ := other.get(path); status != http.StatusNotFound {
			t.Errorf("globex's operator, %s: %d, want 404", path, status)
		}
	}
	if _, page := other.get("/console/dead-letters"); strings.Contains(page, e.reviewDlv) {
		t.Error("globex's operator sees acme's failed deliveries")
	}
	if _, page := other.get("/console/queues"); strings.Contains(page, `data-tenant="acme"`) {
		t.Error("globex's operator sees acme's queues")
	}
	if status, _ := bearer(t, e.f, e.otherOp, http.MethodGet, "/v1/jobs/"+e.reviewJob+"/deliveries", ""); status != http.StatusNotFound {
		t.Errorf("globex's operator, acme's job's deliveries: %d, want 404", status)
	}
	// The admin sees every tenant's queue rows.
	adm := newBrowser(t, base)
	if status, _ := adm.signIn(e.admin); status != http.StatusOK {
		t.Fatalf("the admin's sign-in: %d", status)
	}
	if _, page := adm.get("/console/queues"); !strings.Contains(page, `data-tenant="acme"`) {
		t.Errorf("the admin's queues page lacks acme: %.600s", page)
	}
}
