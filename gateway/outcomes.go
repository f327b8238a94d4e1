package gateway

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"regexp"
	"strconv"
	"time"

	"github.com/google/uuid"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvgate/kvgate/scheduler"
	"github.com/kvgate/kvgate/scheduler/validate"
	"github.com/kvgate/kvgate/store"
)

// Outcomes: validation policies, reviews, audit records, dead letters and
// replay (store/outcomes.go says what each is). Policies are written by
// operators and read by any key of their tenant; reviews, audit, dead
// letters and replay are operators' (an admin's dead-letter listing may
// span tenants).

func (s *Server) outcomeRoutes(reg *prometheus.Registry) {
	s.mux.Handle("POST /v1/validation-policies", s.api("/v1/validation-policies", s.handlePutPolicy))
	s.mux.Handle("GET /v1/validation-policies", s.api("/v1/validation-policies", s.handleListPolicies))
	s.mux.Handle("GET /v1/validation-policies/{name}", s.api("/v1/validation-policies/{name}", s.handleGetPolicy))
	s.mux.Handle("GET /v1/validation-policies/{name}/versions", s.api("/v1/validation-policies/{name}/versions", s.handlePolicyVersions))
	s.mux.Handle("GET /v1/reviews", s.api("/v1/reviews", s.handleReviews))
	s.mux.Handle("POST /v1/jobs/{id}/review", s.api("/v1/jobs/{id}/review", s.handleReview))
	s.mux.Handle("GET /v1/jobs/{id}/review", s.api("/v1/jobs/{id}/review", s.handleGetReview))
	s.mux.Handle("GET /v1/jobs/{id}/audit", s.api("/v1/jobs/{id}/audit", s.handleAudit))
	s.mux.Handle("POST /v1/jobs/{id}/replay", s.api("/v1/jobs/{id}/replay", s.handleReplay))
	s.mux.Handle("GET /v1/dead-letters", s.api("/v1/dead-letters", s.handleDeadLetters))
	s.mux.Handle("GET /v1/entities/{key}", s.api("/v1/entities/{key}", s.handleEntity))
	if reg != nil {
		reg.MustRegister(&outcomeCollector{st: s.jobs.Store})
	}
}

// errOperatorOnly refuses a caller without an operator key.
var errOperatorOnly = forbidden("operator_key_required", "This needs an operator key for the tenant.")

var policyName = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$`)

// jobValidation is what a job submission asks of its outcome.
type jobValidation struct {
	Policy  string `json:"policy"`
	Version int    `json:"version"`
}

// outcomeOf checks a submission's validation request and returns what
// Accept pins, or nil for a job without one. The policy must exist now
// (Accept pins the version in its own transaction) and fit the request:
// a chat or completion, and a schema rule without its own schema needs
// the request's.
func (s *Server) outcomeOf(ctx context.Context, req jobRequest, ep endpoint) (*store.NewOutcome, error) {
	// Counted as the runner will split them (its exact "input" key, not
	// encoding/json's case-insensitive match).
	if ep == epEmbedding {
		if scheduler.EmbedInputs(req.Body) > scheduler.MaxEmbedInputs {
			return nil, badRequest("body.input", fmt.Sprintf("An embeddings job embeds at most %d inputs (in batches, each checkpointed).", scheduler.MaxEmbedInputs))
		}
	}
	if req.Validation == nil {
		if req.Source != nil {
			return nil, badRequest("source", "source is the text a validation policy's evidence must occur in: give it with validation.")
		}
		return nil, nil
	}
	v := req.Validation
	if ep == epEmbedding {
		return nil, badRequest("validation", "Validation policies judge chat and completion answers, not embeddings.")
	}
	if !policyName.MatchString(v.Policy) || v.Version < 0 {
		return nil, badRequest("validation.policy", "validation needs a policy name (and optionally a version of at least 1).")
	}
	p, err := s.jobs.Store.GetPolicy(ctx, tenantOf(ctx), v.Policy, v.Version)
	if err != nil {
		return nil, err
	}
	pol, err := validate.Parse(p.Document)
	if err != nil {
		return nil, fmt.Errorf("stored policy %s v%d: %w", p.Name, p.Version, err)
	}
	r, err := validate.ParseRequest(req.Body)
	if err != nil {
		return nil, badRequest("body", err.Error())
	}
	if schema := r.Schema(); schema != nil {
		if err := validate.CompileSchema(schema); err != nil {
			return nil, badRequest("body.response_format", "The request's JSON schema: "+err.Error())
		}
	} else {
		for _, rule := range pol.Document().Rules {
			if rule.Rule == validate.RuleSchema && len(rule.Schema) == 0 {
				return nil, badRequest("body.response_format", fmt.Sprintf("Policy %s v%d checks the answer against the request's own schema: give response_format json_schema.", p.Name, p.Version))
			}
		}
	}
	o := &store.NewOutcome{Policy: v.Policy, Version: v.Version}
	if req.Source != nil {
		o.Source = *req.Source
	}
	return o, nil
}

// outcomeHash extends a request hash with the validation and the entity
// it asks for: the same key with another policy or version is another
// request.
func outcomeHash(hash string, req jobRequest) string {
	if req.Validation == nil && req.Entity == nil {
		return hash
	}
	b, _ := json.Marshal(struct {
		V *jobValidation `json:"v"`
		S *string        `json:"s"`
		E *jobEntity     `json:"e,omitempty"`
		O string         `json:"o,omitempty"`
	}{req.Validation, req.Source, req.Entity, req.Ordering})
	return requestHash(hash, b)
}

// jobEntity is the entity version a job submission names.
type jobEntity struct {
	Key     string `json:"key"`
	Version int64  `json:"version"`
}

var entityKey = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._:-]{0,254}$`)

