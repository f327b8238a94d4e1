package sqlstore

import (
	"context"
	"database/sql"
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
)

// TestClaimStatementCost times the fair claim's statement beside an
// oldest-first claim with the same writes, and beside the fair claim
// without each of its parts in turn, to show what the fairness costs a
// claim and where (a profiling aid, run by hand, on the database that
// TestExplainClaimComplete reads):
//
//	KVGATE_EXPLAIN_URL=postgres://.../db go test -run TestClaimStatementCost -v ./store/sqlstore/
//
// Every statement claims KVGATE_EXPLAIN_LIMIT jobs (32) in a transaction
// rolled back, the statements interleaved, KVGATE_EXPLAIN_ROUNDS times
// (300) after 20 untimed, under the generic plan that the store's prepared
// statements settle on (and after KVGATE_EXPLAIN_PRE, as in
// TestExplainClaimComplete); the times are the client's, round trip
// included.
// It first marks every listed tenant served now, committed, as a busy
// queue's tenants are: otherwise each claim, rolled back, would refresh
// every considered tenant's record. The variants are cut from claimCTE's
// text: one whose part is no longer found is reported and skipped.
func TestClaimStatementCost(t *testing.T) {
	url := os.Getenv("KVGATE_EXPLAIN_URL")
	if url == "" {
		t.Skip("KVGATE_EXPLAIN_URL not set")
	}
	limit, rounds := 32, 300
	if v, err := strconv.Atoi(os.Getenv("KVGATE_EXPLAIN_LIMIT")); err == nil {
		limit = v
	}
	if v, err := strconv.Atoi(os.Getenv("KVGATE_EXPLAIN_ROUNDS")); err == nil {
		rounds = v
	}
	d := explainDialect()
	db, err := sql.Open("pgx", url)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	db.SetMaxOpenConns(1)
	ctx := context.Background()
	if _, err := db.ExecContext(ctx, "UPDATE job_tenants SET served_at = $1", micros(time.Now())); err != nil {
		t.Fatal(err)
	}

	type variant struct {
		name string
		sql  string
		args func(now time.Time, events string) []any
	}
	m := []string{"m"}
	c := explainChoice(ctx, t, db, d, time.Now(), limit)
	fairArgs := func(now time.Time, events string) []any { return claimArgs(now, time.Minute, limit, m, events, c) }
	fair := claimCTE(d)
	vs := []variant{{"fair claim", fair, fairArgs}}
	add := func(name string, args func(time.Time, string) []any, cuts ...[3]string) {
		s := fair
		for _, c := range cuts {
			i := strings.Index(s, c[0])
			j := strings.Index(s[max(i, 0):], c[1])
			if i < 0 || j < 0 {
				t.Logf("%s: skipped, claimCTE no longer holds %q", name, c[0])
				return
			}
			s = s[:i] + c[2] + s[i+j:]
		}
		vs = append(vs, variant{name, s, args})
	}
	// Each cut keeps the placeholders of what it removes, so that the
	// variant takes claimArgs unchanged.
	served := [3]string{"served AS (", "\n\tev AS (", "served AS (SELECT ?::bigint, ?::text[], ?::text[], ?::bigint),"}
	add("without the served records", fairArgs, served)
	// Oldest first: the jobs taken in claim order, with the fair claim's
	// own update and events.
	oldestFirst := `WITH picked AS (SELECT id FROM jobs WHERE ` + runnable("jobs", "?") + ` AND ` + claimOrderIndexed("jobs") + ` AND ` + d.ModelIn("jobs.model") + `
			ORDER BY priority, available_at, id LIMIT ? FOR UPDATE SKIP LOCKED),`
	add("oldest-first claim, the same writes", func(now time.Time, events string) []any {
		at := micros(now)
		return []any{at, at, m, m, limit, micros(now.Add(time.Minute)), at, events, at}
	}, [3]string{"WITH shares AS", "\n\tclaimed AS (", oldestFirst},
		[3]string{"served AS (", "\n\tev AS (", ""},
		[3]string{", (SELECT count(*) FROM job_tenants", " FROM claimed", ", NULL::bigint"})

	times := make([][]float64, len(vs))
	for i := range rounds + 20 {
		for k, v := range vs {
			events := uuid.Must(uuid.NewV7()).String()
			el, n := func() (time.Duration, int) {
				tx := genericTx(ctx, t, db)
				defer tx.Rollback()
				start := time.Now()
				rows, err := tx.QueryContext(ctx, rebind(d, v.sql), v.args(time.Now(), events)...)
				if err != nil {
					t.Fatalf("%s: %v", v.name, err)
				}
				n := 0
				for rows.Next() {
					n++
				}
				if err := rows.Err(); err != nil {
					t.Fatalf("%s: %v", v.name, err)
				}
				return time.Since(start), n
			}()
			if n != limit {
				t.Fatalf("%s claimed %d jobs of %d: the database needs more runnable jobs (before their deadlines)", v.name, n, limit)
			}
			if i >= 20 {
				times[k] = append(times[k], float64(el.Microseconds()))
			}
		}
	}
	base := slices.Clone(times[len(vs)-1])
	slices.Sort(base)
	for k, v := range vs {
		ts := times[k]
		slices.Sort(ts)
		t.Logf("%-40s median %5.0f µs (p10 %5.0f, p90 %5.0f), %.2f× oldest-first",
			v.name, ts[len(ts)/2], ts[len(ts)/10], ts[len(ts)*9/10], ts[len(ts)/2]/base[len(base)/2])
	}
}
