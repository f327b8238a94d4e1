package gateway

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/kvgate/kvgate/store"
)

// The admin API (/v1/admin/, admin keys only): tenants, keys and every
// tenant's usage; and GET /v1/usage, a tenant's own usage, for its
// operators. It does what `kvgate tenants` and `kvgate keys` do.

func (s *Server) tenantRoutes() {
	admin := func(route string, h func(w http.ResponseWriter, r *http.Request) int) {
		_, path, _ := strings.Cut(route, " ")
		s.mux.Handle(route, s.api(path, func(w http.ResponseWriter, r *http.Request) int {
			if !isAdmin(r.Context()) {
				return writeError(w, s.log, forbidden("admin_key_required", "This endpoint needs an admin key."))
			}
			return h(w, r)
		}))
	}
	admin("GET /v1/admin/tenants", s.handleListTenants)
	admin("POST /v1/admin/tenants", s.handleCreateTenant)
	admin("GET /v1/admin/tenants/{name}", s.handleGetTenant)
	admin("PATCH /v1/admin/tenants/{name}", s.handleUpdateTenant)
	admin("DELETE /v1/admin/tenants/{name}", s.handleDeleteTenant)
	admin("GET /v1/admin/keys", s.handleListKeys)
	admin("POST /v1/admin/keys", s.handleCreateKey)
	admin("DELETE /v1/admin/keys/{id}", s.handleRevokeKey)
	admin("POST /v1/admin/keys/{id}/rotate", s.handleRotateKey)
	admin("GET /v1/admin/usage", s.handleUsage)
	s.mux.Handle("GET /v1/usage", s.api("/v1/usage", func(w http.ResponseWriter, r *http.Request) int {
		if !isOperator(r.Context()) {
			return writeError(w, s.log, forbidden("operator_key_required", "Usage is for your tenant's operators: this endpoint needs an operator key."))
		}
		return s.handleUsage(w, r)
	}))
}

// TenantView is a tenant in the admin API; its limits of 0 mean unlimited.
type TenantView struct {
	Object           string `json:"object"`
	Name             string `json:"name"`
	Weight           int    `json:"weight"`
	RPM              int64  `json:"rpm"`
	TPM              int64  `json:"tpm"`
	MaxConcurrency   int64  `json:"max_concurrency"`
	MaxPendingJobs   int64  `json:"max_pending_jobs"`
	MaxPendingTokens int64  `json:"max_pending_tokens"`
	DailyTokens      int64  `json:"daily_tokens"`
	MonthlyTokens    int64  `json:"monthly_tokens"`
	// Spending budgets, in the configured currency (costs.go).
	DailySpend   float64 `json:"daily_spend"`
	MonthlySpend float64 `json:"monthly_spend"`
	CreatedAt    int64   `json:"created_at"`
	UpdatedAt    int64   `json:"updated_at"`
}

func tenantView(t store.Tenant) TenantView {
	l := t.Limits
	return TenantView{Object: "tenant", Name: t.Name, Weight: t.Weight, RPM: l.RPM, TPM: l.TPM, MaxConcurrency: l.MaxConcurrency,
		MaxPendingJobs: l.MaxPendingJobs, MaxPendingTokens: l.MaxPendingTokens, DailyTokens: l.DailyTokens,
		MonthlyTokens: l.MonthlyTokens, DailySpend: fromMicros(l.DailySpend), MonthlySpend: fromMicros(l.MonthlySpend),
		CreatedAt: t.CreatedAt.Unix(), UpdatedAt: t.UpdatedAt.Unix()}
}

// tenantPatch is a create or update body: fields left out keep their value.
type tenantPatch struct {
	Name             string   `json:"name"`
	Weight           *int     `json:"weight"`
	RPM              *int64   `json:"rpm"`
	TPM              *int64   `json:"tpm"`
	MaxConcurrency   *int64   `json:"max_concurrency"`
	MaxPendingJobs   *int64   `json:"max_pending_jobs"`
	MaxPendingTokens *int64   `json:"max_pending_tokens"`
	DailyTokens      *int64   `json:"daily_tokens"`
	MonthlyTokens    *int64   `json:"monthly_tokens"`
	DailySpend       *float64 `json:"daily_spend"`
	MonthlySpend     *float64 `json:"monthly_spend"`
}

