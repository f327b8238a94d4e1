package gateway

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvgate/kvgate/gateway/webhook"
	"github.com/kvgate/kvgate/store"
	"github.com/kvgate/kvgate/store/sqlstore"
)

// The callers of the route × role matrix, in the order of a row's statuses.
const (
	roleNone     = iota // no Authorization header
	roleOther           // an operator key of another tenant than the objects'
	roleUser            // a user key of the objects' tenant
	roleOperator        // an operator key of the objects' tenant
	roleAdmin           // an admin key (of the objects' tenant)
	nRoles
)

var roleNames = [nRoles]string{"no key", "another tenant's operator", "user", "operator", "admin"}

// matrixEnv is what the matrix runs against: the objects belong to tenant
// acme, the other tenant is globex.
type matrixEnv struct {
	t     *testing.T
	f     *fleet
	st    *sqlstore.Store
	keys  [nRoles]string
	job   string // a job of acme's that succeeded
	file  string // a batch input file of acme's
	batch string // a batch of acme's that completed
	n     int    // names made so far
	spare string // the spare tenant or key id expand made last
	hook  string // a webhook endpoint of acme's, and a delivery to it
	dlv   string
}

// expand fills a path or body template: {job} is acme's job, {unique} a
// fresh name, {spare-tenant} and {spare-key} a tenant and an acme key
// made for this one request (their names, or the key's id).
func (e *matrixEnv) expand(s string) string {
	e.n++
	ctx := context.Background()
	if strings.Contains(s, "{spare-tenant}") {
		e.spare = fmt.Sprintf("spare-%d", e.n)
		if err := e.st.CreateTenant(ctx, store.Tenant{Name: e.spare, Weight: 1, CreatedAt: quotaT0, UpdatedAt: quotaT0}); err != nil {
			e.t.Fatal(err)
		}
		s = strings.ReplaceAll(s, "{spare-tenant}", e.spare)
	}
	if strings.Contains(s, "{spare-key}") {
		_, k := NewAPIKey("acme", store.RoleUser, "spare", quotaT0)
		if err := e.st.CreateKey(ctx, k); err != nil {
			e.t.Fatal(err)
		}
		e.spare = k.ID
		s = strings.ReplaceAll(s, "{spare-key}", k.ID)
	}
	if strings.Contains(s, "{spare-file}") {
		e.spare = matrixFile(e.t, e, "spare.jsonl")
		s = strings.ReplaceAll(s, "{spare-file}", e.spare)
	}
	if strings.Contains(s, "{spare-hook}") {
		e.spare = matrixEndpoint(e.t, e.st)
		s = strings.ReplaceAll(s, "{spare-hook}", e.spare)
	}
	return strings.NewReplacer("{job}", e.job, "{file}", e.file, "{batch}", e.batch, "{hook}", e.hook, "{delivery}", e.dlv,
		"{unique}", fmt.Sprintf("u-%d", e.n)).Replace(s)
}

// matrixEndpoint registers a webhook endpoint of acme's.
func matrixEndpoint(t *testing.T, st *sqlstore.Store) string {
	t.Helper()
	return matrixEndpointOf(t, st, "acme")
}

// matrixEndpointOf registers an endpoint of tenant's on a closed port.
func matrixEndpointOf(t testing.TB, st *sqlstore.Store, tenant string) string {
	t.Helper()
	secret, _ := webhook.NewSecret()
	e := store.WebhookEndpoint{ID: "we_" + fmt.Sprint(time.Now().UnixNano()), Tenant: tenant, URL: "http://127.0.0.1:9/hook",
		Events: []string{"job.succeeded"}, Secret: secret, CreatedAt: quotaT0}
	if err := st.CreateEndpoint(context.Background(), e); err != nil {
		t.Fatal(err)
	}
	return e.ID
}

