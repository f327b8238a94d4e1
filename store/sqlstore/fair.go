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
// runnable) and splits its batch among them in weighted round-robin: a
// tenant's k-th job takes turn k/weight (its weight from the tenants
// table, 1 for a tenant not there), least recently served first among
// equal turns, and the first limit turns are the shares. Each tenant's
// share is then taken from the head of its queue through the index
// jobs_runnable_tenant; the considered tenants then go to the back. One
// tenant's backlog of any size thus costs another tenant's first job at
// most one claim, and saturated tenants are served in turn. What the
// shares could not fill (a tenant had fewer runnable jobs than its share,
// or none available yet) is filled oldest-first from every tenant, so a
// batch is short only when the queue is. A claim reads the small
// job_tenants table and only the jobs it takes: its cost does not grow
// with the backlog, nor with the number of tenants beyond
// fairTenants(limit).
//
// The oldest runnable job of all also comes first when its tenant is
// missing from job_tenants. The reaper drops tenants with nothing
// runnable left, which can race with an acceptance (the row is dropped as
// the tenant's new job commits); the reaper's next pass lists every
// tenant with runnable work again (fairRelist), and a claim that meets
// such a tenant's job as the oldest puts it back at once: a lost row
// costs that tenant at most one reaper period, never its jobs.

// fairTenants is how many tenants one claim of limit jobs considers: as
// many as it takes jobs, so that with tenants interleaved in the queue a
// batch takes about the queue's oldest jobs, on as few pages as an
// oldest-first claim would (8 at most was measured slower: its shares
// came from rows further apart).
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
	fairFill = `SELECT id FROM jobs WHERE ` + runnable("jobs", "?") + ` AND %s
		ORDER BY priority, available_at, id LIMIT ?`
	fairClaimOne = `UPDATE jobs SET state = 'RUNNING', fence = fence + 1, lease_until = ?, state_version = state_version + 1, updated_at = ?
		WHERE id = ? AND ` + runnable("jobs", "?") + `
		RETURNING ` + jobColumns
)

// fairShares is each considered tenant's share of a batch of limit jobs
// (all of it when stray is false; one less, for the stray job, when
// true): the first limit turns of the weighted round-robin, a tenant's
// k-th job taking turn k/weight, least recently served first among equal
// turns. claimCTE's turns and shares are the same rule in SQL.
func fairShares(considered []fairTenant, limit int) map[string]int {
	type turn struct {
		t    float64
		at   int64
		name string
	}
	var sum float64
	for _, t := range considered {
		sum += max(t.weight, 1)
	}
	var turns []turn
	for _, t := range considered {
		w := max(t.weight, 1)
		for k := range min(limit, int(math.Ceil(float64(limit)*w/sum))+1) {
			turns = append(turns, turn{float64(k) / w, t.served, t.name})
		}
	}
	slices.SortFunc(turns, func(a, b turn) int {
		return cmp.Or(cmp.Compare(a.t, b.t), cmp.Compare(a.at, b.at), cmp.Compare(a.name, b.name))
	})
	shares := map[string]int{}
	for _, t := range turns[:min(len(turns), limit)] {
		shares[t.name]++
	}
	return shares
}

type fairTenant struct {
	name   string
	served int64
	weight float64
}

// claimFairTx is the fair claim as several statements in tx, for a
// database that serialises writers (SQLite): the same choice as the
// PostgreSQL statement in claimCTE. m is the dialect's models argument.
func (s *Store) claimFairTx(ctx context.Context, tx *sql.Tx, now time.Time, lease time.Duration, limit int, m any) ([]store.Job, error) {
	head, oldestQ := fmt.Sprintf(fairHead, s.d.ModelIn("jobs.model")), fmt.Sprintf(fairOldest, s.d.ModelIn("jobs.model"))
	fillQ := fmt.Sprintf(fairFill, s.d.ModelIn("jobs.model"))
	var oldest struct{ id, tenant string }
	switch err := s.queryRow(ctx, tx, rebind(s.d, oldestQ), micros(now), micros(now), m, m).Scan(&oldest.id, &oldest.tenant); {
	case errors.Is(err, sql.ErrNoRows):
		return nil, nil // nothing runnable anywhere: write nothing
	case err != nil:
		return nil, err
	}
	rows, err := s.query(ctx, tx, rebind(s.d, fairConsidered), fairTenants(limit))
	if err != nil {
		return nil, err
	}
	var considered []fairTenant
	for rows.Next() {
		var t fairTenant
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
	var ids []string
	var listed int
	if err := s.queryRow(ctx, tx, rebind(s.d, fairListed), oldest.tenant).Scan(&listed); err != nil {
		return nil, err
	}
	if listed == 0 {
		ids = append(ids, oldest.id) // a lost row: first, and its tenant is put back
	}
	shares := fairShares(considered, limit-len(ids))
	for _, t := range considered {
		if shares[t.name] == 0 {
			continue
		}
		rows, err := s.query(ctx, tx, rebind(s.d, head), t.name, micros(now), micros(now), m, m, shares[t.name])
		if err != nil {
			return nil, err
		}
		for rows.Next() {
			var id string
			if err := rows.Scan(&id); err != nil {
				rows.Close()
				return nil, err
			}
			ids = append(ids, id)
		}
		rows.Close()
		if err := rows.Err(); err != nil {
			return nil, err
		}
	}
	// What the shares could not fill, oldest-first.
	if len(ids) < limit {
		rows, err := s.query(ctx, tx, rebind(s.d, fillQ), micros(now), micros(now), m, m, limit)
		if err != nil {
			return nil, err
		}
		for rows.Next() && len(ids) < limit {
			var id string
			if err := rows.Scan(&id); err != nil {
				rows.Close()
				return nil, err
			}
			if !slices.Contains(ids, id) {
				ids = append(ids, id)
			}
		}
		rows.Close()
		if err := rows.Err(); err != nil {
			return nil, err
		}
	}
	var out []store.Job
	tenants := map[string]bool{}
	for _, id := range ids {
		j, err := scanJob(s.queryRow(ctx, tx, rebind(s.d, fairClaimOne), micros(now.Add(lease)), micros(now), id, micros(now), micros(now)))
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
