package store

import (
	"context"
	"errors"
	"fmt"
	"time"
)

// Tenants, API keys, quotas and usage.
//
// Keys. A key is 32 random bytes shown once, at creation, as
// "kvg_<base64url>"; the store keeps only its SHA-256 (a fast hash is
// right for high-entropy random secrets: nothing to brute-force), a short
// non-secret prefix for listings, its tenant, role and times. Revocation
// sets RevokedAt; a revoked key is not found by KeyByHash. Rotation is a
// new key and the old one revoked.
//
// Limits. The store is the limiter state every replica shares. Acquire
// takes, in one transaction serialised per tenant (the tenant's window
// row is locked first, then the key's), a request and a token reservation
// from the current fixed one-minute window, a concurrency permit (a leased
// row) and a charge against the daily and monthly token budgets, or none
// of them. A permit whose replica died is expired by an Acquire of its
// tenant after its lease (the next one where a concurrency cap or a budget
// is set, one now and then otherwise); its reservation then stays charged
// as uncertain usage. Release returns the permit and reconciles the
// reservation with the usage the backend reported.
//
// Slack. Counts are exact across replicas: no two Acquires of one tenant
// interleave. The window is a fixed minute (its start is the acquiring
// replica's clock truncated to the minute, and a window never moves
// backwards), so in any sliding 60 seconds a tenant may get up to twice
// its RPM and TPM: the end of one window and the start of the next.
// Concurrency holds exactly, except that a crashed replica's permits count
// until their lease ends. Limits themselves are read by the gateway and
// cached briefly, so a changed limit takes effect within that cache's TTL.

// Errors of the tenant and key methods.
var (
	// ErrExists: a tenant of that name already exists.
	ErrExists = errors.New("store: already exists")
	// ErrTenantDeleted: the tenant was deleted (GetTenant, UpdateTenant).
	// It is an ErrNotFound too.
	ErrTenantDeleted = fmt.Errorf("%w: the tenant was deleted", ErrNotFound)
	// ErrTenantNameRetired: CreateTenant was given the name of a deleted
	// tenant, whose jobs, files, batches, webhooks and usage stay under
	// it. It is an ErrExists too.
	ErrTenantNameRetired = fmt.Errorf("%w: the name of a deleted tenant", ErrExists)
	// ErrTenantName: CreateTenant was given a name that is empty or
	// longer than 128 bytes. An empty one would read as "every tenant"
	// where a tenant narrows a read (usage, keys).
	ErrTenantName = errors.New("store: a tenant's name is 1 to 128 bytes")
)

// MaxWeight is the largest fair-share weight a tenant may have: the
// stores keep it in a 32-bit column, and a million times another tenant's
// share is already all of it.
const MaxWeight = 1_000_000

// Role is what a key may do.
type Role string

// Roles, each able to do all the ones before it may.
const (
	// RoleUser runs inference and jobs for its tenant.
	RoleUser Role = "user"
	// RoleOperator also sees its tenant's retry details, dead letters and
	// usage.
	RoleOperator Role = "operator"
	// RoleAdmin also manages tenants and keys and reads every tenant's
	// usage.
	RoleAdmin Role = "admin"
)

// Valid reports whether r is a known role.
func (r Role) Valid() bool { return r == RoleUser || r == RoleOperator || r == RoleAdmin }

// Limits are quotas; zero means unlimited.
type Limits struct {
	RPM              int64 // requests per minute
	TPM              int64 // tokens per minute (prompt + output reserved)
	MaxConcurrency   int64 // requests in flight
	MaxPendingJobs   int64 // jobs accepted and not final
	MaxPendingTokens int64 // their token estimates
	DailyTokens      int64 // token budget per UTC day
	MonthlyTokens    int64 // token budget per UTC month
	// Spending budgets per UTC day and month, in micro-units of the
	// configured currency (1_000_000 is one dollar, say).
	DailySpend   int64
	MonthlySpend int64
}

// Tenant is a customer of the gateway with its quotas.
type Tenant struct {
	Name      string
	Weight    int // share in weighted fair scheduling [1]
	Limits    Limits
	CreatedAt time.Time
	UpdatedAt time.Time
}

