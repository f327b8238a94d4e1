package store

import (
	"context"
	"encoding/json"
	"errors"
	"slices"
	"time"
)

// Errors the backends return; callers branch on them with errors.Is.
var (
	// ErrNotFound: no such job for this tenant (another tenant's job is
	// not found either).
	ErrNotFound = errors.New("store: not found")
	// ErrConflict: an idempotency key reused for a different request.
	ErrConflict = errors.New("store: idempotency key reused with a different request")
	// ErrLeaseLost: the caller no longer owns the job (fence moved, lease
	// expired, or the job left RUNNING); its write was discarded.
	ErrLeaseLost = errors.New("store: lease lost")
	// ErrFinal: the job is already in a final state.
	ErrFinal = errors.New("store: job is final")
	// ErrDigestMismatch: an event id seen before with a different payload.
	ErrDigestMismatch = errors.New("store: event id seen with a different payload")
	// ErrUnavailable: the database cannot be reached; nothing was written.
	ErrUnavailable = errors.New("store: unavailable")
	// ErrFailed: the database was reached and failed the statement (a
	// value it refuses, a full disk, a constraint no rule above names):
	// kvgate's own failure, never a backend's.
	ErrFailed = errors.New("store: failed")
)

// State is a job's state.
type State string

// Job states. READY and RETRY_SCHEDULED are runnable once available;
// RUNNING is leased; the rest are final.
const (
	Ready          State = "READY"
	Running        State = "RUNNING"
	RetryScheduled State = "RETRY_SCHEDULED"
	Succeeded      State = "SUCCEEDED"
	ReviewRequired State = "REVIEW_REQUIRED" // the answer failed its validation policy (outcomes.go)
	FailedTerminal State = "FAILED_TERMINAL"
	Cancelled      State = "CANCELLED"
	Superseded     State = "SUPERSEDED" // a later version of its entity won (entities.go)
)

// States lists every job state, and FinalStates the final ones: the one
// table that code (and the SQL built from it) enumerates states from.
var (
	States      = []State{Ready, Running, RetryScheduled, Succeeded, ReviewRequired, FailedTerminal, Cancelled, Superseded}
	FinalStates = []State{Succeeded, ReviewRequired, FailedTerminal, Cancelled, Superseded}
)

// Final reports whether no transition can happen but a review's or a
// replay's (outcomes.go).
func (s State) Final() bool { return slices.Contains(FinalStates, s) }

// Job is a durable unit of deferred work.
type Job struct {
	ID             string
	Tenant         string
	IdempotencyKey string
	RequestHash    string
	Endpoint       string // /v1/chat/completions, /v1/completions or /v1/embeddings
	Model          string
	Body           json.RawMessage // the request body for the endpoint
	Metadata       json.RawMessage // the caller's, returned as given; may be nil
	Priority       int             // lower runs first
	TokenEstimate  int

	State        State
	StateVersion int64 // +1 on every change; never goes backwards
	// Attempt counts the attempts spent: those whose request reached a
	// backend (succeeded or failed there), or found the job's input
	// invalid. Waits and interruptions spend none.
	Attempt     int
	MaxAttempts int
	Fence       int64 // +1 on every claim and every reap: it names one claim
	// ReplayFence is the fence the job had when it was last replayed (0:
	// never): the claims up to it were its earlier run's.
	ReplayFence int64
	LeaseUntil  time.Time
	AvailableAt time.Time
	Deadline    time.Time
	CreatedAt   time.Time
	UpdatedAt   time.Time
	ErrorClass  string // of the last failure
	LastError   string
}

// NewJob is what Accept needs.
type NewJob struct {
	ID             string // chosen by the caller (UUIDv7)
	EventID        string // id of the outbox event written with the job
	Tenant         string
	IdempotencyKey string
	RequestHash    string
	Endpoint       string
	Model          string
	Body           json.RawMessage
	Metadata       json.RawMessage
	Priority       int
	TokenEstimate  int
	MaxAttempts    int
	Deadline       time.Time
	Now            time.Time
	// Outcome, when set, pins the job's validation policy (outcomes.go).
	Outcome *NewOutcome
	// Entity, when set, names the entity and version the job produces
	// (entities.go).
	Entity *NewEntity
}

// Event is an outbox event: committed with the state change it reports,
// published to the broker by the relay.
type Event struct {
	Seq          int64 // insertion order: the relay's publishing order
	Cursor       int64 // place in the feed (0 until published or placed): the replay cursor
	ID           string
	JobID        string
	Tenant       string
	Type         string // job.accepted, job.running, job.succeeded, ...
	State        State
	StateVersion int64
	CreatedAt    time.Time
	PublishedAt  time.Time // zero until published (a placed event may be in the feed before)
}

