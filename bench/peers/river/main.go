// Command river measures kvgate's durable job path beside River
// (github.com/riverqueue/river), the Go and PostgreSQL job queue, on the
// same PostgreSQL server in one run: fresh databases for each, the same
// number of worker slots, work that takes no time, rounds interleaved so
// that a noisy neighbour weighs on both alike, and the median of the
// rounds printed with the ratio. It is a module of its own so that River
// never becomes a dependency of kvgate.
//
//	make bench-peers                       # from the repository root
//	cd bench/peers/river && go run . -rounds 5 -jobs 20000
//	go run . -profile -only kvgate,river   # and where the work goes
//
// -profile adds, per job of each run, the commits of its database, the
// WAL the server wrote, the CPU time of the server's processes (read from
// /proc where it runs on this machine) and of this one, and, where
// pg_stat_statements is loaded, the statements run (nested ones too).
//
// Measured, each round:
//
//   - claim → complete: jobs/s draining a backlog of -jobs jobs with
//     -slots slots. kvgate: its store's fair claim into free slots and
//     Complete under each claim's fence (the state, result, attempt record
//     and event in one transaction; concurrent completions share a
//     statement by group commit), as scheduler.Runner drives it, from two
//     runners of half the slots each. River: a client with -slots workers,
//     a worker that returns nil, and River's shortest fetch cooldown (its
//     default, 100 ms, would cap it at ten fetches a second).
//   - the same for kvgate with a plain oldest-first claim (the same writes,
//     no fairness), the fair claim's cost;
//   - the floor: kvgate's schema and runners with River's writes alone,
//     the fenced claim and the fenced completion (the result kept) and
//     nothing else: no job.running or final event, no attempt record. Not
//     a mode kvgate has: it measures what kvgate's guarantees cost beside
//     River, and what its schema and its way of claiming cost apart from
//     them;
//   - kvgate's full attempt as scheduler.Runner records it for a job
//     without a policy: the claim, the read of the claim's entities and
//     policies (one statement a claim), the sent mark, complete (the
//     inference is such a job's last stage: no checkpoint before its end);
//   - single inserts, one after another: kvgate's Accept (job row and
//     job.accepted event) against River's Insert.
//
// With -paired N and -pre SQL it compares instead two kvgate databases,
// one with the SQL run after its migrations and one without, draining
// N chunks of -jobs jobs each in alternation (pairedDrains).
package main

import (
	"cmp"
	"context"
	"database/sql"
	"encoding/json"
	"flag"
	"fmt"
	"log"
	"maps"
	"math/rand/v2"
	"net/url"
	"os"
	"path/filepath"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivermigrate"

	"github.com/kvgate/kvgate/store"
	"github.com/kvgate/kvgate/store/postgres"
	"github.com/kvgate/kvgate/store/sqlite"
	"github.com/kvgate/kvgate/store/sqlstore"
)

