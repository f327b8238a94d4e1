package sqlite_test

import (
	"context"
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
