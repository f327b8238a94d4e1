package sqlstore

import (
	"cmp"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/kvgate/kvgate/store"
)

// Group commit for the limiter. Every interactive request acquires a
// permit before it is admitted and releases it when it ends: two writes a
// request, which on SQLite (one writer at a time) queued behind each other
// and under load became the gateway's ceiling. Acquisitions and releases
// that arrive together now commit together, in one transaction. A call
// that may be refused (an acquisition under a limit) runs under a
// savepoint of its own, so that its refusal (a *store.QuotaError) undoes
// its writes alone and the others commit; when a call fails otherwise,
// the batch is rolled back and each of its calls runs alone. A call
// alone runs alone, in its own transaction, as before.
//
// The calls of a batch run sorted so that two batches (on one replica or
// several) take their locks in one order: by tenant; within a tenant, the
// calls that lock its window (its tenant's, then its key's: the calls
// under a limit) before those that lock only the tenant's ledger row (the
// calls without limits); then by the ledger day they charge, so that the
// ledger rows of a tenant are locked in the order of their days (around
// midnight, releases charge yesterday and acquisitions today); then by
// key. A sweep of expired permits skips the permits that a release holds.
// What is left (a sweep that charges an earlier day after its batch
// charged a later one: a crashed replica's permits, swept past midnight)
// the database resolves by failing one statement, and then the batch
// rolls back and each of its calls runs alone, as any call that fails for
// another reason than a refusal makes it do.
//
// A call waits for its batch to commit whatever its context says (at
// most quotaWait): a permit written for a caller that had left would
// count until its lease ran out. Past quotaWait the caller is told the
// store did not answer, and an acquisition its batch then commits is
// undone (Acquire's undoAcquire).

// quotaWait bounds how long a call waits for its batch.
const quotaWait = 10 * time.Second

// quotaCall is one Acquire (acquire set; permit its result), Release
// (release set) or RecordUsage (release and record set) in a batch.
type quotaCall struct {
	acquire    *store.Acquisition
	windowless bool // an acquisition or a record that takes no window (Acquire, RecordUsage)
	release    *store.Release
	record     bool
	permit     store.Permit
	err        error
}

// windowed says whether the call locks its tenant's window.
func (c *quotaCall) windowed() bool {
	if c.acquire != nil || c.record {
		return !c.windowless
	}
	return !c.release.Permit.WindowStart.IsZero()
}

// day is the ledger day the call charges.
func (c *quotaCall) day() int {
	if c.acquire != nil {
		return store.DayOf(c.acquire.Now)
	}
	return c.release.Permit.Day
}

// compareCalls is the order of a batch's calls (see above).
func compareCalls(a, b *quotaCall) int {
	at, ak := a.tenant()
	bt, bk := b.tenant()
	return cmp.Or(cmp.Compare(at, bt), compareBool(b.windowed(), a.windowed()), cmp.Compare(a.day(), b.day()), cmp.Compare(ak, bk))
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
	if c.record {
		return s.recordIn(ctx, tx, *c.release, c.windowless)
	}
	return s.releaseIn(ctx, tx, *c.release)
}

func (c *quotaCall) op() string {
	switch {
	case c.acquire != nil:
		return "acquire quota"
	case c.record:
		return "record usage"
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
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), s.quotaWait)
	defer cancel()
	if c.behind() {
		return s.behind.do(ctx, c)
	}
	return s.quotas.do(ctx, c)
}

// behindLinger is how long a batch of calls that no request waits for
// (store.Acquisition.Behind) waits for more calls before it runs: at a
// thousand requests a second, several permits' writes commit in one
// transaction instead of one or two, and the begin and the commit (a
// quarter of a gateway's CPU on SQLite at that rate, most of it the
// permits') are shared. They run in a group of their own, so that no
// acquisition a request waits for lingers with them; on SQLite the write
// gate keeps the two groups' transactions one at a time.
const behindLinger = 2 * time.Millisecond

// behind says whether no request waits for the call.
func (c *quotaCall) behind() bool {
	if c.acquire != nil {
		return c.acquire.Behind
	}
	return c.release.Behind
}