// Attempt records how one claim of a job ended, written with its outcome.
// A claim that only waited is recorded too, as a wait that spent nothing.
type Attempt struct {
	JobID string
	// Attempt is the number this attempt has, or would have had had it
	// counted: the job's spent attempts before it, plus one.
	Attempt int
	Fence   int64 // the claim's
	Backend string
	// Outcome is how the claim ended: the outcomes below.
	Outcome string
	// Spent says the attempt counted against the job's MaxAttempts.
	Spent bool
	// Sent says the job's request may have reached a backend: a backend
	// call happened, or could have, under this claim.
	Sent             bool
	ErrorClass       string
	Error            string
	PromptTokens     int
	CompletionTokens int
	StartedAt        time.Time
	EndedAt          time.Time
	// Charge, when set, is the attempt's usage, charged to its job's
	// tenant's ledger (the day of the end's Now) by the transaction that records the
	// attempt's end (Complete, Fail): the attempt held no permit.
	Charge *Charge
}

// Charge is a job attempt's usage that its tenant's ledger takes with the
// attempt's own writes instead of through a permit (Tenants.Acquire and
// Release): for an attempt nothing can refuse (Acquisition.Unrefusable),
// which then writes nothing of its own. The claim's MarkSent holds the
// reservation, which Reap charges as uncertain usage when the lease of an
// attempt marked sent expires; the attempt's end charges how its request
// ended, as RecordUsage would have. An attempt's usage is so charged
// exactly once, whatever crashes: with the end that commits, or with the
// reap that takes the job from a claim that never recorded one.
type Charge struct {
	Tokens int64 // the reservation: prompt plus output budget
	Cost   int64 // its price, micro-units
	// How the request ended, as in Release.
	Outcome          Outcome
	Attempts         int
	PromptTokens     int64
	CompletionTokens int64
	UsageCost        int64 // the reported usage's price, micro-units
	// Earlier is what the attempt's requests before this one used, when
	// the attempt makes several (an embeddings job split into batches):
	// one Charge carries them all, so that each is charged with the
	// attempt's end or its reap, never apart and never twice.
	Earlier Spent
}

// Spent is what requests that ended reported (Charge.Earlier).
type Spent struct {
	Requests         int
	Tokens           int64 // their reservations
	Cost             int64 // their price, micro-units
	PromptTokens     int64
	CompletionTokens int64
	UsageCost        int64
}

// Reserved is what a sent mark holds for c: the reservation of the
// request in flight and those of the attempt's earlier requests, which a
// reap charges as uncertain usage (their reports die with the attempt).
func (c *Charge) Reserved() (tokens, cost int64) {
	return c.Tokens + c.Earlier.Tokens, c.Cost + c.Earlier.Cost
}

// Spend adds to s the request that c charges, which ended reported.
func (s *Spent) Spend(c Charge) {
	s.Requests++
	s.Tokens, s.Cost = s.Tokens+c.Tokens, s.Cost+c.Cost
	s.PromptTokens, s.CompletionTokens, s.UsageCost = s.PromptTokens+c.PromptTokens, s.CompletionTokens+c.CompletionTokens, s.UsageCost+c.UsageCost
}

// Completion is a worker's successful (or review-required) end of a job.
// It spends an attempt, unless Reused: the result came from a stage an
// earlier attempt checkpointed, and that attempt was counted when it was
// made.
type Completion struct {
	JobID  string
	Fence  int64
	State  State // Succeeded or ReviewRequired
	Result json.RawMessage
	Reused bool
	// Entity, for a job that names one, makes the completion decide the
	// entity's winner in its transaction (entities.go): a version lower
	// than one that SUCCEEDED ends SUPERSEDED whatever State asks.
	Entity  *JobEntity
	Attempt Attempt
	EventID string
	Now     time.Time
}

// Attempt outcomes.
const (
	OutcomeSucceeded = "succeeded"
	// OutcomeFailed: the request reached a backend and failed there, or
	// the job's input is invalid; the attempt counts.
	OutcomeFailed = "failed"
	// OutcomeWait: the claim handed the job back without reaching a
	// backend (no backend for its model, no capacity, its tenant's quota,
	// a backend's 429, a refused connection); nothing was spent.
	OutcomeWait = "wait"
	// OutcomeInterrupted: kvgate's own shutdown handed the job back;
	// nothing was spent, though the request may have been sent (Sent).
	OutcomeInterrupted = "interrupted"
	// OutcomeLeaseExpired: the owner stopped renewing the lease. It
	// counts when the owner had begun sending the request (MarkSent).
	OutcomeLeaseExpired = "lease_expired"
)