// APIKey is a stored key: never the key itself, only its hash.
type APIKey struct {
	ID        string // key_<hex>: names the key in listings and revocation
	Hash      string // hex SHA-256 of the whole key
	Prefix    string // the key's first characters, not secret: for listings
	Tenant    string
	Role      Role
	Name      string // the creator's label
	Limits    Limits // per-key RPM, TPM and concurrency; zero: the tenant's only
	CreatedAt time.Time
	RevokedAt time.Time // zero while the key is valid
}

// Acquisition asks for one request's admission.
type Acquisition struct {
	PermitID string // chosen by the caller
	Tenant   string
	KeyID    string // "" for a key not in the store
	Tokens   int64  // reserved: prompt plus output budget
	Cost     int64  // the reservation's price, micro-units; 0 without prices
	Limits   Limits // the tenant's
	// KeyLimits are the key's own; only RPM, TPM and MaxConcurrency count.
	KeyLimits Limits
	Now       time.Time
	// Lease bounds how long the permit counts if it is never released.
	Lease time.Duration
	// Behind: no request waits for this call (the gateway writes an
	// Unrefusable permit behind its request), so a store may hold it a
	// few milliseconds to commit it with others.
	Behind bool
}

// Permit is the permit an acquisition is given, before any window counts
// it (WindowStart and Window zero).
func (a Acquisition) Permit() Permit {
	return Permit{ID: a.PermitID, Tenant: a.Tenant, KeyID: a.KeyID, Tokens: a.Tokens, Cost: a.Cost, Day: DayOf(a.Now)}
}

// KeyLimited says whether an acquisition's key has limits of its own.
func (a Acquisition) KeyLimited() bool {
	return a.KeyID != "" && (a.KeyLimits.RPM > 0 || a.KeyLimits.TPM > 0 || a.KeyLimits.MaxConcurrency > 0)
}

// Unrefusable says whether nothing can refuse an acquisition: neither its
// tenant nor its key has a limit that a request counts against (the
// pending-job limits count jobs). A store serialises such acquisitions
// with nothing (sqlstore takes no rate window for most of them; a tenant
// given limits later counts its window from the acquisitions after the
// change), and the gateway does not wait for them (gateway/quota.go).
func (a Acquisition) Unrefusable() bool {
	l := a.Limits
	return !a.KeyLimited() && l.RPM <= 0 && l.TPM <= 0 && l.MaxConcurrency <= 0 && l.DailyTokens <= 0 &&
		l.MonthlyTokens <= 0 && l.DailySpend <= 0 && l.MonthlySpend <= 0
}

// Window is a scope's rate window after an acquisition: what the
// x-ratelimit-* headers report. A zero limit means none.
type Window struct {
	LimitRequests, RemainingRequests int64
	LimitTokens, RemainingTokens     int64
	Reset                            time.Duration // until the window ends
}

// Permit is an admitted request's hold on its tenant's quotas.
type Permit struct {
	ID          string
	Tenant      string
	KeyID       string
	Tokens      int64
	Cost        int64 // the reservation's price, micro-units
	Day         int   // yyyymmdd, UTC: the usage ledger row charged
	WindowStart time.Time
	// KeyWindow says the key's own window counted the permit too (the
	// key had limits of its own when it was acquired): its release gives
	// back to that window only then, never a slot it did not take.
	KeyWindow bool
	Window    Window // the tenant's (or the key's, when tighter)
}

// Outcome is how a permit's request ended.
type Outcome int

const (
	// NotSent: no backend received the request; everything is refunded.
	NotSent Outcome = iota
	// Reported: the backend reported usage; the reservation is reconciled
	// with it.
	Reported
	// Uncertain: the request was sent and its usage is unknown (a timeout,
	// a cut stream); the reservation stays charged, as uncertain usage.
	Uncertain
)

// Release returns a permit.
type Release struct {
	Permit   Permit
	Outcome  Outcome
	Attempts int // backend attempts made (retries included)
	// EarlierUncertain counts the request's attempts before its last that
	// were sent and cut with no answer (a stalled backend, a connection
	// dropped before the first byte): whatever they used is unknown, and
	// each is charged the permit's reservation as an uncertain request,
	// whatever the last attempt's outcome.
	EarlierUncertain int
	PromptTokens     int64
	CompletionTokens int64
	Cost             int64 // the reported usage's price, micro-units
	Now              time.Time
	Behind           bool // as Acquisition.Behind
}