func (p tenantPatch) apply(t *store.Tenant) error {
	for _, f := range []struct {
		v   *int64
		dst *int64
	}{{p.RPM, &t.Limits.RPM}, {p.TPM, &t.Limits.TPM}, {p.MaxConcurrency, &t.Limits.MaxConcurrency},
		{p.MaxPendingJobs, &t.Limits.MaxPendingJobs}, {p.MaxPendingTokens, &t.Limits.MaxPendingTokens},
		{p.DailyTokens, &t.Limits.DailyTokens}, {p.MonthlyTokens, &t.Limits.MonthlyTokens}} {
		if f.v != nil {
			if *f.v < 0 {
				return badRequest("", "Limits are 0 (unlimited) or more.")
			}
			*f.dst = *f.v
		}
	}
	for _, f := range []struct {
		v   *float64
		dst *int64
	}{{p.DailySpend, &t.Limits.DailySpend}, {p.MonthlySpend, &t.Limits.MonthlySpend}} {
		if f.v != nil {
			if !(*f.v >= 0 && *f.v < 1e12) || (*f.v > 0 && toMicros(*f.v) == 0) {
				return badRequest("", "Spending budgets are 0 (unlimited) or at least 0.000001, in the configured currency.")
			}
			*f.dst = toMicros(*f.v)
		}
	}
	if p.Weight != nil {
		if *p.Weight < 1 || *p.Weight > store.MaxWeight {
			return badRequest("weight", fmt.Sprintf("weight is 1 to %d.", store.MaxWeight))
		}
		t.Weight = *p.Weight
	}
	return nil
}

// readJSON reads an admin body into v, strictly (decodeStrict).
func readJSON(r *http.Request, v any) error {
	b, err := readBody(r)
	if err != nil {
		return err
	}
	return decodeStrict(b, v)
}

// decodeStrict parses one JSON value into v, refusing a field v does not
// have as OpenAI refuses an unrecognized argument: a misspelled limit or
// role would otherwise be ignored without a word.
func decodeStrict(raw []byte, v any) error {
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.DisallowUnknownFields()
	err := dec.Decode(v)
	if err == nil && dec.More() {
		err = errors.New("more than one JSON value")
	}
	if err == nil {
		return nil
	}
	if name, ok := strings.CutPrefix(err.Error(), "json: unknown field "); ok {
		name, _ = strconv.Unquote(name)
		return badRequest(name, "Unrecognized request argument supplied: "+name+".")
	}
	return badRequest("", "We could not parse the JSON body of your request. ("+err.Error()+")")
}

func notFound(what string) *apiError {
	return &apiError{status: http.StatusNotFound, typ: "invalid_request_error", code: "not_found", msg: "No such " + what + "."}
}

// Admin lists page as OpenAI's lists do: ?after= (the last name or id
// of the page before), ?limit= (100 by default, at most 1000), has_more.
const adminPageDefault, adminPageMax = 100, 1000

func (s *Server) handleListTenants(w http.ResponseWriter, r *http.Request) int {
	limit, err := pageSize(r, adminPageDefault, adminPageMax)
	if err != nil {
		return writeError(w, s.log, err)
	}
	ts, more, err := s.cfg.Tenants.Store.ListTenants(r.Context(), r.URL.Query().Get("after"), limit)
	if err != nil {
		return writeError(w, s.log, err)
	}
	views := make([]TenantView, len(ts))
	for i, t := range ts {
		views[i] = tenantView(t)
	}
	writeJSON(w, http.StatusOK, pageOf(views, func(v TenantView) string { return v.Name }, more))
	return http.StatusOK
}

