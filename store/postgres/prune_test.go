package postgres_test

import (
	"context"
	"database/sql"
	"encoding/json"
	"fmt"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/kvgate/kvgate/store"
	"github.com/kvgate/kvgate/store/sqlstore"
)

// The reaper's prune of job_tenants cannot drop a tenant whose job a
// transaction in flight is making runnable (migration 22): the two
// orders in which they can meet.

// idleTenant accepts a job of tenant at now and claims it under a lease
// longer than the test: the tenant is listed, served at now+1s, with
// nothing runnable.
func idleTenant(t *testing.T, s *sqlstore.Store, tenant string, now time.Time) store.Job {
	t.Helper()
	acceptAt(t, s, tenant, "k0", now)
	js, err := s.Claim(context.Background(), now.Add(time.Second), 2*time.Hour, 1, "m")
	if err != nil || len(js) != 1 {
		t.Fatalf("claim: %d jobs, %v", len(js), err)
	}
	return js[0]
}

func acceptAt(t *testing.T, s store.Store, tenant, key string, now time.Time) {
	t.Helper()
	if err := acceptJob(s, tenant, key, now); err != nil {
		t.Fatal(err)
	}
}

func acceptJob(s store.Store, tenant, key string, now time.Time) error {
	_, _, err := s.Accept(context.Background(), store.NewJob{ID: uuid.Must(uuid.NewV7()).String(), EventID: uuid.Must(uuid.NewV7()).String(),
		Tenant: tenant, IdempotencyKey: key, RequestHash: "h", Endpoint: "/v1/chat/completions", Model: "m",
		Body: json.RawMessage(`{}`), MaxAttempts: 3, Deadline: now.Add(time.Hour), Now: now})
	return err
}

func listed(t *testing.T, db *sql.DB, tenant string) bool {
	t.Helper()
	var n int
	if err := db.QueryRow(`SELECT count(*) FROM job_tenants WHERE tenant = $1`, tenant).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n == 1
}

// committedListed commits tx, waits for the results in waits, and says
// whether tenant is listed then.
func committedListed(t *testing.T, tx *sql.Tx, db *sql.DB, tenant string, waits ...chan error) bool {
	t.Helper()
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	for _, w := range waits {
		if err := <-w; err != nil {
			t.Fatal(err)
		}
	}
	return listed(t, db, tenant)
}

// TestPruneSkipsTenantBeingListed: a transaction that makes the tenant's
// job runnable again is in flight (it found the tenant's row, so it lists
// nothing) when the reaper prunes; the prune, which cannot see that job
// yet, leaves the tenant listed.
func TestPruneSkipsTenantBeingListed(t *testing.T) {
	ctx := context.Background()
	s := migratedFresh(t)
	now := time.Now()
	j := idleTenant(t, s, "late", now)
	tx, err := s.DB().BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback()
	// What a failed attempt's end does to the row, by hand so that its
	// transaction stays open.
	if _, err := tx.ExecContext(ctx, `UPDATE jobs SET state = 'RETRY_SCHEDULED', lease_until = 0 WHERE id = $1`, j.ID); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Reap(ctx, now.Add(2*time.Minute), 100); err != nil {
		t.Fatal(err)
	}
	if !committedListed(t, tx, s.DB(), "late") {
		t.Fatal("the prune dropped a tenant whose job a transaction in flight made runnable")
	}
}

