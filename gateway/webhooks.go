package gateway

import (
	"errors"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/google/uuid"

	"github.com/kvgate/kvgate/gateway/webhook"
	"github.com/kvgate/kvgate/store"
)

// Webhooks: tenant-registered endpoints and their deliveries
// (docs/webhooks.md). Every route is an operator's (or an admin's) of the
// caller's tenant. A delivery's URL is only ever a registered endpoint's,
// checked by the egress guard at registration and again, on the address
// actually dialled, at every attempt.

// Webhooks configures the webhook API.
type Webhooks struct {
	// Store holds endpoints and deliveries; without it the routes answer
	// 404.
	Store store.Webhooks
	// Guard checks endpoint URLs at registration.
	Guard *webhook.Guard
	// Wake tells the dispatcher a delivery is due (a test, a
	// redelivery); nil if none listens.
	Wake func()
	// SecretOverlap is how long a rotated-out secret keeps signing [24h].
	SecretOverlap time.Duration
}

func (s *Server) webhookRoutes() {
	if s.cfg.Webhooks.Guard == nil {
		s.cfg.Webhooks.Guard = &webhook.Guard{} // https, public addresses only
	}
	for _, r := range []struct {
		pattern string
		h       func(http.ResponseWriter, *http.Request) int
	}{
		{"POST /v1/webhooks/endpoints", s.handleCreateEndpoint},
		{"GET /v1/webhooks/endpoints", s.handleListEndpoints},
		{"GET /v1/webhooks/endpoints/{id}", s.handleGetEndpoint},
		{"PATCH /v1/webhooks/endpoints/{id}", s.handlePatchEndpoint},
		{"DELETE /v1/webhooks/endpoints/{id}", s.handleDeleteEndpoint},
		{"POST /v1/webhooks/endpoints/{id}/rotate-secret", s.handleRotateSecret},
		{"POST /v1/webhooks/endpoints/{id}/test", s.handleTestEndpoint},
		{"GET /v1/webhooks/endpoints/{id}/deliveries", s.handleEndpointDeliveries},
		{"GET /v1/webhooks/deliveries/{id}", s.handleGetDelivery},
		{"POST /v1/webhooks/deliveries/{id}/redeliver", s.handleRedeliver},
		{"GET /v1/jobs/{id}/deliveries", s.handleJobDeliveries},
	} {
		_, path, _ := strings.Cut(r.pattern, " ")
		h := r.h
		s.mux.Handle(r.pattern, s.api(path, func(w http.ResponseWriter, req *http.Request) int {
			if !isOperator(req.Context()) {
				return writeError(w, s.log, errOperatorOnly)
			}
			return h(w, req)
		}))
	}
}

var (
	errNoEndpoint = &apiError{status: http.StatusNotFound, typ: "invalid_request_error", code: "not_found",
		msg: "No such webhook endpoint for your tenant."}
	errNoDelivery = &apiError{status: http.StatusNotFound, typ: "invalid_request_error", code: "not_found",
		msg: "No such webhook delivery for your tenant."}
)

// orNotFound puts a webhook's own words on a store's ErrNotFound.
func orNotFound(err error, nf *apiError) error {
	if errors.Is(err, store.ErrNotFound) {
		return nf
	}
	return err
}

type endpointView struct {
	Object         string   `json:"object"`
	ID             string   `json:"id"`
	URL            string   `json:"url"`
	Events         []string `json:"events"`
	Description    string   `json:"description"`
	IncludeResult  bool     `json:"include_result"`
	Disabled       bool     `json:"disabled"`
	DisabledReason string   `json:"disabled_reason,omitempty"`
	// Secret is shown once: in the answers to the creation and to a
	// rotation.
	Secret string `json:"secret,omitempty"`
	// PreviousSecretExpiresAt is when a rotated-out secret stops signing.
	PreviousSecretExpiresAt int64 `json:"previous_secret_expires_at,omitempty"`
	CreatedAt               int64 `json:"created_at"`
	UpdatedAt               int64 `json:"updated_at"`
}

func endpointViewOf(e store.WebhookEndpoint, now time.Time) endpointView {
	v := endpointView{Object: "webhook_endpoint", ID: e.ID, URL: e.URL, Events: e.Events, Description: e.Description,
		IncludeResult: e.IncludeResult, Disabled: e.Disabled, DisabledReason: e.DisabledReason,
		CreatedAt: e.CreatedAt.Unix(), UpdatedAt: e.UpdatedAt.Unix()}
	if e.PrevSecret != "" && now.Before(e.PrevUntil) {
		v.PreviousSecretExpiresAt = e.PrevUntil.Unix()
	}
	return v
}

