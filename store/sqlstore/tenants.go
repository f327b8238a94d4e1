package sqlstore

import (
	"context"
	"database/sql"
	"time"

	"github.com/kvgate/kvgate/store"
)

// Tenants, keys and the usage report: plain statements, run through
// database/sql directly (pgx caches their preparations per connection).
// The limiter itself is in quota.go.

// rb renders a query with ? placeholders in the dialect.
func (s *Store) rb(q string) string { return rebind(s.d, q) }

const tenantColumns = `name, weight, rpm, tpm, max_concurrency, max_pending_jobs, max_pending_tokens, daily_tokens, monthly_tokens,
	daily_spend, monthly_spend, created_at, updated_at`

func scanTenant(r scanner) (store.Tenant, error) {
	var t store.Tenant
	var created, updated int64
	l := &t.Limits
	err := r.Scan(&t.Name, &t.Weight, &l.RPM, &l.TPM, &l.MaxConcurrency, &l.MaxPendingJobs, &l.MaxPendingTokens,
		&l.DailyTokens, &l.MonthlyTokens, &l.DailySpend, &l.MonthlySpend, &created, &updated)
	t.CreatedAt, t.UpdatedAt = fromMicros(created), fromMicros(updated)
	return t, err
}

// CreateTenant implements store.Store.
func (s *Store) CreateTenant(ctx context.Context, t store.Tenant) error {
	if t.Name == "" || len(t.Name) > 128 {
		return store.ErrTenantName
	}
	defer s.fair.invalidate() // its weight
	l := t.Limits
	now := micros(t.CreatedAt)
	res, err := s.db.ExecContext(ctx, s.rb(`INSERT INTO tenants (`+tenantColumns+`) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
		ON CONFLICT (name) DO NOTHING`), t.Name, max(t.Weight, 1), l.RPM, l.TPM, l.MaxConcurrency, l.MaxPendingJobs,
		l.MaxPendingTokens, l.DailyTokens, l.MonthlyTokens, l.DailySpend, l.MonthlySpend, now, now)
	if err != nil {
		return s.err("create tenant", err)
	}
	if n, err := res.RowsAffected(); err != nil {
		return s.err("create tenant", err)
	} else if n == 0 {
		var deleted int64
		if err := s.db.QueryRowContext(ctx, s.rb(`SELECT deleted_at FROM tenants WHERE name = ?`), t.Name).Scan(&deleted); err == nil && deleted > 0 {
			return store.ErrTenantNameRetired
		}
		return store.ErrExists
	}
	return nil
}

// tenantRow reads a tenant, locked with lock (a dialect's clause, or "");
// ErrTenantDeleted for a deleted one.
func (s *Store) tenantRow(ctx context.Context, q querier, name, lock string) (store.Tenant, error) {
	var deleted int64
	row := q.QueryRowContext(ctx, s.rb(`SELECT `+tenantColumns+`, deleted_at FROM tenants WHERE name = ?`+lock), name)
	t, err := scanTenant(scanFunc(func(dest ...any) error { return row.Scan(append(dest, &deleted)...) }))
	switch {
	case err != nil:
		return store.Tenant{}, s.err("get tenant", err)
	case deleted > 0:
		return store.Tenant{}, store.ErrTenantDeleted
	}
	return t, nil
}

