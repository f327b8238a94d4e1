package sqlite_test

import (
	"context"
	"database/sql"
	"errors"
	"path/filepath"
	"testing"

	"github.com/kvgate/kvgate/store"
	"github.com/kvgate/kvgate/store/sqlite"
	"github.com/kvgate/kvgate/store/storetest"
)

func TestConformance(t *testing.T) {
	storetest.Exercise(t, func(t *testing.T) store.Store {
		s, err := sqlite.Open(context.Background(), filepath.Join(t.TempDir(), "kvgate.db"))
		if err != nil {
			t.Fatal(err)
		}
		if _, err := sqlite.Migrate(context.Background(), s); err != nil {
			t.Fatal(err)
		}
		return s
	})
}

func TestMigrateIsIdempotent(t *testing.T) {
	ctx := context.Background()
	s, err := sqlite.Open(ctx, filepath.Join(t.TempDir(), "kvgate.db"))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	first, err := sqlite.Migrate(ctx, s)
	if err != nil || len(first) == 0 {
		t.Fatalf("first migration applied %v, %v", first, err)
	}
	again, err := sqlite.Migrate(ctx, s)
	if err != nil || len(again) != 0 {
		t.Errorf("second migration applied %v, %v; want nothing", again, err)
	}
}

func TestPending(t *testing.T) {
	s, err := sqlite.Open(context.Background(), filepath.Join(t.TempDir(), "kvgate.db"))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	storetest.Pending(t, s, sqlite.Migrate, sqlite.Pending)
}

// TestLockedIsUnavailable: a write that finds the database locked past
// its busy timeout (another process holding the write lock) is the store
// out of reach for now (a 503 with Retry-After to a client, a wait that
// spends no attempt to a job), not a failure of its own.
func TestLockedIsUnavailable(t *testing.T) {
	path := filepath.Join(t.TempDir(), "kvgate.db")
	s, err := sqlite.Open(context.Background(), path)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	holder, err := sql.Open("sqlite", "file:"+path)
	if err != nil {
		t.Fatal(err)
	}
	defer holder.Close()
	hold, err := holder.Conn(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	defer hold.Close()
	if _, err := hold.ExecContext(t.Context(), "BEGIN IMMEDIATE"); err != nil {
		t.Fatal(err)
	}
	defer hold.ExecContext(context.Background(), "ROLLBACK") //nolint:errcheck
	writer, err := sql.Open("sqlite", "file:"+path+"?_pragma=busy_timeout(0)")
	if err != nil {
		t.Fatal(err)
	}
	defer writer.Close()
	_, err = writer.ExecContext(t.Context(), "CREATE TABLE locked_out (x INTEGER)")
	if err == nil {
		t.Fatal("a write beside a held write lock went through")
	}
	if !sqlite.Dialect.Unavailable(err) {
		t.Errorf("%v: not the store out of reach", err)
	}
	if sqlite.Dialect.Unavailable(errors.New("UNIQUE constraint failed")) {
		t.Error("any error is the store out of reach")
	}
}
