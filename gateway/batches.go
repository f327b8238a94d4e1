package gateway

import (
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"net/http"
	"slices"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/kvgate/kvgate/store"
)

// The Batch API (OpenAI's): a batch's input file is validated, then each
// of its lines becomes a durable job of its own, run like any other job
// (the same admission, tenant quotas and fairness, retries and
// checkpoints); once every line has ended, the batch's output and error
// files are written. See docs/batches.md.

// batchWindow is the only completion window there is.
const batchWindow = 24 * time.Hour

// batchEndpoints are the endpoints a batch's lines may call: those a job
// may (jobEndpoints), /v1/responses among them once it is one.
func batchEndpoints() []string { return slices.Sorted(maps.Keys(jobEndpoints)) }

type batchRequest struct {
	InputFileID        string          `json:"input_file_id"`
	Endpoint           string          `json:"endpoint"`
	CompletionWindow   string          `json:"completion_window"`
	Metadata           json.RawMessage `json:"metadata"`
	OutputExpiresAfter *struct {
		Anchor  string `json:"anchor"`
		Seconds int64  `json:"seconds"`
	} `json:"output_expires_after"`
}

// batchError is one of a batch's errors (validation's), as OpenAI's.
type batchError struct {
	Code    string  `json:"code"`
	Message string  `json:"message"`
	Param   *string `json:"param"`
	Line    *int    `json:"line"`
}

type batchCounts struct {
	Total     int `json:"total"`
	Completed int `json:"completed"`
	Failed    int `json:"failed"`
}

// batchUsage is OpenAI's BatchUsage.
type batchUsage struct {
	InputTokens        int `json:"input_tokens"`
	InputTokensDetails struct {
		CachedTokens int `json:"cached_tokens"`
	} `json:"input_tokens_details"`
	OutputTokens        int `json:"output_tokens"`
	OutputTokensDetails struct {
		ReasoningTokens int `json:"reasoning_tokens"`
	} `json:"output_tokens_details"`
	TotalTokens int `json:"total_tokens"`
}

// batchView is OpenAI's Batch object. Fields not set yet are null, as
// OpenAI sends them.
type batchView struct {
	ID               string          `json:"id"`
	Object           string          `json:"object"`
	Endpoint         string          `json:"endpoint"`
	Model            *string         `json:"model"`
	Errors           *batchErrors    `json:"errors"`
	InputFileID      string          `json:"input_file_id"`
	CompletionWindow string          `json:"completion_window"`
	Status           string          `json:"status"`
	OutputFileID     *string         `json:"output_file_id"`
	ErrorFileID      *string         `json:"error_file_id"`
	CreatedAt        int64           `json:"created_at"`
	InProgressAt     *int64          `json:"in_progress_at"`
	ExpiresAt        *int64          `json:"expires_at"`
	FinalizingAt     *int64          `json:"finalizing_at"`
	CompletedAt      *int64          `json:"completed_at"`
	FailedAt         *int64          `json:"failed_at"`
	ExpiredAt        *int64          `json:"expired_at"`
	CancellingAt     *int64          `json:"cancelling_at"`
	CancelledAt      *int64          `json:"cancelled_at"`
	RequestCounts    batchCounts     `json:"request_counts"`
	Metadata         json.RawMessage `json:"metadata"`
	Usage            batchUsage      `json:"usage"`
}

type batchErrors struct {
	Object string          `json:"object"`
	Data   json.RawMessage `json:"data"`
}

func strPtr(s string) *string {
	if s == "" {
		return nil
	}
	return &s
}

