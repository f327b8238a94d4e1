package gateway

import (
	"fmt"
	"net/http"
	"testing"
	"time"

	"github.com/kvgate/kvgate/bench/eventually"
	"github.com/kvgate/kvgate/store"
)

// A client that lost its 202 and retries with the same Idempotency-Key
// gets its job back even though the job itself fills the tenant's
// pending limit (and so do others, once the job has ended); a new key is
// still refused.
func TestIdempotentReplayAtPendingLimit(t *testing.T) {
	st := sqliteStore(t)
	key := newTenant(t, st, "acme", store.Limits{MaxPendingJobs: 1}, store.RoleUser)
	// No runner: the job stays READY and holds the tenant's one pending slot.
	f := startFleet(t, fleetOpts{store: st, gateway: Config{Tenants: Tenants{Store: st}}})
	auth := []string{"Authorization", "Bearer " + key}
	body := chatJob("replay me", 4)

	resp, first := submitJob(t, f, "k1", body, auth...)
	if resp.StatusCode != http.StatusAccepted {
		t.Fatalf("first submit: %d", resp.StatusCode)
	}
	resp, again := submitJob(t, f, "k1", body, auth...)
	if resp.StatusCode != http.StatusAccepted || again.ID != first.ID || resp.Header.Get("Idempotent-Replayed") != "true" {
		t.Fatalf("replay at the pending limit: %d, job %q (want %q), Idempotent-Replayed %q",
			resp.StatusCode, again.ID, first.ID, resp.Header.Get("Idempotent-Replayed"))
	}
	if resp, _ := submitJob(t, f, "k2", body, auth...); resp.StatusCode != http.StatusTooManyRequests {
		t.Errorf("a new job over the pending limit: %d, want 429", resp.StatusCode)
	}
	// The same key with another request is still a conflict, not a replay.
	if resp, _ := submitJob(t, f, "k1", chatJob("something else", 4), auth...); resp.StatusCode != http.StatusUnprocessableEntity {
		t.Errorf("the key reused for another request: %d, want 422", resp.StatusCode)
	}
}

// A replay gets its job back however the world moved since: here its
// absolute deadline has passed (the job, with no runner, still waits), so
// a new job would be refused 400, yet the retried request is the job's.
func TestIdempotentReplayAfterItsDeadlinePassed(t *testing.T) {
	f := startFleet(t, fleetOpts{jobs: true})
	deadline := time.Now().Add(1500 * time.Millisecond).UTC().Format(time.RFC3339Nano)
	body := fmt.Sprintf(`{"endpoint":"/v1/chat/completions","deadline":%q,"body":{"model":%q,"messages":[{"role":"user","content":"hi"}],"max_tokens":4}}`,
		deadline, llama)
	resp, first := submitJob(t, f, "k1", body)
	if resp.StatusCode != http.StatusAccepted {
		t.Fatalf("first submit: %d", resp.StatusCode)
	}
	eventually.True(t, "the deadline to pass", func() bool { return deadlinePassed(deadline) })
	resp, again := submitJob(t, f, "k1", body)
	if resp.StatusCode != http.StatusAccepted || again.ID != first.ID || resp.Header.Get("Idempotent-Replayed") != "true" {
		t.Errorf("replay after the deadline: %d, job %q (want %q)", resp.StatusCode, again.ID, first.ID)
	}
	if resp, _ := submitJob(t, f, "k2", body); resp.StatusCode != http.StatusBadRequest {
		t.Errorf("a new job with that deadline: %d, want 400", resp.StatusCode)
	}
}

func deadlinePassed(rfc3339 string) bool {
	d, err := time.Parse(time.RFC3339Nano, rfc3339)
	return err == nil && time.Now().After(d)
}