func (s *Server) handleCreateTenant(w http.ResponseWriter, r *http.Request) int {
	var p tenantPatch
	if err := readJSON(r, &p); err != nil {
		return writeError(w, s.log, err)
	}
	now := s.cfg.Tenants.Now()
	t := store.Tenant{Name: p.Name, Weight: 1, CreatedAt: now, UpdatedAt: now}
	if err := p.apply(&t); err != nil {
		return writeError(w, s.log, err)
	}
	if err := s.cfg.Tenants.Store.CreateTenant(r.Context(), t); err != nil {
		return writeError(w, s.log, err)
	}
	s.forgetTenant(t.Name)
	writeJSON(w, http.StatusCreated, tenantView(t))
	return http.StatusCreated
}

func (s *Server) handleGetTenant(w http.ResponseWriter, r *http.Request) int {
	t, err := s.cfg.Tenants.Store.GetTenant(r.Context(), r.PathValue("name"))
	if errors.Is(err, store.ErrNotFound) {
		return writeError(w, s.log, notFound("tenant"))
	}
	if err != nil {
		return writeError(w, s.log, err)
	}
	writeJSON(w, http.StatusOK, tenantView(t))
	return http.StatusOK
}

func (s *Server) handleUpdateTenant(w http.ResponseWriter, r *http.Request) int {
	var p tenantPatch
	if err := readJSON(r, &p); err != nil {
		return writeError(w, s.log, err)
	}
	t, err := s.cfg.Tenants.Store.UpdateTenant(r.Context(), r.PathValue("name"), s.cfg.Tenants.Now(), p.apply)
	if errors.Is(err, store.ErrNotFound) {
		return writeError(w, s.log, notFound("tenant"))
	}
	if err != nil {
		return writeError(w, s.log, err)
	}
	s.forgetTenant(t.Name)
	writeJSON(w, http.StatusOK, tenantView(t))
	return http.StatusOK
}

func (s *Server) handleDeleteTenant(w http.ResponseWriter, r *http.Request) int {
	name := r.PathValue("name")
	err := s.cfg.Tenants.Store.DeleteTenant(r.Context(), name, s.cfg.Tenants.Now())
	if errors.Is(err, store.ErrNotFound) {
		return writeError(w, s.log, notFound("tenant"))
	}
	if err != nil {
		return writeError(w, s.log, err)
	}
	s.forgetTenant(name)
	s.keys.forgetAll()
	writeJSON(w, http.StatusOK, map[string]any{"object": "tenant.deleted", "name": name, "deleted": true})
	return http.StatusOK
}

// KeyView is a key in the admin API. Key, the secret, is there only in
// the answer that creates it.
type KeyView struct {
	Object         string `json:"object"`
	ID             string `json:"id"`
	Key            string `json:"key,omitempty"`
	Prefix         string `json:"prefix"`
	Tenant         string `json:"tenant"`
	Role           string `json:"role"`
	Name           string `json:"name"`
	RPM            int64  `json:"rpm"`
	TPM            int64  `json:"tpm"`
	MaxConcurrency int64  `json:"max_concurrency"`
	CreatedAt      int64  `json:"created_at"`
	RevokedAt      *int64 `json:"revoked_at"`
}

func keyView(k store.APIKey, secret string) KeyView {
	v := KeyView{Object: "api_key", ID: k.ID, Key: secret, Prefix: k.Prefix, Tenant: k.Tenant, Role: string(k.Role), Name: k.Name,
		RPM: k.Limits.RPM, TPM: k.Limits.TPM, MaxConcurrency: k.Limits.MaxConcurrency, CreatedAt: k.CreatedAt.Unix()}
	if !k.RevokedAt.IsZero() {
		at := k.RevokedAt.Unix()
		v.RevokedAt = &at
	}
	return v
}

func (s *Server) handleListKeys(w http.ResponseWriter, r *http.Request) int {
	limit, err := pageSize(r, adminPageDefault, adminPageMax)
	if err != nil {
		return writeError(w, s.log, err)
	}
	q := r.URL.Query()
	ks, more, err := s.cfg.Tenants.Store.ListKeys(r.Context(), q.Get("tenant"), q.Get("after"), limit)
	if err != nil {
		return writeError(w, s.log, err)
	}
	views := make([]KeyView, len(ks))
	for i, k := range ks {
		views[i] = keyView(k, "")
	}
	writeJSON(w, http.StatusOK, pageOf(views, func(v KeyView) string { return v.ID }, more))
	return http.StatusOK
}