// TestListingWaitsForPrune: the prune holds the tenant's key and has
// dropped its row when an acceptance of the tenant's job comes; the
// acceptance waits for the prune to end and lists the tenant again.
func TestListingWaitsForPrune(t *testing.T) {
	ctx := context.Background()
	s := migratedFresh(t)
	now := time.Now()
	idleTenant(t, s, "late", now)
	tx, err := s.DB().BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback()
	var keyed bool
	if err := tx.QueryRowContext(ctx, `SELECT kvgate_try_prune_tenant_key('late')`).Scan(&keyed); err != nil || !keyed {
		t.Fatalf("the prune's key: %v, %v", keyed, err)
	}
	if _, err := tx.ExecContext(ctx, `DELETE FROM job_tenants WHERE tenant = 'late'`); err != nil {
		t.Fatal(err)
	}
	accepted := make(chan error, 1)
	go func() { accepted <- acceptJob(s, "late", "k1", now.Add(2*time.Minute)) }()
	// The acceptance waits on the key (an advisory lock not granted).
	for waiting := false; !waiting; {
		if err := s.DB().QueryRowContext(ctx, `SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND NOT granted)`).Scan(&waiting); err != nil {
			t.Fatal(err)
		}
		select {
		case err := <-accepted:
			t.Fatalf("the acceptance ended (%v) while the prune held the tenant's key", err)
		case <-time.After(5 * time.Millisecond):
		}
	}
	if !committedListed(t, tx, s.DB(), "late", accepted) {
		t.Fatal("the acceptance that waited for the prune did not list its tenant again")
	}
}

// TestPruneBounded: one reaper's pass drops at most 256 idle tenants (the
// keys it holds until it commits); the next pass drops the rest.
func TestPruneBounded(t *testing.T) {
	ctx := context.Background()
	s := migratedFresh(t)
	now := time.Now()
	for i := range 300 {
		acceptAt(t, s, fmt.Sprintf("idle%03d", i), "k", now)
	}
	if js, err := s.Claim(ctx, now.Add(time.Second), 2*time.Hour, 300, "m"); err != nil || len(js) != 300 {
		t.Fatalf("claim: %d jobs, %v", len(js), err)
	}
	count := func() (n int) {
		t.Helper()
		if err := s.DB().QueryRowContext(ctx, `SELECT count(*) FROM job_tenants`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	for pass, want := range []int{300 - 256, 0} {
		if _, err := s.Reap(ctx, now.Add(2*time.Minute), 100); err != nil {
			t.Fatal(err)
		}
		if n := count(); n != want {
			t.Errorf("after pass %d: %d tenants listed, want %d", pass+1, n, want)
		}
	}
}

// TestPruneFinalSkipsJobBeingReplayed: a final job a transaction in flight
// is bringing back (a replay: READY, with its event) is not pruned under
// it. The prune chose its jobs without locking them, then deleted the
// chosen once the replay committed: the replayed job and its event went.
func TestPruneFinalSkipsJobBeingReplayed(t *testing.T) {
	ctx := context.Background()
	s := migratedFresh(t)
	old := time.Now().Add(-48 * time.Hour)
	acceptAt(t, s, "acme", "old", old)
	js, err := s.Claim(ctx, old, time.Minute, 1, "m")
	if err != nil || len(js) != 1 {
		t.Fatalf("claim: %d jobs, %v", len(js), err)
	}
	if _, err := s.Cancel(ctx, "acme", js[0].ID, uuid.Must(uuid.NewV7()).String(), old); err != nil {
		t.Fatal(err)
	}
	publish := func() { // as the relay would
		for {
			evs, err := s.Unpublished(ctx, 100)
			if err != nil {
				t.Fatal(err)
			}
			if len(evs) == 0 {
				return
			}
			ids := make([]string, len(evs))
			for i, e := range evs {
				ids[i] = e.ID
			}
			if err := s.MarkPublished(ctx, ids, old); err != nil {
				t.Fatal(err)
			}
		}
	}
	acceptAt(t, s, "acme", "later", time.Now()) // its event holds the feed's last place (kept)
	publish()
	tx, err := s.DB().BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback()
	if _, err := tx.ExecContext(ctx, `UPDATE jobs SET state = 'READY', updated_at = $2 WHERE id = $1`, js[0].ID, time.Now().UnixMicro()); err != nil {
		t.Fatal(err)
	}
	pctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	n, err := s.PruneFinal(pctx, time.Now().Add(-time.Hour), 10)
	if err != nil || n != 0 {
		t.Errorf("prune beside a replay in flight: %d pruned, %v; want none, at once", n, err)
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	if j, err := s.Get(ctx, "acme", js[0].ID); err != nil || j.State != store.Ready {
		t.Errorf("the replayed job after the prune: %+v, %v; want READY", j, err)
	}
}
