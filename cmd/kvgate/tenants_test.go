package main

import (
	"context"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/kvgate/kvgate/gateway"
	"github.com/kvgate/kvgate/store/postgres/pgtest"
)

// kv runs one kvgate command and returns its standard output and error.
func kv(t *testing.T, args ...string) (string, string, error) {
	t.Helper()
	var stdout, stderr syncBuffer
	err := run(context.Background(), args, noenv, &stdout, &stderr)
	return stdout.String(), stderr.String(), err
}

func TestTenantsAndKeysCommands(t *testing.T) {
	stores := map[string]func(t *testing.T) string{
		"sqlite":   func(t *testing.T) string { return "sqlite://" + filepath.Join(t.TempDir(), "kvgate.db") },
		"postgres": func(t *testing.T) string { return pgtest.FreshDatabase(t) },
	}
	for name, url := range stores {
		t.Run(name, func(t *testing.T) { testTenantsAndKeys(t, url(t)) })
	}
}

func testTenantsAndKeys(t *testing.T, url string) {
	must := func(args ...string) string {
		t.Helper()
		out, errOut, err := kv(t, append(args, "--store", url)...)
		if err != nil {
			t.Fatalf("kvgate %s: %v\n%s", strings.Join(args, " "), err, errOut)
		}
		return out
	}
	fails := func(want string, args ...string) {
		t.Helper()
		_, _, err := kv(t, append(args, "--store", url)...)
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("kvgate %s: %v, want an error with %q", strings.Join(args, " "), err, want)
		}
	}
	// Only migrate (and serve) change the schema: the other commands
	// refuse a store that lacks migrations.
	fails("lacks this kvgate's migrations", "tenants", "list")
	fails("run kvgate migrate", "keys", "list")
	must("migrate")
	// Flags after the name, as people type them.
	out := must("tenants", "create", "acme", "--rpm", "60", "--tpm", "10000", "--max-concurrency", "4", "--daily-tokens", "1000000")
	if !regexp.MustCompile(`(?m)^acme\s+1\s+60\s+10000\s+4\s+-\s+-\s+1000000\s+-\s+-\s+-\s*$`).MatchString(out) {
		t.Errorf("tenants create printed:\n%s", out)
	}
	must("tenants", "create", "--weight", "3", "globex")
	fails("already exists", "tenants", "create", "acme")
	out = must("tenants", "update", "acme", "--rpm", "120", "--max-pending-jobs", "50")
	if !regexp.MustCompile(`(?m)^acme\s+1\s+120\s+10000\s+4\s+50\s+-\s+1000000\s+-\s+-\s+-\s*$`).MatchString(out) {
		t.Errorf("tenants update kept the other limits? printed:\n%s", out)
	}
	out = must("tenants", "update", "acme", "--daily-spend", "2.5", "--monthly-spend", "40")
	if !regexp.MustCompile(`(?m)^acme\s+1\s+120\s+10000\s+4\s+50\s+-\s+1000000\s+-\s+2\.5\s+40\s*$`).MatchString(out) {
		t.Errorf("tenants update with spending budgets printed:\n%s", out)
	}
	fails("0 (unlimited) or more", "tenants", "update", "acme", "--daily-spend", "-1")
	fails("no tenant", "tenants", "update", "nobody", "--rpm", "1")
	fails("0 (unlimited) or more", "tenants", "update", "acme", "--rpm", "-1")
	out = must("tenants", "list")
	lines := strings.Split(strings.TrimSpace(out), "\n")
	if len(lines) != 3 || !strings.HasPrefix(lines[0], "NAME") || !strings.HasPrefix(lines[1], "acme ") || !strings.HasPrefix(lines[2], "globex ") {
		t.Errorf("tenants list:\n%s", out)
	}

	// keys create prints the key alone on standard output.
	key := must("keys", "create", "--tenant", "acme", "--role", "operator", "--name", "ci")
	if !regexp.MustCompile(`^kvg_[A-Za-z0-9_-]{43}\n$`).MatchString(key) {
		t.Fatalf("keys create printed %q, want the key alone", key)
	}
	key = strings.TrimSpace(key)
	fails("no tenant", "keys", "create", "--tenant", "nobody")
	fails("not user, operator or admin", "keys", "create", "--tenant", "acme", "--role", "root")
	out = must("keys", "list", "--tenant", "acme")
	if strings.Contains(out, key) || !strings.Contains(out, key[:10]+"...") || !strings.Contains(out, "operator") || !strings.Contains(out, " ci ") {
		t.Errorf("keys list shows the key, or lacks its prefix, role or name:\n%s", out)
	}
	id := regexp.MustCompile(`key_[0-9a-f]{16}`).FindString(out)
	if id == "" {
		t.Fatalf("no key id in:\n%s", out)
	}
	// The stored hash is the key's.
	st, err := (&storeFlags{url: url}).open(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	if k, err := st.KeyByHash(context.Background(), gateway.HashKey(key)); err != nil || k.ID != id || k.Tenant != "acme" {
		t.Fatalf("key by hash: %+v, %v", k, err)
	}
	// Rotation: a new key like the old, the old revoked.
	rotated := strings.TrimSpace(must("keys", "rotate", id))
	if !strings.HasPrefix(rotated, "kvg_") || rotated == key {
		t.Fatalf("keys rotate printed %q", rotated)
	}
	if _, err := st.KeyByHash(context.Background(), gateway.HashKey(key)); err == nil {
		t.Error("the rotated key still works")
	}
	if k, err := st.KeyByHash(context.Background(), gateway.HashKey(rotated)); err != nil || k.Role != "operator" || k.Name != "ci" {
		t.Errorf("the new key: %+v, %v", k, err)
	}
	fails("no valid key", "keys", "revoke", id)
	newID := regexp.MustCompile(`key_[0-9a-f]{16}`).FindAllString(must("keys", "list"), -1)
	if len(newID) != 2 {
		t.Fatalf("keys list: ids %v", newID)
	}
	must("keys", "revoke", newID[1])
	if n, err := st.ActiveKeys(context.Background()); err != nil || n != 0 {
		t.Errorf("active keys after revoking both: %d, %v", n, err)
	}
	// Deleting a tenant revokes its keys.
	admin := strings.TrimSpace(must("keys", "create", "--tenant", "globex", "--role", "admin"))
	must("tenants", "delete", "globex")
	if _, err := st.KeyByHash(context.Background(), gateway.HashKey(admin)); err == nil {
		t.Error("a deleted tenant's key still works")
	}
	fails("no tenant", "tenants", "delete", "globex")
	fails("was deleted", "tenants", "create", "globex")
	fails("unknown tenants command", "tenants", "rename", "acme")
	fails("takes 1 argument", "tenants", "create")
}

