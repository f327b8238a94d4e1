package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"net/url"

	"github.com/kvgate/kvgate/store"
	"github.com/kvgate/kvgate/store/postgres"
	"github.com/kvgate/kvgate/store/sqlite"
	"github.com/kvgate/kvgate/store/sqlstore"
)

// openStore opens the store at url (SQLite under dataDir by default) and,
// unless migrate is false, applies the embedded migrations it lacks.
func openStore(ctx context.Context, url, dataDir string, migrate bool) (*sqlstore.Store, store.Location, []int, error) {
	loc, err := store.ParseLocation(url, dataDir)
	if err != nil {
		return nil, loc, nil, err
	}
	var (
		s        *sqlstore.Store
		migrator func(context.Context, *sqlstore.Store) ([]int, error)
	)
	switch loc.Kind {
	case "postgres":
		s, err = postgres.Open(ctx, loc.URL)
		migrator = postgres.Migrate
	default:
		s, err = sqlite.Open(ctx, loc.URL)
		migrator = sqlite.Migrate
	}
	if err != nil {
		return nil, loc, nil, err
	}
	var applied []int
	if migrate {
		if applied, err = migrator(ctx, s); err != nil {
			s.Close()
			return nil, loc, nil, err
		}
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
	s, loc, applied, err := sf.openStore(ctx)
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

// redact hides a password in a store URL for printing.
func redact(loc store.Location) string {
	if loc.Kind != "postgres" {
		return loc.URL
	}
	u, err := url.Parse(loc.URL)
	if err != nil {
		return "postgres://..."
	}
	return u.Redacted()
}
