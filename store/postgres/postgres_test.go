package postgres_test

import (
	"context"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/kvgate/kvgate/store"
	"github.com/kvgate/kvgate/store/postgres"
	"github.com/kvgate/kvgate/store/postgres/pgtest"
	"github.com/kvgate/kvgate/store/sqlstore"
	"github.com/kvgate/kvgate/store/storetest"
)

func freshDatabase(t testing.TB) string { return pgtest.FreshDatabase(t) }

func open(t *testing.T) store.Store {
	t.Helper()
	s, err := postgres.Open(context.Background(), freshDatabase(t))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := postgres.Migrate(context.Background(), s); err != nil {
		t.Fatal(err)
	}
	return s
}

func TestConformance(t *testing.T) {
	storetest.Exercise(t, open)
}

func TestMigrateConcurrently(t *testing.T) {
	url := freshDatabase(t)
	ctx := context.Background()
	errs := make(chan error, 4)
	applied := make(chan int, 4)
	for range 4 {
		go func() {
			s, err := postgres.Open(ctx, url)
			if err != nil {
				errs <- err
				return
			}
			defer s.Close()
			vs, err := postgres.Migrate(ctx, s)
			applied <- len(vs)
			errs <- err
		}()
	}
	total := 0
	for range 4 {
		if err := <-errs; err != nil {
			t.Error(err)
		}
	}
	close(applied)
	for n := range applied {
		total += n
	}
	want, _ := fs.Glob(postgres.Migrations, "migrations/*.sql")
	if total != len(want) {
		t.Errorf("four concurrent migrations applied %d migrations in all, want %d: each once", total, len(want))
	}
}

func TestPending(t *testing.T) {
	s, err := postgres.Open(context.Background(), freshDatabase(t))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	storetest.Pending(t, s, postgres.Migrate, postgres.Pending)
}

func TestUnavailable(t *testing.T) {
	// A port nothing listens on: Open fails, and says so.
	_, err := postgres.Open(context.Background(), "postgres://postgres@127.0.0.1:1/x?sslmode=disable&connect_timeout=2")
	if err == nil {
		t.Fatal("opened a database on a closed port")
	}
}

// TestSessionSettings: the store's sessions plan its statements
// generically, never JIT-compile them, and say that they fan out webhook
// deliveries themselves (config.go).
func TestSessionSettings(t *testing.T) {
	s, err := postgres.Open(context.Background(), freshDatabase(t))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	for name, want := range map[string]string{"jit": "off", "plan_cache_mode": "force_generic_plan", "kvgate.fanout": "inline"} {
		var got string
		if err := s.DB().QueryRowContext(context.Background(), "SELECT current_setting($1)", name).Scan(&got); err != nil {
			t.Fatal(err)
		}
		if got != want {
			t.Errorf("%s = %q, want %q", name, got, want)
		}
	}
}

