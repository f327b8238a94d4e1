package store

import (
	"context"
	"encoding/json"
	"errors"
	"time"
)

// Outcomes: what makes a job's end trustworthy beyond "the model
// answered".
//
// Validation policies are tenant-scoped, named and versioned: putting a
// policy of a name creates its next version, and every version stays
// readable. A job that names a policy is pinned, in Accept's
// transaction, to a version (the latest at acceptance unless it names
// one); the runner's validation stage judges the inference's answer by
// that version, and a failing answer ends the job REVIEW_REQUIRED with
// its reasons. A review decides such a job (approve: SUCCEEDED, reject:
// FAILED_TERMINAL of class "rejected"), a replay runs a FAILED_TERMINAL
// or REVIEW_REQUIRED job again with a fresh attempt budget and deadline,
// and each decision and replay is an audit record written in the same
// transaction as the change it records.

// Errors of the outcome methods.
var (
	// ErrPolicyNotFound: no such validation policy (or version) for the
	// tenant.
	ErrPolicyNotFound = errors.New("store: no such validation policy")
	// ErrWrongState: the job is not in a state that allows the change
	// (a review of a job not REVIEW_REQUIRED, a replay of a job that has
	// not failed); nothing was written.
	ErrWrongState = errors.New("store: the job's state does not allow this")
	// ErrBatchClosed refuses to replay a line of a batch no longer in
	// progress: its files are written (or being written) from the line as
	// it ended, and a run now would reach neither.
	ErrBatchClosed = errors.New("store: the job is a line of a batch no longer in progress")
	// ErrBatchOpen refuses to finalize a batch with a line not ended.
	ErrBatchOpen = errors.New("store: a line of the batch has not ended")
)

// Stage names, in the order a job runs them. A stage's checkpoint (see
// Store.SaveStage) spares a retry the stage.
const (
	StageInference  = "inference"
	StageValidation = "validation"
)

// ClassRejected is the error class of a job a review rejected.
const ClassRejected = "rejected"

// Policy is one version of a validation policy.
type Policy struct {
	Tenant    string
	Name      string
	Version   int
	Document  json.RawMessage // the policy document as given
	CreatedBy string          // the key id that put it ("" for a static key)
	CreatedAt time.Time
}

// NewOutcome is what a job asks of its outcome at acceptance.
type NewOutcome struct {
	Policy  string // a policy name of the job's tenant
	Version int    // 0: the latest at acceptance
	// Source is the text evidence must occur in; "" for the request's
	// user content.
	Source string
}

// JobOutcome is a job's pinned policy: the version its validation stage
// judges by, with that version's document.
type JobOutcome struct {
	JobID    string
	Tenant   string
	Policy   string
	Version  int
	Document json.RawMessage
	Source   string
}

// Validation is the validation stage's checkpoint: the verdict of one
// policy version on the inference's answer.
type Validation struct {
	Policy  string          `json:"policy"`
	Version int             `json:"version"`
	Passed  bool            `json:"passed"`
	Fence   int64           `json:"fence"`             // the claim whose attempt judged
	Reasons json.RawMessage `json:"reasons,omitempty"` // []validate.Reason
}

// Audit actions.
const (
	AuditApprove = "review.approve"
	AuditReject  = "review.reject"
	AuditReplay  = "replay"
)

// AuditRecord is one decision about a job.
type AuditRecord struct {
	Seq      int64
	Tenant   string
	JobID    string
	Actor    string // the deciding key's id ("" for a static key)
	Action   string
	Policy   string
	Version  int
	Detail   json.RawMessage // what was decided: a reason, a corrected result's digest, a replay's options
	At       time.Time
	Previous State // the job's state before
	State    State // and after
}

// Review is an operator's decision on a REVIEW_REQUIRED job.
type Review struct {
	Tenant  string
	JobID   string
	Approve bool
	// Result, when approving, replaces the job's result (a corrected one,
	// which the caller validated); nil keeps the result under review.
	Result  json.RawMessage
	Reason  string // a rejection's reason, the job's last error
	Audit   AuditRecord
	EventID string
	Now     time.Time
}

