// Package pgtest gives tests of any package a fresh PostgreSQL database
// holding kvgate's migrated schema. It is for tests only.
package pgtest

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net/url"
	"os"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/kvgate/kvgate/store/postgres"
	"github.com/kvgate/kvgate/store/sqlstore"
)

// AdminURL is the server the tests create their databases on:
// KVGATE_TEST_POSTGRES_URL, or the local server.
func AdminURL() string {
	if u := os.Getenv("KVGATE_TEST_POSTGRES_URL"); u != "" {
		return u
	}
	return "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"
}

// FreshDatabase creates an empty database for one test, drops it when the
// test ends, and returns its URL. Without a server the test is skipped,
// but in CI (CI=true) it fails: CI must exercise PostgreSQL.
func FreshDatabase(t testing.TB) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	admin, err := pgx.Connect(ctx, AdminURL())
	if err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("PostgreSQL is required in CI: %v", err)
		}
		t.Skipf("no PostgreSQL at %s (set KVGATE_TEST_POSTGRES_URL): %v", AdminURL(), err)
	}
	name := fmt.Sprintf("kvgate_test_%d_%x", time.Now().Unix(), rand.Uint32())
	if _, err := admin.Exec(ctx, "CREATE DATABASE "+name); err != nil {
		admin.Close(ctx)
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if _, err := admin.Exec(ctx, "DROP DATABASE IF EXISTS "+name+" WITH (FORCE)"); err != nil {
			t.Errorf("drop %s: %v", name, err)
		}
		admin.Close(ctx)
	})
	u, err := url.Parse(AdminURL())
	if err != nil {
		t.Fatal(err)
	}
	u.Path = "/" + name
	return u.String()
}

// Open returns a migrated store on a fresh database, closed when the test
// ends.
func Open(t testing.TB) *sqlstore.Store {
	t.Helper()
	return OpenURL(t, FreshDatabase(t))
}

// OpenURL returns a migrated store at url, closed when the test ends.
func OpenURL(t testing.TB, url string) *sqlstore.Store {
	t.Helper()
	s, err := postgres.Open(context.Background(), url)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := postgres.Migrate(context.Background(), s); err != nil {
		s.Close()
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}
