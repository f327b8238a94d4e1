// Package postgres is the PostgreSQL store.Store, through pgx: the
// production backend, safe for any number of kvgate replicas (claims use
// FOR UPDATE SKIP LOCKED; every write of a worker is fenced).
package postgres

import (
	"context"
	"database/sql/driver"
	"embed"
	"errors"
	"fmt"
	"io"
	"net"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/kvgate/kvgate/store/sqlstore"
)

// Migrations are the schema's migrations, embedded in the binary.
//
//go:embed migrations/*.sql
var Migrations embed.FS

// Dialect is PostgreSQL's SQL.
var Dialect = sqlstore.Dialect{
	Name:           "postgres",
	Positional:     func(n int) string { return fmt.Sprintf("$%d", n) },
	LockRunnable:   "FOR UPDATE SKIP LOCKED",
	Unavailable:    unavailable,
	LockMigrations: "SELECT pg_advisory_xact_lock(7403153941)", // any fixed key: kvgate's migrations
	LockFeed:       "SELECT pg_advisory_xact_lock(7403153942)", // and the feed's
	WritableCTE:    true,
	LockShared:     "FOR SHARE",
	// Migration 22's key, which the jobs' triggers hold shared while
	// they list a tenant.
	TryPruneTenant: func(t string) string { return "kvgate_try_prune_tenant_key(" + t + ")" },
	// array_position, not col = ANY(list): the claim's prepared generic
	// plan is made without the list, and where the table has no
	// statistics yet (no ANALYZE has run) PostgreSQL takes = ANY for a
	// rare match and plans the oldest runnable jobs as a bitmap scan of
	// every runnable job and a sort (2-15 ms for 4,000 runnable) instead
	// of the first entries of jobs_runnable (0.1-0.3 ms). The function's
	// condition it does not try to estimate.
	ModelIn: func(col string) string {
		return "(cardinality(?::text[]) = 0 OR array_position(?::text[], " + col + ") IS NOT NULL)"
	},
	ModelsArg: func(models []string) any { return append([]string{}, models...) },
	HasTable:  "SELECT CASE WHEN to_regclass(?) IS NULL THEN 0 ELSE 1 END",
}

func unavailable(err error) bool {
	var connErr *pgconn.ConnectError
	var netErr net.Error
	var pgErr *pgconn.PgError
	switch {
	case errors.As(err, &connErr), errors.As(err, &netErr):
		return true
	case errors.Is(err, io.ErrUnexpectedEOF), errors.Is(err, io.EOF), errors.Is(err, driver.ErrBadConn):
		// The server went away mid-conversation.
		return true
	case errors.As(err, &pgErr):
		// A connection exception; the server shutting down or not yet up;
		// too many connections; read only (a standby, as during a
		// failover). Not here: what a statement may bring on itself (out
		// of memory, a deadlock, a serialization failure), which the
		// group commit retries call by call (lostTouch).
		return pgErr.Code[:2] == "08" || pgErr.Code == "57P01" || pgErr.Code == "57P02" || pgErr.Code == "57P03" ||
			pgErr.Code == "53300" || pgErr.Code == "25006"
	}
	return false
}

// Open connects to url (postgres://...) and checks the connection.
func Open(ctx context.Context, url string) (*sqlstore.Store, error) {
	cfg, err := pgconnConfig(url)
	if err != nil {
		return nil, err
	}
	db := stdlib.OpenDB(*cfg)
	db.SetMaxOpenConns(32)
	db.SetMaxIdleConns(32)
	db.SetConnMaxIdleTime(5 * time.Minute)
	pctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := db.PingContext(pctx); err != nil {
		db.Close()
		return nil, fmt.Errorf("connect to postgres: %w", err)
	}
	return sqlstore.New(db, Dialect), nil
}

// Migrate applies the embedded migrations the database lacks.
func Migrate(ctx context.Context, s *sqlstore.Store) ([]int, error) {
	return s.MigrateFrom(ctx, Migrations, "migrations")
}

// Pending returns the embedded migrations the database lacks, applying none.
func Pending(ctx context.Context, s *sqlstore.Store) ([]int, error) {
	return s.PendingFrom(ctx, Migrations, "migrations")
}