// UsageDay is one tenant's usage ledger for one UTC day.
type UsageDay struct {
	Tenant           string
	Day              time.Time // midnight UTC
	Requests         int64     // admitted
	Attempts         int64     // sent to a backend, retries included
	PromptTokens     int64     // reported
	CompletionTokens int64     // reported
	ReservedTokens   int64     // held by requests in flight
	Uncertain        int64     // requests (or cut attempts of retried ones) whose usage never came back
	UncertainTokens  int64     // their reservations, still charged
	// Money, in micro-units: reported usage's, held by requests in flight,
	// and that of the uncertain requests' reservations.
	Cost, ReservedCost, UncertainCost int64
}

// ChargedCost is what the day counts against spending budgets.
func (u UsageDay) ChargedCost() int64 { return u.Cost + u.ReservedCost + u.UncertainCost }

// Charged is what the day counts against token budgets.
func (u UsageDay) Charged() int64 {
	return u.PromptTokens + u.CompletionTokens + u.ReservedTokens + u.UncertainTokens
}

// QuotaError is an Acquire or ReserveJob refused by a quota.
type QuotaError struct {
	// Limit names it: requests, tokens, concurrency, daily_tokens,
	// monthly_tokens, daily_spend, monthly_spend (micro-units), pending_jobs
	// or pending_tokens.
	Limit string
	Scope string // "tenant" or "key"
	Max   int64
	Used  int64
	Asked int64
	// Reset is when it may pass again (zero: when work in flight ends).
	Reset  time.Duration
	Window Window // for the x-ratelimit-* headers
}

// Budget reports whether a spent budget refused it (insufficient_quota),
// rather than a rate (rate_limit_exceeded).
func (e *QuotaError) Budget() bool {
	return e.Limit == "daily_tokens" || e.Limit == "monthly_tokens" || e.Spend()
}

// TooLarge reports whether the request alone asks for more than the
// limit allows at all: no reset makes room for it.
func (e *QuotaError) TooLarge() bool { return e.Max > 0 && e.Asked > e.Max }

// Spend reports whether a spending budget refused it: Max, Used and Asked
// are then micro-units of money.
func (e *QuotaError) Spend() bool { return e.Limit == "daily_spend" || e.Limit == "monthly_spend" }

func (e *QuotaError) Error() string {
	return fmt.Sprintf("%s quota %s: limit %d, used %d, requested %d", e.Scope, e.Limit, e.Max, e.Used, e.Asked)
}

// DayOf returns the ledger day (yyyymmdd, UTC) of t.
func DayOf(t time.Time) int {
	y, m, d := t.UTC().Date()
	return y*10000 + int(m)*100 + d
}

