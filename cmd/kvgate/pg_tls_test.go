package main

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"
)

// pgTLSCluster is a private PostgreSQL cluster (its own data directory
// and port; the shared server is not touched) that takes TCP connections
// over TLS only: passwords (scram-sha-256) for user kvgate, client
// certificates for user certuser.
type pgTLSCluster struct {
	port                  int
	caFile                string
	otherCA               string
	clientCert, clientKey string
}

func startPGTLS(t *testing.T) *pgTLSCluster {
	t.Helper()
	dirs, _ := filepath.Glob("/usr/lib/postgresql/*/bin/pg_ctl")
	slices.Sort(dirs)
	if len(dirs) == 0 {
		if os.Getenv("CI") == "true" {
			t.Fatal("no PostgreSQL server programs under /usr/lib/postgresql")
		}
		t.Skip("no PostgreSQL server programs under /usr/lib/postgresql")
	}
	bin := filepath.Dir(dirs[len(dirs)-1])
	dir, err := os.MkdirTemp("", "kvgate-pgtls-")
	if err != nil {
		t.Fatal(err)
	}
	var as []string
	uid, gid := -1, -1
	if os.Geteuid() == 0 {
		u, err := user.Lookup("postgres")
		if err != nil {
			t.Skip("running as root without a postgres user")
		}
		uid, _ = strconv.Atoi(u.Uid)
		gid, _ = strconv.Atoi(u.Gid)
		if err := os.Chown(dir, uid, gid); err != nil {
			t.Fatal(err)
		}
		as = []string{"runuser", "-u", "postgres", "--"}
	}
	run := func(prog string, args ...string) {
		t.Helper()
		argv := append(slices.Clone(as), filepath.Join(bin, prog))
		cmd := exec.Command(argv[0], append(argv[1:], args...)...)
		cmd.Dir = dir
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("%s: %v\n%s", prog, err, out)
		}
	}
	data := filepath.Join(dir, "data")
	run("initdb", "-D", data, "-A", "trust", "-U", "postgres", "--no-sync", "-E", "UTF8")

	ca := newTestCA(t, "kvgate PostgreSQL test CA")
	sc, sk := ca.issue(t, 20, false)
	cc, ck := ca.issueCN(t, 21, true, "certuser")
	c := &pgTLSCluster{caFile: ca.file(t), otherCA: newTestCA(t, "another CA").file(t)}
	write := func(path string, b []byte, owned bool) {
		if err := os.WriteFile(path, b, 0o600); err != nil {
			t.Fatal(err)
		}
		if owned && uid >= 0 {
			_ = os.Chown(path, uid, gid)
		}
	}
	write(filepath.Join(data, "server.crt"), sc, true)
	write(filepath.Join(data, "server.key"), sk, true)
	write(filepath.Join(data, "root.crt"), ca.pem, true)
	c.clientCert, c.clientKey = filepath.Join(t.TempDir(), "client.crt"), filepath.Join(t.TempDir(), "client.key")
	write(c.clientCert, cc, false)
	write(c.clientKey, ck, false)
	write(filepath.Join(data, "pg_hba.conf"), []byte(`local all all trust
hostnossl all all 127.0.0.1/32 reject
hostssl all kvgate 127.0.0.1/32 scram-sha-256
hostssl all certuser 127.0.0.1/32 cert
`), true)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	c.port = ln.Addr().(*net.TCPAddr).Port
	ln.Close()
	opts := fmt.Sprintf("-p %d -k %s -c listen_addresses=127.0.0.1 -c fsync=off -c ssl=on -c ssl_ca_file=root.crt", c.port, dir)
	run("pg_ctl", "start", "-D", data, "-w", "-t", "60", "-l", filepath.Join(dir, "server.log"), "-o", opts)
	t.Cleanup(func() {
		argv := append(slices.Clone(as), filepath.Join(bin, "pg_ctl"), "stop", "-D", data, "-m", "immediate")
		_ = exec.Command(argv[0], argv[1:]...).Run()
		os.RemoveAll(dir)
	})
	sql := "CREATE ROLE kvgate LOGIN PASSWORD 'pg-s3cret'; CREATE ROLE certuser LOGIN; CREATE DATABASE kvgate OWNER kvgate; " +
		"CREATE DATABASE kvgate_cert OWNER certuser;"
	for _, stmt := range strings.Split(sql, "; ") {
		run("psql", "-h", dir, "-p", strconv.Itoa(c.port), "-U", "postgres", "-d", "postgres", "-v", "ON_ERROR_STOP=1", "-c", strings.TrimSuffix(stmt, ";"))
	}
	return c
}

// TestPostgresTLS: kvgate's store URL takes pgx's TLS parameters
// (sslmode, sslrootcert, sslcert, sslkey): verify-full against the
// cluster's CA with a password or a client certificate opens and migrates
// the store; a plain connection, another CA, a wrong password or a
// missing client certificate are refused, each with its reason.
func timeNow() time.Time { return time.Now() }

func TestPostgresTLS(t *testing.T) {
	c := startPGTLS(t)
	ctx := context.Background()
	base := fmt.Sprintf("127.0.0.1:%d", c.port)
	open := func(url string) error {
		st, _, _, err := openStore(ctx, url, t.TempDir(), true)
		if err == nil {
			_, err = st.Stats(ctx, timeNow())
			st.Close()
		}
		return err
	}
	for _, tc := range []struct {
		name, url, want string
	}{
		{"password over verify-full", "postgres://kvgate:pg-s3cret@" + base + "/kvgate?sslmode=verify-full&sslrootcert=" + c.caFile, ""},
		{"client certificate", "postgres://certuser@" + base + "/kvgate_cert?sslmode=verify-full&sslrootcert=" + c.caFile +
			"&sslcert=" + c.clientCert + "&sslkey=" + c.clientKey, ""},
		{"plain connection refused", "postgres://kvgate:pg-s3cret@" + base + "/kvgate?sslmode=disable", "no encryption"},
		{"another CA", "postgres://kvgate:pg-s3cret@" + base + "/kvgate?sslmode=verify-full&sslrootcert=" + c.otherCA, "certificate"},
		{"wrong password", "postgres://kvgate:wrong@" + base + "/kvgate?sslmode=verify-full&sslrootcert=" + c.caFile, "password authentication failed"},
		{"no client certificate", "postgres://certuser@" + base + "/kvgate_cert?sslmode=verify-full&sslrootcert=" + c.caFile, "certificate"},
	} {
		err := open(tc.url)
		switch {
		case tc.want == "" && err != nil:
			t.Errorf("%s: %v", tc.name, err)
		case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)):
			t.Errorf("%s: %v, want an error with %q", tc.name, err, tc.want)
		case err != nil && strings.Contains(err.Error(), "pg-s3cret"):
			t.Errorf("%s: the error shows the password: %v", tc.name, err)
		}
	}
}
