package gateway

import (
	"bytes"
	"cmp"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"net/http"
	"slices"
	"strings"
	"time"

	"github.com/google/uuid"

	"github.com/kvgate/kvgate/store"
)

// jobStore is what the jobs API needs of the durable store.
type jobStore interface {
	Accept(ctx context.Context, j store.NewJob) (store.Job, bool, error)
	Get(ctx context.Context, tenant, id string) (store.Job, error)
	GetByKey(ctx context.Context, tenant, key string) (store.Job, error)
	List(ctx context.Context, tenant string, f store.ListFilter) ([]store.Job, string, error)
	Result(ctx context.Context, tenant, id string) (json.RawMessage, error)
	Cancel(ctx context.Context, tenant, id, eventID string, now time.Time) (store.Job, error)
	Attempts(ctx context.Context, id string) ([]store.Attempt, error)
	Events(ctx context.Context, tenant, jobID string, after int64, limit int) ([]store.Event, error)
	CountEvents(ctx context.Context, tenant string, after int64, limit int) (int, error)
	FeedHead(ctx context.Context, tenant string) (int64, error)
	Stage(ctx context.Context, id, stage string) ([]byte, error)
	store.Outcomes // policies, reviews, replay, dead letters (outcomes.go)
	store.Entities // per-entity ordering (outcomes.go)
}

// feedNotices tells event streams that the published feed may have moved;
// *scheduler.Feed satisfies it.
type feedNotices interface {
	Changed(tenant string) <-chan struct{}
}

// Jobs configures the durable jobs API. Zero values take the defaults in
// brackets.
type Jobs struct {
	Store jobStore
	// Wake tells the runner and the relay that work arrived; nil if none
	// listens.
	Wake func()
	// Feed wakes event streams when events are published; without it they
	// look every second.
	Feed            feedNotices
	MaxAttempts     int           // per job [5]
	DefaultDeadline time.Duration // when a job gives none [24h]
	MaxDeadline     time.Duration // the latest a job may ask for [7 days]
	// MaxReplay bounds what an event stream replays after a client's
	// Last-Event-ID; further behind, it starts from a fresh snapshot [10000].
	MaxReplay int
	// MaxAnswerBytes bounds a backend's answer to a job, the result it
	// stores: a larger one fails the job, not retried [64 MiB].
	MaxAnswerBytes int
	// BatchLease is a replica's lease on the batch it validates or
	// finalizes [30s]; BatchPoll how often the batch worker looks for
	// work it was not woken for [1s].
	BatchLease, BatchPoll time.Duration
}

// withDefaults fills the fields left zero with the defaults in brackets.
func (j Jobs) withDefaults() Jobs {
	j.MaxAttempts = cmp.Or(j.MaxAttempts, 5)
	j.DefaultDeadline = cmp.Or(j.DefaultDeadline, 24*time.Hour)
	j.MaxDeadline = cmp.Or(j.MaxDeadline, 7*24*time.Hour)
	j.MaxReplay = cmp.Or(j.MaxReplay, 10_000)
	j.MaxAnswerBytes = cmp.Or(j.MaxAnswerBytes, 64<<20)
	return j
}

// Check refuses a configuration that would refuse jobs it should take: a
// default deadline past the latest a job may ask for refuses every job
// that names none.
func (j Jobs) Check() error {
	j = j.withDefaults()
	if j.DefaultDeadline < 0 || j.DefaultDeadline > j.MaxDeadline {
		return fmt.Errorf("default_deadline %s: every job that names no deadline would be refused; write at most %s, the latest a job may ask for", j.DefaultDeadline, j.MaxDeadline)
	}
	return nil
}

// deadline is a job's deadline as its request gives it: an instant (at),
// seconds from now (secs, its parameter named secsParam), or neither (the
// default). One that is past, or further than MaxDeadline, is refused.
func (j Jobs) deadline(now time.Time, at *time.Time, secs *int, secsParam string) (time.Time, error) {
	deadline, param := now.Add(j.DefaultDeadline), "deadline"
	switch {
	case at != nil && secs != nil:
		return time.Time{}, badRequest(secsParam, "Give a job's deadline as deadline or as "+secsParam+", not both.")
	case at != nil:
		deadline = *at
	case secs != nil:
		// Clamped first: seconds times time.Second wraps past 2^63 ns,
		// and a wrapped value can land back in range.
		n := max(-1, min(*secs, int(j.MaxDeadline/time.Second)+1))
		deadline, param = now.Add(time.Duration(n)*time.Second), secsParam
	}
	if !deadline.After(now) || deadline.After(now.Add(j.MaxDeadline)) {
		return time.Time{}, badRequest(param, fmt.Sprintf("The deadline must be in the future and within %s.", j.MaxDeadline))
	}
	return deadline, nil
}

