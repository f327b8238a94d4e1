package store

import (
	"context"
	"errors"
)

// Per-entity ordering. A job may name an entity of its tenant and a
// version of it ("invoice-4711", 7; one job per tenant, key and version).
//
// Latest wins (the default): once a version has SUCCEEDED, a lower version
// that ends later ends SUPERSEDED instead (its result is never
// delivered), and the lower versions not yet started are superseded in
// the same transaction, without running. The check and the move of the
// entity's winning version happen in the completing transaction, under
// the entity row's lock, so two replicas finishing n and n+1 at once
// cannot both win.
//
// Serial: versions of the entity run one at a time, in version order (a
// version waits, spending nothing, while a lower one has not ended);
// other entities run in parallel.

// Orderings.
const (
	OrderLatest = "latest"
	OrderSerial = "serial"
)

// ErrEntityVersionExists: the tenant already has a job for that entity
// version.
var ErrEntityVersionExists = errors.New("store: the entity version already has a job")

// NewEntity is what a job names at acceptance.
type NewEntity struct {
	Key      string
	Version  int64
	Ordering string // OrderLatest ("" too) or OrderSerial
}

// JobEntity is a job's entity version.
type JobEntity struct {
	JobID    string
	Tenant   string
	Key      string
	Version  int64
	Ordering string
}

// Turn is what a claimed entity job may do now.
type Turn int

// Turns.
const (
	TurnRun        Turn = iota // run it
	TurnWait                   // serial: a lower version has not ended
	TurnSuperseded             // latest wins: a higher version has SUCCEEDED
)

// EntityVersion is one version of an entity, with its job.
type EntityVersion struct {
	Version int64
	JobID   string
	State   State
}

// Entity is an entity's versions, as its tenant sees them.
type Entity struct {
	Tenant     string
	Key        string
	WonVersion int64 // the highest version that SUCCEEDED, 0 if none
	Versions   []EntityVersion
}

// Entities is the store's part for per-entity ordering.
type Entities interface {
	// JobEntity returns a job's entity version; ErrNotFound when it names
	// none.
	JobEntity(ctx context.Context, jobID string) (JobEntity, error)
	// EntityTurn says what a claimed job of an entity may do now.
	EntityTurn(ctx context.Context, e JobEntity) (Turn, error)
	// Entity returns a tenant's entity, its latest versions first (at most
	// limit of them); ErrNotFound when no job names it.
	Entity(ctx context.Context, tenant, key string, limit int) (Entity, error)
}