// TestWebhookFanoutPerStatement: the fan-out trigger runs once per
// statement over its new events (migration 14): a claim of many jobs and
// ends group-committed many to a statement still make exactly one
// delivery per event and subscribed endpoint of the event's tenant, none
// for another tenant, in the order of the events.
func TestWebhookFanoutPerStatement(t *testing.T) {
	ctx := context.Background()
	s := migratedFresh(t)
	now := time.Now()
	for i, events := range [][]string{{"job.succeeded"}, {"job.failed", "job.succeeded"}} {
		if err := s.CreateEndpoint(ctx, store.WebhookEndpoint{ID: fmt.Sprint("we_", i), Tenant: "acme", URL: "http://127.0.0.1:1/hook",
			Events: events, Secret: "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", CreatedAt: now}); err != nil {
			t.Fatal(err)
		}
	}
	const n = 40
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			tenant := []string{"acme", "globex"}[i%2]
			if _, _, err := s.Accept(ctx, store.NewJob{ID: uuid.Must(uuid.NewV7()).String(), EventID: uuid.Must(uuid.NewV7()).String(),
				Tenant: tenant, IdempotencyKey: fmt.Sprint("k", i), RequestHash: "h", Endpoint: "/v1/chat/completions", Model: "m",
				Body: json.RawMessage(`{}`), MaxAttempts: 3, Deadline: now.Add(time.Hour), Now: now}); err != nil {
				t.Error(err)
			}
		})
	}
	wg.Wait()
	var listed int
	if err := s.DB().QueryRowContext(ctx, `SELECT count(*) FROM job_tenants WHERE tenant IN ('acme', 'globex')`).Scan(&listed); err != nil || listed != 2 {
		t.Fatalf("tenants listed for the fair claim: %d, %v; want 2", listed, err)
	}
	jobs, err := s.Claim(ctx, now, time.Minute, n, "m")
	if err != nil || len(jobs) != n {
		t.Fatalf("claimed %d, %v; want %d", len(jobs), err, n)
	}
	for _, j := range jobs {
		wg.Go(func() {
			if err := s.Complete(ctx, store.Completion{JobID: j.ID, Fence: j.Fence, State: store.Succeeded, Result: json.RawMessage(`{}`),
				Attempt: store.Attempt{Attempt: 1}, EventID: uuid.Must(uuid.NewV7()).String(), Now: now}); err != nil {
				t.Error(err)
			}
		})
	}
	wg.Wait()
	rows, err := s.DB().QueryContext(ctx, `SELECT d.tenant, d.type, o.type, o.seq, o.xmin::text FROM webhook_deliveries d JOIN outbox o ON o.id = d.event_id ORDER BY d.seq`)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	// In the order of the events each transaction wrote (two batches
	// committing at once may interleave their sequence numbers).
	count, last := 0, map[string]int64{}
	for rows.Next() {
		var tenant, typ, eventType, tx string
		var seq int64
		if err := rows.Scan(&tenant, &typ, &eventType, &seq, &tx); err != nil {
			t.Fatal(err)
		}
		if tenant != "acme" || typ != "job.succeeded" || eventType != "job.succeeded" {
			t.Errorf("delivery of %s's %s as %s", tenant, eventType, typ)
		}
		if seq < last[tx] {
			t.Errorf("deliveries out of their transaction's events' order: event %d after %d", seq, last[tx])
		}
		last[tx] = seq
		count++
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	if count != n { // 20 acme jobs, two endpoints each
		t.Errorf("%d deliveries, want %d", count, n)
	}
}