// maxJobTokens bounds a job's reservation: what every store's
// token_estimate column holds, and far beyond any backend's KV cache.
const maxJobTokens = math.MaxInt32

var jobEndpoints = map[string]endpoint{
	"/v1/chat/completions": epChat, "/v1/completions": epCompletion, "/v1/embeddings": epEmbedding,
	"/v1/responses": epResponses,
}

// decodeJobRequest parses a job submission's JSON body. A field the job
// API does not have is refused, as OpenAI refuses an unrecognized
// argument: a misspelled deadline_seconds or an unsupported priority
// would otherwise be ignored without a word.
func decodeJobRequest(raw []byte) (jobRequest, error) {
	var req jobRequest
	err := decodeStrict(raw, &req)
	var e *apiError
	if errors.As(err, &e) && e.param != "" {
		e.msg += " A job takes endpoint, body, deadline or deadline_seconds, metadata, validation, source, entity and ordering."
	}
	return req, err
}

type jobRequest struct {
	Endpoint        string          `json:"endpoint"`
	Body            json.RawMessage `json:"body"`
	Deadline        *time.Time      `json:"deadline"`
	DeadlineSeconds *int            `json:"deadline_seconds"`
	Metadata        json.RawMessage `json:"metadata"`
	// Validation names the policy that judges the answer; Source is the
	// text its evidence must occur in (outcomes.go).
	Validation *jobValidation `json:"validation"`
	Source     *string        `json:"source"`
	// Entity names the entity version the job produces; Ordering is
	// "latest" (the default) or "serial" (entities.go).
	Entity   *jobEntity `json:"entity"`
	Ordering string     `json:"ordering"`
}

// jobView is a job as its tenant sees it. Retry details (attempts,
// backends, error classes) are for operators and are not shown here.
type jobView struct {
	ID           string          `json:"id"`
	Object       string          `json:"object"`
	Endpoint     string          `json:"endpoint"`
	Model        string          `json:"model"`
	State        string          `json:"state"`
	StateVersion int64           `json:"state_version"`
	CreatedAt    int64           `json:"created_at"`
	UpdatedAt    int64           `json:"updated_at"`
	Deadline     int64           `json:"deadline"`
	Metadata     json.RawMessage `json:"metadata,omitempty"`
	ResultURL    string          `json:"result_url,omitempty"`
	// The pinned policy and the entity version, on a single job's view
	// (outcomes.go).
	Validation *jobValidation `json:"validation,omitempty"`
	Entity     *jobEntity     `json:"entity,omitempty"`
}

func viewOf(j store.Job) jobView {
	v := jobView{
		ID: j.ID, Object: "job", Endpoint: j.Endpoint, Model: j.Model, State: string(j.State), StateVersion: j.StateVersion,
		CreatedAt: j.CreatedAt.Unix(), UpdatedAt: j.UpdatedAt.Unix(), Deadline: j.Deadline.Unix(), Metadata: j.Metadata,
	}
	if j.State == store.Succeeded {
		v.ResultURL = "/v1/jobs/" + j.ID + "/result"
	}
	return v
}

func (s *Server) jobRoutes() {
	s.mux.Handle("POST /v1/jobs", s.api("/v1/jobs", s.handleSubmitJob))
	s.mux.Handle("GET /v1/jobs", s.api("/v1/jobs", s.handleListJobs))
	s.mux.Handle("GET /v1/jobs/{id}", s.api("/v1/jobs/{id}", s.handleGetJob))
	s.mux.Handle("GET /v1/jobs/{id}/result", s.api("/v1/jobs/{id}/result", s.handleJobResult))
	s.mux.Handle("POST /v1/jobs/{id}/cancel", s.api("/v1/jobs/{id}/cancel", s.handleCancelJob))
	s.mux.Handle("GET /v1/jobs/{id}/attempts", s.api("/v1/jobs/{id}/attempts", s.handleJobAttempts))
	s.mux.Handle("GET /v1/jobs/{id}/events", s.api("/v1/jobs/{id}/events", s.handleJobEvents))
	s.mux.Handle("GET /v1/events", s.api("/v1/events", s.handleTenantEvents))
}

