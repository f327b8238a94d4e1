package sqlstore

import (
	"cmp"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"math"
	"slices"
	"time"

	"github.com/kvgate/kvgate/store"
)

// Fair claims across tenants.
//
// A claim serves tenants, not the queue's head: it considers the tenants
// least recently served (job_tenants, kept by triggers as jobs become
// runnable), takes the head of each one's queue through the index
// jobs_runnable_tenant, and fills its batch in weighted round-robin: a
// tenant's k-th job takes turn k/weight (its weight from the tenants
// table, 1 for a tenant not there), least recently served first among
// equal turns. The tenants it considered then go to the back. One
// tenant's backlog of any size thus costs another tenant's first job at
// most one claim, and saturated tenants are served in turn. A claim reads
// the small job_tenants table and at most limit jobs of at most
// fairTenants(limit) tenants: its cost does not grow with the backlog.
//
// A claim also takes the oldest runnable job of all: after the fair
// candidates, to fill a batch that the considered tenants could not (their
// work is not available yet), and first when its tenant is missing from
// job_tenants. The reaper drops tenants with nothing runnable left, which
// can race with an acceptance (the row is dropped as the tenant's new job
// commits); the reaper's next pass lists every tenant with runnable work
// again (fairRelist), and a claim that meets such a tenant's job as the
// oldest puts it back at once: a lost row costs that tenant at most one
// reaper period, never its jobs.

// fairTenants is how many tenants one claim of limit jobs considers.
func fairTenants(limit int) int { return max(limit, 1) }

const (
	fairConsidered = `SELECT jt.tenant, jt.served_at, COALESCE(tn.weight, 1)
		FROM (SELECT tenant, served_at FROM job_tenants ORDER BY served_at, tenant LIMIT ?) jt
		LEFT JOIN tenants tn ON tn.name = jt.tenant`
	fairListed = `SELECT count(*) FROM job_tenants WHERE tenant = ?`
	// fairServed sends a tenant to the back: past every other, even
	// within one microsecond.
	fairServed = `UPDATE job_tenants SET served_at = max(?, (SELECT max(served_at) FROM job_tenants) + 1) WHERE tenant = ?`
	fairHeal   = `INSERT INTO job_tenants (tenant) VALUES (?) ON CONFLICT (tenant) DO NOTHING`
	// fairRelist puts back every tenant with runnable jobs that the table
	// lacks, found by skipping through jobs_runnable_tenant one tenant at
	// a time (an index probe per tenant, never the backlog); the reaper
	// runs it after fairPrune, whose race with an acceptance can drop a
	// tenant whose new job was not yet committed.
	fairRelist = `WITH RECURSIVE t(tenant) AS (
			SELECT min(tenant) FROM jobs WHERE state IN ('READY', 'RETRY_SCHEDULED')
			UNION ALL
			SELECT (SELECT min(j.tenant) FROM jobs j WHERE j.state IN ('READY', 'RETRY_SCHEDULED') AND j.tenant > t.tenant)
			FROM t WHERE t.tenant IS NOT NULL)
		INSERT INTO job_tenants (tenant) SELECT tenant FROM t WHERE tenant IS NOT NULL
		ON CONFLICT (tenant) DO NOTHING`
	// fairPrune drops tenants with nothing runnable; the reaper runs it.
	fairPrune = `DELETE FROM job_tenants WHERE served_at < ? AND NOT EXISTS (
		SELECT 1 FROM jobs WHERE jobs.tenant = job_tenants.tenant AND jobs.state IN ('READY', 'RETRY_SCHEDULED'))`
)

// The fair claim's statements for a database that serialises writers,
// with ownership.go's conditions.
var (
	fairHead = `SELECT id FROM jobs WHERE tenant = ? AND ` + runnable("jobs", "?") + ` AND %s
		ORDER BY priority, available_at, id LIMIT ?`
	fairOldest = `SELECT id, tenant FROM jobs WHERE ` + runnable("jobs", "?") + ` AND %s
		ORDER BY priority, available_at, id LIMIT 1`
	fairClaimOne = `UPDATE jobs SET state = 'RUNNING', fence = fence + 1, lease_until = ?, state_version = state_version + 1, updated_at = ?
		WHERE id = ? AND ` + runnable("jobs", "?") + `
		RETURNING ` + jobColumns
)