type endpointRequest struct {
	URL           *string  `json:"url"`
	Events        []string `json:"events"`
	Description   *string  `json:"description"`
	IncludeResult *bool    `json:"include_result"`
	Disabled      *bool    `json:"disabled"`
}

// check validates what a request sets; create says every required field
// must be there.
func (s *Server) checkEndpoint(req endpointRequest, create bool) error {
	if req.URL != nil || create {
		if req.URL == nil || *req.URL == "" {
			return badRequest("url", "url is required: the HTTPS URL that receives the deliveries.")
		}
		if err := s.cfg.Webhooks.Guard.CheckURL(*req.URL); err != nil {
			return badRequest("url", err.Error())
		}
	}
	if req.Events != nil || create {
		if len(req.Events) == 0 {
			return badRequest("events", "events must name at least one of: "+strings.Join(store.WebhookEvents, ", ")+".")
		}
		for _, e := range req.Events {
			if !store.ValidWebhookEvent(e) {
				return badRequest("events", strconv.Quote(e)+" is not an event; events are: "+strings.Join(store.WebhookEvents, ", ")+".")
			}
		}
	}
	if req.Description != nil && len(*req.Description) > 512 {
		return badRequest("description", "description must be at most 512 bytes.")
	}
	if req.Description != nil && !storableText(*req.Description) {
		return badRequest("description", "description must be text without NUL characters.")
	}
	return nil
}

func dedupe(evs []string) []string {
	if evs == nil {
		return nil
	}
	out := slices.Clone(evs)
	slices.Sort(out)
	return slices.Compact(out)
}

func (s *Server) handleCreateEndpoint(w http.ResponseWriter, r *http.Request) int {
	ctx := r.Context()
	var req endpointRequest
	if err := decodeBody(r, &req); err != nil {
		return writeError(w, s.log, err)
	}
	if req.Disabled != nil {
		return writeError(w, s.log, badRequest("disabled", "A new endpoint is enabled; disable it with PATCH."))
	}
	if err := s.checkEndpoint(req, true); err != nil {
		return writeError(w, s.log, err)
	}
	secret, err := webhook.NewSecret()
	if err != nil {
		return writeError(w, s.log, err)
	}
	key, err := optionalIdempotencyKey(r)
	if err != nil {
		return writeError(w, s.log, err)
	}
	now := time.Now()
	e := store.WebhookEndpoint{ID: "we_" + uuid.Must(uuid.NewV7()).String(), Tenant: tenantOf(ctx), URL: *req.URL,
		Events: dedupe(req.Events), Secret: secret, CreatedAt: now, UpdatedAt: now}
	if key != "" {
		// The key names the endpoint: the same request again finds the
		// one it made, never a second.
		e.ID = "we_" + uuid.NewSHA1(endpointKeys, []byte(e.Tenant+"\x00"+key)).String()
	}
	if req.Description != nil {
		e.Description = *req.Description
	}
	if req.IncludeResult != nil {
		e.IncludeResult = *req.IncludeResult
	}
	err = s.cfg.Webhooks.Store.CreateEndpoint(ctx, e)
	if key != "" && errors.Is(err, store.ErrExists) && !errors.Is(err, store.ErrEndpointDeleted) {
		made, err := s.cfg.Webhooks.Store.Endpoint(ctx, e.Tenant, e.ID)
		if errors.Is(err, store.ErrNotFound) {
			err = store.ErrEndpointDeleted // since the insert
		}
		if err != nil {
			return writeError(w, s.log, err)
		}
		if made.URL != e.URL || !slices.Equal(slices.Sorted(slices.Values(made.Events)), slices.Sorted(slices.Values(e.Events))) || made.Description != e.Description || made.IncludeResult != e.IncludeResult {
			return writeError(w, s.log, store.ErrConflict) // idempotency_key_reused
		}
		v := endpointViewOf(made, now)
		v.Secret = made.Secret
		w.Header().Set("Idempotent-Replayed", "true")
		w.Header().Set("Location", "/v1/webhooks/endpoints/"+made.ID)
		writeJSON(w, http.StatusOK, v)
		return http.StatusOK
	}
	if err != nil {
		return writeError(w, s.log, err)
	}
	v := endpointViewOf(e, now)
	v.Secret = secret
	w.Header().Set("Location", "/v1/webhooks/endpoints/"+e.ID)
	writeJSON(w, http.StatusCreated, v)
	return http.StatusCreated
}