// requestHash identifies a job's result-affecting input: the endpoint and
// the body, whitespace aside.
func requestHash(endpoint string, body []byte) string {
	var compact bytes.Buffer
	if json.Compact(&compact, body) != nil {
		compact.Reset()
		compact.Write(body)
	}
	h := sha256.New()
	h.Write([]byte(endpoint))
	h.Write([]byte{0})
	h.Write(compact.Bytes())
	return hex.EncodeToString(h.Sum(nil))
}

func (s *Server) handleSubmitJob(w http.ResponseWriter, r *http.Request) int {
	key, err := optionalIdempotencyKey(r)
	if err != nil {
		return writeError(w, s.log, err) // there, and not a key
	}
	if key == "" {
		return writeError(w, s.log, &apiError{status: http.StatusBadRequest, typ: "invalid_request_error", code: "idempotency_key_required",
			msg: "POST /v1/jobs needs an Idempotency-Key header of 1 to 255 bytes of UTF-8 text: the same key returns the same job."})
	}
	if strings.HasPrefix(key, batchKeyPrefix) {
		// A batch's lines are keyed so: a job taking such a key first
		// would stand in for a line of the tenant's batch.
		return writeError(w, s.log, &apiError{status: http.StatusBadRequest, typ: "invalid_request_error", code: "idempotency_key_reserved",
			msg: "Idempotency-Keys beginning with " + batchKeyPrefix + " name the jobs of Batch API lines: choose another key."})
	}
	raw, err := readBody(r)
	if err != nil {
		return writeError(w, s.log, err)
	}
	req, err := decodeJobRequest(raw)
	if err != nil {
		return writeError(w, s.log, err)
	}
	hash := outcomeHash(requestHash(req.Endpoint, req.Body), req)
	// A client retrying a lost 202 must get its job back whatever refuses
	// a new one now (its limits, which the job it retries fills; a model
	// gone; an absolute deadline since passed): on a refusal, the key's
	// job, if it made one, is the answer.
	refuse := func(err error) int {
		if j, lerr := s.jobs.Store.GetByKey(r.Context(), tenantOf(r.Context()), key); lerr == nil {
			if j.RequestHash != hash {
				return writeError(w, s.log, store.ErrConflict)
			}
			return s.acceptedJob(w, j, false)
		}
		return writeError(w, s.log, err)
	}
	ep, ok := jobEndpoints[req.Endpoint]
	if !ok {
		return refuse(badRequest("endpoint", "endpoint must be /v1/chat/completions, /v1/completions, /v1/embeddings or /v1/responses."))
	}
	if len(req.Metadata) > 16<<10 {
		return refuse(badRequest("metadata", "metadata is limited to 16 KiB."))
	}
	c, err := parseCall(req.Body, ep)
	if err != nil {
		var api *apiError
		if errors.As(err, &api) && api.param != "" {
			api.param = "body." + api.param
		}
		return refuse(err)
	}
	if c.f.Stream {
		return refuse(badRequest("body.stream", "A job's result is stored, not streamed: leave stream unset."))
	}
	model, err := s.resolveCall(c, "body.model")
	if err != nil {
		return refuse(err)
	}
	outcome, err := s.outcomeOf(r.Context(), req, ep)
	if err != nil {
		return refuse(err)
	}
	entity, err := entityOf(req)
	if err != nil {
		return refuse(err)
	}
	now := time.Now()
	deadline, err := s.jobs.deadline(now, req.Deadline, req.DeadlineSeconds, "deadline_seconds")
	if err != nil {
		return refuse(err)
	}
	// Acceptance must not wait on a backend: the estimate, never /tokenize.
	estimate, estOut := s.reservationWith(c, model, s.est.estimate(model.ID, c.promptBytes))
	if estimate > maxJobTokens {
		return refuse(&apiError{status: http.StatusBadRequest, typ: "invalid_request_error", code: "context_length_exceeded",
			param: "body.max_tokens", msg: fmt.Sprintf("The job would reserve %d tokens (its prompt, and max_tokens for each of its n sequences); a job may reserve at most %d.", estimate, maxJobTokens)})
	}
	if err := s.checkJobSpend(r.Context(), tenantOf(r.Context()), s.priceOf(model.ID, c.alias).micros(estimate-estOut, estOut)); err != nil {
		return refuse(err)
	}
	endReservation, err := s.reserveJob(r.Context(), estimate)
	if err != nil {
		return refuse(err)
	}
	defer endReservation()
	job, created, err := s.jobs.Store.Accept(r.Context(), store.NewJob{
		ID: uuid.Must(uuid.NewV7()).String(), EventID: uuid.Must(uuid.NewV7()).String(),
		Tenant: tenantOf(r.Context()), IdempotencyKey: key, RequestHash: hash,
		Endpoint: req.Endpoint, Model: model.ID, Body: req.Body, Metadata: req.Metadata,
		Priority: 0, TokenEstimate: estimate, MaxAttempts: s.jobs.MaxAttempts, Deadline: deadline, Now: now,
		Outcome: outcome, Entity: entity,
	})
	if err != nil {
		return writeError(w, s.log, err)
	}
	if created {
		s.jobAccepted(r.Context(), job)
	}
	if created && s.jobs.Wake != nil {
		s.jobs.Wake()
	}
	return s.acceptedJob(w, job, created)
}