// claimFairTx is the fair claim as several statements in tx, for a
// database that serialises writers (SQLite): the same choice as the
// PostgreSQL statement in claimCTE. m is the dialect's models argument.
func (s *Store) claimFairTx(ctx context.Context, tx *sql.Tx, now time.Time, lease time.Duration, limit int, m any) ([]store.Job, error) {
	head, oldestQ := fmt.Sprintf(fairHead, s.d.ModelIn("jobs.model")), fmt.Sprintf(fairOldest, s.d.ModelIn("jobs.model"))
	type cand struct {
		id, tenant string
		turn       float64 // (rank-1)/weight: weighted round-robin
		served     int64
	}
	rows, err := s.query(ctx, tx, rebind(s.d, fairConsidered), fairTenants(limit))
	if err != nil {
		return nil, err
	}
	type tenant struct {
		name   string
		served int64
		weight float64
	}
	var considered []tenant
	for rows.Next() {
		var t tenant
		if err := rows.Scan(&t.name, &t.served, &t.weight); err != nil {
			rows.Close()
			return nil, err
		}
		considered = append(considered, t)
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return nil, err
	}
	var cands []cand
	for _, t := range considered {
		rows, err := s.query(ctx, tx, rebind(s.d, head), t.name, micros(now), micros(now), m, m, limit)
		if err != nil {
			return nil, err
		}
		for rank := 0; rows.Next(); rank++ {
			c := cand{tenant: t.name, turn: float64(rank) / max(t.weight, 1), served: t.served}
			if err := rows.Scan(&c.id); err != nil {
				rows.Close()
				return nil, err
			}
			cands = append(cands, c)
		}
		rows.Close()
		if err := rows.Err(); err != nil {
			return nil, err
		}
	}
	var oldest cand
	switch err := s.queryRow(ctx, tx, rebind(s.d, oldestQ), micros(now), micros(now), m, m).Scan(&oldest.id, &oldest.tenant); {
	case errors.Is(err, sql.ErrNoRows):
		return nil, nil // nothing runnable anywhere: write nothing
	case err != nil:
		return nil, err
	}
	var listed int
	if err := s.queryRow(ctx, tx, rebind(s.d, fairListed), oldest.tenant).Scan(&listed); err != nil {
		return nil, err
	}
	oldest.turn, oldest.served = math.MaxInt32, -1 // after every fair candidate: it only fills
	if listed == 0 {
		oldest.turn = 0 // a lost row: first, and its tenant is put back
	}
	if !slices.ContainsFunc(cands, func(c cand) bool { return c.id == oldest.id }) {
		cands = append(cands, oldest)
	}
	slices.SortFunc(cands, func(a, b cand) int {
		return cmp.Or(cmp.Compare(a.turn, b.turn), cmp.Compare(a.served, b.served), cmp.Compare(a.tenant, b.tenant))
	})
	var out []store.Job
	tenants := map[string]bool{}
	for _, c := range cands[:min(len(cands), limit)] {
		j, err := scanJob(s.queryRow(ctx, tx, rebind(s.d, fairClaimOne), micros(now.Add(lease)), micros(now), c.id, micros(now), micros(now)))
		if errors.Is(err, sql.ErrNoRows) {
			continue // another claimer's; SQLite serialises them, so only in theory
		}
		if err != nil {
			return nil, err
		}
		out = append(out, j)
		tenants[j.Tenant] = true
	}
	// The considered tenants go to the back, served or found empty (their
	// work is not available yet), so that the next claim looks further.
	for _, t := range considered {
		if _, err := s.exec(ctx, tx, rebind(s.d, fairServed), micros(now), t.name); err != nil {
			return nil, err
		}
	}
	for t := range tenants {
		if _, err := s.exec(ctx, tx, rebind(s.d, fairHeal), t); err != nil {
			return nil, err
		}
	}
	return out, nil
}
