package sqlstore

import (
	"context"
	"database/sql"
	"fmt"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	_ "github.com/jackc/pgx/v5/stdlib"
)

// TestExplainClaimComplete prints the PostgreSQL plans of the claim and
// of a batch of completions, with their buffers and WAL, each in a
// transaction rolled back (a profiling aid, run by hand):
//
//	KVGATE_EXPLAIN_URL=postgres://.../db go test -run TestExplainClaimComplete -v ./store/sqlstore/
//
// The database must hold kvgate's schema and runnable and running jobs
// (bench/peers/river/internal/setup fills one).
func TestExplainClaimComplete(t *testing.T) {
	url := os.Getenv("KVGATE_EXPLAIN_URL")
	if url == "" {
		t.Skip("KVGATE_EXPLAIN_URL not set")
	}
	d := explainDialect()
	db, err := sql.Open("pgx", url)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	ctx := context.Background()
	q := buildQueries(d)
	explain := func(name, stmt string, args ...any) {
		tx := genericTx(ctx, t, db)
		defer tx.Rollback()
		// Prepared, so that the generic plan the store runs is the one shown.
		if _, err := tx.ExecContext(ctx, "PREPARE x AS "+stmt); err != nil {
			t.Fatal(err)
		}
		defer tx.ExecContext(ctx, "DEALLOCATE x")
		ph := make([]string, len(args))
		for i, a := range args {
			ph[i] = literal(a)
		}
		// Twice: the second run is warm (plan cached, trigger functions
		// compiled), as in the store's long-lived sessions.
		for _, w := range []string{"SAVEPOINT warm", "EXPLAIN (ANALYZE) EXECUTE x(" + strings.Join(ph, ", ") + ")", "ROLLBACK TO SAVEPOINT warm"} {
			if _, err := tx.ExecContext(ctx, w); err != nil {
				t.Fatal(err)
			}
		}
		rows, err := tx.QueryContext(ctx, "EXPLAIN (ANALYZE, BUFFERS, WAL, VERBOSE false) EXECUTE x("+strings.Join(ph, ", ")+")")
		if err != nil {
			t.Fatal(err)
		}
		defer rows.Close()
		var out []string
		for rows.Next() {
			var l string
			rows.Scan(&l)
			out = append(out, l)
		}
		t.Logf("%s:\n%s", name, strings.Join(out, "\n"))
	}
	now := time.Now()
	limit := 32
	if v, err := strconv.Atoi(os.Getenv("KVGATE_EXPLAIN_LIMIT")); err == nil {
		limit = v
	}
	m, tt := []string{"m"}, micros(now)
	explain("claim", q.claimCTE, claimArgs(now, time.Minute, limit, m, uuid.Must(uuid.NewV7()).String(), explainChoice(ctx, t, db, d, now, limit))...)

	rows, err := db.QueryContext(ctx, `SELECT id, fence, attempt FROM jobs WHERE state = 'RUNNING' LIMIT $1`, limit)
	if err != nil {
		t.Fatal(err)
	}
	var (
		jids, states, classes, errs, backends, outcomes, events []string
		spent, sent                                             []bool
		fences, nows, avails, starts, ends                      []int64
		results                                                 [][]byte
		attempts, prompts, completions                          []int32
	)
	for rows.Next() {
		var id string
		var fence int64
		var attempt int32
		rows.Scan(&id, &fence, &attempt)
		jids, fences, states = append(jids, id), append(fences, fence), append(states, "SUCCEEDED")
		spent, sent = append(spent, true), append(sent, true)
		nows, avails, results = append(nows, tt), append(avails, tt), append(results, []byte(`{"ok":true}`))
		classes, errs = append(classes, ""), append(errs, "")
		attempts, backends, outcomes = append(attempts, attempt+1), append(backends, ""), append(outcomes, "")
		prompts, completions = append(prompts, 0), append(completions, 0)
		starts, ends = append(starts, 0), append(ends, 0)
		events = append(events, uuid.Must(uuid.NewV7()).String())
	}
	rows.Close()
	// Each end charges its tenant's ledger (store.Charge), as an attempt
	// without a permit does.
	var days []int32
	var charges [10][]int64
	for range jids {
		days = append(days, int32(20261205))
		for i, v := range (ledgerChange{requests: 1, attempts: 1, prompt: 10, completion: 5}).columns() {
			charges[i] = append(charges[i], v)
		}
	}
	args := []any{jids, fences, states, spent, sent, nows, avails, results, classes, errs,
		attempts, backends, outcomes, prompts, completions, starts, ends, events, days}
	for _, c := range charges {
		args = append(args, c)
	}
	explain(fmt.Sprintf("finish %d", len(jids)), q.finishBatch, append(args, jids)...)
}

// genericTx begins a transaction for the caller to roll back, under the
// generic plans that the store's prepared statements settle on, with
// KVGATE_EXPLAIN_PRE run first (schema experiments, rolled back with the
// rest).
func genericTx(ctx context.Context, t *testing.T, db *sql.DB) *sql.Tx {
	t.Helper()
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.ExecContext(ctx, "SET LOCAL plan_cache_mode = force_generic_plan"); err != nil {
		tx.Rollback()
		t.Fatal(err)
	}
	if pre := os.Getenv("KVGATE_EXPLAIN_PRE"); pre != "" {
		if _, err := tx.ExecContext(ctx, pre); err != nil {
			tx.Rollback()
			t.Fatal(err)
		}
	}
	return tx
}

// explainDialect is postgres.Dialect, which this package cannot import.
func explainDialect() Dialect {
	return Dialect{Name: "postgres", Positional: func(n int) string { return fmt.Sprintf("$%d", n) }, LockRunnable: "FOR UPDATE SKIP LOCKED",
		WritableCTE: true, LockShared: "FOR SHARE",
		ModelIn: func(col string) string {
			return "(cardinality(?::text[]) = 0 OR array_position(?::text[], " + col + ") IS NOT NULL)"
		},
		ModelsArg: func(models []string) any { return append([]string{}, models...) }}
}

// literal renders a value as SQL, for EXPLAIN EXECUTE.
func literal(a any) string {
	q := func(s string) string { return "'" + strings.ReplaceAll(s, "'", "''") + "'" }
	arr := func(n int, f func(int) string, typ string) string {
		els := make([]string, n)
		for i := range els {
			els[i] = f(i)
		}
		return "ARRAY[" + strings.Join(els, ",") + "]::" + typ + "[]"
	}
	switch v := a.(type) {
	case string:
		return q(v)
	case []string:
		return arr(len(v), func(i int) string { return q(v[i]) }, "text")
	case []bool:
		return arr(len(v), func(i int) string { return fmt.Sprint(v[i]) }, "boolean")
	case []int64:
		return arr(len(v), func(i int) string { return fmt.Sprint(v[i]) }, "bigint")
	case []int32:
		return arr(len(v), func(i int) string { return fmt.Sprint(v[i]) }, "integer")
	case [][]byte:
		return arr(len(v), func(i int) string { return "convert_to(" + q(string(v[i])) + ", 'UTF8')" }, "bytea")
	}
	return fmt.Sprint(a)
}

// explainChoice is a store's fair choice on db at now for a claim of
// limit jobs, from the start of the turn.
func explainChoice(ctx context.Context, t *testing.T, db *sql.DB, d Dialect, now time.Time, limit int) fairChoice {
	t.Helper()
	c, err := New(db, d).choose(ctx, nil, now, limit)
	if err != nil {
		t.Fatal(err)
	}
	return c
}
