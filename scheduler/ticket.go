package scheduler

import (
	"errors"
	"fmt"
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

	enqueued time.Time
	vstart   float64 // fair-queueing tags
	vfinish  float64
	done     chan struct{}
	grant    *Grant
	state    ticketState
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
	return fmt.Sprintf("request needs %d KV tokens (prompt plus max_tokens), more than any backend can hold (%d)", e.Need, e.Capacity)
}

// ErrNoBackend is returned for a model that no backend serves.
var ErrNoBackend = errors.New("no backend serves the model")