func (s *Server) handleCreateKey(w http.ResponseWriter, r *http.Request) int {
	var req struct {
		Tenant         string `json:"tenant"`
		Role           string `json:"role"`
		Name           string `json:"name"`
		RPM            int64  `json:"rpm"`
		TPM            int64  `json:"tpm"`
		MaxConcurrency int64  `json:"max_concurrency"`
	}
	if err := readJSON(r, &req); err != nil {
		return writeError(w, s.log, err)
	}
	if req.Role == "" {
		req.Role = string(store.RoleUser)
	}
	if !store.Role(req.Role).Valid() {
		return writeError(w, s.log, badRequest("role", "role is user, operator or admin."))
	}
	if req.RPM < 0 || req.TPM < 0 || req.MaxConcurrency < 0 {
		return writeError(w, s.log, badRequest("", "Limits are 0 (unlimited) or more."))
	}
	secret, k := NewAPIKey(req.Tenant, store.Role(req.Role), req.Name, s.cfg.Tenants.Now())
	k.Limits = store.Limits{RPM: req.RPM, TPM: req.TPM, MaxConcurrency: req.MaxConcurrency}
	return s.storeKey(w, r, k, secret)
}

func (s *Server) storeKey(w http.ResponseWriter, r *http.Request, k store.APIKey, secret string) int {
	err := s.cfg.Tenants.Store.CreateKey(r.Context(), k)
	if errors.Is(err, store.ErrNotFound) {
		return writeError(w, s.log, &apiError{status: http.StatusNotFound, typ: "invalid_request_error", code: "not_found",
			param: "tenant", msg: fmt.Sprintf("No such tenant %q: create it first.", k.Tenant)})
	}
	if err != nil {
		return writeError(w, s.log, err)
	}
	s.keys.created()
	writeJSON(w, http.StatusCreated, keyView(k, secret))
	return http.StatusCreated
}

// findKey returns the valid key of an id: a not_found error for none.
func (s *Server) findKey(r *http.Request, id string) (store.APIKey, error) {
	k, err := s.cfg.Tenants.Store.GetKey(r.Context(), id)
	if errors.Is(err, store.ErrNotFound) || err == nil && !k.RevokedAt.IsZero() {
		return store.APIKey{}, notFound("key")
	}
	return k, err
}

func (s *Server) handleRevokeKey(w http.ResponseWriter, r *http.Request) int {
	k, err := s.findKey(r, r.PathValue("id"))
	if err == nil {
		err = s.cfg.Tenants.Store.RevokeKey(r.Context(), k.ID, s.cfg.Tenants.Now())
		// Forgotten whatever the answer: a revocation that committed as
		// its connection broke must not stay cached here.
		s.keys.forget(k.Hash)
	}
	if errors.Is(err, store.ErrNotFound) {
		err = notFound("key")
	}
	if err != nil {
		return writeError(w, s.log, err)
	}
	k.RevokedAt = s.cfg.Tenants.Now()
	writeJSON(w, http.StatusOK, keyView(k, ""))
	return http.StatusOK
}

// handleRotateKey issues a new key like an old one and revokes the old.
func (s *Server) handleRotateKey(w http.ResponseWriter, r *http.Request) int {
	old, err := s.findKey(r, r.PathValue("id"))
	if err != nil {
		return writeError(w, s.log, err)
	}
	secret, k := NewAPIKey(old.Tenant, old.Role, old.Name, s.cfg.Tenants.Now())
	k.Limits = old.Limits
	// One transaction: of two rotations at once, one makes a key and the
	// other finds the old one revoked (404), never two live keys.
	err = s.cfg.Tenants.Store.RotateKey(r.Context(), old.ID, k, s.cfg.Tenants.Now())
	if errors.Is(err, store.ErrNotFound) {
		return writeError(w, s.log, notFound("key"))
	}
	if err != nil {
		return writeError(w, s.log, err)
	}
	s.keys.created()
	s.keys.forget(old.Hash)
	writeJSON(w, http.StatusCreated, keyView(k, secret))
	return http.StatusCreated
}