// entityOf checks a submission's entity and ordering.
func entityOf(req jobRequest) (*store.NewEntity, error) {
	if req.Entity == nil {
		if req.Ordering != "" {
			return nil, badRequest("ordering", "ordering applies to the versions of an entity: give it with entity.")
		}
		return nil, nil
	}
	if !entityKey.MatchString(req.Entity.Key) {
		return nil, badRequest("entity.key", "entity.key must be 1 to 255 letters, digits, '.', '_', ':' or '-', starting with a letter or digit.")
	}
	if req.Entity.Version < 1 {
		return nil, badRequest("entity.version", "entity.version must be a number of at least 1.")
	}
	switch req.Ordering {
	case "", store.OrderLatest, store.OrderSerial:
	default:
		return nil, badRequest("ordering", `ordering must be "latest" (the default) or "serial".`)
	}
	return &store.NewEntity{Key: req.Entity.Key, Version: req.Entity.Version, Ordering: req.Ordering}, nil
}

type entityView struct {
	Object        string              `json:"object"`
	Key           string              `json:"key"`
	LatestVersion int64               `json:"latest_version"`
	LatestJob     string              `json:"latest_job"`
	WonVersion    int64               `json:"succeeded_version"`
	Versions      []entityVersionView `json:"versions"`
}

type entityVersionView struct {
	Version int64  `json:"version"`
	JobID   string `json:"job_id"`
	State   string `json:"state"`
}

// handleEntity shows an entity's accepted versions, the latest first,
// with their jobs, and the version that won.
func (s *Server) handleEntity(w http.ResponseWriter, r *http.Request) int {
	ctx := r.Context()
	limit, err := pageSize(r, 100, 1000)
	if err != nil {
		return writeError(w, s.log, err)
	}
	e, err := s.jobs.Store.Entity(ctx, tenantOf(ctx), r.PathValue("key"), limit)
	if err != nil {
		return writeError(w, s.log, err)
	}
	v := entityView{Object: "entity", Key: e.Key, WonVersion: e.WonVersion, LatestVersion: e.Versions[0].Version,
		LatestJob: e.Versions[0].JobID, Versions: make([]entityVersionView, len(e.Versions))}
	for i, x := range e.Versions {
		v.Versions[i] = entityVersionView{Version: x.Version, JobID: x.JobID, State: string(x.State)}
	}
	writeJSON(w, http.StatusOK, v)
	return http.StatusOK
}

type policyView struct {
	Object    string          `json:"object"`
	Name      string          `json:"name"`
	Version   int             `json:"version"`
	Rules     json.RawMessage `json:"rules"`
	CreatedAt int64           `json:"created_at"`
	CreatedBy string          `json:"created_by,omitempty"`
}

