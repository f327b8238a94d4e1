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
// every replica within that TTL. Without any static key and with no valid
// key in the store, the gateway runs in development mode: every caller is
// the "default" tenant's administrator.

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

// keyCache remembers store lookups for a short while.
type keyCache struct {
	ttl time.Duration
	now func() time.Time
	mu  sync.Mutex
	m   map[string]keyEntry // by hash
	// hasUntil: until when has is known; has: whether the store holds a
	// valid key (no development mode then).
	has      bool
	hasUntil time.Time
}

type keyEntry struct {
	p     principal
	found bool
	until time.Time
}

const keyCacheMax = 10_000

func (s *Server) lookupKey(ctx context.Context, token string) (principal, bool, error) {
	c := s.keys
	hash := HashKey(token)
	now := c.now()
	c.mu.Lock()
	e, ok := c.m[hash]
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
	if len(c.m) >= keyCacheMax {
		clear(c.m) // bounded: a flood of wrong tokens cannot grow it
	}
	c.m[hash] = e
	c.mu.Unlock()
	return e.p, e.found, nil
}

// storeHasKeys reports whether the store holds a valid key; a store that
// does not answer counts as holding one (no development mode by accident).
func (s *Server) storeHasKeys(ctx context.Context) bool {
	c := s.keys
	now := c.now()
	c.mu.Lock()
	if now.Before(c.hasUntil) {
		has := c.has
		c.mu.Unlock()
		return has
	}
	c.mu.Unlock()
	n, err := s.cfg.Tenants.Store.ActiveKeys(ctx)
	has := err != nil || n > 0
	c.mu.Lock()
	c.has, c.hasUntil = has, now.Add(c.ttl)
	c.mu.Unlock()
	return has
}

// forgetAll drops every cached key, after a change through this replica.
func (c *keyCache) forgetAll() {
	c.mu.Lock()
	clear(c.m)
	c.hasUntil = time.Time{}
	c.mu.Unlock()
}

// forget drops a cached key, after a revocation through this replica.
func (c *keyCache) forget(hash string) {
	c.mu.Lock()
	delete(c.m, hash)
	c.hasUntil = time.Time{}
	c.mu.Unlock()
}

// authenticate returns the caller's principal.
func (s *Server) authenticate(r *http.Request) (principal, error) {
	static := len(s.cfg.APIKeys)+len(s.cfg.OperatorKeys)+len(s.cfg.AdminKeys) > 0
	token, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
	if !static && (s.keys == nil || !s.storeHasKeys(r.Context())) {
		return principal{tenant: "default", role: store.RoleAdmin}, nil
	}
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
			return p, nil
		}
	}
	return principal{}, &apiError{status: http.StatusUnauthorized, typ: "invalid_request_error", code: "invalid_api_key",
		msg: "Incorrect API key provided."}
}
