package sqlite_test

import (
	"context"
	"path/filepath"
	"testing"

	"github.com/kvgate/kvgate/store/sqlite"
	"github.com/kvgate/kvgate/store/storetest"
)

// BenchmarkPermits: storetest.BenchPermits on the embedded SQLite.
//
//	go test -run '^$' -bench Permits -benchtime 20000x ./store/sqlite/
func BenchmarkPermits(b *testing.B) {
	s, err := sqlite.Open(context.Background(), filepath.Join(b.TempDir(), "kvgate.db"))
	if err != nil {
		b.Fatal(err)
	}
	defer s.Close()
	if _, err := sqlite.Migrate(context.Background(), s); err != nil {
		b.Fatal(err)
	}
	storetest.BenchPermits(b, s)
}
