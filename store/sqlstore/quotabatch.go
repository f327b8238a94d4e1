package sqlstore

import (
	"cmp"
	"context"
	"database/sql"
	"errors"
	"slices"
	"time"

	"github.com/kvgate/kvgate/store"
)

// Group commit for the limiter. Every interactive request acquires a
// permit before it is admitted and releases it when it ends: two writes a
// request, which on SQLite (one writer at a time) queued behind each other
// and under load became the gateway's ceiling. Acquisitions and releases
// that arrive together now commit together, in one transaction. A call
// that may be refused (an acquisition under a limit) runs under a savepoint
// of its own, so that its refusal (a *store.QuotaError) or a failed
// statement undoes that call alone and the others commit; when a call
// without one fails, the batch is rolled back and each of its calls runs
// alone. A call alone runs alone, in its own transaction, as before.
//
// The calls of a batch run sorted by tenant; within a tenant, the calls
// that lock its window (its tenant's, then its key's) before its ledger
// row go first, by key, and those that lock only the ledger row (mostly
// the calls without limits) after them. Every call thus takes a tenant's
// window before its key's, both before the tenant's ledger row, and all
// of them before anything of a later tenant, so two batches (on one
// replica or several) lock in one order and never deadlock.
//
// A call waits for its batch to commit whatever its context says (at
// most quotaWait): a permit written for a caller that had left would
// count until its lease ran out.

// quotaWait bounds how long a call waits for its batch.
const quotaWait = 10 * time.Second

// quotaCall is one Acquire (acquire set; permit its result) or Release
// (release set) in a batch.
type quotaCall struct {
	acquire    *store.Acquisition
	windowless bool // an acquisition that takes no window (Acquire)
	release    *store.Release
	permit     store.Permit
	err        error
}

// windowed says whether the call locks its tenant's window: then, within
// its tenant, it goes before the calls that do not, because it locks the
// window before the tenant's ledger row and they lock only the ledger row.
func (c *quotaCall) windowed() bool {
	if c.acquire != nil {
		return !c.windowless
	}
	return !c.release.Permit.WindowStart.IsZero()
}

// tenant returns the call's tenant and key: the order of its locks.
func (c *quotaCall) tenant() (string, string) {
	if c.acquire != nil {
		return c.acquire.Tenant, c.acquire.KeyID
	}
	return c.release.Permit.Tenant, c.release.Permit.KeyID
}

// quotaIn runs one call in tx.
func (s *Store) quotaIn(ctx context.Context, tx *sql.Tx, c *quotaCall) error {
	if c.acquire != nil {
		p, err := s.acquireIn(ctx, tx, *c.acquire, c.windowless)
		c.permit = p
		return err
	}
	return s.releaseIn(ctx, tx, *c.release)
}

func (c *quotaCall) op() string {
	if c.acquire != nil {
		return "acquire quota"
	}
	return "release quota"
}

// quotaSlots is how many batches of limiter writes run at once: one where
// the database serialises writers (a second would wait for the first's
// lock, and its calls are better off joining the next batch), a few
// elsewhere.
func quotaSlots(d Dialect) int {
	if d.LockRunnable == "" {
		return 1
	}
	return groupSlots
}

// quotaDo runs c in a batch and returns when the batch has committed (or
// failed): c.err is then the call's own outcome.
func (s *Store) quotaDo(ctx context.Context, c *quotaCall) error {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), quotaWait)
	defer cancel()
	return s.quotas.do(ctx, c)
}

// quotaGroup runs a batch of limiter calls.
func (s *Store) quotaGroup(ctx context.Context, cs []*quotaCall) {
	if len(cs) == 1 {
		c := cs[0]
		c.err = s.tx(ctx, c.op(), func(tx *sql.Tx) error { return s.quotaIn(ctx, tx, c) })
		return
	}
	slices.SortStableFunc(cs, func(a, b *quotaCall) int {
		at, ak := a.tenant()
		bt, bk := b.tenant()
		return cmp.Or(cmp.Compare(at, bt), compareBool(b.windowed(), a.windowed()), cmp.Compare(ak, bk))
	})
	err := s.tx(ctx, "quota batch", func(tx *sql.Tx) error {
		for _, c := range cs {
			if !c.refusable() {
				// Only the database fails it: then the batch is rolled
				// back and every call runs alone.
				if c.err = s.quotaIn(ctx, tx, c); c.err != nil {
					return errQuotaBatch
				}
				continue
			}
			if _, err := tx.ExecContext(ctx, "SAVEPOINT quota_call"); err != nil {
				return err
			}
			if c.err = s.quotaIn(ctx, tx, c); c.err != nil {
				if !isStoreErr(c.err) {
					c.err = s.err(c.op(), c.err) // as tx wraps a call's own error
				}
				if _, err := tx.ExecContext(ctx, "ROLLBACK TO SAVEPOINT quota_call"); err != nil {
					return err
				}
			}
			if _, err := tx.ExecContext(ctx, "RELEASE SAVEPOINT quota_call"); err != nil {
				return err
			}
		}
		return nil
	})
	if errors.Is(err, errQuotaBatch) {
		for _, c := range cs {
			c.permit = store.Permit{}
			c.err = s.tx(ctx, c.op(), func(tx *sql.Tx) error { return s.quotaIn(ctx, tx, c) })
		}
		return
	}
	if err != nil {
		// Nothing committed: a refusal still stands, every other call fails.
		for _, c := range cs {
			if !isQuotaErr(c.err) {
				c.err = err
			}
		}
	}
}

// errQuotaBatch rolls back a batch in which a call failed without a
// savepoint of its own.
var errQuotaBatch = errors.New("a call of the batch failed")

// refusable says whether the call may be refused (an acquisition under
// some limit): it runs under a savepoint, so that its refusal undoes its
// writes alone. The others (a release, an acquisition without limits)
// fail only when the database does, and take no savepoint.
func (c *quotaCall) refusable() bool { return c.acquire != nil && !unlimited(*c.acquire) }

// compareBool orders false before true.
func compareBool(a, b bool) int {
	switch {
	case a == b:
		return 0
	case a:
		return 1
	}
	return -1
}

func isQuotaErr(err error) bool {
	var qe *store.QuotaError
	return errors.As(err, &qe)
}