func TestQuotaConfig(t *testing.T) {
	env := map[string]string{"KVGATE_ADMIN_KEY": "adm", "KVGATE_QUOTA_FAIL_OPEN": "true"}
	getenv := func(k string) string { return env[k] }
	cfg, _, err := parseConfig("serve", "", nil, getenv, io.Discard)
	if err != nil || cfg.AdminKey != "adm" || !cfg.Quotas.FailOpen || cfg.adminKeys()["adm"] != "admin" {
		t.Errorf("from the environment: %+v, %v", cfg, err)
	}
	cfg, _, err = parseConfig("serve", "", []string{"--admin-key", "flag", "--quota-fail-open=false"}, getenv, io.Discard)
	if err != nil || cfg.AdminKey != "flag" || cfg.Quotas.FailOpen {
		t.Errorf("flags over the environment: %+v, %v", cfg, err)
	}
	if cfg, _, err := parseConfig("serve", "", nil, noenv, io.Discard); err != nil || cfg.adminKeys() != nil || cfg.Quotas.FailOpen {
		t.Errorf("defaults: fail closed, no admin key: %+v, %v", cfg, err)
	}
}

// TestServeWithStoreTenants: keys made with the CLI work against serve on
// the same store, the bootstrap admin key reaches the admin API, and a
// tenant's quota is enforced.
func TestServeWithStoreTenants(t *testing.T) {
	dir := t.TempDir()
	url := "sqlite://" + filepath.Join(dir, "kvgate.db")
	if _, errOut, err := kv(t, "serve", "--no-migrate", "--data-dir", dir, "--store", url); err == nil || !strings.Contains(err.Error(), "lacks this kvgate's migrations") {
		t.Fatalf("serve --no-migrate on a store without the schema: %v, want a refusal naming kvgate migrate\n%s", err, errOut)
	}
	if _, errOut, err := kv(t, "migrate", "--store", url); err != nil {
		t.Fatalf("%v\n%s", err, errOut)
	}
	if _, errOut, err := kv(t, "tenants", "create", "acme", "--rpm", "1", "--store", url); err != nil {
		t.Fatalf("%v\n%s", err, errOut)
	}
	key, errOut, err := kv(t, "keys", "create", "--tenant", "acme", "--store", url)
	if err != nil {
		t.Fatalf("%v\n%s", err, errOut)
	}
	key = strings.TrimSpace(key)

	base, stderr := startServe(t, "--data-dir", dir, "--store", url, "--admin-key", "bootstrap")
	do := func(method, path, key, body string) int {
		req, _ := http.NewRequest(method, base+path, strings.NewReader(body))
		req.Header.Set("Authorization", "Bearer "+key)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	chat := `{"model":"meta-llama/Llama-3.1-8B-Instruct","messages":[{"role":"user","content":"hi"}],"max_tokens":2}`
	for deadline := time.Now().Add(10 * time.Second); do(http.MethodGet, "/v1/models", key, "") != http.StatusOK; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("the CLI's key never worked:\n%s", stderr.String())
		}
	}
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		if code := do(http.MethodPost, "/v1/chat/completions", key, chat); code == http.StatusOK {
			break
		} else if time.Now().After(deadline) {
			t.Fatalf("chat: %d\n%s", code, stderr.String())
		}
	}
	if code := do(http.MethodPost, "/v1/chat/completions", key, chat); code != http.StatusTooManyRequests {
		t.Errorf("second request in the minute against an RPM of 1: %d, want 429", code)
	}
	if code := do(http.MethodGet, "/v1/admin/tenants", "bootstrap", ""); code != http.StatusOK {
		t.Errorf("admin API with the bootstrap key: %d", code)
	}
	if code := do(http.MethodGet, "/v1/admin/tenants", key, ""); code != http.StatusForbidden {
		t.Errorf("admin API with a user key: %d, want 403", code)
	}
	if code := do(http.MethodGet, "/v1/models", "kvg_wrong", ""); code != http.StatusUnauthorized {
		t.Errorf("a wrong key: %d, want 401", code)
	}
}

