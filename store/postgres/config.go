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
	// No JIT compilation: the store's statements are short (a claim or a
	// batch of ends touches tens of rows by index), but a generic plan's
	// estimates know no parameter, and the claim's (its tenants' turns,
	// a join of every listed tenant with a series) came out above
	// jit_above_cost: each execution compiled its expressions with LLVM
	// first, which took two thirds of the server's CPU in a drain of
	// zero-delay jobs (perf: 69% of the backends' samples in libLLVM).
	// A jit in the URL wins.
	if _, ok := cfg.RuntimeParams["jit"]; !ok {
		cfg.RuntimeParams["jit"] = "off"
	}
	// No sequential scan where an index serves: a generic plan is made
	// once a connection, from the table's size when the statement first
	// runs, and kept until an analyze of the table. On a new database the
	// jobs table is a page or two then, and a connection's claim found
	// its picked jobs by a scan of the whole table, and kept doing so
	// while the table grew: in the acceptance test (docs/benchmarks.md) a
	// claim of 14 jobs filtered 4,000 rows, 3.0 ms a claim against 1.3 ms
	// with the index.
	// Every statement of the store's is an index lookup or walk (the
	// premise of the generic plan, above); one that no index serves
	// still scans. An enable_seqscan in the URL wins.
	if _, ok := cfg.RuntimeParams["enable_seqscan"]; !ok {
		cfg.RuntimeParams["enable_seqscan"] = "off"
	}
	// This release's statements make the webhook deliveries of the
	// events they write (store/sqlstore/fanout.go); migration 25's row
	// trigger makes them only for connections that do not say so, an
	// earlier release's. Not a setting: it says what this code does.
	cfg.RuntimeParams[fanoutSetting] = "inline"
	return cfg, nil
}

// fanoutSetting is the session setting by which the store's connections
// tell migration 25's trigger that their statements fan out themselves.
const fanoutSetting = "kvgate.fanout"