// Failure is a worker's end of an attempt that did not succeed. Where it
// leaves the job is decided by the store, in one rule for Fail and Reap
// alike: FAILED_TERMINAL when it spent the job's last attempt, when it
// asks for no retry (a zero RetryAt on a spent attempt), or when the retry
// would come at or after the deadline; RETRY_SCHEDULED at RetryAt
// otherwise. An attempt that did not spend is always retried (at once
// when RetryAt is zero) unless the deadline forbids it, which ends the
// job with the class deadline_exceeded.
type Failure struct {
	JobID   string
	Fence   int64
	RetryAt time.Time
	// Attempt is the record; its Spent says whether the attempt counts.
	Attempt Attempt
	EventID string
	Now     time.Time
}

// ListFilter selects a page of a tenant's jobs, newest first.
// InboxRecord is one delivered event for RecordInboxBatch: its id and
// the digest of its payload.
type InboxRecord struct {
	EventID, Digest string
}

// InboxOutcome is what RecordInboxBatch made of one record.
type InboxOutcome int

const (
	// InboxRecorded: the first delivery of the event, recorded now.
	InboxRecorded InboxOutcome = iota
	// InboxDuplicate: a redelivery of an event recorded before.
	InboxDuplicate
	// InboxMismatch: the id was recorded before with another digest
	// (RecordInbox's ErrDigestMismatch); nothing was written for it.
	InboxMismatch
)

type ListFilter struct {
	States []State
	Batch  string // only the lines of this batch ("": any job)
	After  string // cursor: the last job id of the previous page
	Limit  int
}