// endpointKeys is the namespace of the endpoint ids made from a tenant and
// an Idempotency-Key.
var endpointKeys = uuid.MustParse("5b0f7c1e-8f7a-4d0e-9a51-6f2d1c3b4a90")

// optionalIdempotencyKey reads an Idempotency-Key where one is allowed but
// not needed: "" without one.
func optionalIdempotencyKey(r *http.Request) (string, error) {
	key := r.Header.Get("Idempotency-Key")
	if len(key) > 255 || !utf8.ValidString(key) {
		return "", &apiError{status: http.StatusBadRequest, typ: "invalid_request_error", code: "invalid_idempotency_key",
			msg: "An Idempotency-Key is 1 to 255 bytes of UTF-8 text."}
	}
	return key, nil
}

func (s *Server) handleListEndpoints(w http.ResponseWriter, r *http.Request) int {
	ctx := r.Context()
	es, err := s.cfg.Webhooks.Store.Endpoints(ctx, tenantOf(ctx))
	if err != nil {
		return writeError(w, s.log, err)
	}
	now := time.Now()
	data := make([]endpointView, len(es))
	for i, e := range es {
		data[i] = endpointViewOf(e, now)
	}
	writeJSON(w, http.StatusOK, page(data, ""))
	return http.StatusOK
}

func (s *Server) handleGetEndpoint(w http.ResponseWriter, r *http.Request) int {
	ctx := r.Context()
	e, err := s.cfg.Webhooks.Store.Endpoint(ctx, tenantOf(ctx), r.PathValue("id"))
	if err != nil {
		return writeError(w, s.log, orNotFound(err, errNoEndpoint))
	}
	writeJSON(w, http.StatusOK, endpointViewOf(e, time.Now()))
	return http.StatusOK
}

func (s *Server) handlePatchEndpoint(w http.ResponseWriter, r *http.Request) int {
	ctx := r.Context()
	var req endpointRequest
	if err := decodeBody(r, &req); err != nil {
		return writeError(w, s.log, err)
	}
	if err := s.checkEndpoint(req, false); err != nil {
		return writeError(w, s.log, err)
	}
	p := store.EndpointPatch{URL: req.URL, Events: dedupe(req.Events), Description: req.Description, IncludeResult: req.IncludeResult,
		Disabled: req.Disabled, Now: time.Now()}
	if req.Disabled != nil && *req.Disabled {
		p.Reason = "disabled by an operator"
	}
	e, err := s.cfg.Webhooks.Store.UpdateEndpoint(ctx, tenantOf(ctx), r.PathValue("id"), p)
	if err != nil {
		return writeError(w, s.log, orNotFound(err, errNoEndpoint))
	}
	writeJSON(w, http.StatusOK, endpointViewOf(e, p.Now))
	return http.StatusOK
}

func (s *Server) handleDeleteEndpoint(w http.ResponseWriter, r *http.Request) int {
	ctx := r.Context()
	id := r.PathValue("id")
	if err := s.cfg.Webhooks.Store.DeleteEndpoint(ctx, tenantOf(ctx), id); err != nil {
		return writeError(w, s.log, orNotFound(err, errNoEndpoint))
	}
	writeJSON(w, http.StatusOK, map[string]any{"object": "webhook_endpoint.deleted", "id": id, "deleted": true})
	return http.StatusOK
}

func (s *Server) handleRotateSecret(w http.ResponseWriter, r *http.Request) int {
	ctx := r.Context()
	secret, err := webhook.NewSecret()
	if err != nil {
		return writeError(w, s.log, err)
	}
	overlap := s.cfg.Webhooks.SecretOverlap
	if overlap <= 0 {
		overlap = 24 * time.Hour
	}
	key, err := optionalIdempotencyKey(r)
	if err != nil {
		return writeError(w, s.log, err)
	}
	now := time.Now()
	e, err := s.cfg.Webhooks.Store.RotateSecret(ctx, tenantOf(ctx), r.PathValue("id"), secret, key, now.Add(overlap), now)
	if err != nil {
		return writeError(w, s.log, orNotFound(err, errNoEndpoint))
	}
	if e.Secret != secret {
		// This key's rotation was the last: its secret, not a second one.
		w.Header().Set("Idempotent-Replayed", "true")
	}
	v := endpointViewOf(e, now)
	v.Secret = e.Secret
	writeJSON(w, http.StatusOK, v)
	return http.StatusOK
}

