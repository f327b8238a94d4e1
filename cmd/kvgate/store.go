package main

import (
	"context"
	"flag"
	"fmt"
	"io"

	"github.com/kvgate/kvgate/store"
	"github.com/kvgate/kvgate/store/postgres"
	"github.com/kvgate/kvgate/store/sqlite"
	"github.com/kvgate/kvgate/store/sqlstore"
)

// openStore opens the store at url (SQLite under dataDir by default).
// With migrate it applies the embedded migrations the store lacks;
// without, it refuses a store that lacks any: only kvgate migrate and
// serve change the schema, and no command runs on one older than its own.
func openStore(ctx context.Context, url, dataDir string, migrate bool) (*sqlstore.Store, store.Location, []int, error) {
	loc, err := store.ParseLocation(url, dataDir)
	if err != nil {
		return nil, loc, nil, err
	}
	var (
		s                 *sqlstore.Store
		migrator, pending func(context.Context, *sqlstore.Store) ([]int, error)
	)
	switch loc.Kind {
	case "postgres":
		s, err = postgres.Open(ctx, loc.URL)
		migrator, pending = postgres.Migrate, postgres.Pending
	default:
		s, err = sqlite.Open(ctx, loc.URL)
		migrator, pending = sqlite.Migrate, sqlite.Pending
	}
	if err != nil {
		return nil, loc, nil, err
	}
	if !migrate {
		lacks, err := pending(ctx, s)
		if err == nil && len(lacks) > 0 {
			err = fmt.Errorf("the %s store %s lacks this kvgate's migrations %v: run kvgate migrate (serve applies them on start unless no_migrate is set)", loc.Kind, redact(loc), lacks)
		}
		if err != nil {
			s.Close()
			return nil, loc, nil, err
		}
		return s, loc, nil, nil
	}
	applied, err := migrator(ctx, s)
	if err != nil {
		s.Close()
		return nil, loc, nil, err
	}
	return s, loc, applied, nil
}

// runMigrate applies the store's migrations and says which it applied.
func runMigrate(ctx context.Context, args []string, getenv func(string) string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("kvgate migrate", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var sf storeFlags
	sf.register(fs, getenv)
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	s, loc, applied, err := sf.openStore(ctx, true)
	if err != nil {
		return err
	}
	defer s.Close()
	if len(applied) == 0 {
		fmt.Fprintf(stdout, "%s store %s is up to date\n", loc.Kind, redact(loc))
		return nil
	}
	fmt.Fprintf(stdout, "%s store %s: applied migrations %v\n", loc.Kind, redact(loc), applied)
	return nil
}

func envOr(getenv func(string) string, key, def string) string {
	if v := getenv(key); v != "" {
		return v
	}
	return def
}

// redact hides a password in a store URL for printing (store.Redact).
func redact(loc store.Location) string {
	if loc.Kind != "postgres" {
		return loc.URL
	}
	return store.Redact(loc.URL)
}
