package main

import (
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nkeys"

	"github.com/kvgate/kvgate/bench/eventually"
)

// natsTLSServer runs the nats-server binary with TLS (client
// certificates verified) and two users, one by password and one by NKey,
// on a port of its own, never 4222.
type natsTLSServer struct {
	url                   string
	ca                    *testCA
	caFile                string
	clientCert, clientKey string
	nkeySeed              string
	user, password        string
}

func startNATSTLS(t *testing.T) *natsTLSServer {
	t.Helper()
	bin := "/usr/sbin/nats-server"
	if _, err := os.Stat(bin); err != nil {
		p, err := exec.LookPath("nats-server")
		if err != nil {
			if os.Getenv("CI") == "true" {
				t.Fatal("nats-server not installed")
			}
			t.Skip("nats-server not installed")
		}
		bin = p
	}
	dir := t.TempDir()
	ca := newTestCA(t, "kvgate NATS test CA")
	s := &natsTLSServer{ca: ca, caFile: ca.file(t), user: "kvgate", password: "s3cret-nats"}
	sc, sk := ca.issue(t, 10, false)
	cc, ck := ca.issue(t, 11, true)
	write := func(name string, b []byte) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, b, 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	serverCert, serverKey := write("server.crt", sc), write("server.key", sk)
	s.clientCert, s.clientKey = write("client.crt", cc), write("client.key", ck)
	kp, err := nkeys.CreateUser()
	if err != nil {
		t.Fatal(err)
	}
	seed, _ := kp.Seed()
	pub, _ := kp.PublicKey()
	s.nkeySeed = write("user.nk", seed)

	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := ln.Addr().(*net.TCPAddr).Port
	ln.Close()
	conf := fmt.Sprintf(`listen: "127.0.0.1:%d"
jetstream { store_dir: %q }
tls { cert_file: %q, key_file: %q, ca_file: %q, verify: true, timeout: 5 }
authorization { users = [ {user: %q, password: %q}, {nkey: %q} ] }
`, port, filepath.Join(dir, "js"), serverCert, serverKey, s.caFile, s.user, s.password, pub)
	confFile := write("nats.conf", []byte(conf))
	cmd := exec.Command(bin, "-c", confFile)
	logf, _ := os.Create(filepath.Join(dir, "nats.log"))
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		logf.Close()
	})
	s.url = fmt.Sprintf("tls://127.0.0.1:%d", port)
	eventually.True(t, "nats-server listening", func() bool {
		c, err := net.Dial("tcp", fmt.Sprintf("127.0.0.1:%d", port))
		if err == nil {
			c.Close()
		}
		return err == nil
	})
	return s
}

// connectWith connects as kvgate would with a configuration's options.
func connectWith(t *testing.T, c *config) error {
	t.Helper()
	opts, err := natsOptions(c)
	if err != nil {
		return err
	}
	nc, err := nats.Connect(c.NATS.URL, append(opts, nats.Timeout(5*time.Second))...)
	if err != nil {
		return err
	}
	defer nc.Close()
	return nc.FlushTimeout(5 * time.Second)
}

// TestNATSTLSAndCredentials: against a nats-server that requires TLS
// with client certificates and a user, kvgate's options connect with the
// CA, its client certificate and a password or an NKey, and fail, each
// for its reason, without the CA, without the client certificate, with a
// wrong password; serve runs a job over that server end to end.
func TestNATSTLSAndCredentials(t *testing.T) {
	s := startNATSTLS(t)
	good := func() *config {
		c := &config{}
		c.NATS.URL = s.url
		c.NATS.TLS.CAFile, c.NATS.TLS.CertFile, c.NATS.TLS.KeyFile = s.caFile, s.clientCert, s.clientKey
		c.NATS.User, c.NATS.Password = s.user, s.password
		return c
	}
	if err := connectWith(t, good()); err != nil {
		t.Fatalf("TLS, client certificate and password: %v", err)
	}
	nk := good()
	nk.NATS.User, nk.NATS.Password, nk.NATS.NKeySeedFile = "", "", s.nkeySeed
	if err := connectWith(t, nk); err != nil {
		t.Errorf("NKey: %v", err)
	}
	for _, tc := range []struct {
		name string
		mod  func(*config)
		want string
	}{
		{"no CA", func(c *config) { c.NATS.TLS.CAFile = "" }, "certificate"},
		{"no client certificate", func(c *config) { c.NATS.TLS.CertFile, c.NATS.TLS.KeyFile = "", "" }, ""},
		{"wrong password", func(c *config) { c.NATS.Password = "wrong" }, "authorization"},
		{"two kinds of credentials", func(c *config) { c.NATS.NKeySeedFile = s.nkeySeed }, "one of"},
		{"a missing creds file", func(c *config) { c.NATS.User, c.NATS.Password, c.NATS.CredsFile = "", "", "/nonexistent.creds" }, "creds_file"},
	} {
		c := good()
		tc.mod(c)
		err := connectWith(t, c)
		if err == nil || !strings.Contains(strings.ToLower(err.Error()), tc.want) {
			t.Errorf("%s: %v, want an error mentioning %q", tc.name, err, tc.want)
		}
	}

	// server_name alone (the system's roots, a certificate naming
	// another host than the URL's) is kept, not dropped.
	named := &config{}
	named.NATS.URL, named.NATS.TLS.ServerName = "tls://10.0.0.7:4222", "nats.internal"
	opts, err := natsOptions(named)
	if err != nil {
		t.Fatal(err)
	}
	o := nats.GetDefaultOptions()
	for _, opt := range opts {
		if err := opt(&o); err != nil {
			t.Fatal(err)
		}
	}
	if o.TLSConfig == nil || o.TLSConfig.ServerName != "nats.internal" {
		t.Errorf("nats.tls.server_name alone: TLS config %+v, want the name to verify", o.TLSConfig)
	}

	// serve, its events over the TLS server.
	cfg := writeConfig(t, fmt.Sprintf("nats:\n  url: %s\n  user: %s\n  tls: {ca_file: %s, cert_file: %s, key_file: %s}\n",
		s.url, s.user, s.caFile, s.clientCert, s.clientKey))
	base, stderr := startServeEnv(t, map[string]string{"KVGATE_NATS_PASSWORD": s.password}, "--config", cfg, "--data-dir", t.TempDir())
	submitAndWait(t, base, "nats-tls-job")
	waitInboxRecorded(t, base, 30*time.Second)
	if strings.Contains(stderr.String(), s.password) {
		t.Error("the NATS password is in the log")
	}
}
