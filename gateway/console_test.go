package gateway

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"html/template"
	"io"
	"net/http"
	"net/http/cookiejar"
	"net/url"
	"regexp"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvgate/kvgate/bench/eventually"
	"github.com/kvgate/kvgate/bench/vllmsim"
	"github.com/kvgate/kvgate/store"
)

// consoleEnv is a fleet with tenants acme and globex and acme's objects
// for the console to show: a REVIEW_REQUIRED job, a dead letter, a job
// that succeeded, a batch that completed.
type consoleEnv struct {
	f                                  *fleet
	user, operator, admin, otherOp     string // keys: acme's user, operator and admin; globex's operator
	reviewJob, deadJob, doneJob, opKey string // ids; opKey is the operator key's id
	batch                              string // a batch of acme's that completed
	// hook receives acme's webhooks at endpoint; it was down while the
	// jobs above ended, so their deliveries FAILED (the schedule is one
	// attempt): reviewDlv is the review job's.
	hook                *receiver
	endpoint, reviewDlv string
}

func startConsoleEnv(t *testing.T) *consoleEnv {
	t.Helper()
	st := sqliteStore(t)
	f, _, _ := webhookFleet(t, fleetOpts{store: st, speedup: 50, keysRequired: true,
		gateway: Config{Tenants: Tenants{Store: st}, Jobs: Jobs{MaxAttempts: 1}}}, 1,
		func(dc *DispatcherConfig) { dc.Schedule = []time.Duration{0} })
	e := &consoleEnv{f: f}
	// acme weighs 3 to globex's 1: the Queues page shows the shares.
	if err := st.CreateTenant(context.Background(), store.Tenant{Name: "acme", Weight: 3, CreatedAt: quotaT0, UpdatedAt: quotaT0}); err != nil {
		t.Fatal(err)
	}
	e.user = newTenant(t, st, "acme", store.Limits{}, store.RoleUser)
	e.operator = newKey(t, st, "acme", store.RoleOperator)
	e.admin = newKey(t, st, "acme", store.RoleAdmin)
	e.otherOp = newTenant(t, st, "globex", store.Limits{}, store.RoleOperator)
	ks, _, err := st.ListKeys(context.Background(), "acme", "", 100)
	if err != nil {
		t.Fatal(err)
	}
	for _, k := range ks {
		if k.Role == store.RoleOperator {
			e.opKey = k.ID
		}
	}
	if status, b := bearer(t, f, e.operator, http.MethodPost, "/v1/validation-policies",
		`{"name":"invoice","rules":[{"rule":"json"},{"rule":"schema"}]}`); status != http.StatusCreated {
		t.Fatalf("policy: %d %s", status, b)
	}
	submit := func(key, body string) string {
		t.Helper()
		resp, v := submitJob(t, f, key, body, "Authorization", "Bearer "+e.user)
		if resp.StatusCode != http.StatusAccepted {
			t.Fatalf("submit %s: %d", key, resp.StatusCode)
		}
		return v.ID
	}
	e.hook = newReceiver(t)
	e.hook.down.Store(true)
	if status, b := bearer(t, f, e.operator, http.MethodPost, "/v1/webhooks/endpoints",
		fmt.Sprintf(`{"url":%q,"events":["job.review_required","job.failed","job.succeeded"]}`, e.hook.srv.URL+"/hook")); status != http.StatusCreated {
		t.Fatalf("endpoint: %d %s", status, b)
	} else {
		ep := decode[endpointCreated](t, b)
		e.endpoint = ep.ID
		e.hook.trust(ep.Secret)
	}
	f.sims[0].SetFaults(vllmsim.Faults{InvalidJSONRate: 1})
	e.reviewJob = submit("console-review", schemaJob("invoice: total 30 EUR", "invoice"))
	waitJob(t, f, "acme", e.reviewJob, store.ReviewRequired)
	f.sims[0].SetFaults(vllmsim.Faults{ServerErrorRate: 1})
	e.deadJob = submit("console-dead", chatJob("a dead letter", 4))
	waitJob(t, f, "acme", e.deadJob, store.FailedTerminal)
	f.sims[0].SetFaults(vllmsim.Faults{})
	e.doneJob = submit("console-done", chatJob("a job that succeeds", 4))
	waitJob(t, f, "acme", e.doneJob, store.Succeeded)
	status, b := upload(t, f.srv.URL, e.user, "console.jsonl", "batch", batchLines(1, nil))
	if status != http.StatusOK {
		t.Fatalf("upload: %d %s", status, b)
	}
	e.batch = createBatch(t, f.srv.URL, e.user, decode[struct {
		ID string `json:"id"`
	}](t, b).ID).ID
	waitBatch(t, f.srv.URL, e.user, e.batch, store.BatchCompleted)
	eventually.True(t, "the review job's delivery FAILED", func() bool {
		ds, _, err := st.Deliveries(context.Background(), store.DeliveryFilter{Tenant: "acme", JobID: e.reviewJob})
		if err != nil || len(ds) != 1 || ds[0].State != store.DeliveryFailed {
			return false
		}
		e.reviewDlv = ds[0].ID
		return true
	})
	return e
}