func (s *Server) wakeWebhooks() {
	if s.cfg.Webhooks.Wake != nil {
		s.cfg.Webhooks.Wake()
	}
}

// errEndpointDisabled refuses a send (a test, a redelivery) to a disabled
// endpoint.
var errEndpointDisabled = &apiError{status: http.StatusConflict, typ: "invalid_request_error", code: "endpoint_disabled",
	msg: "The webhook endpoint is disabled; enable it with PATCH {\"disabled\": false} first."}

func (s *Server) handleTestEndpoint(w http.ResponseWriter, r *http.Request) int {
	ctx := r.Context()
	d, err := s.cfg.Webhooks.Store.SendTest(ctx, tenantOf(ctx), r.PathValue("id"), uuid.Must(uuid.NewV7()).String(), time.Now())
	if errors.Is(err, store.ErrEndpointDisabled) {
		return writeError(w, s.log, errEndpointDisabled)
	}
	if err != nil {
		return writeError(w, s.log, orNotFound(err, errNoEndpoint))
	}
	s.wakeWebhooks()
	w.Header().Set("Location", "/v1/webhooks/deliveries/"+d.ID)
	writeJSON(w, http.StatusAccepted, deliveryViewOf(d))
	return http.StatusAccepted
}

type deliveryView struct {
	Object        string `json:"object"`
	ID            string `json:"id"` // the webhook-id header
	EndpointID    string `json:"endpoint_id"`
	EventID       string `json:"event_id"`
	Type          string `json:"type"`
	JobID         string `json:"job_id,omitempty"`
	JobState      string `json:"job_state,omitempty"`
	StateVersion  int64  `json:"state_version,omitempty"`
	State         string `json:"state"`
	AttemptCount  int    `json:"attempt_count"`
	NextAttemptAt int64  `json:"next_attempt_at,omitempty"`
	LastStatus    int    `json:"last_status,omitempty"`
	LastError     string `json:"last_error,omitempty"`
	CreatedAt     int64  `json:"created_at"`
	UpdatedAt     int64  `json:"updated_at"`
	// Attempts, in GET /v1/webhooks/deliveries/{id}, and in a listing
	// with ?include=attempts.
	Attempts []deliveryAttemptView `json:"attempts,omitempty"`
}

type deliveryAttemptView struct {
	Attempt   int    `json:"attempt"`
	StartedAt int64  `json:"started_at"`
	LatencyMS int64  `json:"latency_ms"`
	Status    int    `json:"status"` // 0: no HTTP answer
	Error     string `json:"error,omitempty"`
	Body      string `json:"response_body,omitempty"` // truncated
}

func deliveryViewOf(d store.Delivery) deliveryView {
	v := deliveryView{Object: "webhook_delivery", ID: d.ID, EndpointID: d.EndpointID, EventID: d.EventID, Type: d.Type, JobID: d.JobID,
		JobState: string(d.JobState), StateVersion: d.StateVersion, State: d.State, AttemptCount: d.Attempts,
		LastStatus: d.LastStatus, LastError: d.LastError, CreatedAt: d.CreatedAt.Unix(), UpdatedAt: d.UpdatedAt.Unix()}
	if d.State == store.DeliveryPending || d.State == store.DeliveryRetryScheduled {
		v.NextAttemptAt = d.DueAt.Unix()
	}
	return v
}

func attemptViews(as []store.DeliveryAttempt) []deliveryAttemptView {
	out := make([]deliveryAttemptView, len(as))
	for i, a := range as {
		out[i] = deliveryAttemptView{Attempt: a.Attempt, StartedAt: a.StartedAt.Unix(), LatencyMS: a.Latency.Milliseconds(),
			Status: a.Status, Error: a.Error, Body: a.Body}
	}
	return out
}

