package postgres_test

import (
	"context"
	"database/sql"
	"testing"
	"time"

	"github.com/google/uuid"
	_ "github.com/jackc/pgx/v5/stdlib"

	"github.com/kvgate/kvgate/store"
	"github.com/kvgate/kvgate/store/postgres/pgtest"
)

// TestFanoutBesideEarlierReleases: since migration 25 kvgate's statements
// make the webhook deliveries of the events they write, and the outbox's
// row trigger makes them only for a connection that does not say so (an
// earlier release's, still running during an upgrade). Each event gets one
// delivery per subscribed endpoint whichever wrote it, never two.
func TestFanoutBesideEarlierReleases(t *testing.T) {
	ctx := context.Background()
	url := pgtest.FreshDatabase(t)
	s := pgtest.OpenURL(t, url)
	t0 := time.Unix(1_700_000_000, 0)
	hook := store.WebhookEndpoint{ID: "we_1", Tenant: "acme", URL: "http://127.0.0.1:1/hook", Events: []string{"job.succeeded"},
		Secret: "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", CreatedAt: t0}
	if err := s.CreateEndpoint(ctx, hook); err != nil {
		t.Fatal(err)
	}
	deliveries := func(event string) int {
		t.Helper()
		var n int
		if err := s.DB().QueryRowContext(ctx, `SELECT count(*) FROM webhook_deliveries WHERE event_id = $1 AND endpoint_id = $2`,
			event, hook.ID).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}

	// kvgate's own end of an attempt: one delivery, made by its statement.
	if _, _, err := s.Accept(ctx, store.NewJob{ID: uuid.Must(uuid.NewV7()).String(), Tenant: "acme", IdempotencyKey: "k1",
		RequestHash: "h", Endpoint: "/v1/chat/completions", Model: "m", Body: []byte(`{}`), MaxAttempts: 3,
		Deadline: t0.Add(time.Hour), Now: t0}); err != nil {
		t.Fatal(err)
	}
	js, err := s.Claim(ctx, t0, time.Minute, 1)
	if err != nil || len(js) != 1 {
		t.Fatalf("claim: %v, %v", js, err)
	}
	own := uuid.Must(uuid.NewV7()).String()
	if err := s.Complete(ctx, store.Completion{JobID: js[0].ID, Fence: js[0].Fence, State: store.Succeeded, Result: []byte(`{}`),
		Attempt: store.Attempt{JobID: js[0].ID, Attempt: 1, Fence: js[0].Fence, Outcome: store.OutcomeSucceeded, Spent: true, Sent: true},
		EventID: own, Now: t0}); err != nil {
		t.Fatal(err)
	}
	if n := deliveries(own); n != 1 {
		t.Errorf("kvgate's own event: %d deliveries, want 1", n)
	}

	// An earlier release's connection: no kvgate.fanout, and an INSERT
	// into the outbox that makes no delivery itself. The trigger makes it.
	earlier, err := sql.Open("pgx", url)
	if err != nil {
		t.Fatal(err)
	}
	defer earlier.Close()
	earlier.SetMaxOpenConns(1)
	insert := `INSERT INTO outbox (id, job_id, tenant, type, state, state_version, created_at) VALUES ($1, $2, 'acme', $3, 'SUCCEEDED', 3, 1)`
	old := uuid.Must(uuid.NewV7()).String()
	if _, err := earlier.ExecContext(ctx, insert, old, js[0].ID, "job.succeeded"); err != nil {
		t.Fatal(err)
	}
	if n := deliveries(old); n != 1 {
		t.Errorf("an earlier release's event: %d deliveries, want 1", n)
	}
	// A job.running event, which no endpoint can subscribe to, makes none
	// on either path.
	running := uuid.Must(uuid.NewV7()).String()
	if _, err := earlier.ExecContext(ctx, insert, running, js[0].ID, "job.running"); err != nil {
		t.Fatal(err)
	}
	if n := deliveries(running); n != 0 {
		t.Errorf("job.running: %d deliveries", n)
	}
	// A connection that fans out itself without saying so: the trigger
	// finds the delivery made and adds none.
	both := uuid.Must(uuid.NewV7()).String()
	if _, err := earlier.ExecContext(ctx, `WITH ev AS (`+insert+` RETURNING id, tenant)
		INSERT INTO webhook_deliveries (id, endpoint_id, tenant, event_id, job_id, type, job_state, state_version, event_at,
			state, due_at, created_at, updated_at)
		SELECT 'msg_both', 'we_1', 'acme', ev.id, $2, 'job.succeeded', 'SUCCEEDED', 3, 1, 'PENDING', 1, 1, 1 FROM ev`,
		both, js[0].ID, "job.succeeded"); err != nil {
		t.Fatal(err)
	}
	if n := deliveries(both); n != 1 {
		t.Errorf("an event fanned out by its statement and seen by the trigger: %d deliveries, want 1", n)
	}
	// A connection that says it fans out itself and does not: the trigger
	// leaves it alone (this is what keeps it off kvgate's own writes).
	if _, err := earlier.ExecContext(ctx, `SET kvgate.fanout = 'inline'`); err != nil {
		t.Fatal(err)
	}
	skipped := uuid.Must(uuid.NewV7()).String()
	if _, err := earlier.ExecContext(ctx, insert, skipped, js[0].ID, "job.succeeded"); err != nil {
		t.Fatal(err)
	}
	if n := deliveries(skipped); n != 0 {
		t.Errorf("the trigger fanned out for a connection that fans out itself: %d deliveries", n)
	}
}
