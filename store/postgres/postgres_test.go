package postgres_test

import (
	"context"
	"fmt"
	"io/fs"
	"math/rand/v2"
	"net/url"
	"os"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/kvgate/kvgate/store"
	"github.com/kvgate/kvgate/store/postgres"
	"github.com/kvgate/kvgate/store/storetest"
)

// adminURL is the server the tests create their databases on:
// KVGATE_TEST_POSTGRES_URL, or the local server.
func adminURL() string {
	if u := os.Getenv("KVGATE_TEST_POSTGRES_URL"); u != "" {
		return u
	}
	return "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"
}

// freshDatabase creates an empty database for one test and drops it after.
// Without a server the test is skipped, but in CI (CI=true) it fails:
// CI must exercise PostgreSQL.
func freshDatabase(t testing.TB) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	admin, err := pgx.Connect(ctx, adminURL())
	if err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("PostgreSQL is required in CI: %v", err)
		}
		t.Skipf("no PostgreSQL at %s (set KVGATE_TEST_POSTGRES_URL): %v", adminURL(), err)
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
	u, err := url.Parse(adminURL())
	if err != nil {
		t.Fatal(err)
	}
	u.Path = "/" + name
	return u.String()
}

func open(t *testing.T) store.Store {
	t.Helper()
	s, err := postgres.Open(context.Background(), freshDatabase(t))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := postgres.Migrate(context.Background(), s); err != nil {
		t.Fatal(err)
	}
	return s
}

func TestConformance(t *testing.T) {
	storetest.Exercise(t, open)
}

func TestMigrateConcurrently(t *testing.T) {
	url := freshDatabase(t)
	ctx := context.Background()
	errs := make(chan error, 4)
	applied := make(chan int, 4)
	for range 4 {
		go func() {
			s, err := postgres.Open(ctx, url)
			if err != nil {
				errs <- err
				return
			}
			defer s.Close()
			vs, err := postgres.Migrate(ctx, s)
			applied <- len(vs)
			errs <- err
		}()
	}
	total := 0
	for range 4 {
		if err := <-errs; err != nil {
			t.Error(err)
		}
	}
	close(applied)
	for n := range applied {
		total += n
	}
	want, _ := fs.Glob(postgres.Migrations, "migrations/*.sql")
	if total != len(want) {
		t.Errorf("four concurrent migrations applied %d migrations in all, want %d: each once", total, len(want))
	}
}

func TestUnavailable(t *testing.T) {
	// A port nothing listens on: Open fails, and says so.
	_, err := postgres.Open(context.Background(), "postgres://postgres@127.0.0.1:1/x?sslmode=disable&connect_timeout=2")
	if err == nil {
		t.Fatal("opened a database on a closed port")
	}
}