// Tenants is the part of Store about tenants, keys, quotas and usage.
// Methods are safe for concurrent use, also from several processes on one
// database.
type Tenants interface {
	// CreateTenant adds a tenant; ErrTenantName for a name out of bounds,
	// ErrExists if the name is taken, ErrTenantNameRetired if it was a
	// deleted tenant's.
	CreateTenant(ctx context.Context, t Tenant) error
	// UpdateTenant changes a tenant's weight and limits: change is given
	// the tenant as stored, under a lock held until its result is written
	// (at now), so that two updates at once each build on the other and
	// neither is lost. It returns the tenant written; ErrNotFound; change's
	// own error, and nothing written.
	UpdateTenant(ctx context.Context, name string, now time.Time, change func(*Tenant) error) (Tenant, error)
	// DeleteTenant marks a tenant deleted and revokes its keys (its name
	// is not given again: CreateTenant); ErrNotFound; a
	// *TenantBusyError, and nothing changed, while the tenant has jobs
	// not yet ended or batches open: deleted, it would have no limits,
	// and its work would run unlimited.
	DeleteTenant(ctx context.Context, name string, now time.Time) error
	// GetTenant returns a tenant; ErrNotFound, ErrTenantDeleted (an
	// ErrNotFound) for a deleted one.
	GetTenant(ctx context.Context, name string) (Tenant, error)
	// ListTenants returns a page of at most limit (1 or more) tenants not
	// deleted, by name, those named after after ("" from the first), and
	// whether more follow.
	ListTenants(ctx context.Context, after string, limit int) ([]Tenant, bool, error)
	// CreateKey stores a key; ErrNotFound without its tenant.
	CreateKey(ctx context.Context, k APIKey) error
	// KeyByHash returns the valid (not revoked) key with that hash;
	// ErrNotFound otherwise.
	KeyByHash(ctx context.Context, hash string) (APIKey, error)
	// ListKeys returns a page of at most limit (1 or more) of a tenant's
	// keys ("" for all), revoked ones too, oldest first, those after the
	// key of id after ("" from the first; none after an unknown id), and
	// whether more follow.
	ListKeys(ctx context.Context, tenant, after string, limit int) ([]APIKey, bool, error)
	// GetKey returns the key of an id, revoked or not; ErrNotFound.
	GetKey(ctx context.Context, id string) (APIKey, error)
	// RevokeKey revokes a key by id; ErrNotFound if no valid key has it.
	RevokeKey(ctx context.Context, id string, now time.Time) error
	// RotateKey revokes key oldID and creates k in its place, at once:
	// ErrNotFound, and no key created, if no valid key has oldID (one
	// rotated or revoked meanwhile); as CreateKey when k's tenant is gone.
	RotateKey(ctx context.Context, oldID string, k APIKey, now time.Time) error
	// ActiveKeys counts the keys not revoked.
	ActiveKeys(ctx context.Context) (int, error)
	// Acquire admits one request against the tenant's and key's quotas,
	// atomically across replicas: a *QuotaError when a quota refuses it,
	// and then nothing is taken. Any other error leaves no permit held
	// for long: one written although the caller was told it failed (a
	// commit after the caller stopped waiting, or of unknown outcome) is
	// released as not sent, or else ends with its lease.
	Acquire(ctx context.Context, a Acquisition) (Permit, error)
	// Release returns a permit and reconciles its reservation. Releasing
	// twice changes nothing more; a permit that expired first is
	// reconciled from the uncertain usage it was moved to.
	Release(ctx context.Context, r Release) error
	// RenewPermit moves a permit's lease to expires: a permit held longer
	// than a lease (a job's, while the job waits for a backend) keeps
	// counting against its tenant's concurrency. ErrNotFound once the
	// permit is released or swept.
	RenewPermit(ctx context.Context, id string, expires time.Time) error
	// RecordUsage charges the ledger with an ended request as Acquire and
	// then Release would have, with no permit ever stored: for a request
	// that nothing could refuse (Acquisition.Unrefusable) and that ended
	// before its permit was written. r.Permit is its acquisition's
	// Acquisition.Permit.
	RecordUsage(ctx context.Context, r Release) error
	// ReserveJob holds room for one job of tokens under the tenant's
	// pending-job limits until the job is accepted (EndJobReservation) or
	// the lease ends: a *QuotaError when the pending jobs or tokens are
	// at their limit.
	ReserveJob(ctx context.Context, id, tenant string, tokens int64, l Limits, now time.Time, lease time.Duration) error
	// EndJobReservation drops a reservation once its job is stored (or
	// not stored at all).
	EndJobReservation(ctx context.Context, id string) error
	// Usage returns the usage ledger of a tenant ("" for all) for the days
	// from through to (inclusive), by tenant then day.
	Usage(ctx context.Context, tenant string, from, to time.Time) ([]UsageDay, error)
}

// TenantBusyError refuses to delete a tenant with work pending: Jobs not
// yet ended (READY, RUNNING, RETRY_SCHEDULED; a batch's lines among them)
// and Batches open.
type TenantBusyError struct {
	Tenant        string
	Jobs, Batches int64
}

func (e *TenantBusyError) Error() string {
	return fmt.Sprintf("store: tenant %s has %d jobs not yet ended and %d batches open", e.Tenant, e.Jobs, e.Batches)
}
