package sqlstore

import (
	"cmp"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/kvgate/kvgate/store"
)

// Fair claims across tenants.
//
// A claim serves tenants, not the queue's head. job_tenants lists the
// tenants that may have runnable work (kept by triggers as jobs become
// runnable); a claim considers fairTenants(limit) of them in turn order:
// first the tenants never served (served_at 0, by name), then the others
// by name from just after the turn's cursor (the store's own, below),
// wrapping round. It splits its batch among them in weighted
// round-robin: a tenant's k-th job takes turn k/weight (its weight from
// the tenants table, 1 for a tenant not there), earlier in turn order
// first among equal turns, and the first limit turns are the shares.
// The store makes this choice in Go, from its copy of the listing
// (fairList, below), names by byte order. Each tenant's share is then
// taken from the head of its queue through the index
// jobs_runnable_tenant, and the cursor moves to the last considered
// tenant that had been served before. A new tenant's first job thus
// costs it at most one claim of the store that accepted it (two of
// another replica's), whatever another tenant's backlog, and the listed
// tenants are considered in turn, each once per pass of the cursor over
// the table. What the shares could not
// fill (a tenant had fewer runnable jobs than its share, or none
// available yet) is filled oldest-first from every tenant, so a batch is
// short only when the queue is. A claim reads only the jobs it takes
// (and, once in fairListAge, the listing): its cost does not grow with
// the backlog, nor with the number of tenants beyond fairTenants(limit).
//
// The turn record is a cursor that each store keeps in memory, not a
// row: when each claim wrote every considered tenant's row (the order by
// when each was last served, before migration 20), the claims in flight
// queued on those rows and followed their versions, a third of the
// server's time; the one shared row that replaced them (migration 20)
// still cost every claim a write and a row lock (docs/benchmarks.md,
// "The turn in each store's memory"). A claim moves the cursor as it
// chooses (choose, under the copy's lock), before its statement runs, so
// the claims of one store in flight at the same moment consider the
// tenants after each other's, each taking the heads of its own tenants.
// When the cursor moved only once a claim had taken its jobs, every claim
// in flight considered the same tenants and walked past the heads the
// others had locked: in alternated drains from two runners sharing a
// store, the fair claim's cost against the plain claim fell from a
// median of 14.0% to 4.2% with the move (docs/benchmarks.md, "Claims in
// flight take their turns one after another"). A claim that fails, or finds nothing, has passed its tenants
// all the same: they come round again in the cursor's next pass. Replicas
// sharing a database turn on their own, each passing over every listed
// tenant in turn, so that each tenant is served at least once per pass
// of each replica; a restarted replica begins its pass at the first
// name, and tenants never served still come first, whoever serves them
// (served_at is shared). fair_cursor stays in the schema, unread, for
// binaries of the releases before this one during a rolling upgrade.
//
// A tenant's served_at is written when it is first served and then at
// most every fairRefresh, for the reaper: tenants with nothing runnable
// leave the table once their served_at is a minute old.
//
// The reaper lists again every tenant with runnable jobs that the table
// lacks (fairRelist), and then drops the tenants with nothing runnable
// whose served_at is a minute old (pruneTenants). The prune cannot race
// with a transaction that makes a tenant's job runnable: on PostgreSQL
// each such transaction holds the tenant's listing key shared from
// before it looks for the tenant's row until it ends (migration 22's
// triggers), and the prune takes the key exclusively, without waiting,
// before it looks for the tenant's runnable jobs in a statement of its
// own; SQLite serialises the two. The relisting is for rows lost
// otherwise: removed by hand, or by a release before this one during a
// rolling upgrade, whose prune took no key. Claims no longer look for
// such strays (the oldest job of all, its tenant checked, in every
// claim: nearly a third of the fair claim's reads).

