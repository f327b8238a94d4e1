package store

import (
	"context"
	"encoding/json"
	"time"
)

// File is an uploaded file (the Files API), or a batch's output or error
// file. Its content lives in chunks, written one short transaction each;
// a file is listed and readable once Complete.
type File struct {
	ID        string
	Tenant    string
	Filename  string
	Purpose   string // batch, batch_output, user_data, ...
	Bytes     int64
	Lines     int64 // lines holding more than white space
	Complete  bool
	CreatedAt time.Time
	ExpiresAt time.Time // zero: never
}

// FileFilter selects a page of a tenant's complete files.
type FileFilter struct {
	Purpose string // "": any
	After   string // cursor: the last file id of the previous page
	Limit   int
	Asc     bool // oldest first; newest first otherwise
}

// Batch statuses, as OpenAI names them.
const (
	BatchValidating = "validating"
	BatchFailed     = "failed"
	BatchInProgress = "in_progress"
	BatchFinalizing = "finalizing"
	BatchCompleted  = "completed"
	BatchExpired    = "expired"
	BatchCancelling = "cancelling"
	BatchCancelled  = "cancelled"
)

// BatchFinal reports whether a batch status is final.
func BatchFinal(status string) bool {
	switch status {
	case BatchFailed, BatchCompleted, BatchExpired, BatchCancelled:
		return true
	}
	return false
}

// Batch is a batch of requests (the Batch API), each line a job.
type Batch struct {
	ID               string
	Tenant           string
	Endpoint         string
	InputFileID      string
	CompletionWindow string
	Status           string
	// EndStatus is what finalizing ends in: completed, expired or
	// cancelled ("" before finalizing).
	EndStatus    string
	Model        string
	OutputFileID string
	ErrorFileID  string
	Errors       json.RawMessage // [{code, message, param, line}], validation's
	Metadata     json.RawMessage
	// OutputExpiresAfter is how long after they are written the output
	// and error files expire (0: never).
	OutputExpiresAfter time.Duration
	// Total, Completed and Failed are request_counts once final (live
	// counts come from BatchCounts while it runs).
	Total, Completed, Failed int
	Usage                    json.RawMessage
	// PriorityBase is the job priority of the batch's first line: line i
	// runs at priority PriorityBase+i, interleaving a tenant's batches.
	PriorityBase int

	CreatedAt, InProgressAt, ExpiresAt, FinalizingAt, CompletedAt time.Time
	FailedAt, ExpiredAt, CancellingAt, CancelledAt                time.Time

	// Fence names the claim of the batch's validation or finalization
	// (see LeaseBatch); LeaseUntil is when that claim lapses.
	Fence      int64
	LeaseUntil time.Time
	// PendingOutput and PendingError are the files the current
	// finalization writes.
	PendingOutput, PendingError string
}

// BatchLine is one line of a batch as a job: its place and its outcome.
type BatchLine struct {
	JobID      string
	CustomID   string
	State      State
	Result     json.RawMessage // SUCCEEDED or REVIEW_REQUIRED
	ErrorClass string
	LastError  string
	UpdatedAt  time.Time
}

// BatchCounts counts a batch's lines by how they stand.
type BatchCounts struct {
	Total     int
	Succeeded int // SUCCEEDED or REVIEW_REQUIRED
	Failed    int // FAILED_TERMINAL
	Cancelled int
	Open      int // READY, RUNNING or RETRY_SCHEDULED
}

// BatchEnd is a finalization's last write: the batch's final status, its
// files (made complete) and its counts, with its event.
type BatchEnd struct {
	ID, Tenant   string
	Fence        int64
	Status       string // completed, expired or cancelled
	OutputFileID string // "" when no line succeeded
	OutputBytes  int64
	OutputLines  int64
	ErrorFileID  string // "" when no line failed
	ErrorBytes   int64
	ErrorLines   int64
	Counts       BatchCounts
	Usage        json.RawMessage
	EventID      string
	Now          time.Time
}