// batchViewOf shows a batch; live counts a batch's lines while it runs
// (the final ones are the batch's own).
func batchViewOf(b store.Batch, live *store.BatchCounts) batchView {
	v := batchView{
		ID: b.ID, Object: "batch", Endpoint: b.Endpoint, Model: strPtr(b.Model), InputFileID: b.InputFileID,
		CompletionWindow: b.CompletionWindow, Status: b.Status, OutputFileID: strPtr(b.OutputFileID), ErrorFileID: strPtr(b.ErrorFileID),
		CreatedAt: b.CreatedAt.Unix(), InProgressAt: unixPtr(b.InProgressAt), ExpiresAt: unixPtr(b.ExpiresAt),
		FinalizingAt: unixPtr(b.FinalizingAt), CompletedAt: unixPtr(b.CompletedAt), FailedAt: unixPtr(b.FailedAt),
		ExpiredAt: unixPtr(b.ExpiredAt), CancellingAt: unixPtr(b.CancellingAt), CancelledAt: unixPtr(b.CancelledAt),
		RequestCounts: batchCounts{Total: b.Total, Completed: b.Completed, Failed: b.Failed},
		Metadata:      b.Metadata,
	}
	if len(v.Metadata) == 0 {
		v.Metadata = json.RawMessage("null")
	}
	if len(b.Errors) > 0 {
		v.Errors = &batchErrors{Object: "list", Data: b.Errors}
	}
	if len(b.Usage) > 0 {
		_ = json.Unmarshal(b.Usage, &v.Usage)
	}
	if live != nil {
		// A cancelled line counts as failed, as in the final counts.
		v.RequestCounts = batchCounts{Total: max(b.Total, live.Total), Completed: live.Succeeded, Failed: live.Failed + live.Cancelled}
	}
	return v
}

func (s *Server) batchRoutes() {
	s.mux.Handle("POST /v1/batches", s.api("/v1/batches", s.handleCreateBatch))
	s.mux.Handle("GET /v1/batches", s.api("/v1/batches", s.handleListBatches))
	s.mux.Handle("GET /v1/batches/{id}", s.api("/v1/batches/{id}", s.handleGetBatch))
	s.mux.Handle("POST /v1/batches/{id}/cancel", s.api("/v1/batches/{id}/cancel", s.handleCancelBatch))
}

func batchNotFound(id string) error {
	return &apiError{status: http.StatusNotFound, typ: "invalid_request_error", param: "batch_id", msg: fmt.Sprintf("No such Batch object: %s", id)}
}

// checkMetadata applies OpenAI's limits: at most 16 string pairs, keys of
// at most 64 characters, values of at most 512.
func checkMetadata(raw json.RawMessage) error {
	if len(raw) == 0 || string(raw) == "null" {
		return nil
	}
	var m map[string]string
	if err := json.Unmarshal(raw, &m); err != nil {
		return badRequest("metadata", "metadata must be an object of string keys and string values.")
	}
	if len(m) > 16 {
		return badRequest("metadata", "metadata holds at most 16 pairs.")
	}
	for k, v := range m {
		if utf8.RuneCountInString(k) > 64 || utf8.RuneCountInString(v) > 512 {
			return badRequest("metadata", "metadata keys are at most 64 characters, values at most 512.")
		}
	}
	return nil
}