// fairTenants is how many tenants one claim of limit jobs considers: one
// for every eight jobs it takes, and at least three (or limit, when
// smaller), so that a small batch still serves several tenants in turn (a
// batch of 6 over three backlogged tenants takes 2 from each). Each
// considered tenant costs the claim a descent of jobs_runnable_tenant and
// a walk past the entries its tenant's claimed jobs left there (no vacuum
// has removed them yet), so the fewer tenants a claim considers, the
// less it reads: one a job (the first rule) made a claim of 32 over 100
// tenants descend 32 times. In alternating drains (docs/benchmarks.md) one
// for every two jobs took the fair claim's cost against the plain claim
// from a median of 19.7% to 13.3%; one for every four, with the claim's
// stray check gone too, to 7.6%; one for every eight left 100 tenants
// where they were (10.3% against 10.2% in three pairs) and brought 10
// tenants, where a claim of 32 had considered 8 of the 10, from 14.0% to
// 10.5%. A tenant's share grows with it (eight jobs of 32), and each
// backlogged tenant is still served once per pass of the cursor.
func fairTenants(limit int) int { return max((limit+7)/8, min(limit, 3)) }

// fairRefresh is how old a considered tenant's served_at may grow before
// a claim writes it again: rarely enough that claims seldom write a
// tenant's row, often enough that the reaper's minute (fairPruneAge) keeps
// every tenant served within the last half minute.
const fairRefresh = 30 * time.Second

// fairListAge is how long a store claims from its copy of the listing
// (fairList) before it reads job_tenants and the tenants' weights again:
// the copy follows, within it, what other replicas and hands changed
// (a weight set elsewhere, a tenant pruned). What the store itself
// accepts, and every claim's count of the tenants never served, make it
// read the listing sooner.
const fairListAge = time.Second

// fairList is a store's copy of job_tenants, each listed tenant with its
// weight (1 for a tenant not in the tenants table): a claim chooses the
// tenants it considers and their shares from it in Go, by the rule above,
// so that its statement only takes the shares. Worked out in SQL, the
// listing's three ordered reads, the tenants' join, the turns and the
// shares had cost each claim about as much as the rest of the fairness
// (docs/benchmarks.md, "The fair choice in each store's memory").
//
// The copy is read again before the next claim when it is older than
// fairListAge (by the claims' clock, or from their future); when this
// store accepts a job of a tenant the copy lacks (note); when a tenant's
// weight is set through this store (invalidate); and when a claim's
// statement counts a different number of tenants never served than the
// copy held (check): a tenant listed by another replica's acceptance, or
// listed again after the reaper's prune, is new, so the next claim sees
// it. A new tenant's first job thus costs it at most one claim of the
// store that accepted it, and two of any other.
type fairList struct {
	mu      sync.Mutex
	cursor  string       // the turn's: the last tenant of the last choice (empty before any)
	at      time.Time    // when it was read, by the claims' clock; zero: never
	stale   bool         // read it again before the next claim
	gen     uint64       // counts the times it was made stale
	tenants []fairTenant // by name, in byte order
	fresh   int          // how many of them were never served
}

// find is where name is, or would be, in l.tenants.
func (l *fairList) find(name string) (int, bool) {
	return slices.BinarySearchFunc(l.tenants, name, func(t fairTenant, n string) int { return strings.Compare(t.name, n) })
}

// note is told of a tenant whose job this store accepted: the copy is
// stale when it lacks the tenant, whose job listed it.
func (l *fairList) note(tenant string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if _, ok := l.find(tenant); !ok {
		l.stale = true
		l.gen++
	}
}

// invalidate makes the next claim read the listing again.
func (l *fairList) invalidate() {
	l.mu.Lock()
	l.stale = true
	l.gen++
	l.mu.Unlock()
}

// count is the copy's count of tenants never served.
func (l *fairList) count() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.fresh
}

// check compares the count of tenants never served that a claim's
// statement saw with the copy's count when the claim chose (fresh).
func (l *fairList) check(fresh, counted int) {
	if fresh != counted {
		l.invalidate()
	}
}

// fairFreshQuery counts the listed tenants never served: the copy's
// check, in the PostgreSQL claim's statement and before SQLite's claim.
const fairFreshQuery = `SELECT count(*) FROM job_tenants WHERE served_at = 0`