// bearer sends one API request with a key.
func bearer(t *testing.T, f *fleet, key, method, path, body string) (int, []byte) {
	t.Helper()
	req, _ := http.NewRequest(method, f.srv.URL+path, strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer "+key)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, b
}

// browser is an HTTP client with a cookie jar, as a browser signs in.
type browser struct {
	t    *testing.T
	base string
	c    *http.Client
}

func newBrowser(t *testing.T, base string) *browser {
	jar, _ := cookiejar.New(nil)
	return &browser{t: t, base: base, c: &http.Client{Jar: jar}}
}

func (b *browser) do(req *http.Request) (int, string, *http.Response) {
	b.t.Helper()
	resp, err := b.c.Do(req)
	if err != nil {
		b.t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(body), resp
}

func (b *browser) get(path string) (int, string) {
	b.t.Helper()
	req, _ := http.NewRequest(http.MethodGet, b.base+path, nil)
	status, body, _ := b.do(req)
	return status, body
}

func (b *browser) postForm(path string, form url.Values, header ...string) (int, string) {
	b.t.Helper()
	req, _ := http.NewRequest(http.MethodPost, b.base+path, strings.NewReader(form.Encode()))
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	status, body, _ := b.do(req)
	return status, body
}

var (
	formCSRF = regexp.MustCompile(`name="csrf" value="([^"]+)"`)
	metaCSRF = regexp.MustCompile(`name="csrf-token" content="([^"]*)"`)
)

// signIn signs in with key and returns the page it lands on.
func (b *browser) signIn(key string) (int, string) {
	b.t.Helper()
	_, page := b.get("/console/signin")
	m := formCSRF.FindStringSubmatch(page)
	if m == nil {
		b.t.Fatalf("no CSRF token in the sign-in form: %s", page)
	}
	return b.postForm("/console/signin", url.Values{"csrf": {m[1]}, "key": {key}, "next": {"/console/jobs"}})
}

func (b *browser) csrf(page string) string {
	m := metaCSRF.FindStringSubmatch(page)
	if m == nil || m[1] == "" {
		b.t.Fatalf("no CSRF token on the page: %.300s", page)
	}
	return m[1]
}

// TestConsoleAccess: the console's sessions, role by role, without a
// browser (TestConsoleBrowser drives Chromium through the same).
func TestConsoleAccess(t *testing.T) {
	e := startConsoleEnv(t)
	base := e.f.srv.URL

	// Signed out: every page sends the browser to the sign-in form, and
	// the forwarder and the actions answer 401.
	out := newBrowser(t, base)
	if status, page := out.get("/console/jobs"); status != http.StatusOK || !strings.Contains(page, `action="/console/signin"`) {
		t.Errorf("signed out, /console/jobs: %d %.200s", status, page)
	}
	if status, _ := out.get("/console/api/v1/jobs"); status != http.StatusUnauthorized {
		t.Errorf("signed out, the forwarder: %d, want 401", status)
	}
	// A forged sign-in (no form token of this browser's) is refused.
	if status, _ := out.postForm("/console/signin", url.Values{"key": {e.operator}, "csrf": {"forged"}}); status != http.StatusForbidden {
		t.Errorf("a sign-in without the form's token: %d, want 403", status)
	}

	// A user key gets no console, and no session.
	user := newBrowser(t, base)
	if status, page := user.signIn(e.user); status != http.StatusForbidden || !strings.Contains(page, "operator or admin") {
		t.Errorf("a user key's sign-in: %d %.200s", status, page)
	}
	if status, page := user.get("/console/jobs"); !strings.Contains(page, `action="/console/signin"`) {
		t.Errorf("after a user key's sign-in, /console/jobs: %d %.200s", status, page)
	}
	if status, _ := newBrowser(t, base).signIn("kvg_not-a-key"); status != http.StatusUnauthorized {
		t.Errorf("a wrong key's sign-in: %d, want 401", status)
	}

	// acme's operator: a session cookie, HttpOnly and SameSite=Strict,
	// and acme's jobs.
	op := newBrowser(t, base)
	status, page := op.signIn(e.operator)
	if status != http.StatusOK || !strings.Contains(page, e.doneJob) || !strings.Contains(page, e.reviewJob) {
		t.Fatalf("the operator's jobs page: %d %.300s", status, page)
	}
	u, _ := url.Parse(base + "/console/")
	var sess *http.Cookie
	for _, c := range op.c.Jar.Cookies(u) {
		if c.Name == consoleCookie {
			sess = c
		}
	}
	if sess == nil {
		t.Fatal("no session cookie")
	}
	pre := newBrowser(t, base)
	_, page0 := pre.get("/console/signin")
	req, _ := http.NewRequest(http.MethodPost, base+"/console/signin", strings.NewReader(url.Values{"csrf": {formCSRF.FindStringSubmatch(page0)[1]}, "key": {e.operator}}.Encode()))
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	pre.c.CheckRedirect = func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }
	_, _, resp := pre.do(req)
	var set string
	for _, c := range resp.Header.Values("Set-Cookie") {
		if strings.HasPrefix(c, consoleCookie+"=") {
			set = c
		}
	}
	for _, attr := range []string{"HttpOnly", "SameSite=Lax", "Path=/console", "Expires=", "Max-Age="} {
		if !strings.Contains(set, attr) {
			t.Errorf("the session cookie %q lacks %s", set, attr)
		}
	}
	if strings.Contains(set, e.operator) {
		t.Error("the session cookie shows the key in clear")
	}

	// Pages: the job's detail with its attempts; the review queue; the
	// dead letters; admin pages refused to an operator.
	for path, want := range map[string]string{
		"/console/fleet":                 "sim0",
		"/console/queues":                "Durable backlog",
		"/console/jobs/" + e.reviewJob:   "REVIEW_REQUIRED",
		"/console/jobs/" + e.deadJob:     "Attempt 1",
		"/console/jobs/" + e.doneJob:     "chat.completion",
		"/console/reviews":               e.reviewJob,
		"/console/dead-letters":          e.deadJob,
		"/console/usage":                 "Usage by day",
		"/console/batches":               e.batch,
		"/console/jobs?state=SUCCEEDED":  e.doneJob,
		"/console/api/v1/jobs?limit=100": e.deadJob,
		// The reasons its answer was withheld (GET /v1/jobs/{id}/review).
		"/console/jobs/" + e.reviewJob + "#reasons": `<pre>[
  {
    &#34;code&#34;:`,
	} {
		if status, page := op.get(path); status != http.StatusOK || !strings.Contains(page, want) {
			t.Errorf("%s: %d, want %q in %.300s", path, status, want, page)
		}
	}
	// Time filters: the keyset cursor of a time (until), the cut of a
	// page (since).
	later := time.Now().UTC().Add(time.Hour).Format("2006-01-02T15:04")
	for q, want := range map[string]bool{"until=2000-01-01T00:00": false, "since=" + later: false,
		"since=2000-01-01T00:00": true, "until=" + later: true} {
		if _, page := op.get("/console/jobs?" + q); strings.Contains(page, e.doneJob) != want {
			t.Errorf("/console/jobs?%s shows acme's job: %v, want %v", q, !want, want)
		}
	}
	// A batch's lines: its one line, none of the tenant's other jobs.
	if _, page := op.get("/console/jobs?batch=" + e.batch); strings.Count(page, "data-job=") != 1 || strings.Contains(page, e.doneJob) {
		t.Errorf("/console/jobs?batch=%s: %d jobs listed (want its one line), acme's other job shown: %v",
			e.batch, strings.Count(page, "data-job="), strings.Contains(page, e.doneJob))
	}
	if _, page := op.get("/console/batches"); !strings.Contains(page, `href="/console/jobs?batch=`+e.batch+`"`) {
		t.Error("the batches page does not link a batch to its lines")
	}
	if _, page := op.get("/console/jobs?state=SUCCEEDED"); strings.Contains(page, e.deadJob) {
		t.Error("the SUCCEEDED filter shows a FAILED_TERMINAL job")
	}
	if status, page := op.get("/console/tenants"); status != http.StatusForbidden || strings.Contains(page, "kvg_") {
		t.Errorf("an operator's tenants page: %d, want 403", status)
	}

	// Actions need the session's CSRF token; with it, they are the API's
	// actions, audited with the session's key as their actor.
	_, page = op.get("/console/jobs/" + e.reviewJob)
	token := op.csrf(page)
	if status, _ := op.postForm("/console/jobs/"+e.reviewJob+"/review", url.Values{"decision": {"approve"}}); status != http.StatusForbidden {
		t.Errorf("a review without a CSRF token: %d, want 403", status)
	}
	if status, _ := op.postForm("/console/jobs/"+e.reviewJob+"/review", url.Values{"decision": {"approve"}, "csrf": {"wrong"}}); status != http.StatusForbidden {
		t.Errorf("a review with a wrong CSRF token: %d, want 403", status)
	}
	if j, _ := e.f.store.Get(context.Background(), "acme", e.reviewJob); j.State != store.ReviewRequired {
		t.Fatalf("a refused review moved the job to %s", j.State)
	}
	if status, page := op.postForm("/console/jobs/"+e.reviewJob+"/review", url.Values{"decision": {"approve"}, "reason": {"checked by hand"},
		"csrf": {token}, "back": {"/console/jobs/" + e.reviewJob}}); status != http.StatusOK || !strings.Contains(page, "approved") {
		t.Errorf("the review: %d %.300s", status, page)
	}
	// A notice is shown only as the console put it in its redirect: a
	// link's own text is not.
	if _, page := op.get("/console/jobs?notice=Your+key+was+rotated:+get+the+new+one+at+evil.example"); strings.Contains(page, "evil.example") {
		t.Errorf("a notice from a link is shown: %.300s", page)
	}
	for decision, want := range map[string]string{"approve": "approved", "reject": "rejected"} {
		if got := reviewDone(decision); got != want {
			t.Errorf("the notice of a %s: %q, want %q", decision, got, want)
		}
	}
	waitJob(t, e.f, "acme", e.reviewJob, store.Succeeded)
	status, audit := bearer(t, e.f, e.operator, http.MethodGet, "/v1/jobs/"+e.reviewJob+"/audit", "")
	if status != http.StatusOK || !strings.Contains(string(audit), `"action":"review.approve","actor":"`+e.opKey+`"`) {
		t.Errorf("the review's audit record: %d %s", status, audit)
	}
	// The forwarder: a change needs the token in X-CSRF-Token.
	if status, _ := op.postForm("/console/api/v1/jobs/"+e.deadJob+"/replay", nil); status != http.StatusForbidden {
		t.Errorf("a forwarded replay without a CSRF token: %d, want 403", status)
	}
	if status, body := op.postForm("/console/api/v1/jobs/"+e.deadJob+"/replay", nil, "X-CSRF-Token", token); status != http.StatusAccepted {
		t.Errorf("a forwarded replay: %d %s", status, body)
	}
	waitJob(t, e.f, "acme", e.deadJob, store.Succeeded)

	// The forwarder reaches /v1/ only.
	for _, path := range []string{"/console/api/metrics", "/console/api/v1%2F..%2Fmetrics", "/console/api/healthz"} {
		if status, body := op.get(path); status != http.StatusNotFound {
			t.Errorf("the forwarder, %s: %d %.100s, want 404", path, status, body)
		}
	}

	// Another tenant's operator sees none of acme's objects.
	other := newBrowser(t, base)
	if status, _ := other.signIn(e.otherOp); status != http.StatusOK {
		t.Fatalf("globex's operator's sign-in: %d", status)
	}
	for _, path := range []string{"/console/jobs", "/console/reviews", "/console/dead-letters", "/console/queues", "/console/batches", "/console/api/v1/jobs"} {
		if _, page := other.get(path); strings.Contains(page, e.doneJob) || strings.Contains(page, e.reviewJob) || strings.Contains(page, e.deadJob) ||
			strings.Contains(page, e.batch) {
			t.Errorf("globex's operator sees acme's jobs on %s", path)
		}
	}
	for _, id := range []string{e.doneJob, e.reviewJob} {
		if status, _ := other.get("/console/jobs/" + id); status != http.StatusNotFound {
			t.Errorf("globex's operator, acme's job %s: %d, want 404", id, status)
		}
	}

	// The admin rotates the operator's key: the operator's session ends
	// (on this replica at once), and the new key signs in.
	adm := newBrowser(t, base)
	if status, _ := adm.signIn(e.admin); status != http.StatusOK {
		t.Fatalf("the admin's sign-in: %d", status)
	}
	// An admin reads another tenant's jobs with ?tenant= (readScope): the
	// listing, its links, the job's page; an operator's ?tenant= is its own.
	resp, gv := submitJob(t, e.f, "globex-job", chatJob("globex's job", 2), "Authorization", "Bearer "+e.otherOp)
	if resp.StatusCode != http.StatusAccepted {
		t.Fatalf("globex's job: %d", resp.StatusCode)
	}
	gjob := gv.ID
	if _, page := adm.get("/console/jobs?tenant=globex"); !strings.Contains(page, `href="/console/jobs/`+gjob+`?tenant=globex"`) || strings.Contains(page, e.doneJob) {
		t.Errorf("the admin's jobs of globex: globex's job linked %v, acme's shown %v", strings.Contains(page, gjob), strings.Contains(page, e.doneJob))
	}
	if status, page := adm.get("/console/jobs/" + gjob + "?tenant=globex"); status != http.StatusOK || !strings.Contains(page, `data-job="`+gjob+`"`) {
		t.Errorf("the admin's page of globex's job: %d", status)
	}
	if _, page := op.get("/console/jobs?tenant=globex"); strings.Contains(page, gjob) {
		t.Error("acme's operator reads globex's jobs with ?tenant=")
	}
	if _, b := bearer(t, e.f, e.operator, http.MethodGet, "/v1/jobs?tenant=globex", ""); strings.Contains(string(b), gjob) {
		t.Error("acme's operator lists globex's jobs through the API with ?tenant=")
	}
	if status, b := bearer(t, e.f, e.admin, http.MethodGet, "/v1/jobs/"+gjob+"?tenant=globex", ""); status != http.StatusOK {
		t.Errorf("the admin's read of globex's job: %d %s", status, b)
	}
	if status, _ := bearer(t, e.f, e.admin, http.MethodPost, "/v1/jobs/"+gjob+"/cancel?tenant=globex", ""); status != http.StatusNotFound {
		t.Errorf("the admin cancelled globex's job with ?tenant=: %d, want 404 (writes act for the key's tenant)", status)
	}
	// Since writes act for the key's tenant, another tenant's job page
	// offers none: no review, replay or redelivery that could only fail.
	// The tenant's own admin has them.
	gadm := newBrowser(t, base)
	if status, _ := gadm.signIn(newKey(t, e.f.store, "globex", store.RoleAdmin)); status != http.StatusOK {
		t.Fatalf("globex's admin's sign-in: %d", status)
	}
	actions := []string{"/review\"", "/replay\"", "/redeliver\""}
	_, page = gadm.get("/console/jobs/" + e.reviewJob + "?tenant=acme")
	if !strings.Contains(page, `id="foreign"`) || !strings.Contains(page, `data-job="`+e.reviewJob+`"`) {
		t.Errorf("globex's admin's page of acme's review job is not marked read-only: %.400s", page)
	}
	for _, a := range actions {
		if strings.Contains(page, a) {
			t.Errorf("globex's admin's page of acme's review job has the action %s", a)
		}
	}
	// So do its lists: marked read-only, no form but signing out.
	for _, path := range []string{"/console/reviews", "/console/dead-letters", "/console/batches", "/console/webhooks"} {
		_, page := gadm.get(path + "?tenant=acme")
		if !strings.Contains(page, `id="foreign"`) || strings.Count(page, `method="post"`) != 1 {
			t.Errorf("globex's admin's %s of acme: not marked read-only, or %d forms: %.400s", path, strings.Count(page, `method="post"`), page)
		}
		// Its links keep the tenant: a job or delivery of acme's, opened
		// without it, is not found.
		for _, href := range regexp.MustCompile(`href="(/console/(?:jobs/|jobs\?|webhooks/)[^"]*)"`).FindAllStringSubmatch(page, -1) {
			if !strings.Contains(href[1], "tenant=acme") {
				t.Errorf("globex's admin's %s of acme links to %s, without the tenant", path, href[1])
			}
		}
	}
	// Its endpoint's page keeps the tenant in its links and filter.
	_, page = gadm.get("/console/webhooks/endpoints/" + e.endpoint + "?tenant=acme")
	if !strings.Contains(page, `name="tenant" value="acme"`) || !strings.Contains(page, `?tenant=acme">`) || strings.Contains(page, "/redeliver\"") {
		t.Errorf("globex's admin's page of acme's endpoint: the tenant not kept, or a redelivery offered: %.600s", page)
	}
	// (Reviewed by now, the job keeps its failed delivery to redeliver.)
	if _, page = adm.get("/console/jobs/" + e.reviewJob); !strings.Contains(page, "/redeliver\"") || strings.Contains(page, `id="foreign"`) {
		t.Errorf("acme's admin's page of its job lacks the redelivery, or is marked read-only: %.400s", page)
	}
	_, page = adm.get("/console/tenants")
	if !strings.Contains(page, e.opKey) {
		t.Fatalf("the admin's keys page lacks the operator's key: %.300s", page)
	}
	status, page = adm.postForm("/console/keys/"+e.opKey+"/rotate", url.Values{"csrf": {adm.csrf(page)}})
	m := regexp.MustCompile(`id="newkey-value" readonly value="(kvg_[^"]+)"`).FindStringSubmatch(page)
	if status != http.StatusOK || m == nil {
		t.Fatalf("the rotation: %d %.400s", status, page)
	}
	if _, page := op.get("/console/jobs"); !strings.Contains(page, `action="/console/signin"`) {
		t.Errorf("the rotated key's session still opens pages: %.200s", page)
	}
	if status, _ := newBrowser(t, base).signIn(m[1]); status != http.StatusOK {
		t.Errorf("the new key's sign-in: %d", status)
	}
	// The form posted again (a reload) rotates nothing and says why the
	// new key is not shown again.
	_, page = adm.get("/console/tenants")
	status, page = adm.postForm("/console/keys/"+e.opKey+"/rotate", url.Values{"csrf": {adm.csrf(page)}})
	if status != http.StatusNotFound || !strings.Contains(page, "not a live key") || strings.Contains(page, `id="newkey-value"`) {
		t.Errorf("the rotation posted again: %d %.400s, want 404 saying why", status, page)
	}
	// An admin rotating its own session's key is shown the new key and
	// told the session ended, not an error of the revoked key.
	own := newKey(t, e.f.store, "acme", store.RoleAdmin)
	self := newBrowser(t, base)
	if status, _ := self.signIn(own); status != http.StatusOK {
		t.Fatalf("the second admin's sign-in: %d", status)
	}
	var keys struct {
		Data []KeyView `json:"data"`
	}
	_, kb := bearer(t, e.f, own, http.MethodGet, "/v1/admin/keys?tenant=acme&limit=1000", "")
	_ = json.Unmarshal(kb, &keys)
	ownID := ""
	for _, k := range keys.Data {
		if strings.HasPrefix(own, k.Prefix) && k.RevokedAt == nil {
			ownID = k.ID
		}
	}
	_, page = self.get("/console/tenants")
	status, page = self.postForm("/console/keys/"+ownID+"/rotate", url.Values{"csrf": {self.csrf(page)}})
	if status != http.StatusOK || !strings.Contains(page, `id="session-ended"`) || !strings.Contains(page, `id="newkey-value"`) || strings.Contains(page, `role="alert"`) {
		t.Errorf("rotating the session's own key (%s): %d %.600s", ownID, status, page)
	}
	// Signing out ends the browser's session.
	_, page = adm.get("/console/fleet")
	if status, page := adm.postForm("/console/signout", url.Values{"csrf": {adm.csrf(page)}}); !strings.Contains(page, `action="/console/signin"`) {
		t.Errorf("sign-out: %d %.200s", status, page)
	}
	if _, page := adm.get("/console/fleet"); !strings.Contains(page, `action="/console/signin"`) {
		t.Error("signed out, the fleet page still opens")
	}
	// A form posted after the session ended goes to sign in, and back to
	// the form's page after, not to a JSON error.
	status, page = adm.postForm("/console/jobs/"+e.reviewJob+"/review", url.Values{"decision": {"approve"}, "csrf": {"x"}, "back": {"/console/reviews"}})
	if status != http.StatusOK || !strings.Contains(page, `action="/console/signin"`) || !strings.Contains(page, `name="next" value="/console/reviews"`) {
		t.Errorf("a form posted after the session ended: %d %.300s, want the sign-in page leading back to /console/reviews", status, page)
	}
}

// TestConsoleSessionSeal: a cookie is good until its expiry, on a sealer
// with the same secret only, and not after any change.
func TestConsoleSessionSeal(t *testing.T) {
	a, b, other := newConsoleSealer("s3cret"), newConsoleSealer("s3cret"), newConsoleSealer("another")
	now := quotaT0
	c := a.seal(consoleSession{Key: "kvg_x", Expires: now.Unix() + 60, CSRF: "t"})
	if s, ok := b.open(c, now); !ok || s.Key != "kvg_x" {
		t.Errorf("a replica with the same secret: %v %v", s, ok)
	}
	if _, ok := other.open(c, now); ok {
		t.Error("a replica with another secret opened the session")
	}
	if _, ok := a.open(c, now.Add(61e9)); ok {
		t.Error("an expired session opened")
	}
	raw := []byte(c)
	raw[len(raw)/2] ^= 1
	if _, ok := a.open(string(raw), now); ok {
		t.Error("a tampered cookie opened")
	}
	if _, ok := newConsoleSealer("").open(newConsoleSealer("").seal(consoleSession{Key: "k", Expires: now.Unix() + 60}), now); ok {
		t.Error("two replicas without a secret share sessions")
	}
	for _, next := range []string{"//evil.example/", "https://evil.example/", "/console/api/v1/jobs", "/v1/jobs", `/console/\evil`} {
		if got := safeNext(next); got != "/console/fleet" {
			t.Errorf("safeNext(%q) = %q", next, got)
		}
	}
}

// failingKeys is a real tenants store whose key lookups fail while down
// is set, as when the database is away.
type failingKeys struct {
	store.Tenants
	down atomic.Bool
}

func (f *failingKeys) KeyByHash(ctx context.Context, hash string) (store.APIKey, error) {
	if f.down.Load() {
		return store.APIKey{}, errors.New("connection refused")
	}
	return f.Tenants.KeyByHash(ctx, hash)
}

// TestConsoleSessionOutlivesStoreOutage: while the store cannot check
// keys, the console answers 503 (retry) and keeps the session, rather
// than signing the operator out and calling the key invalid; the sign-in
// form says the same. Once the store answers, the session goes on.
func TestConsoleSessionOutlivesStoreOutage(t *testing.T) {
	st := sqliteStore(t)
	keys := &failingKeys{Tenants: st}
	f := startFleet(t, fleetOpts{store: st, keysRequired: true, gateway: Config{Tenants: Tenants{Store: keys, CacheTTL: time.Nanosecond}}})
	op := newTenant(t, st, "acme", store.Limits{}, store.RoleOperator)
	b := newBrowser(t, f.srv.URL)
	if status, page := b.signIn(op); status != http.StatusOK {
		t.Fatalf("sign-in: %d %.200s", status, page)
	}
	keys.down.Store(true)
	req, _ := http.NewRequest(http.MethodGet, f.srv.URL+"/console/jobs", nil)
	status, page, resp := b.do(req)
	if status != http.StatusServiceUnavailable || strings.Contains(page, `action="/console/signin"`) ||
		!strings.HasPrefix(resp.Header.Get("Content-Type"), "text/html") || resp.Header.Get("Retry-After") == "" || !strings.Contains(page, "try again") {
		t.Errorf("a page while keys cannot be checked: %d %q %.200s, want a 503 page with Retry-After and no sign-in form", status, resp.Header, page)
	}
	if status, page := newBrowser(t, f.srv.URL).signIn(op); status != http.StatusServiceUnavailable || strings.Contains(page, "not valid") {
		t.Errorf("a sign-in while keys cannot be checked: %d %.300s, want 503 without calling the key invalid", status, page)
	}
	keys.down.Store(false)
	status, page = b.get("/console/jobs")
	if status != http.StatusOK || strings.Contains(page, `action="/console/signin"`) {
		t.Errorf("the session once the store answers: %d %.200s, want the jobs page", status, page)
	}
	// Signing out works with the key store away too; without the
	// session's CSRF token it does not.
	keys.down.Store(true)
	csrf := b.csrf(page)
	if status, _ := b.postForm("/console/signout", url.Values{"csrf": {"wrong"}}); status != http.StatusForbidden {
		t.Errorf("a sign-out without the CSRF token: %d, want 403", status)
	}
	if status, page := b.postForm("/console/signout", url.Values{"csrf": {csrf}}); status != http.StatusOK || !strings.Contains(page, `action="/console/signin"`) {
		t.Errorf("a sign-out while keys cannot be checked: %d %.200s, want the sign-in page", status, page)
	}
	keys.down.Store(false)
	if status, page := b.get("/console/jobs"); !strings.Contains(page, `action="/console/signin"`) {
		t.Errorf("after signing out: %d %.200s, want the sign-in page", status, page)
	}
}

// TestConsoleCookies: the session's cookie is Lax (a link from a chat
// opens signed in), the sign-in form's Strict; console.secure_cookies
// marks both Secure on plain HTTP (TLS ended by a proxy); two sign-in
// forms open at once both work.
func TestConsoleCookies(t *testing.T) {
	st := sqliteStore(t)
	f := startFleet(t, fleetOpts{store: st, keysRequired: true, gateway: Config{Tenants: Tenants{Store: st}, ConsoleSecureCookies: true}})
	op := newTenant(t, st, "acme", store.Limits{}, store.RoleOperator)
	get := func(c *http.Client, path string) *http.Response {
		resp, err := c.Get(f.srv.URL + path)
		if err != nil {
			t.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		return resp
	}
	b := newBrowser(t, f.srv.URL)
	_, first := b.get("/console/signin")
	_, second := b.get("/console/signin") // another tab
	m1, m2 := formCSRF.FindStringSubmatch(first), formCSRF.FindStringSubmatch(second)
	if m1 == nil || m2 == nil || m1[1] != m2[1] {
		t.Fatalf("two sign-in forms carry %v and %v, want the same token", m1, m2)
	}
	noFollow := &http.Client{Jar: b.c.Jar, CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	req, _ := http.NewRequest(http.MethodPost, f.srv.URL+"/console/signin",
		strings.NewReader(url.Values{"csrf": {m1[1]}, "key": {op}, "next": {"/console/jobs"}}.Encode()))
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	resp, err := noFollow.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	var session *http.Cookie
	for _, c := range resp.Cookies() {
		if c.Name == consoleCookie {
			session = c
		}
	}
	if resp.StatusCode != http.StatusSeeOther || session == nil || session.SameSite != http.SameSiteLaxMode || !session.Secure || !session.HttpOnly {
		t.Fatalf("sign-in with the first form's token: %d, session cookie %+v; want 303 and a Lax, Secure, HttpOnly cookie", resp.StatusCode, session)
	}
	// A sign-out posted without the session's cookie (another site's
	// form: a Lax cookie does not go with it) clears nothing.
	bare, err := (&http.Client{CheckRedirect: noFollow.CheckRedirect}).Post(f.srv.URL+"/console/signout", "application/x-www-form-urlencoded", strings.NewReader("csrf=x"))
	if err != nil {
		t.Fatal(err)
	}
	bare.Body.Close()
	if bare.StatusCode != http.StatusSeeOther || len(bare.Cookies()) != 0 {
		t.Errorf("a sign-out without the cookie: %d, cookies %v; want a redirect that clears nothing", bare.StatusCode, bare.Cookies())
	}
	pre := get(&http.Client{}, "/console/signin").Cookies()
	if len(pre) != 1 || pre[0].SameSite != http.SameSiteStrictMode || !pre[0].Secure {
		t.Errorf("the sign-in form's cookie %+v, want Strict and Secure", pre)
	}
}

// TestConsoleStreamEndsWithTheSession: a live stream a console page
// opened ends at the session's expiry, not after it (its key is still
// valid: only the session ended).
func TestConsoleStreamEndsWithTheSession(t *testing.T) {
	st := sqliteStore(t)
	f := startFleet(t, fleetOpts{store: st, keysRequired: true, gateway: Config{Tenants: Tenants{Store: st}, ConsoleSessionTTL: time.Second}})
	op := newTenant(t, st, "acme", store.Limits{}, store.RoleOperator)
	b := newBrowser(t, f.srv.URL)
	if status, page := b.signIn(op); status != http.StatusOK {
		t.Fatalf("sign-in: %d %.200s", status, page)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, f.srv.URL+"/console/api/v1/events", nil)
	resp, err := b.c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("the stream: %d", resp.StatusCode)
	}
	if _, err := io.Copy(io.Discard, resp.Body); err != nil || ctx.Err() != nil {
		t.Errorf("the stream did not end with the session (%v, %v)", err, ctx.Err())
	}
}

// TestConsoleNumbers: amounts and counts kept as floats print in full,
// never in exponent form, and GPU memory in GiB.
func TestConsoleNumbers(t *testing.T) {
	for _, c := range []struct {
		tmpl string
		v    any
		want string
	}{
		{"{{num .}}", 0.000042, "0.000042"},
		{"{{num .}}", 1234567.0, "1234567"},
		{"{{gib .}}", uint64(85520809984), "79.6 GiB"},
	} {
		tm := template.Must(template.New("t").Funcs(consoleFuncs).Parse(c.tmpl))
		var b strings.Builder
		if err := tm.Execute(&b, c.v); err != nil || b.String() != c.want {
			t.Errorf("%s of %v: %q, %v; want %q", c.tmpl, c.v, b.String(), err, c.want)
		}
	}
}
