package gateway

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/kvgate/kvgate/store"
)

// Authentication. A bearer token is looked up in the static maps of the
// configuration first (APIKeys, OperatorKeys, AdminKeys: small setups and
// a bootstrap administrator), then among the store's keys by its SHA-256.
// Store lookups are cached in process for Tenants.CacheTTL (5 s by
// default), found or not: a key revoked on any replica stops working on
// every replica within that TTL, and at once on the replica that revoked
// it (a lookup in flight across the revocation does not cache what it read
// before it).
//
// A caller without a valid key gets 401. Only in development mode
// (Config.Dev) is a caller without a key let in, as the "default" tenant's
// administrator, and only while no key exists: no static key is
// configured and the store has never held one (a revoked key counts). The
// first key ends development mode for good: revoking every key afterwards
// leaves a gateway that answers 401 to everyone, never an open one.

// KeyPrefix starts every key kvgate issues.
const KeyPrefix = "kvg_"

// NewAPIKey returns a new random key, to be shown once, and its stored
// form (its hash, never the key) for tenant with role.
func NewAPIKey(tenant string, role store.Role, name string, now time.Time) (string, store.APIKey) {
	var b [32]byte
	_, _ = rand.Read(b[:]) // never fails
	secret := KeyPrefix + base64.RawURLEncoding.EncodeToString(b[:])
	var id [8]byte
	_, _ = rand.Read(id[:])
	return secret, store.APIKey{
		ID: "key_" + hex.EncodeToString(id[:]), Hash: HashKey(secret), Prefix: secret[:len(KeyPrefix)+6],
		Tenant: tenant, Role: role, Name: name, CreatedAt: now,
	}
}

// HashKey is what the store keeps of a key: its SHA-256, in hex. A fast
// hash is right for 32 random bytes: there is nothing to guess.
func HashKey(key string) string {
	h := sha256.Sum256([]byte(key))
	return hex.EncodeToString(h[:])
}

// principal is who a request authenticated as.
type principal struct {
	tenant    string
	role      store.Role
	keyID     string       // "" for a static key or development mode
	keyLimits store.Limits // the stored key's own limits
}

type principalKey struct{}

func principalOf(ctx context.Context) principal {
	p, _ := ctx.Value(principalKey{}).(principal)
	return p
}

// isAdmin reports whether the caller may manage tenants and keys.
func isAdmin(ctx context.Context) bool { return principalOf(ctx).role == store.RoleAdmin }

// errKeysUnavailable: a token could not be checked because the store did
// not answer.
var errKeysUnavailable = errors.New("key store unavailable")

// keyCache remembers store lookups for a short while. Keys found and
// tokens not found are kept apart, each map bounded: a flood of wrong
// tokens empties the misses only, never evicts the valid keys in use.
type keyCache struct {
	ttl  time.Duration
	now  func() time.Time
	mu   sync.Mutex
	m    map[string]keyEntry // keys found, by hash
	miss map[string]keyEntry // tokens not found, by hash
	// gen counts the forgets: a lookup caches its answer only if none
	// happened while it read the store, so that a key read before its
	// revocation is not cached after it.
	gen uint64
	// held: the store holds or has held a key, and development mode is
	// over for good. heldUntil: until when a "never held one" is trusted.
	held      bool
	heldUntil time.Time
}

type keyEntry struct {
	p     principal
	found bool
	until time.Time
}

// keyCacheMax bounds each of keyCache's maps.
const keyCacheMax = 10_000

// keyShaped reports whether token could be a key NewAPIKey made: a token
// of another shape is refused without asking the store.
func keyShaped(token string) bool {
	const n = len(KeyPrefix) + 43 // 32 bytes, unpadded base64
	if len(token) != n || !strings.HasPrefix(token, KeyPrefix) {
		return false
	}
	for _, c := range []byte(token[len(KeyPrefix):]) {
		if !('a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || c == '-' || c == '_') {
			return false
		}
	}
	return true
}

func (s *Server) lookupKey(ctx context.Context, token string) (principal, bool, error) {
	if !keyShaped(token) {
		return principal{}, false, nil
	}
	c := s.keys
	hash := HashKey(token)
	now := c.now()
	c.mu.Lock()
	e, ok := c.m[hash]
	if !ok {
		e, ok = c.miss[hash]
	}
	gen := c.gen
	c.mu.Unlock()
	if ok && now.Before(e.until) {
		return e.p, e.found, nil
	}
	k, err := s.cfg.Tenants.Store.KeyByHash(ctx, hash)
	switch {
	case errors.Is(err, store.ErrNotFound):
		e = keyEntry{until: now.Add(c.ttl)}
	case err != nil:
		s.log.Warn("key lookup failed", "err", err)
		return principal{}, false, errKeysUnavailable
	default:
		e = keyEntry{p: principal{tenant: k.Tenant, role: k.Role, keyID: k.ID, keyLimits: k.Limits}, found: true, until: now.Add(c.ttl)}
	}
	c.mu.Lock()
	c.held = c.held || e.found
	if c.gen == gen {
		m := c.miss
		if e.found {
			m = c.m
			delete(c.miss, hash)
		} else {
			delete(c.m, hash)
		}
		if len(m) >= keyCacheMax {
			clear(m)
		}
		m[hash] = e
	}
	c.mu.Unlock()
	return e.p, e.found, nil
}