// Replay asks for a failed or reviewed job to run again.
type Replay struct {
	Tenant string
	JobID  string
	// FromInference drops every checkpoint, so that the job calls the
	// backend again; otherwise it resumes at its first stage without one
	// (a validation under Version re-validates the answer it has).
	FromInference bool
	// Version re-pins the job's policy (0: its latest version now); only
	// for a job with a policy.
	Version     int
	MaxAttempts int
	Deadline    time.Time
	Audit       AuditRecord
	EventID     string
	Now         time.Time
}

// DeadLetterFilter selects a page of dead letters, newest first.
type DeadLetterFilter struct {
	Tenant string // "" for every tenant (an admin's view)
	Class  string // "" for every class
	Since  time.Time
	Until  time.Time
	After  string // cursor: the last job id of the previous page
	Limit  int
}

// DeadLetter is a job that ended FAILED_TERMINAL, by reference: no
// request body, no result.
type DeadLetter struct {
	Job      Job // Body and Metadata left empty
	Attempts []Attempt
	Policy   string
	Version  int
	Decision string // the last audit action, "" if none
}

// OutcomeCounts are the gauges of jobs that did not end in success.
type OutcomeCounts struct {
	ReviewRequired int
	DeadLetters    map[string]int // by error class
}

// Outcomes is the store's part for policies, reviews, audit, dead
// letters, replay and retention.
type Outcomes interface {
	// PutPolicy stores the next version of a tenant's policy of that
	// name (version 1 for a new name) and returns it.
	PutPolicy(ctx context.Context, p Policy) (Policy, error)
	// GetPolicy returns a version of a tenant's policy, the latest for
	// version 0; ErrPolicyNotFound if none.
	GetPolicy(ctx context.Context, tenant, name string, version int) (Policy, error)
	// PolicyVersions returns every version of a policy, oldest first.
	PolicyVersions(ctx context.Context, tenant, name string) ([]Policy, error)
	// Policies returns the latest version of each of a tenant's policies.
	Policies(ctx context.Context, tenant string) ([]Policy, error)
	// JobOutcome returns a job's pinned policy; ErrNotFound when the job
	// names none.
	JobOutcome(ctx context.Context, jobID string) (JobOutcome, error)
	// Decide applies a review to a REVIEW_REQUIRED job, with its audit
	// record and event; ErrWrongState when the job is not under review.
	Decide(ctx context.Context, r Review) (Job, error)
	// Replay makes a FAILED_TERMINAL or REVIEW_REQUIRED job READY again
	// with a fresh attempt budget and deadline, dropping the checkpoints
	// the replay redoes, with its audit record and event; ErrWrongState
	// for a job in another state.
	Replay(ctx context.Context, r Replay) (Job, error)
	// Audit returns a tenant's job's audit records, oldest first.
	Audit(ctx context.Context, tenant, jobID string) ([]AuditRecord, error)
	// Reviews returns a page of a tenant's REVIEW_REQUIRED jobs with
	// their validation, newest first, and the next cursor.
	Reviews(ctx context.Context, tenant, after string, limit int) ([]Job, []Validation, string, error)
	// Review returns one of a tenant's REVIEW_REQUIRED jobs with its
	// validation; ErrNotFound for a job not waiting for a review.
	Review(ctx context.Context, tenant, id string) (Job, Validation, error)
	// DeadLetters returns a page of dead letters and the next cursor.
	DeadLetters(ctx context.Context, f DeadLetterFilter) ([]DeadLetter, string, error)
	// CountOutcomes counts the REVIEW_REQUIRED jobs and the dead letters
	// by class, across tenants.
	CountOutcomes(ctx context.Context) (OutcomeCounts, error)
	// PruneFinal deletes up to limit final jobs last changed before
	// before, with their attempts, checkpoints, events, outcome and audit
	// records, oldest first, and returns how many jobs it removed.
	PruneFinal(ctx context.Context, before time.Time, limit int) (int, error)
}