func policyViewOf(p store.Policy) policyView {
	var d struct {
		Rules json.RawMessage `json:"rules"`
	}
	_ = json.Unmarshal(p.Document, &d)
	return policyView{Object: "validation_policy", Name: p.Name, Version: p.Version, Rules: d.Rules,
		CreatedAt: p.CreatedAt.Unix(), CreatedBy: p.CreatedBy}
}

func (s *Server) handlePutPolicy(w http.ResponseWriter, r *http.Request) int {
	ctx := r.Context()
	if !isOperator(ctx) {
		return writeError(w, s.log, errOperatorOnly)
	}
	raw, err := readBody(r)
	if err != nil {
		return writeError(w, s.log, err)
	}
	p, err := validate.Parse(raw)
	if err != nil {
		return writeError(w, s.log, badRequest("rules", err.Error()))
	}
	if !policyName.MatchString(p.Document().Name) {
		return writeError(w, s.log, badRequest("name", "name must be 1 to 64 letters, digits, '.', '_' or '-', starting with a letter or digit."))
	}
	doc, _ := json.Marshal(p.Document())
	stored, err := s.jobs.Store.PutPolicy(ctx, store.Policy{Tenant: tenantOf(ctx), Name: p.Document().Name, Document: doc,
		CreatedBy: principalOf(ctx).keyID, CreatedAt: time.Now()})
	if err != nil {
		return writeError(w, s.log, err)
	}
	writeJSON(w, http.StatusCreated, policyViewOf(stored))
	return http.StatusCreated
}

func (s *Server) handleListPolicies(w http.ResponseWriter, r *http.Request) int {
	ps, err := s.jobs.Store.Policies(r.Context(), tenantOf(r.Context()))
	if err != nil {
		return writeError(w, s.log, err)
	}
	return writePolicies(w, ps)
}

func writePolicies(w http.ResponseWriter, ps []store.Policy) int {
	out := struct {
		Object string       `json:"object"`
		Data   []policyView `json:"data"`
	}{Object: "list", Data: make([]policyView, len(ps))}
	for i, p := range ps {
		out.Data[i] = policyViewOf(p)
	}
	writeJSON(w, http.StatusOK, out)
	return http.StatusOK
}

func (s *Server) handleGetPolicy(w http.ResponseWriter, r *http.Request) int {
	version := 0
	if v := r.URL.Query().Get("version"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 {
			return writeError(w, s.log, badRequest("version", "version must be a number of at least 1."))
		}
		version = n
	}
	p, err := s.jobs.Store.GetPolicy(r.Context(), tenantOf(r.Context()), r.PathValue("name"), version)
	if err != nil {
		return writeError(w, s.log, err)
	}
	writeJSON(w, http.StatusOK, policyViewOf(p))
	return http.StatusOK
}

func (s *Server) handlePolicyVersions(w http.ResponseWriter, r *http.Request) int {
	ps, err := s.jobs.Store.PolicyVersions(r.Context(), tenantOf(r.Context()), r.PathValue("name"))
	if err != nil {
		return writeError(w, s.log, err)
	}
	return writePolicies(w, ps)
}

// reviewView is a job under review with what its validation found.
type reviewView struct {
	jobView
	Policy        string          `json:"policy"`
	PolicyVersion int             `json:"policy_version"`
	Reasons       json.RawMessage `json:"reasons"`
}

func (s *Server) handleReviews(w http.ResponseWriter, r *http.Request) int {
	ctx := r.Context()
	if !isOperator(ctx) {
		return writeError(w, s.log, errOperatorOnly)
	}
	limit, err := pageSize(r, 100, 1000)
	if err != nil {
		return writeError(w, s.log, err)
	}
	jobs, vals, next, err := s.jobs.Store.Reviews(ctx, tenantOf(ctx), r.URL.Query().Get("after"), limit)
	if err != nil {
		return writeError(w, s.log, err)
	}
	data := make([]reviewView, len(jobs))
	for i, j := range jobs {
		data[i] = reviewViewOf(j, vals[i])
	}
	writeJSON(w, http.StatusOK, page(data, next))
	return http.StatusOK
}

