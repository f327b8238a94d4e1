package storetest

import (
	"context"
	"slices"
	"strconv"
	"testing"

	"github.com/kvgate/kvgate/store/sqlstore"
)

// Pending checks a backend's Pending against its Migrate on a database
// without kvgate's schema: every migration pending at first, none once
// applied, and the one whose record is removed (a store one migration
// behind this binary) alone after that. It applies s's migrations.
func Pending(t *testing.T, s *sqlstore.Store, migrate, pending func(context.Context, *sqlstore.Store) ([]int, error)) {
	t.Helper()
	ctx := context.Background()
	before, err := pending(ctx, s)
	if err != nil || len(before) == 0 {
		t.Fatalf("pending on a database without the schema: %v, %v; want every migration", before, err)
	}
	applied, err := migrate(ctx, s)
	if err != nil || !slices.Equal(applied, before) {
		t.Fatalf("migrate applied %v, %v; pending named %v", applied, err, before)
	}
	if after, err := pending(ctx, s); err != nil || len(after) != 0 {
		t.Errorf("pending after migrate: %v, %v; want none", after, err)
	}
	last := applied[len(applied)-1]
	if _, err := s.DB().ExecContext(ctx, `DELETE FROM schema_migrations WHERE version = `+strconv.Itoa(last)); err != nil {
		t.Fatal(err)
	}
	if behind, err := pending(ctx, s); err != nil || !slices.Equal(behind, []int{last}) {
		t.Errorf("pending with migration %d's record removed: %v, %v", last, behind, err)
	}
}