// deliveryPage answers a page of deliveries by filter; with
// ?include=attempts each one carries its attempts.
func (s *Server) deliveryPage(w http.ResponseWriter, r *http.Request, f store.DeliveryFilter) int {
	ctx := r.Context()
	var err error
	if f.Limit, err = pageSize(r, 100, 1000); err != nil {
		return writeError(w, s.log, err)
	}
	if a := r.URL.Query().Get("after"); a != "" {
		if f.After, err = strconv.ParseInt(a, 10, 64); err != nil || f.After < 0 {
			return writeError(w, s.log, badRequest("after", "after must be a next_cursor of a previous page."))
		}
	}
	ds, next, err := s.cfg.Webhooks.Store.Deliveries(ctx, f)
	if err != nil {
		return writeError(w, s.log, err)
	}
	include := r.URL.Query().Get("include")
	if include != "" && include != "attempts" {
		return writeError(w, s.log, badRequest("include", `include may only be "attempts": each delivery with its attempts.`))
	}
	data := make([]deliveryView, len(ds))
	for i, d := range ds {
		data[i] = deliveryViewOf(d)
		if include == "attempts" {
			as, err := s.cfg.Webhooks.Store.DeliveryAttempts(ctx, d.ID)
			if err != nil {
				return writeError(w, s.log, err)
			}
			data[i].Attempts = attemptViews(as)
		}
	}
	cursor := ""
	if next != 0 {
		cursor = strconv.FormatInt(next, 10)
	}
	writeJSON(w, http.StatusOK, page(data, cursor))
	return http.StatusOK
}

var deliveryStates = []string{store.DeliveryPending, store.DeliverySending, store.DeliveryDelivered, store.DeliveryRetryScheduled,
	store.DeliveryFailed}

func (s *Server) handleEndpointDeliveries(w http.ResponseWriter, r *http.Request) int {
	ctx := r.Context()
	e, err := s.cfg.Webhooks.Store.Endpoint(ctx, tenantOf(ctx), r.PathValue("id"))
	if err != nil {
		return writeError(w, s.log, orNotFound(err, errNoEndpoint))
	}
	st := r.URL.Query().Get("state")
	if st != "" && !slices.Contains(deliveryStates, st) {
		return writeError(w, s.log, badRequest("state", "state must be one of: "+strings.Join(deliveryStates, ", ")+"."))
	}
	return s.deliveryPage(w, r, store.DeliveryFilter{Tenant: e.Tenant, EndpointID: e.ID, State: st})
}

// handleJobDeliveries is a job's deliveries to every endpoint of its
// tenant, oldest first: another tenant's job is a 404, as on its page.
func (s *Server) handleJobDeliveries(w http.ResponseWriter, r *http.Request) int {
	ctx := r.Context()
	id := r.PathValue("id")
	if s.jobs.Store != nil {
		if _, err := s.jobs.Store.Get(ctx, tenantOf(ctx), id); err != nil {
			return writeError(w, s.log, err)
		}
	}
	return s.deliveryPage(w, r, store.DeliveryFilter{Tenant: tenantOf(ctx), JobID: id})
}

func (s *Server) handleGetDelivery(w http.ResponseWriter, r *http.Request) int {
	ctx := r.Context()
	d, err := s.cfg.Webhooks.Store.Delivery(ctx, tenantOf(ctx), r.PathValue("id"))
	if err != nil {
		return writeError(w, s.log, orNotFound(err, errNoDelivery))
	}
	as, err := s.cfg.Webhooks.Store.DeliveryAttempts(ctx, d.ID)
	if err != nil {
		return writeError(w, s.log, err)
	}
	v := deliveryViewOf(d)
	v.Attempts = attemptViews(as)
	writeJSON(w, http.StatusOK, v)
	return http.StatusOK
}

func (s *Server) handleRedeliver(w http.ResponseWriter, r *http.Request) int {
	ctx := r.Context()
	d, err := s.cfg.Webhooks.Store.Redeliver(ctx, tenantOf(ctx), r.PathValue("id"), principalOf(ctx).keyID, time.Now())
	if errors.Is(err, store.ErrWrongState) {
		return writeError(w, s.log, &apiError{status: http.StatusConflict, typ: "invalid_request_error", code: "delivery_state",
			msg: "The delivery is still in flight; only a FAILED or DELIVERED delivery can be redelivered."})
	}
	if errors.Is(err, store.ErrEndpointDisabled) {
		return writeError(w, s.log, errEndpointDisabled)
	}
	if err != nil {
		return writeError(w, s.log, orNotFound(err, errNoDelivery))
	}
	s.wakeWebhooks()
	writeJSON(w, http.StatusAccepted, deliveryViewOf(d))
	return http.StatusAccepted
}

// handleDeadDeliveries is GET /v1/dead-letters?kind=webhook_delivery:
// the tenant's FAILED deliveries, oldest first.
func (s *Server) handleDeadDeliveries(w http.ResponseWriter, r *http.Request) int {
	if s.cfg.Webhooks.Store == nil {
		return writeError(w, s.log, badRequest("kind", "Webhooks are not enabled on this gateway."))
	}
	return s.deliveryPage(w, r, store.DeliveryFilter{Tenant: tenantOf(r.Context()), State: store.DeliveryFailed})
}