// handleGetReview is one job's entry of the review queue: its policy and
// the reasons its answer was withheld; 404 for a job not waiting for a
// review.
func (s *Server) handleGetReview(w http.ResponseWriter, r *http.Request) int {
	ctx := r.Context()
	if !isOperator(ctx) {
		return writeError(w, s.log, errOperatorOnly)
	}
	j, v, err := s.jobs.Store.Review(ctx, tenantOf(ctx), r.PathValue("id"))
	if err != nil {
		return writeError(w, s.log, err)
	}
	writeJSON(w, http.StatusOK, reviewViewOf(j, v))
	return http.StatusOK
}

func reviewViewOf(j store.Job, v store.Validation) reviewView {
	rv := reviewView{jobView: viewOf(j), Policy: v.Policy, PolicyVersion: v.Version, Reasons: v.Reasons}
	if rv.Reasons == nil {
		rv.Reasons = json.RawMessage("[]")
	}
	return rv
}

func page[T any](data []T, next string) any {
	return struct {
		Object     string `json:"object"`
		Data       []T    `json:"data"`
		HasMore    bool   `json:"has_more"`
		NextCursor string `json:"next_cursor,omitempty"`
	}{Object: "list", Data: data, HasMore: next != "", NextCursor: next}
}

// pageSize reads a list's ?limit=: def without it, 1 to max with it.
func pageSize(r *http.Request, def, max int) (int, error) {
	l := r.URL.Query().Get("limit")
	if l == "" {
		return def, nil
	}
	n, err := strconv.Atoi(l)
	if err != nil || n < 1 || n > max {
		return 0, badRequest("limit", fmt.Sprintf("limit must be a number from 1 to %d.", max))
	}
	return n, nil
}

type reviewRequest struct {
	Decision string          `json:"decision"`
	Result   json.RawMessage `json:"result"`
	Reason   string          `json:"reason"`
}

// handleReview decides a REVIEW_REQUIRED job. An approval may carry a
// corrected answer (the JSON the model should have given), which is
// validated by the job's policy version like the model's was and replaces
// the answer's content in the stored result.
func (s *Server) handleReview(w http.ResponseWriter, r *http.Request) int {
	ctx := r.Context()
	if !isOperator(ctx) {
		if _, err := s.jobs.Store.Get(ctx, tenantOf(ctx), r.PathValue("id")); err != nil {
			return writeError(w, s.log, err)
		}
		return writeError(w, s.log, errOperatorOnly)
	}
	var req reviewRequest
	if err := decodeBody(r, &req); err != nil {
		return writeError(w, s.log, err)
	}
	tenant, id := tenantOf(ctx), r.PathValue("id")
	j, err := s.jobs.Store.Get(ctx, tenant, id)
	if err != nil {
		return writeError(w, s.log, err)
	}
	rv := store.Review{Tenant: tenant, JobID: id, EventID: uuid.Must(uuid.NewV7()).String(), Now: time.Now(),
		Audit: store.AuditRecord{Actor: principalOf(ctx).keyID}}
	detail := map[string]any{}
	switch req.Decision {
	case "approve":
		rv.Approve = true
		if len(req.Result) > 0 && string(req.Result) != "null" {
			res, reasons, err := s.correctedResult(ctx, tenant, j, req.Result)
			if err != nil {
				return writeError(w, s.log, err)
			}
			if len(reasons) > 0 {
				writeJSON(w, http.StatusUnprocessableEntity, struct {
					Error   any               `json:"error"`
					Reasons []validate.Reason `json:"reasons"`
				}{map[string]any{"message": "The corrected result fails the job's validation policy; see reasons.",
					"type": "invalid_request_error", "code": "validation_failed", "param": "result"}, reasons})
				return http.StatusUnprocessableEntity
			}
			rv.Result = res
			detail["corrected"] = true
		}
	case "reject":
		if req.Reason == "" || len(req.Reason) > 4096 {
			return writeError(w, s.log, badRequest("reason", "A rejection needs a reason of at most 4096 bytes."))
		}
		rv.Reason = req.Reason
		detail["reason"] = req.Reason
	default:
		return writeError(w, s.log, badRequest("decision", `decision must be "approve" or "reject".`))
	}
	rv.Audit.Detail, _ = json.Marshal(detail)
	out, err := s.jobs.Store.Decide(ctx, rv)
	if err != nil {
		return writeError(w, s.log, err)
	}
	if s.jobs.Wake != nil {
		s.jobs.Wake() // the relay publishes the decision's event
	}
	writeJSON(w, http.StatusOK, viewOf(out))
	return http.StatusOK
}