func (s *Server) handleCreateBatch(w http.ResponseWriter, r *http.Request) int {
	raw, err := readBody(r)
	if err != nil {
		return writeError(w, s.log, err)
	}
	var req batchRequest
	if err := json.Unmarshal(raw, &req); err != nil {
		return writeError(w, s.log, badRequest("", "We could not parse the JSON body of your request. ("+err.Error()+")"))
	}
	eps := batchEndpoints()
	switch {
	case req.InputFileID == "":
		return writeError(w, s.log, badRequest("input_file_id", "Missing required parameter: 'input_file_id'."))
	case !slices.Contains(eps, req.Endpoint):
		return writeError(w, s.log, badRequest("endpoint", fmt.Sprintf("endpoint must be one of %s.", strings.Join(eps, ", "))))
	case req.CompletionWindow != "24h":
		return writeError(w, s.log, badRequest("completion_window", "completion_window must be '24h'."))
	}
	if err := checkMetadata(req.Metadata); err != nil {
		return writeError(w, s.log, err)
	}
	var outExpires time.Duration
	if o := req.OutputExpiresAfter; o != nil {
		if o.Anchor != "created_at" || o.Seconds < 3600 || o.Seconds > 2592000 {
			return writeError(w, s.log, badRequest("output_expires_after", "output_expires_after takes anchor 'created_at' and seconds from 3600 to 2592000."))
		}
		outExpires = time.Duration(o.Seconds) * time.Second
	}
	tenant, now := tenantOf(r.Context()), time.Now()
	f, err := s.batches.File(r.Context(), tenant, req.InputFileID, now)
	if errors.Is(err, store.ErrNotFound) {
		err = &apiError{status: http.StatusNotFound, typ: "invalid_request_error", param: "input_file_id",
			msg: fmt.Sprintf("No such File object: %s", req.InputFileID)}
	}
	if err != nil {
		return writeError(w, s.log, err)
	}
	if f.Purpose != "batch" {
		return writeError(w, s.log, badRequest("input_file_id", fmt.Sprintf("File %s has purpose '%s'; a batch's input file needs purpose 'batch'.", f.ID, f.Purpose)))
	}
	meta := req.Metadata
	if string(meta) == "null" {
		meta = nil
	}
	b := store.Batch{ID: newObjectID("batch_"), Tenant: tenant, Endpoint: req.Endpoint, InputFileID: f.ID, CompletionWindow: "24h",
		Status: store.BatchValidating, Metadata: meta, OutputExpiresAfter: outExpires, CreatedAt: now, ExpiresAt: now.Add(batchWindow)}
	if err := s.batches.CreateBatch(r.Context(), b); err != nil {
		return writeError(w, s.log, err)
	}
	s.batchWk.wake()
	writeJSON(w, http.StatusOK, batchViewOf(b, nil))
	return http.StatusOK
}

// liveBatch shows a batch, counting its lines while they run.
func (s *Server) liveBatch(r *http.Request, b store.Batch) (batchView, error) {
	if store.BatchFinal(b.Status) || b.Status == store.BatchValidating {
		return batchViewOf(b, nil), nil
	}
	c, err := s.batches.BatchCounts(r.Context(), b.ID)
	if err != nil {
		return batchView{}, err
	}
	return batchViewOf(b, &c), nil
}

func (s *Server) handleGetBatch(w http.ResponseWriter, r *http.Request) int {
	b, err := s.batches.Batch(r.Context(), tenantOf(r.Context()), r.PathValue("id"))
	if errors.Is(err, store.ErrNotFound) {
		err = batchNotFound(r.PathValue("id"))
	}
	if err != nil {
		return writeError(w, s.log, err)
	}
	v, err := s.liveBatch(r, b)
	if err != nil {
		return writeError(w, s.log, err)
	}
	writeJSON(w, http.StatusOK, v)
	return http.StatusOK
}

func (s *Server) handleListBatches(w http.ResponseWriter, r *http.Request) int {
	q := r.URL.Query()
	limit, err := pageSize(r, 20, 100)
	if err != nil {
		return writeError(w, s.log, err)
	}
	bs, more, err := s.batches.ListBatches(r.Context(), tenantOf(r.Context()), q.Get("after"), limit)
	if err != nil {
		return writeError(w, s.log, err)
	}
	views := make([]batchView, len(bs))
	for i, b := range bs {
		if views[i], err = s.liveBatch(r, b); err != nil {
			return writeError(w, s.log, err)
		}
	}
	writeJSON(w, http.StatusOK, pageOf(views, func(v batchView) string { return v.ID }, more))
	return http.StatusOK
}

func (s *Server) handleCancelBatch(w http.ResponseWriter, r *http.Request) int {
	id := r.PathValue("id")
	b, err := s.batches.CancelBatch(r.Context(), tenantOf(r.Context()), id, time.Now())
	switch {
	case errors.Is(err, store.ErrNotFound):
		return writeError(w, s.log, batchNotFound(id))
	case errors.Is(err, store.ErrFinal):
		return writeError(w, s.log, &apiError{status: http.StatusConflict, typ: "invalid_request_error", code: "batch_not_cancellable",
			msg: fmt.Sprintf("Cannot cancel a batch with status '%s'.", b.Status)})
	case err != nil:
		return writeError(w, s.log, err)
	}
	s.batchWk.wake()
	v, err := s.liveBatch(r, b)
	if err != nil {
		return writeError(w, s.log, err)
	}
	writeJSON(w, http.StatusOK, v)
	return http.StatusOK
}