func main() {
	admin := flag.String("url", cmp.Or(os.Getenv("KVGATE_TEST_POSTGRES_URL"), "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"),
		"PostgreSQL server to create the databases on")
	jobs := flag.Int("jobs", 20000, "backlog drained per round")
	rounds := flag.Int("rounds", 5, "rounds, interleaved")
	slots := flag.Int("slots", 64, "worker slots, for both")
	inserts := flag.Int("inserts", 1000, "sequential single inserts per round")
	flag.IntVar(&tenants, "tenants", 100, "tenants the jobs are spread over, in turn (kvgate's fair claim serves them in turn)")
	flag.IntVar(&burst, "burst", 1, "consecutive jobs of one tenant before the next tenant's (1: every job a different tenant's, the jobs of a tenant farthest apart on disk)")
	only := flag.String("only", "", "comma-separated runs to do (all when empty): kvgate, kvgate-plain, kvgate-floor, kvgate-runner, river, kvgate-insert, sqlite, sqlite-insert, river-insert")
	pre := flag.String("pre", "", "SQL run on each kvgate PostgreSQL database after its migrations (experiments)")
	profile := flag.Bool("profile", false, "print each run's commits, WAL bytes and statements per job (WAL is the server's, whoever writes it; statements need pg_stat_statements)")
	paired := flag.Int("paired", 0, "with -pre: drain this many chunks of -jobs jobs from each of two databases, one with -pre and one without, in alternation, and compare them chunk by chunk (experiments)")
	cpuProfile := flag.String("cpuprofile", "", "write the bench process's CPU profile of the whole run to this file (its own side: the store's Go code, River's, the drivers')")
	flag.Parse()
	if *cpuProfile != "" {
		f, err := os.Create(*cpuProfile)
		if err != nil {
			log.Fatal(err)
		}
		if err := pprof.StartCPUProfile(f); err != nil {
			log.Fatal(err)
		}
		defer func() {
			pprof.StopCPUProfile()
			if err := f.Close(); err != nil {
				log.Print(err)
			}
		}()
	}
	if tenants < 1 {
		log.Fatalf("-tenants %d: at least one tenant", tenants)
	}
	if burst < 1 {
		log.Fatalf("-burst %d: at least one job", burst)
	}
	if *paired > 0 {
		if *pre == "" {
			log.Fatal("-paired needs -pre: the change to compare")
		}
		if err := pairedDrains(context.Background(), *admin, *pre, *paired, *jobs, *slots); err != nil {
			log.Fatal(err)
		}
		return
	}
	ctx := context.Background()
	b, err := newBench(ctx, *admin, *pre)
	if err != nil {
		log.Fatal(err)
	}
	defer b.close()

	rates := map[string][]float64{}
	withVac := map[string][]float64{} // drains, their own vacuum's time counted
	profs := map[string][]prof{}
	for r := range *rounds {
		runs := []struct {
			name string
			fn   func() (float64, error)
		}{
			{"kvgate", func() (float64, error) { return b.kvgate(ctx, b.fair, *jobs, *slots, fairClaim, false) }},
			{"kvgate-plain", func() (float64, error) { return b.kvgate(ctx, b.plain, *jobs, *slots, plainClaim, false) }},
			{"kvgate-floor", func() (float64, error) { return b.kvgate(ctx, b.floor, *jobs, *slots, floorClaim, false) }},
			{"kvgate-runner", func() (float64, error) { return b.kvgate(ctx, b.runner, *jobs, *slots, fairClaim, true) }},
			{"river", func() (float64, error) { return b.river(ctx, *jobs, *slots) }},
			{"kvgate-insert", func() (float64, error) { return b.kvgateInserts(ctx, b.inserts, *inserts) }},
			{"sqlite", func() (float64, error) { return b.kvgate(ctx, b.sqlite, *jobs, *slots, fairClaim, false) }},
			{"sqlite-insert", func() (float64, error) { return b.kvgateInserts(ctx, b.sqliteIns, *inserts) }},
			{"river-insert", func() (float64, error) { return b.riverInserts(ctx, *inserts) }},
		}
		// Rotate the order so that no system always goes first.
		for i := range runs {
			run := runs[(i+r)%len(runs)]
			if *only != "" && !slices.Contains(strings.Split(*only, ","), run.name) {
				continue
			}
			var before counters
			b.started = func() {}
			if *profile {
				// After the backlog is loaded: the drain's own counts.
				b.started = func() { before = b.counters(ctx, run.name) }
				if strings.HasSuffix(run.name, "-insert") {
					b.started()
				}
			}
			v, err := run.fn()
			if err != nil {
				log.Fatalf("round %d, %s: %v", r+1, run.name, err)
			}
			rates[run.name] = append(rates[run.name], v)
			fmt.Fprintf(os.Stderr, "round %d: %-14s %8.0f jobs/s\n", r+1, run.name, v)
			if *profile && before.ok {
				n := float64(*jobs)
				if strings.HasSuffix(run.name, "-insert") {
					n = float64(*inserts)
				}
				if p, ok := b.report(ctx, run.name, before, n); ok {
					profs[run.name] = append(profs[run.name], p)
				}
			}
			// The run's dead rows are vacuumed before the next run, not
			// during it: autovacuum of one run's database would otherwise
			// weigh on the run after it, whichever system that is. A
			// drain's rate is also reported with the vacuum of its own dead
			// rows counted in its time: what the work costs once cleaned
			// up after, as a queue that runs for days pays it.
			vac, err := b.vacuum(ctx, run.name)
			if err != nil {
				log.Fatalf("round %d, vacuum after %s: %v", r+1, run.name, err)
			}
			if vac > 0 && !strings.HasSuffix(run.name, "-insert") {
				n := float64(*jobs)
				withVac[run.name] = append(withVac[run.name], n/(n/v+vac.Seconds()))
			}
		}
	}
	costs := fairCosts(rates) // before the rates are sorted
	if *only != "" {
		defer printProfiles(profs)
		if costs != "" {
			defer fmt.Printf("The fair claim costs, against the plain oldest-first claim, %s.\n", costs)
		}
		for k, v := range rates {
			slices.Sort(v)
			fmt.Printf("%-14s median %.0f jobs/s (%.0f-%.0f)", k, v[len(v)/2], v[0], v[len(v)-1])
			if w := withVac[k]; len(w) > 0 {
				slices.Sort(w)
				fmt.Printf("; with its own vacuum %.0f (%.0f-%.0f)", w[len(w)/2], w[0], w[len(w)-1])
			}
			fmt.Println()
		}
		return
	}
	medOf := func(m map[string][]float64, k string) float64 {
		v := slices.Clone(m[k])
		if len(v) == 0 {
			return 0
		}
		slices.Sort(v)
		return v[len(v)/2]
	}
	spanOf := func(m map[string][]float64, k string) string {
		v := slices.Clone(m[k])
		if len(v) == 0 {
			return "-"
		}
		slices.Sort(v)
		return fmt.Sprintf("%.0f-%.0f", v[0], v[len(v)-1])
	}
	med := func(k string) float64 { return medOf(rates, k) }
	span := func(k string) string { return spanOf(rates, k) }
	ratio := func(a, b string) float64 { return med(a) / med(b) }
	// drains prints the drains' rows of a table of rates m.
	drains := func(m map[string][]float64) {
		fmt.Println("| path | kvgate | River | kvgate / River |")
		fmt.Println("|---|---|---|---|")
		row := func(label, k string) {
			fmt.Printf("| %s | %.0f (%s) | | %.2f× |\n", label, medOf(m, k), spanOf(m, k), medOf(m, k)/medOf(m, "river"))
		}
		fmt.Printf("| claim → complete (fair claim) | %.0f (%s) | %.0f (%s) | %.2f× |\n",
			medOf(m, "kvgate"), spanOf(m, "kvgate"), medOf(m, "river"), spanOf(m, "river"), medOf(m, "kvgate")/medOf(m, "river"))
		row("claim → complete (plain oldest-first claim)", "kvgate-plain")
		row("the floor: River's writes alone in kvgate's schema (fenced claim and completion, no events, no attempt records)", "kvgate-floor")
		row("claim → facts read → sent mark → complete (the runner's writes)", "kvgate-runner")
	}
	fmt.Printf("Median of %d interleaved rounds, jobs/s (range); %d-job backlog of %d tenants (in runs of %d jobs), %d slots, zero-delay work; one PostgreSQL.\n\n", *rounds, *jobs, tenants, burst, *slots)
	drains(rates)
	fmt.Printf("| single inserts, sequential | %.0f (%s) | %.0f (%s) | %.2f× |\n", med("kvgate-insert"), span("kvgate-insert"), med("river-insert"), span("river-insert"), ratio("kvgate-insert", "river-insert"))
	fmt.Printf("\nSQLite (kvgate's embedded default, WAL, synchronous=NORMAL, one writer at a time), same run: claim → complete %.0f jobs/s (%s), single inserts %.0f jobs/s (%s).\n",
		med("sqlite"), span("sqlite"), med("sqlite-insert"), span("sqlite-insert"))
	fmt.Printf("\nThe fair claim costs %.1f%% against the plain oldest-first claim (medians)", 100*(1-ratio("kvgate", "kvgate-plain")))
	if costs != "" {
		fmt.Printf("; %s", costs)
	}
	fmt.Println(".")
	fmt.Println("\nThe same drains with the VACUUM of each one's own dead rows counted in its time (jobs/s):")
	fmt.Println()
	drains(withVac)
	printProfiles(profs)
}