// correctedResult validates a reviewer's corrected answer with the job's
// pinned policy and returns the job's result with it as the answer's
// content, or the reasons it fails.
func (s *Server) correctedResult(ctx context.Context, tenant string, j store.Job, corrected json.RawMessage) (json.RawMessage, []validate.Reason, error) {
	o, err := s.jobs.Store.JobOutcome(ctx, j.ID)
	if err != nil {
		return nil, nil, err
	}
	pol, err := validate.Parse(o.Document)
	if err != nil {
		return nil, nil, err
	}
	req, _ := validate.ParseRequest(j.Body)
	source := o.Source
	if source == "" {
		source = req.Source()
	}
	if reasons := pol.Check(validate.Input{Answer: string(corrected), RequestSchema: req.Schema(), Source: source}); len(reasons) > 0 {
		return nil, reasons, nil
	}
	res, err := s.jobs.Store.Result(ctx, tenant, j.ID)
	if err != nil {
		return nil, nil, err
	}
	out, err := validate.ReplaceAnswer(res, string(corrected))
	if err != nil {
		return nil, nil, badRequest("result", "The job's result has no answer to correct: "+err.Error())
	}
	return out, nil, nil
}

type auditView struct {
	Object        string          `json:"object"`
	Action        string          `json:"action"`
	Actor         string          `json:"actor"`
	Policy        string          `json:"policy,omitempty"`
	PolicyVersion int             `json:"policy_version,omitempty"`
	From          string          `json:"from_state"`
	To            string          `json:"to_state"`
	Detail        json.RawMessage `json:"detail,omitempty"`
	CreatedAt     int64           `json:"created_at"`
}

func (s *Server) handleAudit(w http.ResponseWriter, r *http.Request) int {
	ctx := r.Context()
	j, err := s.jobs.Store.Get(ctx, tenantOf(ctx), r.PathValue("id"))
	if err != nil {
		return writeError(w, s.log, err)
	}
	if !isOperator(ctx) {
		return writeError(w, s.log, errOperatorOnly)
	}
	recs, err := s.jobs.Store.Audit(ctx, j.Tenant, j.ID)
	if err != nil {
		return writeError(w, s.log, err)
	}
	data := make([]auditView, len(recs))
	for i, a := range recs {
		data[i] = auditView{Object: "audit_record", Action: a.Action, Actor: a.Actor, Policy: a.Policy, PolicyVersion: a.Version,
			From: string(a.Previous), To: string(a.State), Detail: a.Detail, CreatedAt: a.At.Unix()}
	}
	writeJSON(w, http.StatusOK, page(data, ""))
	return http.StatusOK
}

type replayRequest struct {
	From            string `json:"from"`
	Version         int    `json:"version"`
	DeadlineSeconds *int   `json:"deadline_seconds"`
}

