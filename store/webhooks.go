package store

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"
)

// Webhooks: tenant-registered endpoints that receive signed deliveries of
// job events (docs/webhooks.md).
//
// Deliveries are made by the database, not by the code paths that write
// events: a trigger on the outbox (migration 0013) inserts, in the
// transaction that commits each event, one PENDING delivery per enabled
// endpoint of the event's tenant that subscribes to it. The event types of
// the outbox are delivered under the names of WebhookEvents
// (job.dead_lettered as job.failed); the others match nothing.
//
// A delivery's state machine: PENDING -> SENDING (claimed: fence+1, leased
// until due) -> DELIVERED, RETRY_SCHEDULED (due at the next attempt) or
// FAILED (the schedule is spent, or the endpoint is gone). A SENDING
// delivery whose lease expired is claimed again under the same id and a
// new fence, and every record of an attempt is conditioned on the fence:
// a stale dispatcher never writes over a newer attempt.

// Delivery states.
const (
	DeliveryPending        = "PENDING"
	DeliverySending        = "SENDING"
	DeliveryDelivered      = "DELIVERED"
	DeliveryRetryScheduled = "RETRY_SCHEDULED"
	DeliveryFailed         = "FAILED"
)

// Webhook event names an endpoint may subscribe to. WebhookTest is sent
// only on request (SendTest), to one endpoint.
const WebhookTest = "webhook.test"

// WebhookEvents lists the event names an endpoint may subscribe to.
var WebhookEvents = []string{"job.succeeded", "job.review_required", "job.failed", "job.superseded", "job.cancelled",
	"batch.completed", "batch.failed", "batch.expired", "batch.cancelled"}

// ValidWebhookEvent reports whether an endpoint may subscribe to name.
func ValidWebhookEvent(name string) bool { return slices.Contains(WebhookEvents, name) }

// AuditRedeliver is the webhook audit action of an operator's redelivery.
const AuditRedeliver = "webhook.redeliver"

// ErrLeaseLost, for deliveries, means the claim's fence moved or the
// delivery left SENDING: the record was discarded.

// WebhookEndpoint is a registered receiver.
type WebhookEndpoint struct {
	ID          string
	Tenant      string
	URL         string
	Events      []string
	Description string
	// Secret signs every delivery; PrevSecret, until PrevUntil, signs
	// beside it after a rotation.
	Secret         string
	PrevSecret     string
	PrevUntil      time.Time
	IncludeResult  bool
	Disabled       bool
	DisabledReason string
	CreatedAt      time.Time
	UpdatedAt      time.Time
}

// Secrets returns the secrets that sign at now: the current one, then a
// rotated-out one still in its overlap.
func (e WebhookEndpoint) Secrets(now time.Time) []string {
	s := []string{e.Secret}
	if e.PrevSecret != "" && now.Before(e.PrevUntil) {
		s = append(s, e.PrevSecret)
	}
	return s
}

// EndpointPatch changes an endpoint; nil fields stay.
type EndpointPatch struct {
	URL           *string
	Events        []string // nil: unchanged
	Description   *string
	IncludeResult *bool
	Disabled      *bool
	Reason        string // a disabling's reason; enabling clears it
	Now           time.Time
}

// Delivery is one event's delivery to one endpoint.
type Delivery struct {
	Seq          int64
	ID           string // the webhook-id
	EndpointID   string
	Tenant       string
	EventID      string
	JobID        string
	Type         string // the webhook event name
	JobState     State
	StateVersion int64
	EventAt      time.Time
	State        string
	Attempts     int   // attempts made
	Base         int   // attempts before the latest redelivery: the retry schedule restarts there
	Fence        int64 // +1 on every claim
	DueAt        time.Time
	LastStatus   int
	LastError    string
	CreatedAt    time.Time
	UpdatedAt    time.Time
}

// DeliveryAttempt is the record of one POST.
type DeliveryAttempt struct {
	DeliveryID string
	Attempt    int
	Fence      int64
	StartedAt  time.Time
	Latency    time.Duration
	Status     int // 0: no HTTP answer
	Error      string
	Body       string // the response body, truncated
}

// DeliveryResult is how a claimed delivery's attempt ended. State is
// DeliveryDelivered, DeliveryRetryScheduled (at RetryAt) or
// DeliveryFailed; DisableEndpoint also disables the endpoint (a 410).
// A Deferred result records no attempt: the dispatcher handed the
// delivery back unsent (its endpoint's breaker is open, or its
// concurrency spent) to be claimed at RetryAt.
type DeliveryResult struct {
	ID              string
	Fence           int64
	State           string
	RetryAt         time.Time
	Attempt         DeliveryAttempt
	DisableEndpoint string // the reason, "" to leave the endpoint
	Deferred        bool
	Now             time.Time
}

