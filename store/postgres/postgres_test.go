package postgres_test

import (
	"context"
	"io/fs"
	"testing"

	"github.com/kvgate/kvgate/store"
	"github.com/kvgate/kvgate/store/postgres"
	"github.com/kvgate/kvgate/store/postgres/pgtest"
	"github.com/kvgate/kvgate/store/storetest"
)

func freshDatabase(t testing.TB) string { return pgtest.FreshDatabase(t) }

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