// do sends one request and returns its status and body; an event stream's
// body is not read (it does not end).
func (e *matrixEnv) do(method, path, key, body string, header ...string) (int, []byte) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var rd io.Reader
	if body != "" {
		rd = strings.NewReader(body)
	}
	contentType := "application/json"
	if body == "{upload}" {
		rd, contentType = multipartUpload("matrix.jsonl", "batch", batchLines(1, nil))
	}
	req, _ := http.NewRequestWithContext(ctx, method, e.f.srv.URL+path, rd)
	req.Header.Set("Content-Type", contentType)
	if key != "" {
		req.Header.Set("Authorization", "Bearer "+key)
	}
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		e.t.Errorf("%s %s: %v", method, path, err)
		return 0, nil
	}
	defer resp.Body.Close()
	if strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream") {
		return resp.StatusCode, nil
	}
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, b
}

// matrixRow is one route against every caller.
type matrixRow struct {
	pattern    string // as registered on the mux
	path, body string // templates for expand
	header     []string
	want       [nRoles]int
	// check, when set, looks further at an answer (what it shows, or that
	// a refused request changed nothing).
	check func(e *matrixEnv, role, status int, body []byte)
}

// TestRouteRoleMatrix: every route the gateway registers, against no key,
// another tenant's key, and user, operator and admin keys of the objects'
// tenant. Another tenant's objects are 404, never a 403 that would say
// they exist; a refusal is an OpenAI-shaped error; a refused change
// changes nothing. A route registered without a row here fails the test.
func TestRouteRoleMatrix(t *testing.T) {
	st := sqliteStore(t)
	f := startFleet(t, fleetOpts{store: st, runner: true, speedup: 50, keysRequired: true,
		gateway: Config{Tenants: Tenants{Store: st}, Webhooks: Webhooks{Store: st, Guard: loopbackGuard()}}})
	e := &matrixEnv{t: t, f: f, st: st}
	e.keys[roleUser] = newTenant(t, st, "acme", store.Limits{}, store.RoleUser)
	e.keys[roleOperator] = newKey(t, st, "acme", store.RoleOperator)
	e.keys[roleAdmin] = newKey(t, st, "acme", store.RoleAdmin)
	e.keys[roleOther] = newTenant(t, st, "globex", store.Limits{}, store.RoleOperator)
	if status, b := e.do(http.MethodPost, "/v1/jobs", e.keys[roleUser], chatJob("the matrix's job", 2), "Idempotency-Key", "matrix"); status != http.StatusAccepted {
		t.Fatalf("submit: %d %s", status, b)
	} else {
		e.job = decode[jobView](t, b).ID
	}
	waitJob(t, f, "acme", e.job, store.Succeeded)
	if status, b := e.do(http.MethodPost, "/v1/jobs", e.keys[roleUser], strings.Replace(chatJob("an entity's job", 2), `"metadata"`,
		`"entity":{"key":"matrix-entity","version":1},"metadata"`, 1), "Idempotency-Key", "matrix-entity"); status != http.StatusAccepted {
		t.Fatalf("submit with an entity: %d %s", status, b)
	}
	if _, err := st.PutPolicy(context.Background(), store.Policy{Tenant: "acme", Name: "matrix", Document: json.RawMessage(`{"name":"matrix","rules":[{"rule":"json"}]}`), CreatedAt: quotaT0}); err != nil {
		t.Fatal(err)
	}

	e.hook = matrixEndpoint(t, st)
	if d, err := st.SendTest(context.Background(), "acme", e.hook, fmt.Sprint(time.Now().UnixNano()), quotaT0); err != nil {
		t.Fatal(err)
	} else {
		e.dlv = d.ID
	}

	const (
		no = http.StatusUnauthorized
		ok = http.StatusOK
		nf = http.StatusNotFound
		fb = http.StatusForbidden
	)
	anyone := [nRoles]int{ok, ok, ok, ok, ok}
	keyed := [nRoles]int{no, ok, ok, ok, ok}
	adminOnly := [nRoles]int{no, fb, fb, fb, ok}
	ownJob := [nRoles]int{no, nf, ok, ok, ok}
	refusedScoring := [nRoles]int{no, http.StatusBadRequest, http.StatusBadRequest, http.StatusBadRequest, http.StatusBadRequest}
	// kept: a refused request left the spare tenant or key as it was.
	keptTenant := func(e *matrixEnv, role, status int, _ []byte) {
		if _, err := e.st.GetTenant(context.Background(), e.spare); status >= 300 && err != nil {
			e.t.Errorf("%s was refused (%d) and the tenant is gone: %v", roleNames[role], status, err)
		}
	}
	keptKey := func(e *matrixEnv, role, status int, _ []byte) {
		ks, _, err := e.st.ListKeys(context.Background(), "acme", "", 100)
		if err != nil {
			e.t.Fatal(err)
		}
		i := slices.IndexFunc(ks, func(k store.APIKey) bool { return k.ID == e.spare })
		if status >= 300 && (i < 0 || !ks[i].RevokedAt.IsZero()) {
			e.t.Errorf("%s was refused (%d) and the key was revoked", roleNames[role], status)
		}
	}
	consoleRefused := [nRoles]int{no, no, no, no, no}
	signInForm := func(e *matrixEnv, role, status int, body []byte) {
		if !strings.Contains(string(body), `action="/console/signin"`) {
			e.t.Errorf("%s without a session was not sent to the sign-in form: %.200s", roleNames[role], body)
		}
	}
	// A console form posted without a session sends the browser to sign
	// in (the redirect followed: 200, the form); it changes nothing.
	formToSignIn := [nRoles]int{ok, ok, ok, ok, ok}
	keptKeyToSignIn := func(e *matrixEnv, role, status int, body []byte) {
		signInForm(e, role, status, body)
		keptKey(e, role, http.StatusUnauthorized, body)
	}
	hidesJob := func(e *matrixEnv, role, status int, body []byte) {
		if role == roleOther && strings.Contains(string(body), e.job) {
			e.t.Errorf("another tenant sees acme's job: %s", body)
		}
	}
	hidesFile := func(e *matrixEnv, role, status int, body []byte) {
		if role == roleOther && strings.Contains(string(body), e.file) {
			e.t.Errorf("another tenant sees acme's file: %s", body)
		}
	}
	hidesBatch := func(e *matrixEnv, role, status int, body []byte) {
		if role == roleOther && strings.Contains(string(body), e.batch) {
			e.t.Errorf("another tenant sees acme's batch: %s", body)
		}
	}
	keptFile := func(e *matrixEnv, role, status int, _ []byte) {
		if _, err := e.st.File(context.Background(), "acme", e.spare, time.Now()); status >= 300 && err != nil {
			e.t.Errorf("%s was refused (%d) and the file is gone: %v", roleNames[role], status, err)
		}
	}
	e.file, e.batch = matrixBatch(t, e)
	rows := []matrixRow{
		{pattern: "POST /v1/chat/completions", body: chatReq(2), want: keyed},
		{pattern: "POST /v1/completions", body: `{"model":"` + llama + `","prompt":"hi","max_tokens":2}`, want: keyed},
		// The fleet serves a chat model: its backend refuses embeddings,
		// once the caller is let through.
		{pattern: "POST /v1/embeddings", body: `{"model":"` + llama + `","input":"hi"}`,
			want: [nRoles]int{no, http.StatusBadRequest, http.StatusBadRequest, http.StatusBadRequest, http.StatusBadRequest}},
		{pattern: "GET /v1/models", want: keyed},
		{pattern: "GET /v1/models/{model...}", path: "/v1/models/" + llama, want: keyed},
		{pattern: "POST /v1/jobs", body: chatJob("matrix", 2), header: []string{"Idempotency-Key", "{unique}"},
			want: [nRoles]int{no, http.StatusAccepted, http.StatusAccepted, http.StatusAccepted, http.StatusAccepted}},
		{pattern: "GET /v1/jobs", want: keyed, check: hidesJob},
		{pattern: "GET /v1/jobs/{id}", path: "/v1/jobs/{job}", want: ownJob},
		{pattern: "GET /v1/jobs/{id}/result", path: "/v1/jobs/{job}/result", want: ownJob},
		{pattern: "POST /v1/jobs/{id}/cancel", path: "/v1/jobs/{job}/cancel", // it succeeded: too late to cancel
			want: [nRoles]int{no, nf, http.StatusConflict, http.StatusConflict, http.StatusConflict}},
		{pattern: "GET /v1/jobs/{id}/attempts", path: "/v1/jobs/{job}/attempts", want: [nRoles]int{no, nf, fb, ok, ok}},
		{pattern: "GET /v1/jobs/{id}/events", path: "/v1/jobs/{job}/events", want: ownJob},
		{pattern: "GET /v1/events", want: keyed},
		{pattern: "GET /v1/usage", want: [nRoles]int{no, ok, fb, ok, ok}, check: func(e *matrixEnv, role, status int, body []byte) {
			if role == roleOther && strings.Contains(string(body), "acme") {
				e.t.Errorf("another tenant's usage shows acme's: %s", body)
			}
		}},
		{pattern: "GET /v1/admin/tenants", want: adminOnly},
		{pattern: "POST /v1/admin/tenants", body: `{"name":"{unique}"}`, want: [nRoles]int{no, fb, fb, fb, http.StatusCreated}},
		{pattern: "GET /v1/admin/tenants/{name}", path: "/v1/admin/tenants/acme", want: adminOnly},
		{pattern: "PATCH /v1/admin/tenants/{name}", path: "/v1/admin/tenants/acme", body: `{"weight":1}`, want: adminOnly},
		{pattern: "DELETE /v1/admin/tenants/{name}", path: "/v1/admin/tenants/{spare-tenant}", want: adminOnly, check: keptTenant},
		{pattern: "GET /v1/admin/keys", want: adminOnly},
		{pattern: "POST /v1/admin/keys", body: `{"tenant":"acme"}`, want: [nRoles]int{no, fb, fb, fb, http.StatusCreated}},
		{pattern: "DELETE /v1/admin/keys/{id}", path: "/v1/admin/keys/{spare-key}", want: adminOnly, check: keptKey},
		{pattern: "POST /v1/admin/keys/{id}/rotate", path: "/v1/admin/keys/{spare-key}/rotate",
			want: [nRoles]int{no, fb, fb, fb, http.StatusCreated}, check: keptKey},
		{pattern: "GET /v1/admin/usage", want: adminOnly},
		// vLLM's routes (vllmroutes.go, responses.go, pooling.go): /health
		// and /version need no key, as on vLLM; the chat fleet's backend
		// refuses scoring, once the caller is let through.
		{pattern: "GET /health", want: anyone},
		{pattern: "GET /version", want: anyone},
		{pattern: "POST /tokenize", body: `{"model":"` + llama + `","prompt":"hi"}`, want: keyed},
		{pattern: "POST /detokenize", body: `{"model":"` + llama + `","tokens":[104,105]}`, want: keyed},
		{pattern: "POST /v1/responses", body: `{"model":"` + llama + `","input":"hi","max_output_tokens":2}`, want: keyed},
		{pattern: "POST /v1/rerank", body: `{"model":"` + llama + `","query":"q","documents":["d"]}`, want: refusedScoring},
		{pattern: "POST /rerank", body: `{"model":"` + llama + `","query":"q","documents":["d"]}`, want: refusedScoring},
		{pattern: "POST /v1/score", body: `{"model":"` + llama + `","text_1":"q","text_2":"d"}`, want: refusedScoring},
		{pattern: "POST /score", body: `{"model":"` + llama + `","text_1":"q","text_2":"d"}`, want: refusedScoring},
		// Outcomes (outcomes.go): policies are written by operators and
		// read by any key of their tenant; the rest is operators'. The
		// matrix's job succeeded: too late to review or replay.
		{pattern: "POST /v1/validation-policies", body: `{"name":"{unique}","rules":[{"rule":"json"}]}`,
			want: [nRoles]int{no, http.StatusCreated, fb, http.StatusCreated, http.StatusCreated}},
		{pattern: "GET /v1/validation-policies", want: keyed, check: func(e *matrixEnv, role, status int, body []byte) {
			if role == roleOther && strings.Contains(string(body), `"matrix"`) {
				e.t.Errorf("another tenant sees acme's policies: %s", body)
			}
		}},
		{pattern: "GET /v1/validation-policies/{name}", path: "/v1/validation-policies/matrix", want: ownJob},
		{pattern: "GET /v1/validation-policies/{name}/versions", path: "/v1/validation-policies/matrix/versions", want: ownJob},
		{pattern: "GET /v1/reviews", want: [nRoles]int{no, ok, fb, ok, ok}, check: hidesJob},
		{pattern: "POST /v1/jobs/{id}/review", path: "/v1/jobs/{job}/review", body: `{"decision":"approve"}`,
			want: [nRoles]int{no, nf, fb, http.StatusConflict, http.StatusConflict}},
		{pattern: "GET /v1/jobs/{id}/review", path: "/v1/jobs/{job}/review", want: [nRoles]int{no, nf, fb, nf, nf}},
		{pattern: "GET /v1/jobs/{id}/audit", path: "/v1/jobs/{job}/audit", want: [nRoles]int{no, nf, fb, ok, ok}},
		{pattern: "POST /v1/jobs/{id}/replay", path: "/v1/jobs/{job}/replay",
			want: [nRoles]int{no, nf, fb, http.StatusConflict, http.StatusConflict}},
		{pattern: "GET /v1/dead-letters", want: [nRoles]int{no, ok, fb, ok, ok}, check: hidesJob},
		{pattern: "GET /v1/entities/{key}", path: "/v1/entities/matrix-entity", want: ownJob},
		// Files and batches (files.go, batches.go): {file} and {batch} are acme's.
		{pattern: "POST /v1/files", body: "{upload}", want: keyed},
		{pattern: "GET /v1/files", want: keyed, check: hidesFile},
		{pattern: "GET /v1/files/{id}", path: "/v1/files/{file}", want: ownJob},
		{pattern: "GET /v1/files/{id}/content", path: "/v1/files/{file}/content", want: ownJob},
		{pattern: "DELETE /v1/files/{id}", path: "/v1/files/{spare-file}", want: ownJob, check: keptFile},
		{pattern: "POST /v1/batches", body: `{"input_file_id":"{file}","endpoint":"/v1/chat/completions","completion_window":"24h"}`,
			want: [nRoles]int{no, nf, ok, ok, ok}},
		{pattern: "GET /v1/batches", want: keyed, check: hidesBatch},
		{pattern: "GET /v1/batches/{id}", path: "/v1/batches/{batch}", want: ownJob},
		{pattern: "POST /v1/batches/{id}/cancel", path: "/v1/batches/{batch}/cancel", // it completed: too late to cancel
			want: [nRoles]int{no, nf, http.StatusConflict, http.StatusConflict, http.StatusConflict}},
		// The fleet (fleet.go): operators', every tenant's (backends are shared).
		{pattern: "GET /v1/fleet", want: [nRoles]int{no, ok, fb, ok, ok}},
		{pattern: "GET /v1/fleet/events", want: [nRoles]int{no, ok, fb, ok, ok}},
		// Its queues: another tenant's operator sees none of acme's rows.
		{pattern: "GET /v1/fleet/queues", want: [nRoles]int{no, ok, fb, ok, ok}, check: func(e *matrixEnv, role, status int, body []byte) {
			if role == roleOther && strings.Contains(string(body), `"acme"`) {
				e.t.Errorf("another tenant's operator sees acme's queues: %s", body)
			}
			if role == roleOperator && !strings.Contains(string(body), `"tenant":"acme"`) {
				e.t.Errorf("acme's operator does not see acme's admissions: %s", body)
			}
		}},
		// The console (console.go) authenticates by its session cookie,
		// which the matrix cannot express: here, a bearer key alone opens
		// nothing (a page or a form's action sends the browser to the
		// sign-in form, changing nothing; a forwarded call is 401).
		// TestConsoleAccess tests the sessions of each role.
		{pattern: "GET /console", want: anyone, check: signInForm},
		{pattern: "GET /console/static/", path: "/console/static/console.css", want: anyone},
		{pattern: "GET /console/signin", want: anyone, check: signInForm},
		{pattern: "POST /console/signin", want: [nRoles]int{fb, fb, fb, fb, fb}},
		{pattern: "POST /console/signout", want: formToSignIn, check: signInForm},
		{pattern: "GET /console/fleet", want: anyone, check: signInForm},
		{pattern: "GET /console/queues", want: anyone, check: signInForm},
		{pattern: "GET /console/jobs", want: anyone, check: signInForm},
		{pattern: "GET /console/jobs/{id}", path: "/console/jobs/{job}", want: anyone, check: signInForm},
		{pattern: "GET /console/reviews", want: anyone, check: signInForm},
		{pattern: "POST /console/jobs/{id}/review", path: "/console/jobs/{job}/review", want: formToSignIn, check: signInForm},
		{pattern: "GET /console/dead-letters", want: anyone, check: signInForm},
		{pattern: "POST /console/jobs/{id}/replay", path: "/console/jobs/{job}/replay", want: formToSignIn, check: signInForm},
		{pattern: "GET /console/batches", want: anyone, check: signInForm},
		{pattern: "POST /console/batches/{id}/cancel", path: "/console/batches/{batch}/cancel", want: formToSignIn, check: signInForm},
		{pattern: "GET /console/tenants", want: anyone, check: signInForm},
		{pattern: "POST /console/keys/{id}/rotate", path: "/console/keys/{spare-key}/rotate", want: formToSignIn, check: keptKeyToSignIn},
		{pattern: "GET /console/usage", want: anyone, check: signInForm},
		{pattern: "GET /console/webhooks", want: anyone, check: signInForm},
		{pattern: "POST /console/webhooks/endpoints", want: formToSignIn, check: signInForm},
		{pattern: "GET /console/webhooks/endpoints/{id}", path: "/console/webhooks/endpoints/{hook}", want: anyone, check: signInForm},
		{pattern: "POST /console/webhooks/endpoints/{id}/state", path: "/console/webhooks/endpoints/{hook}/state", want: formToSignIn, check: signInForm},
		{pattern: "POST /console/webhooks/endpoints/{id}/rotate", path: "/console/webhooks/endpoints/{hook}/rotate", want: formToSignIn, check: signInForm},
		{pattern: "POST /console/webhooks/endpoints/{id}/test", path: "/console/webhooks/endpoints/{hook}/test", want: formToSignIn, check: signInForm},
		{pattern: "GET /console/webhooks/deliveries/{id}", path: "/console/webhooks/deliveries/{delivery}", want: anyone, check: signInForm},
		{pattern: "POST /console/webhooks/deliveries/{id}/redeliver", path: "/console/webhooks/deliveries/{delivery}/redeliver", want: formToSignIn, check: signInForm},
		{pattern: "GET /console/api/{path...}", path: "/console/api/v1/jobs", want: consoleRefused},
		{pattern: "POST /console/api/{path...}", path: "/console/api/v1/jobs/{job}/cancel", want: consoleRefused},
		{pattern: "PATCH /console/api/{path...}", path: "/console/api/v1/admin/tenants/acme", want: consoleRefused},
		{pattern: "DELETE /console/api/{path...}", path: "/console/api/v1/admin/keys/{spare-key}", want: consoleRefused, check: keptKey},
		// Webhooks (webhooks.go): operators' of their own tenant. The
		// matrix's delivery is still pending: too early to redeliver.
		{pattern: "POST /v1/webhooks/endpoints", body: `{"url":"http://127.0.0.1:9/x","events":["job.failed"]}`,
			want: [nRoles]int{no, http.StatusCreated, fb, http.StatusCreated, http.StatusCreated}},
		{pattern: "GET /v1/webhooks/endpoints", want: [nRoles]int{no, ok, fb, ok, ok}, check: func(e *matrixEnv, role, status int, body []byte) {
			if role == roleOther && strings.Contains(string(body), e.hook) {
				e.t.Errorf("another tenant sees acme's endpoint: %s", body)
			}
		}},
		{pattern: "GET /v1/webhooks/endpoints/{id}", path: "/v1/webhooks/endpoints/{hook}", want: [nRoles]int{no, nf, fb, ok, ok}},
		{pattern: "PATCH /v1/webhooks/endpoints/{id}", path: "/v1/webhooks/endpoints/{hook}", body: `{"description":"x"}`,
			want: [nRoles]int{no, nf, fb, ok, ok}},
		{pattern: "DELETE /v1/webhooks/endpoints/{id}", path: "/v1/webhooks/endpoints/{spare-hook}", want: [nRoles]int{no, nf, fb, ok, ok},
			check: func(e *matrixEnv, role, status int, _ []byte) {
				if _, err := e.st.Endpoint(context.Background(), "acme", e.spare); status >= 300 && err != nil {
					e.t.Errorf("%s was refused (%d) and the endpoint is gone: %v", roleNames[role], status, err)
				}
			}},
		{pattern: "POST /v1/webhooks/endpoints/{id}/rotate-secret", path: "/v1/webhooks/endpoints/{hook}/rotate-secret",
			want: [nRoles]int{no, nf, fb, ok, ok}},
		{pattern: "POST /v1/webhooks/endpoints/{id}/test", path: "/v1/webhooks/endpoints/{hook}/test",
			want: [nRoles]int{no, nf, fb, http.StatusAccepted, http.StatusAccepted}},
		{pattern: "GET /v1/webhooks/endpoints/{id}/deliveries", path: "/v1/webhooks/endpoints/{hook}/deliveries",
			want: [nRoles]int{no, nf, fb, ok, ok}},
		{pattern: "GET /v1/webhooks/deliveries/{id}", path: "/v1/webhooks/deliveries/{delivery}", want: [nRoles]int{no, nf, fb, ok, ok}},
		{pattern: "POST /v1/webhooks/deliveries/{id}/redeliver", path: "/v1/webhooks/deliveries/{delivery}/redeliver",
			want: [nRoles]int{no, nf, fb, http.StatusConflict, http.StatusConflict}},
		{pattern: "GET /v1/jobs/{id}/deliveries", path: "/v1/jobs/{job}/deliveries", want: [nRoles]int{no, nf, fb, ok, ok}},
		{pattern: "GET /healthz", want: anyone},
		{pattern: "GET /readyz", want: anyone},
		{pattern: "GET /metrics", want: anyone},
		{pattern: "/", path: "/v1/no-such-route", want: [nRoles]int{nf, nf, nf, nf, nf}},
	}

	var covered []string
	for _, row := range rows {
		covered = append(covered, row.pattern)
		method, path, found := strings.Cut(row.pattern, " ")
		if !found {
			method, path = http.MethodGet, row.pattern
		}
		if row.path != "" {
			path = row.path
		}
		for role := range nRoles {
			p, body := e.expand(path), e.expand(row.body)
			var header []string
			for _, h := range row.header {
				header = append(header, e.expand(h))
			}
			status, b := e.do(method, p, e.keys[role], body, header...)
			if status != row.want[role] {
				t.Errorf("%s (%s %s) with %s: %d %s, want %d", row.pattern, method, p, roleNames[role], status, b, row.want[role])
			}
			var eb errorBody
			if status >= 400 && path != "/health" && path != "/console/signin" && (json.Unmarshal(b, &eb) != nil || eb.Error.Message == "" || eb.Error.Type == "") {
				t.Errorf("%s with %s: %d and not an OpenAI-shaped error: %s", row.pattern, roleNames[role], status, b)
			}
			if row.check != nil {
				row.check(e, role, status, b)
			}
		}
	}
	// ?tenant= is an admin's alone: every read again, by another tenant's
	// operator naming acme, answers as it did without (its own tenant's
	// view) and shows none of acme's objects.
	for _, row := range rows {
		method, path, _ := strings.Cut(row.pattern, " ")
		if row.path != "" {
			path = row.path
		}
		if method != http.MethodGet || row.want[roleOther] == http.StatusUnauthorized || strings.HasPrefix(path, "/console") {
			continue
		}
		p := e.expand(path)
		sep := "?"
		if strings.Contains(p, "?") {
			sep = "&"
		}
		status, b := e.do(method, p+sep+"tenant=acme", e.keys[roleOther], "")
		if status != row.want[roleOther] {
			t.Errorf("%s with another tenant's operator naming ?tenant=acme: %d %s, want %d as without it", row.pattern, status, b, row.want[roleOther])
		}
		for _, id := range []string{e.job, e.file, e.batch, e.hook, e.dlv, `"tenant":"acme"`} {
			if status < 300 && bytes.Contains(b, []byte(id)) { // an error names the id asked for
				t.Errorf("%s with another tenant's operator naming ?tenant=acme shows %s: %.300s", row.pattern, id, b)
			}
		}
	}
	for _, p := range f.api.mux.patterns {
		if !slices.Contains(covered, p) {
			t.Errorf("route %q has no row in the matrix: add one", p)
		}
	}
	for _, p := range covered {
		if !slices.Contains(f.api.mux.patterns, p) {
			t.Errorf("the matrix has a row for %q, which the gateway does not register", p)
		}
	}
}