// Batches is the job store's part for the Files and Batch APIs;
// *sqlstore.Store implements it. Every tenant-scoped read treats another
// tenant's file or batch as not found.
type Batches interface {
	CreateFile(ctx context.Context, f File) error
	PutFileChunk(ctx context.Context, id string, seq int, data []byte) error
	CompleteFile(ctx context.Context, f File) error
	File(ctx context.Context, tenant, id string, now time.Time) (File, error)
	FileChunk(ctx context.Context, id string, seq int) ([]byte, error)
	ListFiles(ctx context.Context, tenant string, f FileFilter, now time.Time) ([]File, bool, error)
	DeleteFile(ctx context.Context, tenant, id string) error
	SweepFiles(ctx context.Context, staleBefore, now time.Time, limit int) (int, error)
	// FileBytes is what a tenant's files hold at now: the complete,
	// unexpired ones' bytes and the chunks of those being written.
	FileBytes(ctx context.Context, tenant string, now time.Time) (int64, error)

	CreateBatch(ctx context.Context, b Batch) error
	Batch(ctx context.Context, tenant, id string) (Batch, error)
	ListBatches(ctx context.Context, tenant, after string, limit int) ([]Batch, bool, error)
	// BatchesToWork returns up to limit unfinished batches whose lease is
	// free at now, by id from after ("": the first): a worker pages
	// through them all, so that no open batch waits behind others.
	BatchesToWork(ctx context.Context, now time.Time, after string, limit int) ([]Batch, error)
	LeaseBatch(ctx context.Context, id string, fence int64, now time.Time, lease time.Duration) (int64, error)
	RenewBatch(ctx context.Context, id string, fence int64, now time.Time, lease time.Duration) error
	ReleaseBatch(ctx context.Context, id string, fence int64) error
	BatchPriorityBase(ctx context.Context, tenant string) (int, error)
	SetBatchPriorityBase(ctx context.Context, id string, fence int64, base int) error
	AcceptBatchLines(ctx context.Context, batchID string, fence int64, jobs []NewJob, customIDs []string) error
	StartBatch(ctx context.Context, id string, fence int64, total int, model string, now time.Time) error
	FailBatch(ctx context.Context, tenant, id string, fence int64, errs json.RawMessage, total int, eventID string, now time.Time) error
	CancelBatch(ctx context.Context, tenant, id string, now time.Time) (Batch, error)
	CancelBatchLines(ctx context.Context, id string, running bool, now time.Time) (int, error)
	BatchCounts(ctx context.Context, id string) (BatchCounts, error)
	BatchOpen(ctx context.Context, id string) (bool, error)
	// BeginFinalize moves a batch to finalizing; ErrBatchOpen, the batch
	// unchanged, where a line is open again (a replay committed after
	// the caller saw every line ended): the batch's files must not be
	// written while a line can still change.
	BeginFinalize(ctx context.Context, tenant, id string, fence int64, endStatus string, out, errFile File, now time.Time) error
	// BatchLines returns up to limit lines of a batch after the job id
	// after, fewer where their results are large: only an empty page
	// says there are no more.
	BatchLines(ctx context.Context, id, after string, limit int) ([]BatchLine, error)
	EndBatch(ctx context.Context, e BatchEnd) error
	// ReserveBatch holds room for a batch's jobs lines of tokens in all
	// under the tenant's pending-job limits, as ReserveJob does for one
	// job: the check and the reservation are one transaction, so that two
	// batches accepted at once never pass a limit together. It returns a
	// *QuotaError when the lines would pass a limit. The reservation
	// counts until EndJobReservation(id) or the lease ends; the lines
	// count as pending jobs from their insertion. Reserving an id again
	// replaces its reservation.
	ReserveBatch(ctx context.Context, id, tenant string, jobs, tokens int64, l Limits, now time.Time, lease time.Duration) error
}