// UpdateTenant implements store.Store. The row is read locked where the
// dialect locks rows (SQLite's transactions are immediate: one writer at
// a time), so two changes at once are applied one after the other, each
// to what the other wrote.
func (s *Store) UpdateTenant(ctx context.Context, name string, now time.Time, change func(*store.Tenant) error) (store.Tenant, error) {
	defer s.fair.invalidate() // its weight
	lock := s.forUpdate()
	var t store.Tenant
	var refused error // change's own, returned as it is
	err := s.tx(ctx, "update tenant", func(tx *sql.Tx) error {
		var err error
		if t, err = s.tenantRow(ctx, tx, name, lock); err != nil {
			return err
		}
		if refused = change(&t); refused != nil {
			return refused
		}
		t.Name, t.UpdatedAt = name, now
		l := t.Limits
		_, err = tx.ExecContext(ctx, s.rb(`UPDATE tenants SET weight = ?, rpm = ?, tpm = ?, max_concurrency = ?,
			max_pending_jobs = ?, max_pending_tokens = ?, daily_tokens = ?, monthly_tokens = ?, daily_spend = ?, monthly_spend = ?,
			updated_at = ? WHERE name = ?`),
			max(t.Weight, 1), l.RPM, l.TPM, l.MaxConcurrency, l.MaxPendingJobs, l.MaxPendingTokens, l.DailyTokens, l.MonthlyTokens,
			l.DailySpend, l.MonthlySpend, micros(now), name)
		return err
	})
	switch {
	case refused != nil:
		return store.Tenant{}, refused
	case err != nil:
		return store.Tenant{}, err
	}
	t.Weight = max(t.Weight, 1)
	return t, nil
}

// affected turns an update of no row into ErrNotFound.
func (s *Store) affected(op string, res sql.Result, err error) error {
	if err != nil {
		return s.err(op, err)
	}
	n, err := res.RowsAffected()
	if err != nil {
		return s.err(op, err)
	}
	if n == 0 {
		return store.ErrNotFound
	}
	return nil
}

// DeleteTenant implements store.Store.
func (s *Store) DeleteTenant(ctx context.Context, name string, now time.Time) error {
	defer s.fair.invalidate() // its weight
	return s.tx(ctx, "delete tenant", func(tx *sql.Tx) error {
		res, err := tx.ExecContext(ctx, s.rb(`UPDATE tenants SET deleted_at = ? WHERE name = ? AND deleted_at = 0`), micros(now), name)
		if err := s.affected("delete tenant", res, err); err != nil {
			return err
		}
		// Its work pending, a deleted tenant's jobs would run with no
		// limits (a tenant the store does not know has none): refused.
		// The row is locked already, so a key made meanwhile waits for
		// this transaction (CreateKey). A submission is not held back:
		// one that commits between this count and the commit, or that
		// another replica accepts on a key it still has cached (for
		// quotas.cache_ttl), is accepted after the delete.
		busy := store.TenantBusyError{Tenant: name}
		var tokens int64
		if err := tx.QueryRowContext(ctx, s.rb(pendingCount), name, name).Scan(&busy.Jobs, &tokens); err != nil {
			return err
		}
		if err := tx.QueryRowContext(ctx, s.rb(`SELECT COUNT(*) FROM batches WHERE tenant = ?
			AND status IN ('validating', 'in_progress', 'finalizing', 'cancelling')`), name).Scan(&busy.Batches); err != nil {
			return err
		}
		if busy.Jobs > 0 || busy.Batches > 0 {
			return &busy
		}
		_, err = tx.ExecContext(ctx, s.rb(`UPDATE api_keys SET revoked_at = ? WHERE tenant = ? AND revoked_at = 0`), micros(now), name)
		return err
	})
}

// GetTenant implements store.Store.
func (s *Store) GetTenant(ctx context.Context, name string) (store.Tenant, error) {
	return s.tenantRow(ctx, s.db, name, "")
}

// ListTenants implements store.Store.
func (s *Store) ListTenants(ctx context.Context, after string, limit int) ([]store.Tenant, bool, error) {
	rows, err := s.db.QueryContext(ctx, s.rb(`SELECT `+tenantColumns+` FROM tenants WHERE deleted_at = 0 AND name > ?
		ORDER BY name LIMIT ?`), after, limit+1)
	if err != nil {
		return nil, false, s.err("list tenants", err)
	}
	defer rows.Close()
	var out []store.Tenant
	for rows.Next() {
		t, err := scanTenant(rows)
		if err != nil {
			return nil, false, s.err("list tenants", err)
		}
		out = append(out, t)
	}
	if err := rows.Err(); err != nil {
		return nil, false, s.err("list tenants", err)
	}
	out, more := cutPage(out, limit)
	return out, more, nil
}

