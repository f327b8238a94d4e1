package scheduler

import (
	"errors"
	"fmt"
	"strings"
	"time"
)

// Ticket is a request waiting for capacity.
type Ticket struct {
	Tenant string
	// Weight is the tenant's share within its class, relative to other
	// tenants' (see fair.go); 0 means 1.
	Weight       float64
	Class        Class
	Model        string
	PromptTokens int
	MaxTokens    int // output tokens to reserve
	// Deadline bounds the wait; zero means the policy's MaxQueueWait.
	Deadline time.Time
	// Exclude lists backends not to use, such as one that just failed.
	Exclude []string
	// PromptEstimate, when set, re-counts the prompt: PromptTokens is an
	// estimate that improves as backends report usage, and a ticket that
	// waits, or a request that runs, should not keep a cold guess.
	PromptEstimate func() int
	// Prefix, when set, names the prompt's cacheable chunks (prefix.go):
	// admission then reserves only what the chosen backend does not
	// already hold for requests in flight, and routing prefers a backend
	// likely to have the prompt cached.
	Prefix *Prefix
	// Booked, when set, is called once Acquire has put the ticket in the
	// scheduler's books (admitted at once, or queued), under the
	// scheduler's lock and in Acquire's caller's goroutine: from then
	// Room counts it, and the caller stops counting it itself (the
	// runner's admitting count).
	Booked func()

	enqueued time.Time
	vstart   float64 // fair-queueing tags
	vfinish  float64
	done     chan struct{}
	grant    *Grant
	state    ticketState
	err      error // why a queued ticket was failed (models.go)
	// waitsOn names the backend holding the ticket's prefix that its
	// last admission attempt waited for (prefix.go), rather than for room
	// anywhere; "" when it did not.
	waitsOn string
	// waitsNeed is the KV the ticket needs on waitsOn (its prompt less
	// the chunks computed there, plus its output budget).
	waitsNeed int
	// waitsPassed says that, waiting on waitsOn, it passed over a
	// backend that could have taken it.
	waitsPassed bool
	// refusals and waitedOn feed the admission record (admittrace.go),
	// only while an observer is set.
	refusals map[string]int
	waitedOn string
}

type ticketState uint8

const (
	ticketNew ticketState = iota
	ticketQueued
	ticketGranted
	ticketGone // cancelled or expired
)

// Need is the ticket's reservation in KV tokens.
func (t *Ticket) Need() int { return t.PromptTokens + t.MaxTokens }

// RejectedError is returned when kvgate cannot take a ticket now: its queue
// is full, or the ticket's wait ran out. RetryAfter is a hint for the
// client.
type RejectedError struct {
	Reason     string // "queue_full", "queue_timeout", "shutting_down"
	RetryAfter time.Duration
}

func (e *RejectedError) Error() string {
	return fmt.Sprintf("no capacity: %s (retry after %s)", e.Reason, e.RetryAfter)
}

// TooLargeError is returned for a ticket that no backend serving its model
// could ever hold: waiting would be forever.
type TooLargeError struct {
	Need, Capacity int // tokens; Capacity is the largest budget on offer
}

func (e *TooLargeError) Error() string {
	return fmt.Sprintf("request needs %d KV tokens (its prompt and output), more than any backend can hold (%d)", e.Need, e.Capacity)
}

// ErrNoBackend is returned for a model that no backend serves, is
// configured to serve, or may serve once reached: kvgate does not know it.
var ErrNoBackend = errors.New("no backend serves the model")

// ErrNoRoutableBackend is returned for a model that backends serve, are
// configured to serve, or may serve (their models are not known yet), none
// of which can take work now: down, ejected, not reached yet, or with
// failed GPUs. It is transient. The error returned is an
// *UnroutableError, which matches it under errors.Is.
var ErrNoRoutableBackend = errors.New("no routable backend serves the model")

// UnroutableError is ErrNoRoutableBackend with its detail.
type UnroutableError struct {
	Model string
	// Backends says, for each backend that serves or may serve the model,
	// why it cannot take work: "b1: ejected: connection refused".
	Backends []string
	// RetryAfter is when one of them may be back: the end of the
	// earliest ejection, else a short pause.
	RetryAfter time.Duration
}

func (e *UnroutableError) Error() string {
	return fmt.Sprintf("no routable backend serves model %s (%s)", e.Model, strings.Join(e.Backends, "; "))
}

// Is makes the error match ErrNoRoutableBackend.
func (e *UnroutableError) Is(target error) bool { return target == ErrNoRoutableBackend }