// handleReplay runs a FAILED_TERMINAL or REVIEW_REQUIRED job again.
func (s *Server) handleReplay(w http.ResponseWriter, r *http.Request) int {
	ctx := r.Context()
	tenant, id := tenantOf(ctx), r.PathValue("id")
	if _, err := s.jobs.Store.Get(ctx, tenant, id); err != nil {
		return writeError(w, s.log, err)
	}
	if !isOperator(ctx) {
		return writeError(w, s.log, errOperatorOnly)
	}
	var req replayRequest
	if err := decodeBody(r, &req); err != nil {
		return writeError(w, s.log, err)
	}
	if req.From != "" && req.From != store.StageInference {
		return writeError(w, s.log, badRequest("from", `from may only be "inference" (run the model again); without it the job resumes at its first stage without a checkpoint.`))
	}
	if req.Version < 0 {
		return writeError(w, s.log, badRequest("version", "version must be at least 1."))
	}
	now := time.Now()
	deadline, err := s.jobs.deadline(now, nil, req.DeadlineSeconds, "deadline_seconds")
	if err != nil {
		return writeError(w, s.log, err)
	}
	detail, _ := json.Marshal(req)
	j, err := s.jobs.Store.Replay(ctx, store.Replay{Tenant: tenant, JobID: id, FromInference: req.From == store.StageInference,
		Version: req.Version, MaxAttempts: s.jobs.MaxAttempts, Deadline: deadline, Now: now, EventID: uuid.Must(uuid.NewV7()).String(),
		Audit: store.AuditRecord{Actor: principalOf(ctx).keyID, Detail: detail}})
	if err != nil {
		return writeError(w, s.log, err)
	}
	if s.jobs.Wake != nil {
		s.jobs.Wake()
	}
	w.Header().Set("Location", "/v1/jobs/"+j.ID)
	writeJSON(w, http.StatusAccepted, viewOf(j))
	return http.StatusAccepted
}

type deadLetterView struct {
	jobView
	Tenant        string        `json:"tenant"`
	ErrorClass    string        `json:"error_class"`
	LastError     string        `json:"last_error,omitempty"`
	Policy        string        `json:"policy,omitempty"`
	PolicyVersion int           `json:"policy_version,omitempty"`
	Decision      string        `json:"decision,omitempty"`
	Attempts      []attemptView `json:"attempts"`
	// References, not bodies: where the request and the history are.
	JobURL      string `json:"job_url"`
	AttemptsURL string `json:"attempts_url"`
	AuditURL    string `json:"audit_url"`
}

// handleDeadLetters lists FAILED_TERMINAL jobs: the tenant's for an
// operator; an admin's ?tenant= names one, or all=true spans every tenant.
func (s *Server) handleDeadLetters(w http.ResponseWriter, r *http.Request) int {
	ctx := r.Context()
	if !isOperator(ctx) {
		return writeError(w, s.log, errOperatorOnly)
	}
	q := r.URL.Query()
	if q.Get("kind") == "webhook_delivery" {
		return s.handleDeadDeliveries(w, r) // webhooks.go
	}
	f := store.DeadLetterFilter{Tenant: tenantOf(ctx), Class: q.Get("class"), After: q.Get("after")}
	if isAdmin(ctx) {
		if t := q.Get("tenant"); t != "" {
			f.Tenant = t
		} else if q.Get("all") == "true" {
			f.Tenant = ""
		}
	}
	var err error
	if f.Limit, err = pageSize(r, 100, 1000); err != nil {
		return writeError(w, s.log, err)
	}
	for name, at := range map[string]*time.Time{"since": &f.Since, "until": &f.Until} {
		if v := q.Get(name); v != "" {
			t, err := time.Parse(time.RFC3339, v)
			if err != nil {
				sec, serr := strconv.ParseInt(v, 10, 64)
				if serr != nil {
					return writeError(w, s.log, badRequest(name, name+" must be an RFC 3339 time or Unix seconds."))
				}
				t = time.Unix(sec, 0)
			}
			*at = t
		}
	}
	ds, next, err := s.jobs.Store.DeadLetters(ctx, f)
	if err != nil {
		return writeError(w, s.log, err)
	}
	data := make([]deadLetterView, len(ds))
	for i, d := range ds {
		j := d.Job
		v := deadLetterView{jobView: viewOf(j), Tenant: j.Tenant, ErrorClass: j.ErrorClass, LastError: j.LastError, Policy: d.Policy,
			PolicyVersion: d.Version, Decision: d.Decision, Attempts: make([]attemptView, len(d.Attempts)),
			JobURL: "/v1/jobs/" + j.ID, AttemptsURL: "/v1/jobs/" + j.ID + "/attempts", AuditURL: "/v1/jobs/" + j.ID + "/audit"}
		for k, a := range d.Attempts {
			v.Attempts[k] = attemptView{Attempt: a.Attempt, Fence: a.Fence, Backend: a.Backend, Outcome: a.Outcome, Spent: a.Spent, Sent: a.Sent,
				ErrorClass: a.ErrorClass, Error: a.Error, PromptTokens: a.PromptTokens, CompletionTokens: a.CompletionTokens, EndedAt: a.EndedAt.Unix()}
			if !a.StartedAt.IsZero() {
				v.Attempts[k].StartedAt = a.StartedAt.Unix()
			}
		}
		data[i] = v
	}
	writeJSON(w, http.StatusOK, page(data, next))
	return http.StatusOK
}