type bench struct {
	adminURL  string
	admin     *pgx.Conn
	dbs       []string
	fair      *sqlstore.Store // a database each, so that no run inherits another's dead rows
	plain     *sqlstore.Store
	floor     *sqlstore.Store // created after River's database (dbOf)
	runner    *sqlstore.Store
	inserts   *sqlstore.Store
	sqlite    *sqlstore.Store // kvgate's embedded default, for its own figures
	sqliteIns *sqlstore.Store
	tmp       string
	pool      *pgxpool.Pool // River's
	workers   *river.Workers
	insertC   *river.Client[pgx.Tx] // inserts only
	started   func()                // called once a drain's backlog is loaded
}

func newBench(ctx context.Context, adminURL, pre string) (*bench, error) {
	admin, err := pgx.Connect(ctx, adminURL)
	if err != nil {
		return nil, err
	}
	b := &bench{adminURL: adminURL, admin: admin}
	openPG := func() (*sqlstore.Store, error) {
		u, err := b.createDB(ctx)
		if err != nil {
			return nil, err
		}
		s, err := postgres.Open(ctx, u)
		if err != nil {
			return nil, err
		}
		if _, err := postgres.Migrate(ctx, s); err != nil {
			return nil, err
		}
		if pre != "" {
			if _, err := s.DB().ExecContext(ctx, pre); err != nil {
				return nil, err
			}
		}
		return s, nil
	}
	for _, s := range []**sqlstore.Store{&b.fair, &b.plain, &b.runner, &b.inserts} {
		if *s, err = openPG(); err != nil {
			return nil, err
		}
	}
	if b.tmp, err = os.MkdirTemp("", "kvgate-peers-"); err != nil {
		return nil, err
	}
	for i, s := range []**sqlstore.Store{&b.sqlite, &b.sqliteIns} {
		if *s, err = sqlite.Open(ctx, filepath.Join(b.tmp, fmt.Sprint(i, ".db"))); err != nil {
			return nil, err
		}
		if _, err := sqlite.Migrate(ctx, *s); err != nil {
			return nil, err
		}
	}
	u, err := b.createDB(ctx)
	if err != nil {
		return nil, err
	}
	cfg, err := pgxpool.ParseConfig(u)
	if err != nil {
		return nil, err
	}
	cfg.MaxConns = 16 // River's default is four on two cores; give it room
	if b.pool, err = pgxpool.NewWithConfig(ctx, cfg); err != nil {
		return nil, err
	}
	m, err := rivermigrate.New(riverpgxv5.New(b.pool), nil)
	if err != nil {
		return nil, err
	}
	if _, err := m.Migrate(ctx, rivermigrate.DirectionUp, nil); err != nil {
		return nil, err
	}
	b.workers = river.NewWorkers()
	river.AddWorker(b.workers, river.WorkFunc(func(context.Context, *river.Job[noop]) error { return nil }))
	if b.insertC, err = river.NewClient(riverpgxv5.New(b.pool), &river.Config{}); err != nil {
		return nil, err
	}
	if b.floor, err = openPG(); err != nil {
		return nil, err
	}
	return b, nil
}

func (b *bench) createDB(ctx context.Context) (string, error) {
	name := fmt.Sprintf("kvgate_peers_%d_%x", time.Now().Unix(), rand.Uint32())
	if _, err := b.admin.Exec(ctx, "CREATE DATABASE "+name); err != nil {
		return "", err
	}
	b.dbs = append(b.dbs, name)
	return b.dbURL(name)
}

// dbURL is the address of database name on the admin URL's server.
func (b *bench) dbURL(name string) (string, error) {
	u, err := url.Parse(b.adminURL)
	if err != nil {
		return "", err
	}
	u.Path = "/" + name
	return u.String(), nil
}

