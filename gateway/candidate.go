package gateway

import (
	"fmt"
	"net/http"

	"github.com/kvgate/kvgate/store"
)

// handleCandidateResult is GET /v1/jobs/{id}/result?candidate=true: the
// answer a REVIEW_REQUIRED job's validation withheld, for the operator who
// reviews it (a reviewer must see what is approved). A user key gets 403,
// another tenant's job is a 404, and a job in another state is a 409 (a
// SUCCEEDED job's result is the plain route's). Every read is logged
// with the reader's key id, as an audit trail of who saw a withheld
// answer; the answer carries X-Kvgate-Candidate: true.
func (s *Server) handleCandidateResult(w http.ResponseWriter, r *http.Request) int {
	ctx := r.Context()
	tenant, id := tenantOf(ctx), r.PathValue("id")
	if v := r.URL.Query().Get("candidate"); v != "true" {
		return writeError(w, s.log, badRequest("candidate", `candidate must be "true": an operator's read of a REVIEW_REQUIRED job's withheld result.`))
	}
	j, err := s.jobs.Store.Get(ctx, tenant, id)
	if err != nil {
		return writeError(w, s.log, err)
	}
	if !isOperator(ctx) {
		return writeError(w, s.log, errOperatorOnly)
	}
	if j.State != store.ReviewRequired {
		return writeError(w, s.log, &apiError{status: http.StatusConflict, typ: "invalid_request_error", code: "job_not_in_review",
			msg: fmt.Sprintf("The job is %s; a candidate result is read while a job is REVIEW_REQUIRED.", j.State)})
	}
	res, err := s.jobs.Store.Result(ctx, tenant, id)
	if err != nil {
		return writeError(w, s.log, err)
	}
	s.log.InfoContext(ctx, "audit: withheld result read for review", "tenant", tenant, "job_id", id,
		"key_id", principalOf(ctx).keyID, "bytes", len(res))
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("X-Kvgate-Candidate", "true")
	w.WriteHeader(http.StatusOK)
	_, _ = w.Write(res)
	return http.StatusOK
}