// decodeBody reads a small JSON request body; an empty body is {}.
func decodeBody(r *http.Request, v any) error {
	raw, err := readBody(r)
	if err != nil {
		return err
	}
	if len(raw) == 0 {
		return nil
	}
	if err := json.Unmarshal(raw, v); err != nil {
		return badRequest("", "We could not parse the JSON body of your request. ("+err.Error()+")")
	}
	return nil
}

// outcomeCollector reports, on each scrape, the jobs that ended without
// success: kvgate_jobs_review_required and kvgate_dead_letters{class}.
type outcomeCollector struct {
	st interface {
		CountOutcomes(ctx context.Context) (store.OutcomeCounts, error)
	}
}

var (
	reviewRequiredDesc = prometheus.NewDesc("kvgate_jobs_review_required", "Durable jobs waiting in REVIEW_REQUIRED: their answer failed its validation policy.", nil, nil)
	deadLettersDesc    = prometheus.NewDesc("kvgate_dead_letters", "Durable jobs that ended FAILED_TERMINAL and are kept as dead letters (until replayed or pruned), by error class.", []string{"class"}, nil)
)

func (c *outcomeCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- reviewRequiredDesc
	ch <- deadLettersDesc
}

func (c *outcomeCollector) Collect(ch chan<- prometheus.Metric) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	n, err := c.st.CountOutcomes(ctx)
	if err != nil {
		ch <- prometheus.NewInvalidMetric(reviewRequiredDesc, err)
		return
	}
	ch <- prometheus.MustNewConstMetric(reviewRequiredDesc, prometheus.GaugeValue, float64(n.ReviewRequired))
	for class, v := range n.DeadLetters {
		ch <- prometheus.MustNewConstMetric(deadLettersDesc, prometheus.GaugeValue, float64(v), class)
	}
	// The classes a job can end with are reported at 0 too, so that a
	// rule's increase() sees the first dead letter of a class.
	for _, class := range terminalClasses {
		if _, ok := n.DeadLetters[class]; !ok {
			ch <- prometheus.MustNewConstMetric(deadLettersDesc, prometheus.GaugeValue, 0, class)
		}
	}
}

// terminalClasses are the classes a FAILED_TERMINAL job can carry: the
// spending ones, a review's rejection and a passed deadline.
var terminalClasses = []string{
	string(scheduler.ClassBackend), string(scheduler.ClassTimeout), string(scheduler.ClassInvalid),
	store.ClassRejected, "deadline_exceeded",
}

// outcomeView adds a job's pinned policy and entity version to its view.
func (s *Server) outcomeView(ctx context.Context, v *jobView) error {
	switch o, err := s.jobs.Store.JobOutcome(ctx, v.ID); {
	case err == nil:
		v.Validation = &jobValidation{Policy: o.Policy, Version: o.Version}
	case !errors.Is(err, store.ErrNotFound):
		return err
	}
	switch e, err := s.jobs.Store.JobEntity(ctx, v.ID); {
	case err == nil:
		v.Entity = &jobEntity{Key: e.Key, Version: e.Version}
	case !errors.Is(err, store.ErrNotFound):
		return err
	}
	return nil
}

// attemptPolicies marks the attempt that validated the job's answer with
// the policy version it judged by (from the validation checkpoint).
func (s *Server) attemptPolicies(ctx context.Context, jobID string, as []attemptView) {
	data, err := s.jobs.Store.Stage(ctx, jobID, store.StageValidation)
	var v store.Validation
	if err != nil || json.Unmarshal(data, &v) != nil {
		return
	}
	for i := len(as) - 1; i >= 0; i-- {
		if as[i].Fence == v.Fence {
			as[i].Policy, as[i].PolicyVersion = v.Policy, v.Version
			return
		}
	}
}