// fairListQuery reads the listing, with each tenant's weight.
const fairListQuery = `SELECT jt.tenant, jt.served_at, COALESCE(tn.weight, 1) FROM job_tenants jt
	LEFT JOIN tenants tn ON tn.name = jt.tenant`

// fairChoice is what a claim of limit jobs takes from whom: the tenants
// it considers in turn order (the rule above: the never served by name,
// then the others by name from just after the cursor, wrapping round,
// fairTenants(limit) in all), each with its share (fairShares); due, the
// considered tenants whose served record the claim writes (never served,
// or longer ago than fairRefresh before now); and fresh, the copy's count
// of tenants never served, for check.
type fairChoice struct {
	tenants []string
	shares  []int32
	due     []string
	fresh   int
}

// choose reads the listing again where it must (fairList), in tx where
// not nil, and makes the choice of a claim at now of limit jobs. It
// moves the cursor to the last considered tenant served before (where
// there is one), so that the next claim, even one in flight beside this
// one, considers the tenants after these.
func (s *Store) choose(ctx context.Context, tx *sql.Tx, now time.Time, limit int) (fairChoice, error) {
	l := &s.fair
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.stale || l.at.IsZero() || now.Before(l.at) || now.Sub(l.at) >= fairListAge {
		// Read without the lock, which acceptances take (note); what they
		// note meanwhile keeps the copy stale.
		gen := l.gen
		l.mu.Unlock()
		ts, err := s.readList(ctx, tx)
		l.mu.Lock()
		if err != nil {
			return fairChoice{}, err
		}
		l.tenants, l.at, l.stale, l.fresh = ts, now, l.gen != gen, 0
		for _, t := range ts {
			if t.served == 0 {
				l.fresh++
			}
		}
	}
	n := fairTenants(limit)
	considered := make([]fairTenant, 0, n)
	if l.fresh > 0 {
		for _, t := range l.tenants {
			if len(considered) == n {
				break
			}
			if t.served == 0 {
				considered = append(considered, t)
			}
		}
	}
	after, _ := slices.BinarySearchFunc(l.tenants, l.cursor, func(t fairTenant, c string) int {
		return cmp.Or(strings.Compare(t.name, c), -1) // the first name above the cursor
	})
	for k := 0; k < len(l.tenants) && len(considered) < n; k++ {
		if t := l.tenants[(after+k)%len(l.tenants)]; t.served != 0 {
			considered = append(considered, t)
		}
	}
	c := fairChoice{fresh: l.fresh}
	shares := fairShares(considered, limit)
	stale := micros(now.Add(-fairRefresh))
	for _, t := range considered {
		if shares[t.name] > 0 {
			c.tenants, c.shares = append(c.tenants, t.name), append(c.shares, int32(shares[t.name]))
		}
		if t.served != 0 {
			l.cursor = t.name
		}
		if t.served < stale {
			c.due = append(c.due, t.name)
		}
	}
	return c, nil
}

// readList reads the listing, by name in byte order (the cursor's
// order, whatever the database's collation).
func (s *Store) readList(ctx context.Context, tx *sql.Tx) ([]fairTenant, error) {
	rows, err := s.query(ctx, tx, s.q.fairList)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var ts []fairTenant
	for rows.Next() {
		var t fairTenant
		if err := rows.Scan(&t.name, &t.served, &t.weight); err != nil {
			return nil, err
		}
		ts = append(ts, t)
	}
	slices.SortFunc(ts, func(a, b fairTenant) int { return strings.Compare(a.name, b.name) })
	return ts, rows.Err()
}

// served records in the copy that a claim at now, which took jobs, wrote
// the served records of c.due.
func (l *fairList) served(c fairChoice, now time.Time) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, name := range c.due {
		if i, ok := l.find(name); ok {
			if l.tenants[i].served == 0 {
				l.fresh--
			}
			l.tenants[i].served = micros(now)
		}
	}
}

