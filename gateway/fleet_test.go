package gateway

import (
	"context"
	"encoding/json"
	"net/http"
	"testing"
	"time"

	"github.com/kvgate/kvgate/store"
)

// TestFleetStream: GET /v1/fleet and its stream show every backend to an
// operator; the stream ends with an error event once its key is revoked,
// as the job streams do; a user key gets 403.
func TestFleetStream(t *testing.T) {
	st := sqliteStore(t)
	clock := &testClock{now: time.Now()} // the key cache's clock
	op := newTenant(t, st, "acme", store.Limits{}, store.RoleOperator)
	user := newKey(t, st, "acme", store.RoleUser)
	f := startFleet(t, fleetOpts{store: st, backends: 2, keysRequired: true,
		gateway: Config{Tenants: Tenants{Store: st, Now: clock.Now, CacheTTL: time.Minute}}})

	if status, b := bearer(t, f, user, http.MethodGet, "/v1/fleet", ""); status != http.StatusForbidden {
		t.Errorf("a user key's fleet: %d %s", status, b)
	}
	status, b := bearer(t, f, op, http.MethodGet, "/v1/fleet", "")
	fv := decode[fleetView](t, b)
	if status != http.StatusOK || len(fv.Backends) != 2 || fv.Backends[0].Name != "sim0" || fv.Backends[1].Name != "sim1" || fv.KVTarget <= 0 {
		t.Fatalf("the fleet: %d %s", status, b)
	}

	s := openStream(t, f.srv.URL+"/v1/fleet/events", "Authorization", "Bearer "+op)
	// The backends' capacity shows once they are scraped.
	for {
		e, ok := s.next(t)
		if !ok || e.Event != "fleet" {
			t.Fatalf("the stream sent %+v (open %v), want fleet events", e, ok)
		}
		var v fleetView
		if err := json.Unmarshal([]byte(e.Data), &v); err != nil {
			t.Fatal(err)
		}
		if len(v.Backends) == 2 && v.Backends[0].CapacityTokens > 0 && v.Backends[0].Routable && len(v.Backends[0].Models) == 1 {
			break
		}
	}
	keys, err := st.ListKeys(context.Background(), "acme")
	if err != nil {
		t.Fatal(err)
	}
	for _, k := range keys {
		if k.Hash == HashKey(op) {
			if err := st.RevokeKey(context.Background(), k.ID, time.Now()); err != nil {
				t.Fatal(err)
			}
		}
	}
	clock.Advance(2 * time.Minute) // past the TTL of every cached lookup
	for {
		e, ok := s.next(t)
		if !ok {
			t.Fatal("the stream ended without an error event")
		}
		if e.Event == "fleet" {
			continue // sent before the revocation came into force
		}
		var body errorBody
		if e.Event != "error" || json.Unmarshal([]byte(e.Data), &body) != nil || body.Error.Code == nil || *body.Error.Code != "invalid_api_key" {
			t.Fatalf("%+v, want an error event with code invalid_api_key", e)
		}
		break
	}
	if e, ok := s.next(t); ok {
		t.Errorf("the stream went on after its error event: %+v", e)
	}
}