// TestRenewalsAreHOT: a heartbeat and a sent mark change no indexed
// column of the job (migration 18), so PostgreSQL writes them as HOT
// updates, without a new entry in each of the jobs table's indexes.
func TestRenewalsAreHOT(t *testing.T) {
	ctx := context.Background()
	url := freshDatabase(t)
	s, err := postgres.Open(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := postgres.Migrate(ctx, s); err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	const n = 20
	for i := range n {
		if _, _, err := s.Accept(ctx, store.NewJob{ID: uuid.Must(uuid.NewV7()).String(), EventID: uuid.Must(uuid.NewV7()).String(),
			Tenant: "acme", IdempotencyKey: fmt.Sprint("k", i), RequestHash: "h", Endpoint: "/v1/chat/completions", Model: "m",
			Body: json.RawMessage(`{}`), MaxAttempts: 3, Deadline: now.Add(time.Hour), Now: now}); err != nil {
			t.Fatal(err)
		}
	}
	jobs, err := s.Claim(ctx, now, time.Minute, n, "m")
	if err != nil || len(jobs) != n {
		t.Fatalf("claimed %d, %v", len(jobs), err)
	}
	updates := func() (all, hot int64) {
		// A server process reports its counts when it exits: close the
		// store's connections first.
		s.DB().SetMaxIdleConns(0)
		s.DB().SetMaxIdleConns(2)
		time.Sleep(100 * time.Millisecond)
		if err := s.DB().QueryRowContext(ctx, `SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_user_tables WHERE relname = 'jobs'`).Scan(&all, &hot); err != nil {
			t.Fatal(err)
		}
		return all, hot
	}
	all0, hot0 := updates()
	for _, j := range jobs {
		if err := s.Heartbeat(ctx, j.ID, j.Fence, now.Add(time.Second), time.Minute); err != nil {
			t.Fatal(err)
		}
		if err := s.MarkSent(ctx, j.ID, j.Fence, now.Add(2*time.Second), time.Minute, nil); err != nil {
			t.Fatal(err)
		}
	}
	all, hot := updates()
	for i := 0; i < 50 && all-all0 < 2*n; i++ { // reports may come late under load
		all, hot = updates()
	}
	if all-all0 != 2*n {
		t.Fatalf("%d updates of jobs counted, want %d", all-all0, 2*n)
	}
	if hot-hot0 < n {
		t.Errorf("%d of %d renewals were HOT updates; want most", hot-hot0, 2*n)
	}
	s.Close()
}

// TestClaimWalksClaimOrderOnStaleStatistics: with statistics taken while
// no job was runnable (an ANALYZE after a drain), then a backlog, a claim
// still walks the runnable jobs in claim order and stops at its limit: it
// never reads the reaper's index of deadlines (migration 19), which the
// generic plan had chosen, reading every runnable job per probe.
func TestClaimWalksClaimOrderOnStaleStatistics(t *testing.T) {
	s := migratedFresh(t)
	staleStatistics(t, s, "VACUUM ANALYZE jobs", 20, 400, 3000)
	before := indexReads(t, s)["jobs_runnable_deadline"]
	claimed := 0
	for range 5 {
		js, err := s.Claim(context.Background(), time.Now(), time.Minute, 16, "m")
		if err != nil || len(js) != 16 {
			t.Fatalf("claimed %d, %v", len(js), err)
		}
		claimed += len(js)
	}
	after := indexReads(t, s)["jobs_runnable_deadline"]
	for i := 0; i < 30 && after == before; i++ { // reports may come late under load
		after = indexReads(t, s)["jobs_runnable_deadline"]
	}
	if after-before > int64(claimed) {
		t.Errorf("claims of %d jobs read %d entries of the deadlines' index", claimed, after-before)
	}
}

// TestFairProbesWalkTenantIndexOnStaleStatistics: with statistics taken
// at the end of a drain (an ANALYZE without a vacuum, as autovacuum's
// analyze runs apart from its vacuum), a fair claim's head probes still
// take each tenant's share through jobs_runnable_tenant. Before migration
// 21 the generic plan filtered the head of jobs_runnable, the whole
// queue in claim order, for each tenant: ten claims of 32 read 14,369 of
// its entries and none of the tenants' index.
func TestFairProbesWalkTenantIndexOnStaleStatistics(t *testing.T) {
	s := migratedFresh(t)
	staleStatistics(t, s, "ANALYZE jobs", 16, 2000, 4000)
	claim := func() int {
		js, err := s.Claim(context.Background(), time.Now(), time.Minute, 32, "m")
		if err != nil || len(js) != 32 {
			t.Fatalf("claimed %d, %v", len(js), err)
		}
		return len(js)
	}
	claim() // steps once over the drained jobs' entries, which it marks dead
	before := indexReads(t, s)
	claimed := 0
	for range 10 { // past the five custom plans of a prepared statement
		claimed += claim()
	}
	after := indexReads(t, s)
	for i := 0; i < 30 && after["jobs_runnable_tenant"] == before["jobs_runnable_tenant"]; i++ {
		after = indexReads(t, s)
	}
	ordered, heads := after["jobs_runnable"]-before["jobs_runnable"], after["jobs_runnable_tenant"]-before["jobs_runnable_tenant"]
	// The oldest-job probe steps over the previous claim's entries once.
	if ordered > 2*int64(claimed) || heads < int64(claimed) {
		t.Errorf("claims of %d jobs read %d entries of jobs_runnable and %d of jobs_runnable_tenant", claimed, ordered, heads)
	}
}

// staleStatistics accepts drained jobs over the tenants, claims and
// completes them all, runs analyze (an ANALYZE with or without VACUUM)
// while nothing is runnable, then accepts runnable jobs more: the
// statistics say the runnable-jobs indexes are empty while they hold a
// backlog. Jobs are for model m.
func staleStatistics(t *testing.T, s *sqlstore.Store, analyze string, tenants, drained, runnable int) {
	t.Helper()
	ctx := context.Background()
	now := time.Now()
	accept := func(from, n int) {
		var wg sync.WaitGroup
		for w := range 8 {
			wg.Go(func() {
				for i := from + w; i < from+n; i += 8 {
					if _, _, err := s.Accept(ctx, store.NewJob{ID: uuid.Must(uuid.NewV7()).String(), EventID: uuid.Must(uuid.NewV7()).String(),
						Tenant: fmt.Sprint("t", i%tenants), IdempotencyKey: fmt.Sprint("k", i), RequestHash: "h", Endpoint: "/v1/chat/completions",
						Model: "m", Body: json.RawMessage(`{}`), MaxAttempts: 3, Deadline: now.Add(time.Hour), Now: now}); err != nil {
						t.Error(err)
						return
					}
				}
			})
		}
		wg.Wait()
	}
	accept(0, drained)
	for {
		js, err := s.Claim(ctx, now, time.Minute, 64, "m")
		if err != nil {
			t.Fatal(err)
		}
		if len(js) == 0 {
			break
		}
		for _, j := range js {
			if err := s.Complete(ctx, store.Completion{JobID: j.ID, Fence: j.Fence, State: store.Succeeded, Result: json.RawMessage(`{}`),
				Attempt: store.Attempt{Attempt: 1}, Now: now}); err != nil {
				t.Fatal(err)
			}
		}
	}
	if _, err := s.DB().ExecContext(ctx, analyze); err != nil {
		t.Fatal(err)
	}
	accept(drained, runnable)
	if t.Failed() {
		t.FailNow()
	}
}

// indexReads is each index of jobs and the entries read from it so far.
func indexReads(t *testing.T, s *sqlstore.Store) map[string]int64 {
	t.Helper()
	s.DB().SetMaxIdleConns(0) // a server process reports its counts when it exits
	s.DB().SetMaxIdleConns(2)
	time.Sleep(100 * time.Millisecond)
	rows, err := s.DB().QueryContext(context.Background(), `SELECT indexrelname, idx_tup_read FROM pg_stat_user_indexes WHERE relname = 'jobs'`)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	reads := map[string]int64{}
	for rows.Next() {
		var name string
		var n int64
		if err := rows.Scan(&name, &n); err != nil {
			t.Fatal(err)
		}
		reads[name] = n
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return reads
}

// migratedFresh opens a fresh database with every migration applied,
// closed when the test ends.
func migratedFresh(t *testing.T) *sqlstore.Store {
	t.Helper()
	ctx := context.Background()
	s, err := postgres.Open(ctx, freshDatabase(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	if _, err := postgres.Migrate(ctx, s); err != nil {
		t.Fatal(err)
	}
	return s
}

// acceptInTurn accepts n jobs of model "m" at now, their tenants t0, t1
// and t2 in turn.
func acceptInTurn(t *testing.T, s store.Store, n int, now time.Time) {
	t.Helper()
	for i := range n {
		if _, _, err := s.Accept(context.Background(), store.NewJob{ID: uuid.Must(uuid.NewV7()).String(), EventID: uuid.Must(uuid.NewV7()).String(),
			Tenant: fmt.Sprint("t", i%3), IdempotencyKey: fmt.Sprint("k", i), RequestHash: "h", Endpoint: "/v1/chat/completions", Model: "m",
			Body: json.RawMessage(`{}`), MaxAttempts: 3, Deadline: now.Add(time.Hour), Now: now}); err != nil {
			t.Fatal(err)
		}
	}
}

// TestClaimLeavesListedTenantRows: once every listed tenant has been
// served, claims pass the turn by the store's cursor alone and write none
// of job_tenants' rows: claims in flight all consider the same tenants,
// and when each wrote their rows they queued on them (migration 20). Nor
// do they write the shared cursor that migration 20 had put in their
// place: the turn is each store's own (fair.go).
func TestClaimLeavesListedTenantRows(t *testing.T) {
	ctx := context.Background()
	s, err := postgres.Open(ctx, freshDatabase(t))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if _, err := postgres.Migrate(ctx, s); err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	acceptInTurn(t, s, 12, now)
	rows := func() (versions string) {
		if err := s.DB().QueryRowContext(ctx, `SELECT string_agg(tenant || ':' || xmin::text, ',' ORDER BY tenant)
			|| ' cursor:' || (SELECT xmin::text FROM fair_cursor) FROM job_tenants`).Scan(&versions); err != nil {
			t.Fatal(err)
		}
		return versions
	}
	claim := func(at time.Duration) string {
		js, err := s.Claim(ctx, now.Add(at), time.Minute, 1, "m")
		if err != nil || len(js) != 1 {
			t.Fatalf("claim at %v: %d jobs, %v", at, len(js), err)
		}
		return js[0].Tenant
	}
	// Three new tenants, first in name order, each written once.
	for i, want := range []string{"t0", "t1", "t2"} {
		if got := claim(time.Duration(i) * time.Millisecond); got != want {
			t.Errorf("claim %d of the new tenants took %s's job, want %s's", i+1, got, want)
		}
	}
	before := rows()
	var got []string
	for i := range 6 {
		got = append(got, claim(time.Second+time.Duration(i)*time.Millisecond))
	}
	after := rows()
	if before != after {
		t.Errorf("claims wrote listed tenants' rows: %s, then %s", before, after)
	}
	if want := "t0 t1 t2 t0 t1 t2"; fmt.Sprint(got) != "["+want+"]" {
		t.Errorf("claims after the new tenants' took %v, want [%s]", got, want)
	}
}

// TestClaimTurnPerStore: replicas over one database each keep their own
// turn (fair.go): with claims of one alternating between two stores, each
// store's claims pass over every backlogged tenant in turn, however the
// other store's claims interleave with them.
func TestClaimTurnPerStore(t *testing.T) {
	ctx := context.Background()
	url := freshDatabase(t)
	var stores []*sqlstore.Store
	for range 2 {
		s, err := postgres.Open(ctx, url)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { s.Close() })
		stores = append(stores, s)
	}
	if _, err := postgres.Migrate(ctx, stores[0]); err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	acceptInTurn(t, stores[0], 60, now) // 20 jobs for each of three tenants: none runs out
	per := [2][]string{}
	for i := range 30 {
		js, err := stores[i%2].Claim(ctx, now.Add(time.Second+time.Duration(i)*time.Millisecond), time.Minute, 1, "m")
		if err != nil || len(js) != 1 {
			t.Fatalf("claim %d: %d jobs, %v", i+1, len(js), err)
		}
		per[i%2] = append(per[i%2], js[0].Tenant)
	}
	// The first three claims serve the new tenants (served_at is shared);
	// then each store's own claims take the tenants in turn.
	for k, got := range per {
		last := got[len(got)-12:]
		seen := map[string]int{}
		for _, tenant := range last {
			seen[tenant]++
		}
		if seen["t0"] != 4 || seen["t1"] != 4 || seen["t2"] != 4 {
			t.Errorf("store %d's last 12 claims: %v, want each tenant 4 times (all its claims: %v)", k, seen, got)
		}
		for i := 2; i < len(last); i++ {
			if last[i] == last[i-1] || last[i] == last[i-2] {
				t.Errorf("store %d took %v: a tenant again before the others' turns", k, last)
				break
			}
		}
	}
}

// TestInboxBatchReadsNoInbox: the inbox's batch reads no records but the
// ones it did not insert. It had read every record of the batch's ids in
// the same statement, and the generic plan made while the inbox was
// small scanned the whole table for each batch: with 20,000 records, five
// batches of 40 new events read over 100,000 rows.
func TestInboxBatchReadsNoInbox(t *testing.T) {
	s := migratedFresh(t)
	ctx := context.Background()
	s.DB().SetMaxOpenConns(1) // one server process, so one prepared statement and its generic plan
	batch := func() {
		t.Helper()
		recs := make([]store.InboxRecord, 40) // as the inbox records them: event ids and SHA-256 digests
		for i := range recs {
			id := uuid.Must(uuid.NewV7()).String()
			recs[i] = store.InboxRecord{EventID: id, Digest: fmt.Sprintf("%x", sha256.Sum256([]byte(id)))}
		}
		outs, err := s.RecordInboxBatch(ctx, recs, time.Now())
		if err != nil {
			t.Fatal(err)
		}
		for i, o := range outs {
			if o != store.InboxRecorded {
				t.Fatalf("%s: outcome %v", recs[i].EventID, o)
			}
		}
	}
	bulk := func(n int) {
		t.Helper()
		if _, err := s.DB().ExecContext(ctx, `INSERT INTO inbox (event_id, digest, received_at)
			SELECT gen_random_uuid()::text, encode(sha256(g::text::bytea), 'hex'), g FROM generate_series(1, $1::int) g`, n); err != nil {
			t.Fatal(err)
		}
	}
	// The store's statements are planned once per connection, generically,
	// when first run (config.go): here with a few hundred records, as a
	// connection opened early in a run plans it.
	bulk(500)
	batch()
	bulk(20000)
	// Row counts reach the statistics when a server process flushes
	// them, at most once a second. The connection is kept (a new one
	// would plan afresh): a count of the inbox, a sequential scan of
	// known size on the same connection, tells when the batches' reads
	// have been flushed too.
	seqRead := func() int64 {
		t.Helper()
		var n int64
		if err := s.DB().QueryRowContext(ctx, `SELECT COALESCE(seq_tup_read, 0) FROM pg_stat_user_tables WHERE relname = 'inbox'`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	time.Sleep(1100 * time.Millisecond)
	before := seqRead()
	for range 5 {
		batch()
	}
	var records int64
	if err := s.DB().QueryRowContext(ctx, `SELECT count(digest) FROM inbox`).Scan(&records); err != nil {
		t.Fatal(err)
	}
	after := seqRead()
	for i := 0; i < 30 && after-before < records; i++ {
		time.Sleep(200 * time.Millisecond)
		after = seqRead()
	}
	if after-before < records {
		t.Fatalf("the count's scan of %d records never reached the statistics (%d rows read)", records, after-before)
	}
	if read := after - before - records; read > 0 {
		t.Errorf("five batches of 40 new events scanned %d rows of the inbox", read)
	}
}

// TestClaimEventIDs: a claim's job.running events take their ids from one
// UUIDv7 of the claim's, numbered in claim order (claimEventID): each a
// version 7 UUID, distinct within the claim and from the next claim's.
func TestClaimEventIDs(t *testing.T) {
	s := migratedFresh(t)
	ctx := context.Background()
	now := time.Now()
	acceptInTurn(t, s, 50, now)
	seen := map[string]bool{}
	for _, limit := range []int{20, 1 << 20} { // the second beyond maxClaim: it takes what is left
		js, err := s.Claim(ctx, now, time.Minute, limit, "m")
		if err != nil {
			t.Fatal(err)
		}
		if want := min(limit, 50-len(seen)); len(js) != want {
			t.Fatalf("claimed %d of limit %d, want %d", len(js), limit, want)
		}
		ids := make([]string, len(js))
		for i, j := range js {
			ids[i] = j.ID
		}
		rows, err := s.DB().QueryContext(ctx, `SELECT id FROM outbox WHERE type = 'job.running' AND job_id = ANY($1) ORDER BY id`, ids)
		if err != nil {
			t.Fatal(err)
		}
		var events []string
		for rows.Next() {
			var id string
			if err := rows.Scan(&id); err != nil {
				t.Fatal(err)
			}
			events = append(events, id)
		}
		rows.Close()
		if len(events) != len(js) {
			t.Fatalf("%d job.running events for %d claimed jobs", len(events), len(js))
		}
		for k, id := range events {
			u, err := uuid.Parse(id)
			if err != nil || u.Version() != 7 || u.Variant() != uuid.RFC4122 {
				t.Fatalf("event id %q: not a UUIDv7 (%v)", id, err)
			}
			if seen[id] {
				t.Fatalf("event id %s given twice", id)
			}
			seen[id] = true
			if id[:32] != events[0][:32] || id[32:] != fmt.Sprintf("%04x", k+1) {
				t.Errorf("event %d of the claim: id %s, want %s%04x", k+1, id, events[0][:32], k+1)
			}
		}
	}
}

// TestReapSeesACheckpointCommittedWhileItRuns: a checkpoint whose
// transaction holds the job's row shared while the reap begins, and
// commits while the reap is still choosing its expired jobs, is seen by
// the reap, which then hands the job on (RETRY_SCHEDULED) even on its
// last attempt, its answer checkpointed; or the reap leaves the job to
// its next pass. It never ends the job. Thousands of jobs whose leases
// expired earlier stand before it in the reap's order, so that the
// checkpoint commits after the reap began and before it reaches the job
// (the reap's statement is seen running first); a single statement
// checked the stages with a snapshot taken before that commit, and ended
// the job FAILED_TERMINAL.
func TestReapSeesACheckpointCommittedWhileItRuns(t *testing.T) {
	ctx := context.Background()
	s := migratedFresh(t)
	now := time.Now()
	j, _, err := s.Accept(ctx, store.NewJob{ID: uuid.Must(uuid.NewV7()).String(), EventID: uuid.Must(uuid.NewV7()).String(),
		Tenant: "acme", IdempotencyKey: "k", RequestHash: "h", Endpoint: "/v1/chat/completions", Model: "m",
		Body: json.RawMessage(`{}`), MaxAttempts: 1, Deadline: now.Add(time.Hour), Now: now})
	if err != nil {
		t.Fatal(err)
	}
	js, err := s.Claim(ctx, now, time.Minute, 1)
	if err != nil || len(js) != 1 {
		t.Fatalf("claim: %v, %v", js, err)
	}
	if err := s.MarkSent(ctx, j.ID, js[0].Fence, now, time.Minute, nil); err != nil {
		t.Fatal(err)
	}
	const earlier = 5000
	if _, err := s.DB().ExecContext(ctx, `INSERT INTO jobs (id, tenant, idempotency_key, request_hash, endpoint, model, body,
			priority, token_estimate, state, state_version, attempt, max_attempts, fence, lease_until, available_at, deadline_at,
			created_at, updated_at, error_class, last_error, sent_fence)
		SELECT 'earlier-' || g, tenant, 'earlier-' || g, request_hash, endpoint, model, body,
			priority, token_estimate, state, state_version, attempt, max_attempts, fence, lease_until - 1000000 - g, available_at, deadline_at,
			created_at, updated_at, error_class, last_error, sent_fence
		FROM jobs, generate_series(1, $2::int) g WHERE id = $1`, j.ID, earlier); err != nil {
		t.Fatal(err)
	}

	// The checkpoint, as SaveStage writes it: the job's row held shared.
	cp, err := s.DB().BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer cp.Rollback()
	var cpPID int
	if err := cp.QueryRowContext(ctx, `SELECT pg_backend_pid()`).Scan(&cpPID); err != nil {
		t.Fatal(err)
	}
	if _, err := cp.ExecContext(ctx, `INSERT INTO stages (job_id, stage, fence, data, created_at)
		SELECT id, 'inference', fence, '"answer"', 0 FROM jobs WHERE id = $1 FOR SHARE`, j.ID); err != nil {
		t.Fatal(err)
	}
	reaped := make(chan error, 1)
	go func() {
		_, err := s.Reap(ctx, now.Add(2*time.Minute), earlier+10)
		reaped <- err
	}()
	// The reap's statement has begun (its snapshot taken) once it is seen
	// running; then the checkpoint commits. On a loaded host the reap may
	// be done before a look sees it: it then skipped the job, held by the
	// checkpoint (SKIP LOCKED), and the window was not hit this time.
	deadline := time.Now().Add(10 * time.Second)
	var reapErr error
	reapDone := false
	for {
		select {
		case reapErr = <-reaped:
			reapDone = true
		default:
		}
		if reapDone {
			t.Log("the reap ended before it was seen running: the window was missed")
			break
		}
		var running bool
		if err := s.DB().QueryRowContext(ctx, `SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE datname = current_database()
			AND pid NOT IN (pg_backend_pid(), $1) AND state = 'active' AND query LIKE '%lease_until <= $%')`, cpPID).Scan(&running); err != nil {
			t.Fatal(err)
		}
		if running {
			// Shown running as its statement is bound, a moment before
			// it takes its snapshot.
			time.Sleep(3 * time.Millisecond)
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the reap's statement was never seen running")
		}
	}
	if err := cp.Commit(); err != nil {
		t.Fatal(err)
	}
	if !reapDone {
		reapErr = <-reaped
	}
	if reapErr != nil {
		t.Fatal(reapErr)
	}
	got, err := s.Get(ctx, "acme", j.ID)
	if err != nil {
		t.Fatal(err)
	}
	switch got.State {
	case store.RetryScheduled:
	case store.Running:
		t.Log("the reap reached the job before the checkpoint committed, and left it for its next pass")
	default:
		t.Errorf("the job checkpointed while the reap ran ended %s (%s): want RETRY_SCHEDULED, its answer reused by the next claim", got.State, got.LastError)
	}
}

// TestCreateKeyWaitsForTenantDelete: a key created while its tenant's
// delete is in flight (the tenant's row deleted, its keys revoked, not
// yet committed) waits for the delete and is refused, rather than being
// written for a tenant that no longer exists, unrevoked and so valid.
func TestCreateKeyWaitsForTenantDelete(t *testing.T) {
	ctx := context.Background()
	s := migratedFresh(t)
	now := time.Now()
	if err := s.CreateTenant(ctx, store.Tenant{Name: "acme", CreatedAt: now}); err != nil {
		t.Fatal(err)
	}
	del, err := s.DB().BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer del.Rollback()
	// What DeleteTenant's transaction writes, held open.
	if _, err := del.ExecContext(ctx, `DELETE FROM tenants WHERE name = 'acme'`); err != nil {
		t.Fatal(err)
	}
	if _, err := del.ExecContext(ctx, `UPDATE api_keys SET revoked_at = $1 WHERE tenant = 'acme' AND revoked_at = 0`, now.UnixMicro()); err != nil {
		t.Fatal(err)
	}
	created := make(chan error, 1)
	go func() {
		created <- s.CreateKey(ctx, store.APIKey{ID: "key_1", Hash: "h1", Prefix: "sk-kv-1", Tenant: "acme", Role: store.RoleUser, CreatedAt: now})
	}()
	// The key's statement is seen waiting on the tenant's row.
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(time.Millisecond) {
		var waiting bool
		if err := s.DB().QueryRowContext(ctx, `SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE datname = current_database()
			AND wait_event_type = 'Lock' AND query LIKE 'INSERT INTO api_keys%')`).Scan(&waiting); err != nil {
			t.Fatal(err)
		}
		if waiting {
			break
		}
		select {
		case err := <-created:
			t.Fatalf("the key was created (%v) while its tenant's delete was in flight", err)
		default:
		}
		if time.Now().After(deadline) {
			t.Fatal("the key's statement was never seen waiting")
		}
	}
	if err := del.Commit(); err != nil {
		t.Fatal(err)
	}
	if err := <-created; !errors.Is(err, store.ErrNotFound) {
		t.Errorf("key for a tenant deleted meanwhile: %v, want ErrNotFound", err)
	}
	if k, err := s.KeyByHash(ctx, "h1"); !errors.Is(err, store.ErrNotFound) {
		t.Errorf("the deleted tenant's key is valid: %+v, %v", k, err)
	}
}

// TestReadOnlyIsUnavailable: a write refused because the server is read
// only (a standby, as during a failover: SQLSTATE 25006) is the store out
// of reach for now, ErrUnavailable (a 503 with Retry-After to a client, a
// wait that spends no attempt to a job), not a failure of its own.
func TestReadOnlyIsUnavailable(t *testing.T) {
	ctx := context.Background()
	url := freshDatabase(t)
	s, err := postgres.Open(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := postgres.Migrate(ctx, s); err != nil {
		t.Fatal(err)
	}
	var name string
	if err := s.DB().QueryRowContext(ctx, "SELECT current_database()").Scan(&name); err != nil {
		t.Fatal(err)
	}
	if _, err := s.DB().ExecContext(ctx, "ALTER DATABASE "+pgx.Identifier{name}.Sanitize()+" SET default_transaction_read_only = on"); err != nil {
		t.Fatal(err)
	}
	s.Close()
	ro, err := postgres.Open(ctx, url) // new sessions: read only
	if err != nil {
		t.Fatal(err)
	}
	defer ro.Close()
	now := time.Now()
	_, _, err = ro.Accept(ctx, store.NewJob{ID: "00000000-0000-7000-8000-000000000001", EventID: "00000000-0000-7000-8000-000000000002",
		Tenant: "acme", IdempotencyKey: "k", RequestHash: "h", Endpoint: "/v1/chat/completions", Model: "m", Body: []byte(`{}`),
		TokenEstimate: 1, MaxAttempts: 1, Deadline: now.Add(time.Hour), Now: now})
	if !errors.Is(err, store.ErrUnavailable) {
		t.Errorf("a write on a read-only server: %v, want ErrUnavailable", err)
	}
}