// cutPage cuts a page of limit items from out, read with one more to see
// whether more follow, and says whether they do.
func cutPage[T any](out []T, limit int) ([]T, bool) {
	if len(out) > limit {
		return out[:limit], true
	}
	return out, false
}

const keyColumns = `id, hash, prefix, tenant, role, name, rpm, tpm, max_concurrency, created_at, revoked_at`

func scanKey(r scanner) (store.APIKey, error) {
	var k store.APIKey
	var role string
	var created, revoked int64
	err := r.Scan(&k.ID, &k.Hash, &k.Prefix, &k.Tenant, &role, &k.Name, &k.Limits.RPM, &k.Limits.TPM, &k.Limits.MaxConcurrency,
		&created, &revoked)
	k.Role, k.CreatedAt, k.RevokedAt = store.Role(role), fromMicros(created), fromMicros(revoked)
	return k, err
}

// RotateKey implements store.Store: the revocation and the new key in one
// transaction, the revocation first, so that of two rotations of one key
// at once one makes a key and the other finds the key revoked.
func (s *Store) RotateKey(ctx context.Context, oldID string, k store.APIKey, now time.Time) error {
	return s.tx(ctx, "rotate key", func(tx *sql.Tx) error {
		res, err := tx.ExecContext(ctx, s.rb(`UPDATE api_keys SET revoked_at = ? WHERE id = ? AND revoked_at = 0`), micros(now), oldID)
		if err := s.affected("rotate key", res, err); err != nil {
			return err
		}
		return s.insertKey(ctx, tx, k)
	})
}

// CreateKey implements store.Store. The key's tenant is held shared
// (Dialect.LockShared) while the key is written: a DeleteTenant in flight
// is waited for, and then its tenant is gone and no key is made; one that
// begins meanwhile waits for the key and revokes it with the others.
// Without the lock a key could be written for a tenant whose delete had
// already revoked its keys, and live on, valid, with no tenant to limit it.
func (s *Store) CreateKey(ctx context.Context, k store.APIKey) error {
	return s.insertKey(ctx, s.db, k)
}

// execer is a *sql.DB or a *sql.Tx.
type execer interface {
	ExecContext(ctx context.Context, q string, args ...any) (sql.Result, error)
}

// insertKey writes k, its tenant held shared (CreateKey).
func (s *Store) insertKey(ctx context.Context, db execer, k store.APIKey) error {
	res, err := db.ExecContext(ctx, s.rb(`INSERT INTO api_keys (`+keyColumns+`)
		SELECT ?, ?, ?, ?, ?, ?, CAST(? AS BIGINT), CAST(? AS BIGINT), CAST(? AS BIGINT), CAST(? AS BIGINT), 0
		WHERE EXISTS (SELECT 1 FROM tenants WHERE name = ? AND deleted_at = 0 `+s.d.LockShared+`)`),
		k.ID, k.Hash, k.Prefix, k.Tenant, string(k.Role), k.Name, k.Limits.RPM, k.Limits.TPM, k.Limits.MaxConcurrency,
		micros(k.CreatedAt), k.Tenant)
	return s.affected("create key", res, err)
}

// KeyByHash implements store.Store.
func (s *Store) KeyByHash(ctx context.Context, hash string) (store.APIKey, error) {
	k, err := scanKey(s.db.QueryRowContext(ctx, s.rb(`SELECT `+keyColumns+` FROM api_keys WHERE hash = ? AND revoked_at = 0`), hash))
	return k, s.err("look up key", err)
}