const (
	// fairServed records that a tenant was served, when its record is
	// older than fairRefresh (or it was never served).
	fairServed = `UPDATE job_tenants SET served_at = ? WHERE tenant = ? AND served_at < ?`
	// fairRelist puts back every tenant with runnable jobs that the table
	// lacks, found by skipping through jobs_runnable_tenant one tenant at
	// a time (an index probe per tenant, never the backlog); the reaper
	// runs it on every pass.
	fairRelist = `WITH RECURSIVE t(tenant) AS (
			SELECT min(tenant) FROM jobs WHERE state IN ('READY', 'RETRY_SCHEDULED')
			UNION ALL
			SELECT (SELECT min(j.tenant) FROM jobs j WHERE j.state IN ('READY', 'RETRY_SCHEDULED') AND j.tenant > t.tenant)
			FROM t WHERE t.tenant IS NOT NULL)
		INSERT INTO job_tenants (tenant) SELECT tenant FROM t WHERE tenant IS NOT NULL
		ON CONFLICT (tenant) DO NOTHING`
	// fairIdle is the condition that tenant row job_tenants has nothing
	// runnable and was last served before the placeholder's time.
	fairIdle = `job_tenants.served_at < ? AND NOT EXISTS (
		SELECT 1 FROM jobs WHERE jobs.tenant = job_tenants.tenant AND jobs.state IN ('READY', 'RETRY_SCHEDULED'))`
	// fairPrune drops the idle tenants where writers are serialised.
	fairPrune = `DELETE FROM job_tenants WHERE ` + fairIdle
	// fairPruneKeys takes the listing keys of at most fairPruneMax idle
	// tenants that no listing holds (%s: the dialect's TryPruneTenant of
	// tenant), and fairPruneKeyed drops those still idle, seen after
	// their keys.
	fairPruneKeys = `SELECT tenant FROM (
			SELECT tenant FROM job_tenants WHERE ` + fairIdle + ` ORDER BY tenant LIMIT ?) idle
		WHERE %s`
	fairPruneKeyed = `DELETE FROM job_tenants WHERE tenant = ANY(?::text[]) AND ` + fairIdle
)

// fairPruneAge is how long ago an idle tenant must have been served for
// the reaper to drop it: tenants served within it stay, being likely to
// come back.
const fairPruneAge = time.Minute

// fairPruneMax is the most tenants one prune drops where it takes their
// keys: each key is an entry in the database's lock table (PostgreSQL's
// is shared, sized by max_locks_per_transaction) until the reaper's
// transaction ends. The rest wait for the reaper's next passes.
const fairPruneMax = 256

// pruneTenants drops from job_tenants the tenants with nothing runnable
// that were last served over fairPruneAge before now, in tx (the rule
// above). Where listings run beside it, it keeps the keys of the tenants
// it drops until tx ends.
func (s *Store) pruneTenants(ctx context.Context, tx *sql.Tx, now time.Time) error {
	before := micros(now.Add(-fairPruneAge))
	if s.d.TryPruneTenant == nil {
		_, err := s.exec(ctx, tx, rebind(s.d, fairPrune), before)
		return err
	}
	keyed, err := scanTexts(s.query(ctx, tx, rebind(s.d, fmt.Sprintf(fairPruneKeys, s.d.TryPruneTenant("tenant"))), before, fairPruneMax))
	if err != nil || len(keyed) == 0 {
		return err
	}
	// A statement of its own: its snapshot follows the keys, so it sees
	// every job whose listing had found the tenant's row.
	_, err = s.exec(ctx, tx, rebind(s.d, fairPruneKeyed), keyed, before)
	return err
}

// The fair claim's statements for a database that serialises writers,
// with ownership.go's conditions.
var (
	fairHead = `SELECT id FROM jobs WHERE tenant = ? AND ` + runnable("jobs", "?") + ` AND %s
		ORDER BY priority, available_at, id LIMIT ?`
	fairFill = `SELECT id FROM jobs WHERE ` + runnable("jobs", "?") + ` AND ` + claimOrderIndexed("jobs") + ` AND %s
		ORDER BY priority, available_at, id LIMIT ?`
	fairClaimOne = `UPDATE jobs SET state = 'RUNNING', fence = fence + 1, lease_until = ?, state_version = state_version + 1, updated_at = ?
		WHERE id = ? AND ` + runnable("jobs", "?") + `
		RETURNING ` + jobColumns
)

