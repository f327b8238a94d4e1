package postgres

import (
	"fmt"

	"github.com/jackc/pgx/v5"
)

func pgconnConfig(url string) (*pgx.ConnConfig, error) {
	cfg, err := pgx.ParseConfig(url)
	if err != nil {
		return nil, fmt.Errorf("postgres url: %w", err)
	}
	// Every statement the store runs is prepared, and each one's best plan
	// is the same whatever its parameters: an index that matches its
	// WHERE and ORDER BY. PostgreSQL's default nonetheless re-plans a
	// statement on every execution while its generic plan's estimate
	// looks worse than a custom one's, which for the claim (its LIMIT is
	// a parameter) is forever: ~0.2 ms of planning a claim, more than
	// running it. A session setting, only for the store's connections; a
	// plan_cache_mode in the URL wins.
	if _, ok := cfg.RuntimeParams["plan_cache_mode"]; !ok {
		cfg.RuntimeParams["plan_cache_mode"] = "force_generic_plan"
	}
	return cfg, nil
}