// Store is the durable job store. Implementations are safe for concurrent
// use. Every method that changes state writes its outbox event in the same
// transaction; every tenant-scoped read treats another tenant's job as
// not found. A backend that cannot reach its database returns an error
// wrapping ErrUnavailable: each method's writes are one transaction, so
// nothing was written, or (when the connection broke during the commit)
// all of it, never a part.
type Store interface {
	// Accept inserts a job and its job.accepted event, or returns the
	// existing job for the same tenant and key (created false). A
	// different RequestHash for an existing key is ErrConflict.
	Accept(ctx context.Context, j NewJob) (job Job, created bool, err error)
	// Get returns a tenant's job.
	Get(ctx context.Context, tenant, id string) (Job, error)
	// GetByKey returns a tenant's job by its idempotency key; ErrNotFound
	// if the key made none.
	GetByKey(ctx context.Context, tenant, key string) (Job, error)
	// List returns a page of a tenant's jobs, without their request
	// bodies (Body nil: Get reads one), and the cursor of the next page
	// ("" at the end).
	List(ctx context.Context, tenant string, f ListFilter) ([]Job, string, error)
	// Claim leases up to limit runnable jobs (READY or RETRY_SCHEDULED,
	// available, before their deadline): RUNNING, fence+1, lease until
	// now+lease; the attempt counter is not touched (an attempt counts
	// only when it ends, see Complete and Fail). With models given, only
	// jobs for those models. It serves tenants in turn, least recently
	// served first and round-robin within the batch, so that one tenant's
	// backlog never holds another's jobs behind it; within a tenant, the
	// lowest priority value first, then the oldest available. Several
	// claimers never get the same job. A store may take fewer than limit
	// even when more are runnable (PostgreSQL: at most 65,535 a claim).
	Claim(ctx context.Context, now time.Time, lease time.Duration, limit int, models ...string) ([]Job, error)
	// Heartbeat extends a lease while the claim owns the job (RUNNING,
	// the same fence, the lease unexpired at now); ErrLeaseLost otherwise.
	Heartbeat(ctx context.Context, id string, fence int64, now time.Time, lease time.Duration) error
	// MarkSent records, under the same ownership as Heartbeat (whose
	// lease it also extends), that the claim is about to send the job's
	// request to a backend: from then on, a lease that expires counts the
	// attempt. The request must not be sent unless it returned nil. A
	// reservation, when given, is the attempt's Charge: a reap of the
	// lease charges it as uncertain usage.
	MarkSent(ctx context.Context, id string, fence int64, now time.Time, lease time.Duration, reserved *Charge) error
	// Complete ends an attempt with a result, under the fence; the
	// attempt counts.
	Complete(ctx context.Context, c Completion) error
	// Fail ends an attempt that did not succeed, under the fence (see
	// Failure for where it leaves the job).
	Fail(ctx context.Context, f Failure) error
	// Reap returns expired leases to RETRY_SCHEDULED with a new fence, by
	// Failure's rule: the lost attempt counts when its claim had marked
	// the request sent, and its Charge, when the mark held one, lands in
	// the tenant's ledger as uncertain usage. It also fails runnable jobs whose deadline
	// passed. It returns how many jobs it changed.
	Reap(ctx context.Context, now time.Time, limit int) (int, error)
	// Cancel moves a tenant's non-final job to CANCELLED; ErrFinal when
	// it already ended.
	Cancel(ctx context.Context, tenant, id, eventID string, now time.Time) (Job, error)
	// Result returns a tenant's job result; ErrNotFound until there is one.
	Result(ctx context.Context, tenant, id string) (json.RawMessage, error)
	// Attempts returns a job's attempt records in order.
	Attempts(ctx context.Context, id string) ([]Attempt, error)
	// SaveStage checkpoints a stage's output in one statement conditioned
	// on the claim's ownership at now (as Heartbeat), so that a later
	// retry need not redo it; ErrLeaseLost when the claim no longer owns
	// the job. Saving a stage twice keeps the first.
	SaveStage(ctx context.Context, id string, fence int64, stage string, data []byte, now time.Time) error
	// Stage returns a checkpointed stage's output; ErrNotFound if none.
	Stage(ctx context.Context, id, stage string) ([]byte, error)
	// Unpublished returns up to limit outbox events not yet published:
	// those placed in the feed without the broker (FeedUnpublished) first,
	// in feed order, then the oldest others.
	Unpublished(ctx context.Context, limit int) ([]Event, error)
	// FeedUnpublished gives up to limit unpublished events without a feed
	// place their places, oldest first, and returns how many it placed:
	// while the broker is away, the feed (the event streams) goes on. They
	// stay unpublished, for the relay to publish once the broker is back;
	// MarkPublished keeps their places.
	FeedUnpublished(ctx context.Context, limit int) (int, error)
	// MarkPublished records the publication of events, giving each its
	// place in the published feed (Cursor) in the order of ids. Places
	// follow commit order, even with several relays marking at once: a
	// reader never finds a new event behind a cursor it has passed.
	// Marking an event again changes nothing; an event placed by
	// FeedUnpublished keeps its place.
	MarkPublished(ctx context.Context, ids []string, at time.Time) error
	// Events returns a tenant's events with a Cursor after the given one,
	// in feed order; jobID narrows them to one job. An event is in the
	// feed once published or placed by FeedUnpublished.
	Events(ctx context.Context, tenant, jobID string, after int64, limit int) ([]Event, error)
	// CountEvents counts a tenant's events with a Cursor after the given
	// one, at most limit: how far behind a reader at that cursor is,
	// without reading the events.
	CountEvents(ctx context.Context, tenant string, after int64, limit int) (int, error)
	// FeedHead returns the cursor of a tenant's latest published event, 0
	// when there is none: where a reader without a cursor starts.
	FeedHead(ctx context.Context, tenant string) (int64, error)
	// RecordInbox records a delivered event once: duplicate reports a
	// redelivery; ErrDigestMismatch a redelivery with other content.
	RecordInbox(ctx context.Context, eventID, digest string, now time.Time) (duplicate bool, err error)
	// RecordInboxBatch records delivered events as RecordInbox does, all
	// in one transaction (one commit for the batch), and returns each
	// record's outcome in order. An id given twice is recorded once: its
	// later mentions are duplicates (or mismatches) of the first. On an
	// error the batch may or may not be recorded: each event must come
	// back as a redelivery, which the inbox then recognises.
	RecordInboxBatch(ctx context.Context, recs []InboxRecord, now time.Time) ([]InboxOutcome, error)
	// PruneInbox forgets up to limit inbox records received before
	// before, oldest first, and returns how many it removed. Records must
	// outlive every redelivery of their event (the stream's retention).
	PruneInbox(ctx context.Context, before time.Time, limit int) (int, error)
	// Close releases the store's connections.
	Close() error
	// Tenants, keys, quotas and usage (tenants.go).
	Tenants
	// Policies, reviews, audit, dead letters and replay (outcomes.go).
	Outcomes
	// Per-entity ordering (entities.go).
	Entities
	// Webhook endpoints and deliveries (webhooks.go).
	Webhooks
}