func (b *bench) close() {
	for _, s := range []*sqlstore.Store{b.fair, b.plain, b.floor, b.runner, b.inserts, b.sqlite, b.sqliteIns} {
		if s != nil {
			s.Close()
		}
	}
	if b.tmp != "" {
		os.RemoveAll(b.tmp)
	}
	if b.pool != nil {
		b.pool.Close()
	}
	ctx := context.Background()
	for _, n := range b.dbs {
		if _, err := b.admin.Exec(ctx, "DROP DATABASE IF EXISTS "+n+" WITH (FORCE)"); err != nil {
			log.Printf("drop %s: %v", n, err)
		}
	}
	b.admin.Close(ctx)
}

// idle closes a store's idle connections after its turn: the server's
// connection slots are shared (with other tests, too).
func idle(s *sqlstore.Store) {
	s.DB().SetMaxIdleConns(0)
	s.DB().SetMaxIdleConns(32)
}

type noop struct{}

func (noop) Kind() string { return "noop" }

var seq atomic.Int64

// claimLinger is scheduler.DefaultClaimLinger, the runner's default,
// copied: this module does not build kvgate's scheduler.
const claimLinger = time.Millisecond

// models are the models a runner serves: scheduler.Runner always claims
// for the models its backends serve.
var models = []string{"m"}

// tenants is how many tenants the jobs are spread over (-tenants), in
// runs of burst consecutive jobs each (-burst).
var tenants, burst = 100, 1

func newJob() store.NewJob {
	i := seq.Add(1)
	return store.NewJob{
		ID: uuid.Must(uuid.NewV7()).String(), EventID: uuid.Must(uuid.NewV7()).String(),
		Tenant: fmt.Sprint("t", i/int64(burst)%int64(tenants)), IdempotencyKey: fmt.Sprint("k", i), RequestHash: "h",
		Endpoint: "/v1/chat/completions", Model: "m",
		Body:        json.RawMessage(`{"model":"m","messages":[{"role":"user","content":"Extract the line items of this invoice."}],"max_tokens":256}`),
		MaxAttempts: 5, TokenEstimate: 300, Deadline: time.Now().Add(time.Hour), Now: time.Now(),
	}
}

