package sqlstore

import (
	"context"
	"database/sql"
	"fmt"
	"io/fs"
	"slices"
	"strconv"
	"strings"
	"time"
)

// Migration is one numbered schema change.
type Migration struct {
	Version int
	Name    string
	SQL     string
}

// LoadMigrations reads NNNN_name.sql files from fsys, in version order.
func LoadMigrations(fsys fs.FS) ([]Migration, error) {
	names, err := fs.Glob(fsys, "*.sql")
	if err != nil {
		return nil, err
	}
	var ms []Migration
	for _, n := range names {
		num, rest, ok := strings.Cut(n, "_")
		v, err := strconv.Atoi(num)
		if !ok || err != nil {
			return nil, fmt.Errorf("migration %s: name is not NNNN_name.sql", n)
		}
		b, err := fs.ReadFile(fsys, n)
		if err != nil {
			return nil, err
		}
		ms = append(ms, Migration{Version: v, Name: strings.TrimSuffix(rest, ".sql"), SQL: string(b)})
	}
	slices.SortFunc(ms, func(a, b Migration) int { return a.Version - b.Version })
	for i := 1; i < len(ms); i++ {
		if ms[i].Version == ms[i-1].Version {
			return nil, fmt.Errorf("two migrations numbered %d", ms[i].Version)
		}
	}
	return ms, nil
}

// MigrateFrom applies the NNNN_name.sql migrations under dir in fsys that
// the store's database lacks, and returns the versions it applied.
func (s *Store) MigrateFrom(ctx context.Context, fsys fs.FS, dir string) ([]int, error) {
	ms, err := loadMigrationsIn(fsys, dir)
	if err != nil {
		return nil, err
	}
	return Migrate(ctx, s.db, s.d, ms)
}

// loadMigrationsIn reads the migrations under dir in fsys.
func loadMigrationsIn(fsys fs.FS, dir string) ([]Migration, error) {
	sub, err := fs.Sub(fsys, dir)
	if err != nil {
		return nil, err
	}
	return LoadMigrations(sub)
}

// PendingFrom returns the versions of the NNNN_name.sql migrations under
// dir in fsys that the store's database lacks, in order, applying none:
// every one of them where it has no schema yet.
func (s *Store) PendingFrom(ctx context.Context, fsys fs.FS, dir string) ([]int, error) {
	ms, err := loadMigrationsIn(fsys, dir)
	if err != nil {
		return nil, err
	}
	return Pending(ctx, s.db, s.d, ms)
}

// Pending returns the versions of ms that db lacks, applying none.
func Pending(ctx context.Context, db *sql.DB, d Dialect, ms []Migration) ([]int, error) {
	applied := map[int]bool{}
	var n int
	if err := db.QueryRowContext(ctx, rebind(d, d.HasTable), "schema_migrations").Scan(&n); err != nil {
		return nil, fmt.Errorf("read the schema's version: %w", err)
	}
	if n > 0 {
		rows, err := db.QueryContext(ctx, `SELECT version FROM schema_migrations`)
		if err != nil {
			return nil, fmt.Errorf("read the schema's version: %w", err)
		}
		defer rows.Close()
		for rows.Next() {
			var v int
			if err := rows.Scan(&v); err != nil {
				return nil, err
			}
			applied[v] = true
		}
		if err := rows.Err(); err != nil {
			return nil, fmt.Errorf("read the schema's version: %w", err)
		}
	}
	var pending []int
	for _, m := range ms {
		if !applied[m.Version] {
			pending = append(pending, m.Version)
		}
	}
	return pending, nil
}

// Migrate applies the migrations db lacks, each in its own transaction,
// and returns the versions it applied.
func Migrate(ctx context.Context, db *sql.DB, d Dialect, ms []Migration) ([]int, error) {
	// Under the migration lock too: concurrent CREATE TABLE IF NOT EXISTS
	// can collide in PostgreSQL's catalog when replicas start together.
	if err := inLock(ctx, db, d, func(tx *sql.Tx) error {
		_, err := tx.ExecContext(ctx, `CREATE TABLE IF NOT EXISTS schema_migrations (
			version INTEGER PRIMARY KEY, name TEXT NOT NULL, applied_at BIGINT NOT NULL)`)
		return err
	}); err != nil {
		return nil, fmt.Errorf("migrate: %w", err)
	}
	var applied []int
	for _, m := range ms {
		done, err := migrateOne(ctx, db, d, m)
		if err != nil {
			return applied, fmt.Errorf("migration %04d_%s: %w", m.Version, m.Name, err)
		}
		if done {
			applied = append(applied, m.Version)
		}
	}
	return applied, nil
}

func migrateOne(ctx context.Context, db *sql.DB, d Dialect, m Migration) (bool, error) {
	applied := false
	err := inLock(ctx, db, d, func(tx *sql.Tx) error {
		var n int
		if err := tx.QueryRowContext(ctx, rebind(d, `SELECT COUNT(*) FROM schema_migrations WHERE version = ?`), m.Version).Scan(&n); err != nil {
			return err
		}
		if n > 0 {
			return nil
		}
		if _, err := tx.ExecContext(ctx, m.SQL); err != nil {
			return err
		}
		applied = true
		_, err := tx.ExecContext(ctx, rebind(d, `INSERT INTO schema_migrations (version, name, applied_at) VALUES (?, ?, ?)`),
			m.Version, m.Name, time.Now().UnixMicro())
		return err
	})
	return applied && err == nil, err
}

// inLock runs fn in a transaction that holds the dialect's migration lock.
func inLock(ctx context.Context, db *sql.DB, d Dialect, fn func(*sql.Tx) error) error {
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return err
	}
	defer func() { _ = tx.Rollback() }()
	if d.LockMigrations != "" {
		if _, err := tx.ExecContext(ctx, d.LockMigrations); err != nil {
			return err
		}
	}
	if err := fn(tx); err != nil {
		return err
	}
	return tx.Commit()
}
