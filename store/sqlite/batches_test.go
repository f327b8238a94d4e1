package sqlite_test

import (
	"context"
	"path/filepath"
	"testing"

	"github.com/kvgate/kvgate/store"
	"github.com/kvgate/kvgate/store/sqlite"
	"github.com/kvgate/kvgate/store/storetest"
)

func TestBatchesConformance(t *testing.T) {
	storetest.ExerciseBatches(t, func(t *testing.T) store.Store {
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