// acceptedJob answers a submission with its job: 202 and its Location,
// flagged as a replay when the key had already made it.
func (s *Server) acceptedJob(w http.ResponseWriter, job store.Job, created bool) int {
	if !created {
		w.Header().Set("Idempotent-Replayed", "true")
	}
	w.Header().Set("Location", "/v1/jobs/"+job.ID)
	writeJSON(w, http.StatusAccepted, viewOf(job))
	return http.StatusAccepted
}

func (s *Server) handleGetJob(w http.ResponseWriter, r *http.Request) int {
	j, err := s.jobs.Store.Get(r.Context(), tenantOf(r.Context()), r.PathValue("id"))
	if err != nil {
		return writeError(w, s.log, err)
	}
	v := viewOf(j)
	if err := s.outcomeView(r.Context(), &v); err != nil {
		return writeError(w, s.log, err)
	}
	writeJSON(w, http.StatusOK, v)
	return http.StatusOK
}

func (s *Server) handleListJobs(w http.ResponseWriter, r *http.Request) int {
	q := r.URL.Query()
	f := store.ListFilter{After: q.Get("after")}
	var err error
	if f.Limit, err = pageSize(r, 100, 1000); err != nil {
		return writeError(w, s.log, err)
	}
	if b := q.Get("batch"); b != "" {
		if len(b) > 128 {
			return writeError(w, s.log, badRequest("batch", "batch must be a batch id (at most 128 characters)."))
		}
		f.Batch = b
	}
	for _, st := range q["state"] {
		if !slices.Contains(store.States, store.State(st)) {
			return writeError(w, s.log, badRequest("state", fmt.Sprintf("state %q is not a job state.", st)))
		}
		f.States = append(f.States, store.State(st))
	}
	jobs, next, err := s.jobs.Store.List(r.Context(), tenantOf(r.Context()), f)
	if err != nil {
		return writeError(w, s.log, err)
	}
	page := struct {
		Object     string    `json:"object"`
		Data       []jobView `json:"data"`
		HasMore    bool      `json:"has_more"`
		NextCursor string    `json:"next_cursor,omitempty"`
	}{Object: "list", Data: make([]jobView, len(jobs)), HasMore: next != "", NextCursor: next}
	for i, j := range jobs {
		page.Data[i] = viewOf(j)
	}
	writeJSON(w, http.StatusOK, page)
	return http.StatusOK
}

func (s *Server) handleJobResult(w http.ResponseWriter, r *http.Request) int {
	if r.URL.Query().Has("candidate") {
		return s.handleCandidateResult(w, r) // a reviewer's read of a withheld answer (candidate.go)
	}
	tenant, id := tenantOf(r.Context()), r.PathValue("id")
	j, err := s.jobs.Store.Get(r.Context(), tenant, id)
	if err != nil {
		return writeError(w, s.log, err)
	}
	if j.State != store.Succeeded {
		return writeError(w, s.log, &apiError{status: http.StatusConflict, typ: "invalid_request_error", code: "job_not_succeeded",
			msg: fmt.Sprintf("The job is %s; a result exists once it has SUCCEEDED.", j.State)})
	}
	res, err := s.jobs.Store.Result(r.Context(), tenant, id)
	if err != nil {
		return writeError(w, s.log, err)
	}
	defer traceDelivery(r.Context(), j, len(res))
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusOK)
	_, _ = w.Write(res)
	return http.StatusOK
}

func (s *Server) handleCancelJob(w http.ResponseWriter, r *http.Request) int {
	j, err := s.jobs.Store.Cancel(r.Context(), tenantOf(r.Context()), r.PathValue("id"), uuid.Must(uuid.NewV7()).String(), time.Now())
	if err != nil {
		return writeError(w, s.log, err)
	}
	writeJSON(w, http.StatusOK, viewOf(j))
	return http.StatusOK
}
