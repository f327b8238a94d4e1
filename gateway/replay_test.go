package gateway

import (
	"net/http"
	"testing"

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
	if resp, _ := submitJob(t, f, "k1", chatJob("something else", 4), auth...); resp.StatusCode != http.StatusConflict {
		t.Errorf("the key reused for another request: %d, want 409", resp.StatusCode)
	}
}