// GetKey implements store.Store.
func (s *Store) GetKey(ctx context.Context, id string) (store.APIKey, error) {
	k, err := scanKey(s.db.QueryRowContext(ctx, s.rb(`SELECT `+keyColumns+` FROM api_keys WHERE id = ?`), id))
	return k, s.err("get key", err)
}

// ListKeys implements store.Store. The cursor is a key's id; the page
// goes on from that key's place in (created_at, id) order.
func (s *Store) ListKeys(ctx context.Context, tenant, after string, limit int) ([]store.APIKey, bool, error) {
	// One tenant's keys go by api_keys_tenant, all by api_keys_created: a
	// condition serving both would let a generic plan use neither.
	q, args := `SELECT `+keyColumns+` FROM api_keys k WHERE TRUE`, []any{}
	if tenant != "" {
		q += ` AND tenant = ?`
		args = append(args, tenant)
	}
	if after != "" {
		q += ` AND (k.created_at, k.id) > (SELECT a.created_at, a.id FROM api_keys a WHERE a.id = ?)`
		args = append(args, after)
	}
	rows, err := s.db.QueryContext(ctx, s.rb(q+` ORDER BY created_at, id LIMIT ?`), append(args, limit+1)...)
	if err != nil {
		return nil, false, s.err("list keys", err)
	}
	defer rows.Close()
	var out []store.APIKey
	for rows.Next() {
		k, err := scanKey(rows)
		if err != nil {
			return nil, false, s.err("list keys", err)
		}
		out = append(out, k)
	}
	if err := rows.Err(); err != nil {
		return nil, false, s.err("list keys", err)
	}
	out, more := cutPage(out, limit)
	return out, more, nil
}

// RevokeKey implements store.Store.
func (s *Store) RevokeKey(ctx context.Context, id string, now time.Time) error {
	res, err := s.db.ExecContext(ctx, s.rb(`UPDATE api_keys SET revoked_at = ? WHERE id = ? AND revoked_at = 0`), micros(now), id)
	return s.affected("revoke key", res, err)
}

// ActiveKeys implements store.Store.
func (s *Store) ActiveKeys(ctx context.Context) (int, error) {
	var n int
	err := s.db.QueryRowContext(ctx, `SELECT COUNT(*) FROM api_keys WHERE revoked_at = 0`).Scan(&n)
	return n, s.err("count keys", err)
}

// Usage implements store.Store.
func (s *Store) Usage(ctx context.Context, tenant string, from, to time.Time) ([]store.UsageDay, error) {
	rows, err := s.db.QueryContext(ctx, s.rb(`SELECT tenant, day, requests, attempts, prompt_tokens, completion_tokens,
		reserved_tokens, uncertain, uncertain_tokens, cost, reserved_cost, uncertain_cost FROM usage_days WHERE (tenant = ? OR ? = '') AND day >= ? AND day <= ?
		ORDER BY tenant, day`), tenant, tenant, store.DayOf(from), store.DayOf(to))
	if err != nil {
		return nil, s.err("read usage", err)
	}
	defer rows.Close()
	var out []store.UsageDay
	for rows.Next() {
		var u store.UsageDay
		var day int
		if err := rows.Scan(&u.Tenant, &day, &u.Requests, &u.Attempts, &u.PromptTokens, &u.CompletionTokens,
			&u.ReservedTokens, &u.Uncertain, &u.UncertainTokens, &u.Cost, &u.ReservedCost, &u.UncertainCost); err != nil {
			return nil, s.err("read usage", err)
		}
		u.Day = time.Date(day/10000, time.Month(day/100%100), day%100, 0, 0, 0, 0, time.UTC)
		out = append(out, u)
	}
	return out, s.err("read usage", rows.Err())
}

// querier is a *sql.DB or a *sql.Tx.
type querier interface {
	QueryRowContext(ctx context.Context, q string, args ...any) *sql.Row
}

// scanFunc is a scanner of a function, to scan extra columns.
type scanFunc func(dest ...any) error

func (f scanFunc) Scan(dest ...any) error { return f(dest...) }