// DeliveryFilter selects a page of deliveries, oldest first.
type DeliveryFilter struct {
	Tenant     string // "" for every tenant (an admin's)
	EndpointID string
	JobID      string // a job's (or a batch's) deliveries, to every endpoint
	State      string
	After      int64 // cursor: the last Seq of the previous page
	Limit      int
}

// Webhooks is the store of endpoints and deliveries.
type Webhooks interface {
	// CreateEndpoint registers an endpoint; ErrExists if its id is taken
	// (an id made from an Idempotency-Key: the same request again),
	// ErrEndpointDeleted if an endpoint of the id was deleted.
	CreateEndpoint(ctx context.Context, e WebhookEndpoint) error
	// Endpoint returns a tenant's endpoint ("" tenant: any tenant's).
	Endpoint(ctx context.Context, tenant, id string) (WebhookEndpoint, error)
	// Endpoints lists a tenant's endpoints.
	Endpoints(ctx context.Context, tenant string) ([]WebhookEndpoint, error)
	// UpdateEndpoint patches a tenant's endpoint ("" tenant: any).
	UpdateEndpoint(ctx context.Context, tenant, id string, p EndpointPatch) (WebhookEndpoint, error)
	// DeleteEndpoint removes a tenant's endpoint and its deliveries; its
	// id is kept, and never made again.
	DeleteEndpoint(ctx context.Context, tenant, id string) error
	// RotateSecret makes secret the endpoint's, keeping the current one
	// signing beside it until overlapUntil. With a key, a rotation whose
	// key was the last rotation's changes nothing and returns the
	// endpoint as it is, with the secret that rotation made.
	RotateSecret(ctx context.Context, tenant, id, secret, key string, overlapUntil, now time.Time) (WebhookEndpoint, error)
	// SendTest makes a PENDING webhook.test delivery to one endpoint.
	SendTest(ctx context.Context, tenant, endpointID, eventID string, now time.Time) (Delivery, error)
	// ClaimDeliveries leases up to limit due deliveries (PENDING or
	// RETRY_SCHEDULED due at now, or SENDING with an expired lease):
	// SENDING, fence+1, due at now+lease. Several claimers never get the
	// same delivery.
	ClaimDeliveries(ctx context.Context, now time.Time, lease time.Duration, limit int) ([]Delivery, error)
	// FinishDeliveries records the ends of claimed attempts, each under
	// its fence, in one transaction; errs[i] is ErrLeaseLost where the
	// claim no longer owned its delivery (nothing of it was written).
	FinishDeliveries(ctx context.Context, rs []DeliveryResult) (errs []error, err error)
	// DeferEndpoint moves an endpoint's due deliveries (PENDING,
	// RETRY_SCHEDULED) to until, spending no attempt: the circuit
	// breaker's open state, shared by every dispatcher.
	DeferEndpoint(ctx context.Context, endpointID string, until time.Time) (int, error)
	// Delivery returns a tenant's delivery ("" tenant: any).
	Delivery(ctx context.Context, tenant, id string) (Delivery, error)
	// Deliveries returns a page of deliveries and the next cursor (0 at
	// the end).
	Deliveries(ctx context.Context, f DeliveryFilter) ([]Delivery, int64, error)
	// DeliveryAttempts returns a delivery's attempt records in order.
	DeliveryAttempts(ctx context.Context, id string) ([]DeliveryAttempt, error)
	// Redeliver makes a tenant's FAILED or DELIVERED delivery PENDING
	// again, due at now, under the same id, with an audit record of the
	// actor; ErrWrongState for one still in flight, ErrEndpointDisabled
	// for one whose endpoint is disabled.
	Redeliver(ctx context.Context, tenant, id, actor string, now time.Time) (Delivery, error)
	// PendingDeliveries counts deliveries not yet ended.
	PendingDeliveries(ctx context.Context) (int, error)
}

// ErrEndpointDisabled: the endpoint is disabled; nothing was sent.
var ErrEndpointDisabled = errors.New("store: webhook endpoint is disabled")

// ErrEndpointDeleted: CreateEndpoint was given the id of a deleted
// endpoint (its Idempotency-Key's). It is an ErrExists too.
var ErrEndpointDeleted = fmt.Errorf("%w: the id of a deleted webhook endpoint", ErrExists)