// fairShares is each considered tenant's share of a batch of limit jobs:
// the first limit turns of the weighted round-robin, a tenant's k-th job
// taking turn k/weight, earlier in turn order (considered's order) first
// among equal turns.
func fairShares(considered []fairTenant, limit int) map[string]int {
	type turn struct {
		t   float64
		pos int
	}
	var sum float64
	for _, t := range considered {
		sum += max(t.weight, 1)
	}
	var turns []turn
	for i, t := range considered {
		w := max(t.weight, 1)
		for k := range min(limit, int(math.Ceil(float64(limit)*w/sum))+1) {
			turns = append(turns, turn{float64(k) / w, i})
		}
	}
	slices.SortFunc(turns, func(a, b turn) int {
		return cmp.Or(cmp.Compare(a.t, b.t), cmp.Compare(a.pos, b.pos))
	})
	shares := map[string]int{}
	for _, t := range turns[:min(len(turns), limit)] {
		shares[considered[t.pos].name]++
	}
	return shares
}

type fairTenant struct {
	name   string
	served int64 // 0: never
	weight float64
}

// claimFairTx is the fair claim as several statements in tx, for a
// database that serialises writers (SQLite): the same choice as the
// PostgreSQL statement in claimCTE. m is the dialect's models argument.
//
// The claim returns its choice, for the caller to note the served
// records once the claim has committed.
func (s *Store) claimFairTx(ctx context.Context, tx *sql.Tx, now time.Time, lease time.Duration, limit int, m any) ([]store.Job, fairChoice, error) {
	head, fillQ := fmt.Sprintf(fairHead, s.d.ModelIn("jobs.model")), fmt.Sprintf(fairFill, s.d.ModelIn("jobs.model"))
	// Writers are serialised: the count is exact, and a tenant listed
	// since the copy was read is considered by this very claim.
	var fresh int
	if err := s.queryRow(ctx, tx, s.q.fairFresh).Scan(&fresh); err != nil {
		return nil, fairChoice{}, err
	}
	s.fair.check(s.fair.count(), fresh)
	c, err := s.choose(ctx, tx, now, limit)
	if err != nil {
		return nil, fairChoice{}, err
	}
	var ids []string
	for i, t := range c.tenants {
		got, err := scanTexts(s.query(ctx, tx, rebind(s.d, head), t, micros(now), micros(now), m, m, c.shares[i]))
		if err != nil {
			return nil, fairChoice{}, err
		}
		ids = append(ids, got...)
	}
	// What the shares could not fill, oldest-first.
	if len(ids) < limit {
		oldest, err := scanTexts(s.query(ctx, tx, rebind(s.d, fillQ), micros(now), micros(now), m, m, limit))
		if err != nil {
			return nil, fairChoice{}, err
		}
		for _, id := range oldest {
			if len(ids) < limit && !slices.Contains(ids, id) {
				ids = append(ids, id)
			}
		}
	}
	if len(ids) == 0 {
		return nil, fairChoice{}, nil // nothing runnable anywhere: write nothing
	}
	var out []store.Job
	for _, id := range ids {
		j, err := scanJob(s.queryRow(ctx, tx, rebind(s.d, fairClaimOne), micros(now.Add(lease)), micros(now), id, micros(now), micros(now)))
		if errors.Is(err, sql.ErrNoRows) {
			continue // another claimer's; SQLite serialises them, so only in theory
		}
		if err != nil {
			return nil, fairChoice{}, err
		}
		out = append(out, j)
	}
	// The turn passes the considered tenants, served or found empty
	// (their work is not available yet), so that the next claim looks
	// further; the new among them join the turn order.
	for _, t := range c.due {
		if _, err := s.exec(ctx, tx, rebind(s.d, fairServed), micros(now), t, micros(now.Add(-fairRefresh))); err != nil {
			return nil, fairChoice{}, err
		}
	}
	return out, c, nil
}