// UsageView is one tenant's usage on one UTC day.
type UsageView struct {
	Object            string `json:"object"`
	Tenant            string `json:"tenant"`
	Date              string `json:"date"` // YYYY-MM-DD, UTC
	Requests          int64  `json:"requests"`
	Attempts          int64  `json:"attempts"`
	PromptTokens      int64  `json:"prompt_tokens"`
	CompletionTokens  int64  `json:"completion_tokens"`
	ReservedTokens    int64  `json:"reserved_tokens"`
	UncertainRequests int64  `json:"uncertain_requests"`
	UncertainTokens   int64  `json:"uncertain_tokens"`
	ChargedTokens     int64  `json:"charged_tokens"` // what budgets count: all of the tokens above
	// Money, in Currency (costs.go): reported usage's, reserved by
	// requests in flight, and the uncertain requests'; Charged is what
	// spending budgets count, all three.
	Currency      string  `json:"currency"`
	Cost          float64 `json:"cost"`
	ReservedCost  float64 `json:"reserved_cost"`
	UncertainCost float64 `json:"uncertain_cost"`
	ChargedCost   float64 `json:"charged_cost"`
}

// maxUsageSpan bounds a usage report's days (a year, a leap one too).
const maxUsageSpan = 365 * 24 * time.Hour

// handleUsage answers GET /v1/usage (the caller's tenant) and GET
// /v1/admin/usage (?tenant=, every tenant without it), ?from= and ?to= as
// YYYY-MM-DD: the 30 days ending at to (today without it) by default,
// at most 366 days, from on or before to.
func (s *Server) handleUsage(w http.ResponseWriter, r *http.Request) int {
	q := r.URL.Query()
	now := s.cfg.Tenants.Now().UTC()
	to, from := now, time.Time{}
	for _, p := range []struct {
		name string
		dst  *time.Time
	}{{"from", &from}, {"to", &to}} {
		if v := q.Get(p.name); v != "" {
			t, err := time.Parse(time.DateOnly, v)
			if err != nil {
				return writeError(w, s.log, badRequest(p.name, p.name+" is a date: YYYY-MM-DD."))
			}
			*p.dst = t
		}
	}
	if from.IsZero() {
		from = to.AddDate(0, 0, -29) // the 30 days ending at to
	}
	switch {
	case from.After(to):
		return writeError(w, s.log, badRequest("from", "from is a day on or before to."))
	case to.Sub(from) > maxUsageSpan:
		return writeError(w, s.log, badRequest("from", "A usage report spans at most 366 days: narrow from and to."))
	}
	tenant := tenantOf(r.Context())
	if r.URL.Path != "/v1/usage" {
		tenant = q.Get("tenant")
	}
	s.permitsBehind.settle(r.Context()) // this replica's ended requests, all of them
	us, err := s.cfg.Tenants.Store.Usage(r.Context(), tenant, from, to)
	if err != nil {
		return writeError(w, s.log, err)
	}
	list := listOf([]UsageView{})
	for _, u := range us {
		list.Data = append(list.Data, UsageView{Object: "usage.day", Tenant: u.Tenant, Date: u.Day.Format(time.DateOnly),
			Requests: u.Requests, Attempts: u.Attempts, PromptTokens: u.PromptTokens, CompletionTokens: u.CompletionTokens,
			ReservedTokens: u.ReservedTokens, UncertainRequests: u.Uncertain, UncertainTokens: u.UncertainTokens,
			ChargedTokens: u.Charged(), Currency: s.currency(), Cost: fromMicros(u.Cost), ReservedCost: fromMicros(u.ReservedCost),
			UncertainCost: fromMicros(u.UncertainCost), ChargedCost: fromMicros(u.ChargedCost())})
	}
	writeJSON(w, http.StatusOK, list)
	return http.StatusOK
}