// preload accepts n jobs from 32 goroutines (not measured).
func preload(ctx context.Context, s store.Store, n int) error {
	var left atomic.Int64
	left.Store(int64(n))
	var wg sync.WaitGroup
	errs := make(chan error, 32)
	for range 32 {
		wg.Go(func() {
			for left.Add(-1) >= 0 {
				if _, _, err := s.Accept(ctx, newJob()); err != nil {
					errs <- err
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	return <-errs
}

// fairCosts is the fair claim's cost against the plain claim round by
// round, and their median, or "" unless both ran in every round. Each
// round drains both within minutes of each other (back to back under
// -only kvgate,kvgate-plain), so its own ratio leaves out what drifts
// between rounds (the machine's other load).
func fairCosts(rates map[string][]float64) string {
	f, p := rates["kvgate"], rates["kvgate-plain"]
	if len(f) == 0 || len(f) != len(p) {
		return ""
	}
	costs := make([]float64, len(f))
	each := make([]string, len(f))
	for i := range f {
		costs[i] = 100 * (1 - f[i]/p[i])
		each[i] = fmt.Sprintf("%.1f%%", costs[i])
	}
	slices.Sort(costs)
	return fmt.Sprintf("round by round %s, their median %.1f%%", strings.Join(each, ", "), costs[len(costs)/2])
}

// plainClaimSQL is an oldest-first claim with the same writes as kvgate's
// fair one (the lease, the fence, a job.running event per job in claim
// order), the same models condition and the same rows returned (the jobs
// whole), and no fairness: what the fair claim is measured against. It
// states jobs_runnable's whole predicate (migration 21), as kvgate's
// statements in claim order do.
const plainClaimSQL = pickedSQL + `,
	claimed AS (` + claimUpdateSQL + `),
	ev AS (
		INSERT INTO outbox (id, job_id, tenant, type, state, state_version, created_at)
		SELECT left($5::text, 32) || lpad(to_hex(row_number() OVER (ORDER BY priority, available_at, id)), 4, '0'),
			id, tenant, 'job.running', state, state_version, $1
		FROM claimed)
	SELECT ` + jobColumns + ` FROM claimed`

// pickedSQL and claimUpdateSQL are what the plain claim and the floor's
// share: the jobs taken oldest first ($1 now, $2 limit, $4 models) and
// their lease ($3 its end).
const (
	pickedSQL = `WITH picked AS (
		SELECT id FROM jobs WHERE state IN ('READY', 'RETRY_SCHEDULED') AND available_at <= $1 AND deadline_at > $1
			AND (priority >= 0 OR priority < 0) AND array_position($4::text[], model) IS NOT NULL
		ORDER BY priority, available_at, id LIMIT $2 FOR UPDATE SKIP LOCKED)`
	claimUpdateSQL = `UPDATE jobs SET state = 'RUNNING', fence = fence + 1, lease_until = $3, state_version = state_version + 1, updated_at = $1
		WHERE id = ANY(ARRAY(SELECT id FROM picked))
		RETURNING ` + jobColumns
)

// jobColumns are the columns a claim returns: the job whole, as kvgate's
// claim returns it to the runner (the body is the work).
const jobColumns = `id, tenant, idempotency_key, request_hash, endpoint, model, body, metadata, priority, token_estimate,
	state, state_version, attempt, max_attempts, fence, lease_until, available_at, deadline_at, created_at, updated_at,
	error_class, last_error`

// floorClaimSQL is plainClaimSQL without its events: the floor's claim.
const floorClaimSQL = pickedSQL + `
	` + claimUpdateSQL

// floorComplete is the floor's completion of many jobs, each under its
// fence: the state and the result, nothing else.
const floorComplete = `UPDATE jobs SET state = 'SUCCEEDED', state_version = jobs.state_version + 1, updated_at = $1,
		lease_until = 0, result = input.result
	FROM unnest($2::text[], $3::bigint[], $4::bytea[]) AS input(id, fence, result)
	WHERE jobs.id = ANY($2::text[]) AND jobs.id = input.id AND jobs.state = 'RUNNING' AND jobs.fence = input.fence
		AND jobs.lease_until > $1`

// claimMode is how a drain claims (and, for the floor, completes).
type claimMode int

const (
	fairClaim  claimMode = iota // the store's Claim, as scheduler.Runner
	plainClaim                  // oldest first, the same writes
	floorClaim                  // oldest first, River's writes alone
)

// claimPlain claims oldest first, as mode says: plainClaim or floorClaim.
func claimPlain(ctx context.Context, s *sqlstore.Store, now time.Time, lease time.Duration, limit int, mode claimMode) ([]store.Job, error) {
	var rows *sql.Rows
	var err error
	if mode == floorClaim {
		rows, err = s.DB().QueryContext(ctx, floorClaimSQL, now.UnixMicro(), limit, now.Add(lease).UnixMicro(), models)
	} else {
		// The events' ids as the store's claim makes them
		// (store/sqlstore's claimEventID): one UUIDv7 a claim, numbered.
		rows, err = s.DB().QueryContext(ctx, plainClaimSQL, now.UnixMicro(), limit, now.Add(lease).UnixMicro(), models, uuid.Must(uuid.NewV7()).String())
	}
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var js []store.Job
	for rows.Next() {
		var j store.Job
		var state string
		var body, meta []byte
		var lease, avail, deadline, created, updated int64
		if err := rows.Scan(&j.ID, &j.Tenant, &j.IdempotencyKey, &j.RequestHash, &j.Endpoint, &j.Model, &body, &meta,
			&j.Priority, &j.TokenEstimate, &state, &j.StateVersion, &j.Attempt, &j.MaxAttempts, &j.Fence,
			&lease, &avail, &deadline, &created, &updated, &j.ErrorClass, &j.LastError); err != nil {
			return nil, err
		}
		j.State, j.Body, j.Metadata = store.State(state), body, meta
		j.LeaseUntil, j.AvailableAt, j.Deadline = time.UnixMicro(lease), time.UnixMicro(avail), time.UnixMicro(deadline)
		j.CreatedAt, j.UpdatedAt = time.UnixMicro(created), time.UnixMicro(updated)
		js = append(js, j)
	}
	return js, rows.Err()
}

// kvgate drains a backlog of n jobs as scheduler.Runner would: two
// runners of slots/2 slots each claim as many jobs as they have free
// slots, once those in flight have freed theirs or claimLinger has gone
// by, and each job ends in its own goroutine under its fence (with the
// runner's read of the claim's facts and each job's sent mark first when
// full is set).
func (b *bench) kvgate(ctx context.Context, s *sqlstore.Store, n, slots int, mode claimMode, full bool) (float64, error) {
	defer idle(s)
	if err := preload(ctx, s, n); err != nil {
		return 0, err
	}
	b.started()
	return drain(ctx, s, n, slots, mode, full)
}

// drain ends n jobs of the store's backlog as kvgate does (see kvgate),
// and returns their rate; the backlog may hold more.
func drain(ctx context.Context, s *sqlstore.Store, n, slots int, mode claimMode, full bool) (float64, error) {
	var fc *floorCompleter
	if mode == floorClaim {
		fc = &floorCompleter{db: s.DB(), slots: make(chan struct{}, 2)}
	}
	var done, left atomic.Int64
	left.Store(int64(n))
	take := func(k int) int {
		for {
			l := left.Load()
			t := min(int64(k), l)
			if left.CompareAndSwap(l, l-t) {
				return int(t)
			}
		}
	}
	var failed atomic.Value
	fail := func(err error) { failed.CompareAndSwap(nil, err) }
	start := time.Now()
	var runners sync.WaitGroup
	for range 2 {
		runners.Go(func() {
			busy := make(chan struct{}, slots/2)
			freed := make(chan struct{}, slots/2)
			var work sync.WaitGroup
			defer work.Wait()
			for failed.Load() == nil {
				free := cap(busy) - len(busy)
				if free == 0 {
					<-freed
					continue
				}
				if free < cap(busy) {
					// As the runner lingers (scheduler.Runner's linger) for
					// the attempts in flight to free their slots into this
					// claim.
					t := time.NewTimer(claimLinger)
				linger:
					for len(busy) > 0 {
						select {
						case <-freed:
						case <-t.C:
							break linger
						}
					}
					t.Stop()
					free = cap(busy) - len(busy)
				}
				// The jobs this claim may take, of the n left to both runners.
				free = take(free)
				if free == 0 {
					if len(busy) == 0 {
						return // n jobs claimed, nothing running
					}
					<-freed
					continue
				}
				var js []store.Job
				var err error
				if mode != fairClaim {
					js, err = claimPlain(ctx, s, time.Now(), time.Minute, free, mode)
				} else {
					js, err = s.Claim(ctx, time.Now(), time.Minute, free, models...)
				}
				if err != nil {
					fail(err)
					return
				}
				left.Add(int64(free - len(js)))
				if full && len(js) > 0 {
					// As the runner reads what its attempts need of their
					// jobs: once per claim.
					ids := make([]string, len(js))
					for i, j := range js {
						ids[i] = j.ID
					}
					if _, _, err := s.AttemptFacts(ctx, ids); err != nil {
						fail(err)
						return
					}
				}
				if len(js) == 0 {
					if len(busy) == 0 {
						return // nothing left to claim, nothing running
					}
					<-freed
					continue
				}
				for _, j := range js {
					busy <- struct{}{}
					work.Go(func() {
						// The slot is freed when the work is done, before its
						// end is written, as scheduler.Runner does.
						var once sync.Once
						free := func() {
							once.Do(func() {
								<-busy
								select {
								case freed <- struct{}{}:
								default:
								}
							})
						}
						defer free()
						result := json.RawMessage(`{"ok":true}`)
						if full {
							// The sent mark is the work's (before its request
							// leaves); the end is its record.
							if err := s.MarkSent(ctx, j.ID, j.Fence, time.Now(), time.Minute, nil); err != nil {
								fail(err)
								return
							}
						}
						free()
						complete := func() error {
							return s.Complete(ctx, store.Completion{JobID: j.ID, Fence: j.Fence, State: store.Succeeded,
								Result: result, Attempt: store.Attempt{Attempt: j.Attempt + 1}, Now: time.Now()})
						}
						if fc != nil {
							complete = func() error { return fc.complete(ctx, j.ID, j.Fence, result) }
						}
						if err := complete(); err != nil {
							fail(err)
							return
						}
						done.Add(1)
					})
				}
			}
		})
	}
	runners.Wait()
	el := time.Since(start)
	if err, _ := failed.Load().(error); err != nil {
		return 0, err
	}
	if done.Load() != int64(n) {
		return 0, fmt.Errorf("completed %d of %d jobs", done.Load(), n)
	}
	return float64(n) / el.Seconds(), nil
}

// river drains a backlog of n jobs with a River client of slots workers.
func (b *bench) river(ctx context.Context, n, slots int) (float64, error) {
	params := make([]river.InsertManyParams, 0, 1000)
	for left := n; left > 0; left -= len(params) {
		params = params[:0]
		for range min(left, cap(params)) {
			params = append(params, river.InsertManyParams{Args: noop{}})
		}
		if _, err := b.insertC.InsertManyFast(ctx, params); err != nil {
			return 0, err
		}
	}
	c, err := river.NewClient(riverpgxv5.New(b.pool), &river.Config{
		Queues:  map[string]river.QueueConfig{river.QueueDefault: {MaxWorkers: slots}},
		Workers: b.workers,
		// River's default cooldown (100 ms) allows ten fetches a second,
		// slots×10 jobs/s at most; its minimum gives it its best rate.
		FetchCooldown: river.FetchCooldownMin,
	})
	if err != nil {
		return 0, err
	}
	b.started()
	events, cancel := c.SubscribeConfig(&river.SubscribeConfig{ChanSize: n, Kinds: []river.EventKind{river.EventKindJobCompleted, river.EventKindJobFailed}})
	defer cancel()
	start := time.Now()
	if err := c.Start(ctx); err != nil {
		return 0, err
	}
	for range n {
		e := <-events
		if e.Kind != river.EventKindJobCompleted {
			return 0, fmt.Errorf("river job %d: %s", e.Job.ID, e.Kind)
		}
	}
	el := time.Since(start)
	if err := c.Stop(ctx); err != nil {
		return 0, err
	}
	return float64(n) / el.Seconds(), nil
}

func (b *bench) kvgateInserts(ctx context.Context, s *sqlstore.Store, n int) (float64, error) {
	defer idle(s)
	start := time.Now()
	for range n {
		if _, _, err := s.Accept(ctx, newJob()); err != nil {
			return 0, err
		}
	}
	return float64(n) / time.Since(start).Seconds(), nil
}

func (b *bench) riverInserts(ctx context.Context, n int) (float64, error) {
	start := time.Now()
	for range n {
		if _, err := b.insertC.Insert(ctx, noop{}, nil); err != nil {
			return 0, err
		}
	}
	return float64(n) / time.Since(start).Seconds(), nil
}

// counters are a database's commits, the server's WAL position and the
// statements run in the database, read before and after a run (-profile).
type counters struct {
	ok            bool
	db            string
	commits       int64
	lsn           string
	walRecords    int64
	walFPI        int64
	walBytes      float64
	walSync       int64
	stmts         float64
	stmtsTracking bool
	serverCPU     time.Duration // the server's processes, where they run on this machine
	selfCPU       time.Duration // this process
}

// dbOf names the database a run writes to; "" for SQLite.
func (b *bench) dbOf(run string) string {
	i := map[string]int{"kvgate": 0, "kvgate-plain": 1, "kvgate-runner": 2, "kvgate-insert": 3, "river": 4, "river-insert": 4, "kvgate-floor": 5}
	if k, ok := i[run]; ok && k < len(b.dbs) {
		return b.dbs[k]
	}
	return ""
}

// vacuum vacuums the database a run wrote to (none for SQLite) and
// returns how long the VACUUM took.
func (b *bench) vacuum(ctx context.Context, run string) (time.Duration, error) {
	db := b.dbOf(run)
	if db == "" {
		return 0, nil
	}
	u, err := b.dbURL(db)
	if err != nil {
		return 0, err
	}
	c, err := pgx.Connect(ctx, u)
	if err != nil {
		return 0, err
	}
	defer c.Close(ctx)
	start := time.Now()
	_, err = c.Exec(ctx, "VACUUM")
	return time.Since(start), err
}

func (b *bench) counters(ctx context.Context, run string) counters {
	db := b.dbOf(run)
	if db == "" {
		return counters{}
	}
	time.Sleep(1500 * time.Millisecond) // backends flush their statistics within a second of going idle
	c := counters{ok: true, db: db}
	if err := b.admin.QueryRow(ctx, `SELECT xact_commit, pg_current_wal_lsn()::text FROM pg_stat_database WHERE datname = $1`, db).Scan(&c.commits, &c.lsn); err != nil {
		log.Printf("profile: %v", err)
		return counters{}
	}
	_ = b.admin.QueryRow(ctx, `SELECT wal_records, wal_fpi, wal_bytes::float8, wal_sync FROM pg_stat_wal`).Scan(&c.walRecords, &c.walFPI, &c.walBytes, &c.walSync)
	c.serverCPU, c.selfCPU = b.cpu(ctx)
	if err := b.admin.QueryRow(ctx, `SELECT COALESCE(sum(calls), 0)::float8 FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid WHERE d.datname = $1`, db).Scan(&c.stmts); err == nil {
		c.stmtsTracking = true
	} else {
		c.stmts = 0
	}
	return c
}

// prof is one run's counts per job (-profile).
type prof struct {
	commits, walBytes, walRecords, fpi, syncs, serverCPU, selfCPU, stmts float64
	hasStmts                                                             bool
}

func (b *bench) report(ctx context.Context, run string, before counters, n float64) (prof, bool) {
	after := b.counters(ctx, run)
	if !after.ok {
		return prof{}, false
	}
	var wal float64
	_ = b.admin.QueryRow(ctx, `SELECT pg_wal_lsn_diff($1::pg_lsn, $2::pg_lsn)::float8`, after.lsn, before.lsn).Scan(&wal)
	p := prof{
		commits: float64(after.commits-before.commits) / n, walBytes: wal / n,
		walRecords: float64(after.walRecords-before.walRecords) / n, fpi: float64(after.walFPI-before.walFPI) / n,
		syncs:     float64(after.walSync-before.walSync) / n,
		serverCPU: float64((after.serverCPU - before.serverCPU).Microseconds()) / n,
		selfCPU:   float64((after.selfCPU - before.selfCPU).Microseconds()) / n,
		stmts:     (after.stmts - before.stmts) / n, hasStmts: after.stmtsTracking,
	}
	line := fmt.Sprintf("  %-14s per job: %.3f commits, %.0f WAL bytes, %.2f WAL records, %.3f full-page images, %.3f WAL syncs, server CPU %.0f µs, bench CPU %.0f µs",
		run, p.commits, p.walBytes, p.walRecords, p.fpi, p.syncs, p.serverCPU, p.selfCPU)
	if p.hasStmts {
		line += fmt.Sprintf(", %.2f statements", p.stmts)
	}
	// The run's WAL, for pg_waldump --stats=record --start --end.
	line += fmt.Sprintf(" (WAL %s to %s)", before.lsn, after.lsn)
	fmt.Fprintln(os.Stderr, line)
	return p, true
}

// printProfiles prints the medians of the runs' counts per job.
func printProfiles(profs map[string][]prof) {
	if len(profs) == 0 {
		return
	}
	fmt.Println("\nPer job, medians of the rounds (-profile; WAL and server CPU are the whole server's, whoever else writes to it; statements counted by pg_stat_statements, nested ones too, where it is loaded):")
	fmt.Println("\n| run | commits | WAL bytes | WAL records | WAL syncs | server CPU µs | bench CPU µs | statements |")
	fmt.Println("|---|---|---|---|---|---|---|---|")
	for _, k := range slices.Sorted(maps.Keys(profs)) {
		ps := profs[k]
		med := func(f func(prof) float64) float64 {
			v := make([]float64, len(ps))
			for i, p := range ps {
				v[i] = f(p)
			}
			slices.Sort(v)
			return v[len(v)/2]
		}
		st := "-"
		if ps[0].hasStmts {
			st = fmt.Sprintf("%.2f", med(func(p prof) float64 { return p.stmts }))
		}
		fmt.Printf("| %s | %.3f | %.0f | %.1f | %.3f | %.0f | %.0f | %s |\n", k,
			med(func(p prof) float64 { return p.commits }), med(func(p prof) float64 { return p.walBytes }),
			med(func(p prof) float64 { return p.walRecords }), med(func(p prof) float64 { return p.syncs }),
			med(func(p prof) float64 { return p.serverCPU }), med(func(p prof) float64 { return p.selfCPU }), st)
	}
}

// cpu is the CPU time of the server's processes (the postmaster's
// children, living and reaped), read from /proc where the server runs on
// this machine (0 elsewhere), and of this process.
func (b *bench) cpu(ctx context.Context) (server, self time.Duration) {
	var ru syscall.Rusage
	if syscall.Getrusage(syscall.RUSAGE_SELF, &ru) == nil {
		self = time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
	}
	var pid int
	if b.admin.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid) != nil {
		return 0, self
	}
	stat := func(pid int) []string {
		data, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
		if err != nil {
			return nil
		}
		s := string(data)
		return strings.Fields(s[strings.LastIndexByte(s, ')')+2:]) // from field 3, the state
	}
	f := stat(pid)
	if f == nil {
		return 0, self
	}
	pm, _ := strconv.Atoi(f[1])
	ticks := func(f []string, fields ...int) (t int64) {
		for _, i := range fields {
			v, _ := strconv.ParseInt(f[i-3], 10, 64)
			t += v
		}
		return t
	}
	pf := stat(pm)
	if pf == nil {
		return 0, self
	}
	total := ticks(pf, 16, 17) // the reaped children's
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		p, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if f := stat(p); f != nil && f[1] == strconv.Itoa(pm) {
			total += ticks(f, 14, 15)
		}
	}
	return time.Duration(total) * time.Second / 100, self // USER_HZ
}

// floorLinger is sqlstore's finishLinger, copied: how long a batch of
// the floor's ends waits for more.
const floorLinger = 5 * time.Millisecond

// floorCompleter ends the floor's jobs as kvgate's store ends attempts
// (sqlstore's finish group): the ends that arrive within floorLinger share
// one statement, at most two statements run at once, and each job's
// goroutine waits for its own. River's completer batches likewise.
type floorCompleter struct {
	db    *sql.DB
	slots chan struct{}

	mu      sync.Mutex
	pending *floorBatch
}

type floorBatch struct {
	ids     []string
	fences  []int64
	results [][]byte
	done    chan struct{}
	err     error
}

func (c *floorCompleter) complete(ctx context.Context, id string, fence int64, result []byte) error {
	c.mu.Lock()
	b := c.pending
	leader := b == nil
	if leader {
		b = &floorBatch{done: make(chan struct{})}
		c.pending = b
	}
	b.ids, b.fences, b.results = append(b.ids, id), append(b.fences, fence), append(b.results, result)
	if len(b.ids) == 256 {
		c.pending = nil
	}
	c.mu.Unlock()
	if !leader {
		<-b.done
		return b.err
	}
	time.Sleep(floorLinger)
	c.slots <- struct{}{}
	c.mu.Lock()
	if c.pending == b {
		c.pending = nil
	}
	c.mu.Unlock()
	res, err := c.db.ExecContext(ctx, floorComplete, time.Now().UnixMicro(), b.ids, b.fences, b.results)
	<-c.slots
	if err == nil {
		if n, _ := res.RowsAffected(); n != int64(len(b.ids)) {
			err = fmt.Errorf("floor: %d of %d jobs completed under their fence", n, len(b.ids))
		}
	}
	b.err = err
	close(b.done)
	return err
}

// pairedDrains compares two databases on one server, alike but for the
// SQL pre run on one of them after its migrations: each gets a backlog
// of chunks×n jobs, then the two drain n jobs each in turn (the order
// swapped every pair), so that whatever drifts on the host in the
// meantime weighs on both alike. It prints the median rate of each and
// the median of the chunk-by-chunk ratios.
func pairedDrains(ctx context.Context, adminURL, pre string, chunks, n, slots int) error {
	admin, err := pgx.Connect(ctx, adminURL)
	if err != nil {
		return err
	}
	b := &bench{adminURL: adminURL, admin: admin} // for its databases alone
	defer b.close()
	var ss [2]*sqlstore.Store // without pre, with it
	for i := range ss {
		u, err := b.createDB(ctx)
		if err != nil {
			return err
		}
		s, err := postgres.Open(ctx, u)
		if err != nil {
			return err
		}
		defer s.Close()
		if _, err := postgres.Migrate(ctx, s); err != nil {
			return err
		}
		if i == 1 {
			if _, err := s.DB().ExecContext(ctx, pre); err != nil {
				return err
			}
		}
		if err := preload(ctx, s, chunks*n); err != nil {
			return err
		}
		if _, err := s.DB().ExecContext(ctx, "VACUUM ANALYZE"); err != nil {
			return err
		}
		ss[i] = s
	}
	var rates [2][]float64
	var ratios []float64
	for c := range chunks {
		var r [2]float64
		for k := range 2 {
			i := (k + c) % 2
			if r[i], err = drain(ctx, ss[i], n, slots, fairClaim, false); err != nil {
				return err
			}
		}
		fmt.Fprintf(os.Stderr, "chunk %d: without %6.0f, with %6.0f jobs/s (%.3f)\n", c+1, r[0], r[1], r[1]/r[0])
		rates[0], rates[1] = append(rates[0], r[0]), append(rates[1], r[1])
		ratios = append(ratios, r[1]/r[0])
	}
	med := func(v []float64) float64 {
		v = slices.Clone(v)
		slices.Sort(v)
		return v[len(v)/2]
	}
	fmt.Printf("%d chunks of %d jobs, fair claim → complete, %d slots: without -pre median %.0f jobs/s, with it %.0f; chunk by chunk, with/without median %.3f (%.3f-%.3f)\n",
		chunks, n, slots, med(rates[0]), med(rates[1]), med(ratios), slices.Min(ratios), slices.Max(ratios))
	return nil
}