// storeHeldKeys reports whether the store holds or has ever held a key; a
// store that does not answer counts as having held one (no development
// mode by accident).
func (s *Server) storeHeldKeys(ctx context.Context) bool {
	c := s.keys
	now := c.now()
	c.mu.Lock()
	held, known, gen := c.held, now.Before(c.heldUntil), c.gen
	c.mu.Unlock()
	if held || known {
		return held
	}
	// Revoked keys are listed too: a store whose keys were all revoked
	// has held one. This runs in development mode only, until a key shows.
	ks, _, err := s.cfg.Tenants.Store.ListKeys(ctx, "", "", 1)
	if err != nil {
		s.log.Warn("key listing failed: no development mode", "err", err)
		return true
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	switch {
	case len(ks) > 0:
		c.held = true
	case c.gen == gen:
		c.heldUntil = now.Add(c.ttl)
	}
	return c.held
}

// forgetAll drops every cached key, after a change through this replica.
func (c *keyCache) forgetAll() {
	c.mu.Lock()
	c.gen++
	clear(c.m)
	clear(c.miss)
	c.heldUntil = time.Time{}
	c.mu.Unlock()
}

// forget drops a cached key, after a revocation through this replica.
func (c *keyCache) forget(hash string) {
	c.mu.Lock()
	c.gen++
	delete(c.m, hash)
	delete(c.miss, hash)
	c.heldUntil = time.Time{}
	c.mu.Unlock()
}

// created records a key stored through this replica: development mode is
// over.
func (c *keyCache) created() {
	c.forgetAll()
	c.mu.Lock()
	c.held = true
	c.mu.Unlock()
}

// initAuth checks that some caller can authenticate, and says so in the
// log when development mode is on.
func (s *Server) initAuth() error {
	if !s.cfg.Dev {
		if !s.hasStaticKeys() && s.cfg.Tenants.Store == nil {
			return errors.New("no caller could authenticate: configure a key, a tenant store or development mode")
		}
		return nil
	}
	s.log.Warn("development mode: a caller without a key is tenant default's administrator until the first key exists; never in production",
		"static_keys", s.hasStaticKeys())
	return nil
}

func (s *Server) hasStaticKeys() bool {
	return len(s.cfg.APIKeys)+len(s.cfg.OperatorKeys)+len(s.cfg.AdminKeys) > 0
}

// devOpen reports whether development mode lets a caller in without a key:
// no static key, and a store that has never held one.
func (s *Server) devOpen(ctx context.Context) bool {
	if !s.cfg.Dev || s.hasStaticKeys() {
		return false
	}
	return s.keys == nil || !s.storeHeldKeys(ctx)
}

// DevOpen reports whether development mode lets a caller in without a key
// now.
func (s *Server) DevOpen(ctx context.Context) bool { return s.devOpen(ctx) }

// authenticate returns the caller's principal.
func (s *Server) authenticate(r *http.Request) (principal, error) {
	if s.devOpen(r.Context()) {
		return principal{tenant: "default", role: store.RoleAdmin}, nil
	}
	token, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
	if !ok || token == "" {
		return principal{}, &apiError{status: http.StatusUnauthorized, typ: "invalid_request_error",
			msg: "You didn't provide an API key. Provide it in the Authorization header as 'Bearer YOUR_KEY'."}
	}
	for _, m := range []struct {
		keys map[string]string
		role store.Role
	}{{s.cfg.APIKeys, store.RoleUser}, {s.cfg.OperatorKeys, store.RoleOperator}, {s.cfg.AdminKeys, store.RoleAdmin}} {
		for key, tenant := range m.keys {
			if subtle.ConstantTimeCompare([]byte(key), []byte(token)) == 1 {
				return principal{tenant: tenant, role: m.role}, nil
			}
		}
	}
	if s.keys != nil {
		p, found, err := s.lookupKey(r.Context(), token)
		if err != nil {
			return principal{}, err
		}
		if found {
			// A key cached before its tenant was deleted (on another
			// replica) works no longer once the tenant is read again.
			if _, _, err := s.tenant(r.Context(), p.tenant); errors.Is(err, errTenantDeleted) {
				return principal{}, err
			}
			return p, nil
		}
	}
	return principal{}, &apiError{status: http.StatusUnauthorized, typ: "invalid_request_error", code: "invalid_api_key",
		msg: "Incorrect API key provided."}
}
