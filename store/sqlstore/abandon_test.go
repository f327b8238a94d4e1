package sqlstore_test

import (
	"context"
	"errors"
	"path/filepath"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/kvgate/kvgate/store"
	"github.com/kvgate/kvgate/store/postgres/pgtest"
	"github.com/kvgate/kvgate/store/sqlite"
	"github.com/kvgate/kvgate/store/sqlstore"
)

// TestAbandonedAcquisitionUndone: a caller that stops waiting for its
// acquisition's batch (the store stalled past quotaWait) is told the
// store did not answer, and gets 503 from the gateway; when the batch
// then commits for the callers still waiting, that caller's permit is
// given back, rather than holding its tenant's concurrency and
// reservation until its lease (an hour here) runs out.
func TestAbandonedAcquisitionUndone(t *testing.T) {
	for _, backend := range []string{"sqlite", "postgres"} {
		t.Run(backend, func(t *testing.T) {
			var s *sqlstore.Store
			if backend == "postgres" {
				s = pgtest.Open(t)
			} else {
				var err error
				if s, err = sqlite.Open(context.Background(), filepath.Join(t.TempDir(), "kv.db")); err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { s.Close() })
				if _, err := sqlite.Migrate(context.Background(), s); err != nil {
					t.Fatal(err)
				}
			}
			testAbandonedAcquisitionUndone(t, s)
		})
	}
}

func testAbandonedAcquisitionUndone(t *testing.T, s *sqlstore.Store) {
	ctx := context.Background()
	now := time.Date(2026, 12, 5, 12, 0, 0, 0, time.UTC)
	l := store.Limits{MaxConcurrency: 2}
	acq := func(tokens int64) store.Acquisition {
		return store.Acquisition{PermitID: uuid.Must(uuid.NewV7()).String(), Tenant: "acme", Tokens: tokens, Limits: l, Now: now, Lease: time.Hour}
	}
	type outcome struct {
		p   store.Permit
		err error
	}
	acquire := func(a store.Acquisition) chan outcome {
		ch := make(chan outcome, 1)
		go func() {
			p, err := s.Acquire(ctx, a)
			ch <- outcome{p, err}
		}()
		return ch
	}
	waitPending := func(n int) {
		t.Helper()
		for deadline := time.Now().Add(10 * time.Second); sqlstore.QuotaPending(s) < n; time.Sleep(time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("%d calls in the open batch, want %d", sqlstore.QuotaPending(s), n)
			}
		}
	}

	release := sqlstore.HoldQuotaSlots(s) // the store stalls
	first := acquire(acq(10))             // opens the batch, and waits on
	waitPending(1)
	sqlstore.SetQuotaWait(s, 50*time.Millisecond)
	gaveUp := acquire(acq(20)) // joins it, and gives up
	if o := <-gaveUp; !errors.Is(o.err, context.DeadlineExceeded) {
		t.Fatalf("the caller that stopped waiting: %+v, want the wait's deadline", o)
	}
	sqlstore.SetQuotaWait(s, time.Minute)
	release() // the store comes back: the batch commits both
	if o := <-first; o.err != nil {
		t.Fatalf("the caller that waited: %v", o.err)
	}

	// The tenant holds one permit (first's), not two: a second request is
	// admitted once the abandoned permit is given back, and the ledger
	// reserves first's tokens alone.
	var err error
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(5 * time.Millisecond) {
		var p store.Permit
		if p, err = s.Acquire(ctx, acq(5)); err == nil {
			if err := s.Release(ctx, store.Release{Permit: p, Outcome: store.NotSent, Now: now}); err != nil {
				t.Fatal(err)
			}
			break
		}
		var qe *store.QuotaError
		if !errors.As(err, &qe) || qe.Limit != "concurrency" {
			t.Fatalf("second request: %v", err)
		}
	}
	if err != nil {
		t.Fatalf("the abandoned permit still holds the tenant's concurrency: %v", err)
	}
	u, err := s.Usage(ctx, "acme", now, now)
	if err != nil {
		t.Fatal(err)
	}
	if len(u) != 1 || u[0].ReservedTokens != 10 {
		t.Errorf("ledger: %+v, want first's 10 tokens reserved alone", u)
	}
}
