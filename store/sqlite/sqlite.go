// Package sqlite is the embedded store.Store: a single SQLite file under
// the data directory, pure Go (modernc.org/sqlite), for one kvgate
// process. Writers are serialised by SQLite, so claims need no row locks.
package sqlite

import (
	"context"
	"database/sql"
	"embed"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"modernc.org/sqlite"
	sqlite3 "modernc.org/sqlite/lib"

	"github.com/kvgate/kvgate/store/sqlstore"
)

//go:embed migrations/*.sql
var migrations embed.FS

// Dialect is SQLite's SQL.
var Dialect = sqlstore.Dialect{
	Name:       "sqlite",
	Positional: func(int) string { return "?" },
	ModelIn: func(col string) string {
		return "(json_array_length(?) = 0 OR " + col + " IN (SELECT value FROM json_each(?)))"
	},
	ModelsArg: func(models []string) any {
		b, _ := json.Marshal(append([]string{}, models...))
		return string(b)
	},
	Unavailable: unavailable,
	HasTable:    "SELECT COUNT(*) FROM sqlite_master WHERE type = 'table' AND name = ?",
}

// unavailable: the file is gone, shut or failing, or another process
// held the write lock past the busy timeout. Not here: what a statement
// may bring on itself (out of memory, a full disk from a large write),
// which the group commit retries call by call (lostTouch).
func unavailable(err error) bool {
	var se *sqlite.Error
	if errors.As(err, &se) {
		switch se.Code() & 0xff { // the primary result code
		case sqlite3.SQLITE_BUSY, sqlite3.SQLITE_READONLY, sqlite3.SQLITE_IOERR, sqlite3.SQLITE_CANTOPEN:
			return true
		}
	}
	return errors.Is(err, os.ErrNotExist) || errors.Is(err, os.ErrPermission)
}

// Open opens (creating it if needed) the database file at path.
func Open(ctx context.Context, path string) (*sqlstore.Store, error) {
	if dir := filepath.Dir(path); dir != "" {
		if err := os.MkdirAll(dir, 0o750); err != nil {
			return nil, fmt.Errorf("sqlite: %w", err)
		}
	}
	// WAL lets readers run beside the writer; immediate transactions take
	// the write lock at BEGIN, so two writers queue instead of deadlocking.
	dsn := "file:" + path + "?_pragma=journal_mode(WAL)&_pragma=busy_timeout(10000)&_pragma=foreign_keys(ON)" +
		"&_pragma=synchronous(NORMAL)&_txlock=immediate"
	conn, err := newCachingConnector(dsn)
	if err != nil {
		return nil, fmt.Errorf("sqlite: %w", err)
	}
	db := sql.OpenDB(conn)
	// Every connection stays open: a new one reads the schema and runs the
	// pragmas again, and its cached statements would be lost with the old.
	db.SetMaxOpenConns(4)
	db.SetMaxIdleConns(4)
	if err := db.PingContext(ctx); err != nil {
		db.Close()
		return nil, fmt.Errorf("sqlite %s: %w", path, err)
	}
	return sqlstore.New(db, Dialect), nil
}

// Migrate applies the embedded migrations the database lacks.
func Migrate(ctx context.Context, s *sqlstore.Store) ([]int, error) {
	return s.MigrateFrom(ctx, migrations, "migrations")
}

// Pending returns the embedded migrations the database lacks, applying none.
func Pending(ctx context.Context, s *sqlstore.Store) ([]int, error) {
	return s.PendingFrom(ctx, migrations, "migrations")
}
