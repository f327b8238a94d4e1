package gateway

import (
	"context"
	"encoding/json"
	"testing"
	"time"

	"github.com/kvgate/kvgate/store"
)

// An event stream opened with a key that is then revoked (in the store,
// as another replica revokes it) ends with an OpenAI-shaped error event
// once the key's cached lookup has expired; a stream of another key of
// the tenant goes on.
func TestRevokedKeyEndsEventStreams(t *testing.T) {
	st := sqliteStore(t)
	clock := &testClock{now: time.Now()} // the key cache's clock
	doomed := newTenant(t, st, "acme", store.Limits{}, store.RoleUser)
	kept := newKey(t, st, "acme", store.RoleUser)
	f := startFleet(t, fleetOpts{store: st, signals: true,
		gateway: Config{Tenants: Tenants{Store: st, Now: clock.Now, CacheTTL: time.Minute}}})
	auth := func(key string) []string { return []string{"Authorization", "Bearer " + key} }
	_, v := submitJob(t, f, "k1", chatJob("watched", 4), auth(doomed)...)

	streams := map[string]*sseStream{
		"job stream":    openStream(t, f.srv.URL+"/v1/jobs/"+v.ID+"/events", auth(doomed)...),
		"tenant stream": openStream(t, f.srv.URL+"/v1/events", auth(doomed)...),
	}
	other := openStream(t, f.srv.URL+"/v1/events", auth(kept)...)
	for name, s := range map[string]*sseStream{"job stream": streams["job stream"], "tenant stream": streams["tenant stream"], "other": other} {
		if e, _ := s.next(t); e.Event != "snapshot" {
			t.Fatalf("%s starts with %+v, want a snapshot", name, e)
		}
	}

	keys, _, err := st.ListKeys(context.Background(), "acme", "", 100)
	if err != nil {
		t.Fatal(err)
	}
	for _, k := range keys {
		if k.Hash == HashKey(doomed) {
			if err := st.RevokeKey(context.Background(), k.ID, time.Now()); err != nil {
				t.Fatal(err)
			}
		}
	}
	clock.Advance(2 * time.Minute) // past the TTL of every cached lookup

	for name, s := range streams {
		for {
			e, ok := s.next(t)
			if !ok {
				t.Fatalf("%s ended without an error event", name)
			}
			if e.Event == "job.accepted" {
				continue // published before the revocation came into force
			}
			var body errorBody
			if e.Event != "error" || json.Unmarshal([]byte(e.Data), &body) != nil || body.Error.Code == nil ||
				*body.Error.Code != "invalid_api_key" || body.Error.Message == "" {
				t.Fatalf("%s: %+v, want an error event with code invalid_api_key", name, e)
			}
			break
		}
		if e, ok := s.next(t); ok {
			t.Errorf("%s went on after its error event: %+v", name, e)
		}
	}
	// The tenant's other key still follows the feed.
	_, w := submitJob(t, f, "k2", chatJob("still watched", 4), auth(kept)...)
	for {
		e, ok := other.next(t)
		if !ok {
			t.Fatal("the other key's stream ended")
		}
		if ev := decodeEvent(t, e); ev.JobID == w.ID {
			break
		}
	}
}

// An admin follows another tenant's streams (?tenant=, as the console's
// tenant pages do): each recheck of the caller finds the admin still
// allowed, and the streams go on past it.
func TestAdminFollowsAnotherTenantsStreams(t *testing.T) {
	st := sqliteStore(t)
	user := newTenant(t, st, "acme", store.Limits{}, store.RoleUser)
	admin := newTenant(t, st, "root", store.Limits{}, store.RoleAdmin)
	f := startFleet(t, fleetOpts{store: st, signals: true, gateway: Config{Tenants: Tenants{Store: st}}})
	auth := func(key string) []string { return []string{"Authorization", "Bearer " + key} }
	_, v := submitJob(t, f, "k1", chatJob("watched", 4), auth(user)...)
	streams := map[string]*sseStream{
		"job stream":    openStream(t, f.srv.URL+"/v1/jobs/"+v.ID+"/events?tenant=acme", auth(admin)...),
		"tenant stream": openStream(t, f.srv.URL+"/v1/events?tenant=acme", auth(admin)...),
	}
	for name, s := range streams {
		if e, _ := s.next(t); e.Event != "snapshot" {
			t.Fatalf("%s starts with %+v, want a snapshot", name, e)
		}
	}
	// The streams recheck their caller every feedRecheck (a server
	// constant): let two rechecks pass before the next job.
	time.Sleep(2 * feedRecheck)
	_, w := submitJob(t, f, "k2", chatJob("still watched", 4), auth(user)...)
	for {
		e, ok := streams["tenant stream"].next(t)
		if !ok || e.Event == "error" {
			t.Fatalf("the admin's tenant stream ended: %+v", e)
		}
		if e.Event != "snapshot" && decodeEvent(t, e).JobID == w.ID {
			break
		}
	}
}