// quotaGroup runs a batch of limiter calls.
func (s *Store) quotaGroup(ctx context.Context, cs []*quotaCall) {
	slices.SortStableFunc(cs, compareCalls)
	if s.plainRun(cs) == len(cs) {
		// Nothing but plain calls: one statement, its own transaction.
		err := s.ready(ctx)
		if err == nil {
			err = s.quotaPlain(ctx, s.db, cs)
		}
		switch {
		case err == nil:
			return
		case s.lostTouch(err):
			// Written or not: running the calls again could charge a
			// record twice.
			for _, c := range cs {
				c.permit, c.err = store.Permit{}, s.err(c.op(), err)
			}
			return
		}
		// Nothing was written (a permit's id taken, say): each call alone.
		for _, c := range cs {
			c.permit = store.Permit{}
			c.err = s.tx(ctx, c.op(), func(tx *sql.Tx) error { return s.quotaIn(ctx, tx, c) })
		}
		return
	}
	if len(cs) == 1 {
		c := cs[0]
		c.err = s.tx(ctx, c.op(), func(tx *sql.Tx) error { return s.quotaIn(ctx, tx, c) })
		return
	}
	err := s.tx(ctx, "quota batch", func(tx *sql.Tx) error {
		for i := 0; i < len(cs); i++ {
			if n := s.plainRun(cs[i:]); n > 0 {
				if err := s.quotaPlain(ctx, tx, cs[i:i+n]); err != nil {
					return errQuotaBatch
				}
				i += n - 1
				continue
			}
			c := cs[i]
			refusable := c.refusable()
			if refusable {
				if _, err := tx.ExecContext(ctx, "SAVEPOINT quota_call"); err != nil {
					return err
				}
			}
			c.err = s.quotaIn(ctx, tx, c)
			switch {
			case c.err == nil && refusable:
				if _, err := tx.ExecContext(ctx, "RELEASE SAVEPOINT quota_call"); err != nil {
					return err
				}
			case c.err == nil:
			case !isQuotaErr(c.err):
				return errQuotaBatch
			default:
				c.err = s.err(c.op(), c.err) // as tx wraps a call's own error
				if _, err := tx.ExecContext(ctx, "ROLLBACK TO SAVEPOINT quota_call"); err != nil {
					return err
				}
				if _, err := tx.ExecContext(ctx, "RELEASE SAVEPOINT quota_call"); err != nil {
					return err
				}
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

// errQuotaBatch rolls back a batch in which a call failed otherwise than
// by a refusal: its calls then run alone.
var errQuotaBatch = errors.New("a call of the batch failed")

// refusable says whether the call may be refused (an acquisition under
// some limit): it runs under a savepoint, so that its refusal undoes its
// writes alone. The others (a release, an acquisition without limits)
// fail only when the database does, and take no savepoint.
func (c *quotaCall) refusable() bool { return c.acquire != nil && !c.acquire.Unrefusable() }

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

// plain says whether the call writes nothing but its permit and its
// tenant's ledger: it takes no window and nothing can refuse it (an
// unlimited acquisition, a release of its permit, a record of usage).
func (c *quotaCall) plain() bool { return !c.windowed() && !c.refusable() }

// plainRun is how many calls at the head of cs (sorted) are plain:
// quotaPlain writes them together, where the database takes arrays. On
// SQLite, where a statement is a function call, each runs on its own.
func (s *Store) plainRun(cs []*quotaCall) int {
	if !s.d.WritableCTE {
		return 0
	}
	acquired := map[string]bool{}
	n := 0
	for _, c := range cs {
		if !c.plain() {
			break
		}
		// quotaPlain's statement does not see the permits it inserts: a
		// release of one of them starts a run of its own.
		if c.acquire != nil {
			acquired[c.acquire.PermitID] = true
		} else if !c.record && acquired[c.release.Permit.ID] {
			break
		}
		n++
	}
	return n
}

// Set-based writes of a run of plain calls, in one statement: the
// permits inserted and deleted, and the ledger charged, one row a tenant
// and day with the run's changes summed. A batch of n such calls takes
// one statement instead of two each (the permit, then the ledger row: the
// same row again and again, a new version of it each time), and a batch
// of nothing else no explicit transaction either: one round trip.
//
// A release's change depends on whether a sweep had taken its permit's
// reservation into uncertain usage: the statement is given the change
// both ways and keeps the one that matches the permit it deleted (none
// when the permit is gone: released before, as releaseIn).
//
// The run keeps the batch's lock order: it lies between the windowed
// calls of the tenants before it and after it (each tenant's windowed
// calls come before its plain ones), and it charges the ledger rows by
// tenant, then day. Its permits are deleted first, by id: a permit row
// is contended only by a sweep of its tenant, which skips the permits
// that a release holds and, once it holds one, locks nothing of the
// tenants before its own, which are all this run may already hold.
var plainCalls = fmt.Sprintf(`WITH acquired AS (
		INSERT INTO quota_permits (id, tenant, key_id, day, window_start, tokens, cost, expires_at, swept)
		SELECT id, tenant, key_id, day, 0, tokens, cost, expires_at, 0
		FROM unnest(?::text[], ?::text[], ?::text[], ?::integer[], ?::bigint[], ?::bigint[], ?::bigint[])
			AS t(id, tenant, key_id, day, tokens, cost, expires_at)),
	released AS (
		DELETE FROM quota_permits WHERE id = ANY(?::text[]) RETURNING id, swept),
	changes AS (
		SELECT * FROM unnest(?::text[], ?::integer[], ?::text[], ?::integer[], ?::bigint[], ?::bigint[], ?::bigint[], ?::bigint[],
			?::bigint[], ?::bigint[], ?::bigint[], ?::bigint[], ?::bigint[], ?::bigint[])
			AS c(tenant, day, permit, swept, requests, attempts, prompt, completion, reserved, uncertain, uncertain_tokens,
				cost, reserved_cost, uncertain_cost)
		WHERE c.permit = '' OR EXISTS (SELECT 1 FROM released r WHERE r.id = c.permit AND r.swept = c.swept))
	`+ledgerUpsert, `SELECT tenant, day, sum(requests)::bigint, sum(attempts)::bigint, sum(prompt)::bigint,
			sum(completion)::bigint, sum(reserved)::bigint, sum(uncertain)::bigint, sum(uncertain_tokens)::bigint,
			sum(cost)::bigint, sum(reserved_cost)::bigint, sum(uncertain_cost)::bigint
		FROM changes GROUP BY tenant, day ORDER BY tenant, day`)

// quotaPlain writes a run of plain calls by ex: a transaction, or the
// database for a batch of nothing else (see plainCalls).
func (s *Store) quotaPlain(ctx context.Context, ex interface {
	ExecContext(context.Context, string, ...any) (sql.Result, error)
}, cs []*quotaCall) error {
	var acq struct {
		id, tenant, key       []string
		day                   []int32
		tokens, cost, expires []int64
	}
	var released []string
	var ch struct {
		tenant, permit []string
		day, swept     []int32
		col            [10][]int64 // ledgerChange's fields in ledgerUpsert's order
	}
	change := func(tenant string, day int, permit string, swept bool, d ledgerChange) {
		ch.tenant, ch.day, ch.permit = append(ch.tenant, tenant), append(ch.day, int32(day)), append(ch.permit, permit)
		sw := int32(0)
		if swept {
			sw = 1
		}
		ch.swept = append(ch.swept, sw)
		for i, v := range d.columns() {
			ch.col[i] = append(ch.col[i], v)
		}
	}
	for _, c := range cs {
		tenant, _ := c.tenant()
		switch {
		case c.acquire != nil:
			a := c.acquire
			c.permit = a.Permit()
			acq.id, acq.tenant, acq.key = append(acq.id, a.PermitID), append(acq.tenant, a.Tenant), append(acq.key, a.KeyID)
			acq.day, acq.tokens, acq.cost = append(acq.day, int32(c.permit.Day)), append(acq.tokens, a.Tokens), append(acq.cost, a.Cost)
			acq.expires = append(acq.expires, micros(a.Now.Add(a.Lease)))
			change(tenant, c.permit.Day, "", false, acquiredChange(*a))
		case c.record:
			if d, ok := recordedChange(*c.release); ok {
				change(tenant, c.release.Permit.Day, "", false, d)
			}
		default:
			p := c.release.Permit
			released = append(released, p.ID)
			change(tenant, p.Day, p.ID, false, releasedChange(*c.release, false))
			change(tenant, p.Day, p.ID, true, releasedChange(*c.release, true))
		}
	}
	args := []any{acq.id, acq.tenant, acq.key, acq.day, acq.tokens, acq.cost, acq.expires, released,
		ch.tenant, ch.day, ch.permit, ch.swept}
	for _, c := range ch.col {
		args = append(args, c)
	}
	_, err := ex.ExecContext(ctx, s.rb(plainCalls), args...)
	return err
}