// TestStoreCommandsReadTheConfigFile: migrate, tenants and keys reach the
// store a configuration file names, as serve does with the same file;
// --store and KVGATE_STORE still win over it.
func TestStoreCommandsReadTheConfigFile(t *testing.T) {
	dir := t.TempDir()
	inFile := filepath.Join(dir, "file.db")
	cfgPath := filepath.Join(dir, "kvgate.yaml")
	if err := os.WriteFile(cfgPath, []byte("store: sqlite://"+inFile+"\ndata_dir: "+filepath.Join(dir, "nowhere")+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	runWith := func(env map[string]string, args ...string) string {
		t.Helper()
		var stdout, stderr syncBuffer
		if err := run(context.Background(), args, func(k string) string { return env[k] }, &stdout, &stderr); err != nil {
			t.Fatalf("kvgate %s: %v\n%s", strings.Join(args, " "), err, stderr.String())
		}
		return stdout.String()
	}
	if out := runWith(nil, "migrate", "--config", cfgPath); !strings.Contains(out, inFile) {
		t.Errorf("migrate --config: %q, want the file's store %s", out, inFile)
	}
	runWith(map[string]string{"KVGATE_CONFIG": cfgPath}, "tenants", "create", "fromfile")
	if out := runWith(nil, "tenants", "list", "--store", "sqlite://"+inFile); !strings.Contains(out, "fromfile") {
		t.Errorf("KVGATE_CONFIG's store did not get the tenant; it holds:\n%s", out)
	}
	other := filepath.Join(dir, "other.db")
	runWith(nil, "migrate", "--store", "sqlite://"+other)
	runWith(map[string]string{"KVGATE_CONFIG": cfgPath, "KVGATE_STORE": "sqlite://" + other}, "tenants", "create", "fromenv")
	runWith(nil, "tenants", "create", "fromflag", "--config", cfgPath, "--store", "sqlite://"+other)
	out := runWith(nil, "tenants", "list", "--store", "sqlite://"+other)
	if !strings.Contains(out, "fromenv") || !strings.Contains(out, "fromflag") {
		t.Errorf("KVGATE_STORE and --store beside a config file: the other store holds\n%s", out)
	}
	if _, err := os.Stat(filepath.Join(dir, "nowhere")); err == nil {
		t.Error("the file's data_dir was made though the file names its store")
	}
	runWith(nil, "keys", "create", "--tenant", "fromfile", "--config", cfgPath) // the tenant is in the file's store only
	if out := runWith(nil, "keys", "list", "--store", "sqlite://"+inFile); !strings.Contains(out, "fromfile") {
		t.Errorf("keys create --config: the file's store lists\n%s", out)
	}
	var stderr syncBuffer
	err := run(context.Background(), []string{"tenants", "list", "--config", filepath.Join(dir, "missing.yaml")}, noenv, io.Discard, &stderr)
	if err == nil || !strings.Contains(err.Error(), "missing.yaml") {
		t.Errorf("a missing config file: %v, want an error naming it", err)
	}
}
