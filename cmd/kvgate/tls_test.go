package main

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"log/slog"
	"math/big"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kvgate/kvgate/bench/eventually"
)

// testCA is a certificate authority made in the test.
type testCA struct {
	cert *x509.Certificate
	key  *ecdsa.PrivateKey
	pem  []byte
	dir  string
}

func newTestCA(t *testing.T, name string) *testCA {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: name},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	cert, _ := x509.ParseCertificate(der)
	ca := &testCA{cert: cert, key: key, pem: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), dir: t.TempDir()}
	return ca
}

func (ca *testCA) file(t *testing.T) string {
	t.Helper()
	p := filepath.Join(ca.dir, "ca.pem")
	if err := os.WriteFile(p, ca.pem, 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

func (ca *testCA) pool() *x509.CertPool {
	p := x509.NewCertPool()
	p.AddCert(ca.cert)
	return p
}

// issue signs a certificate for 127.0.0.1 and localhost (a client
// certificate when client) with the given serial, and returns the PEM of
// the certificate and of its key.
func (ca *testCA) issue(t *testing.T, serial int64, client bool) (certPEM, keyPEM []byte) {
	t.Helper()
	return ca.issueCN(t, serial, client, "kvgate-test")
}

// issueCN is issue with the certificate's common name (PostgreSQL's
// cert authentication takes the user from it).
func (ca *testCA) issueCN(t *testing.T, serial int64, client bool, cn string) (certPEM, keyPEM []byte) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	usage := x509.ExtKeyUsageServerAuth
	if client {
		usage = x509.ExtKeyUsageClientAuth
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(serial), Subject: pkix.Name{CommonName: cn},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{usage},
		IPAddresses: []net.IP{net.ParseIP("127.0.0.1")}, DNSNames: []string{"localhost"},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.cert, &key.PublicKey, ca.key)
	if err != nil {
		t.Fatal(err)
	}
	kder, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: kder})
}

// writePair writes a certificate and key to certFile and keyFile, each
// replaced whole (written aside, then renamed), as a renewal tool does.
func writePair(t *testing.T, certFile, keyFile string, certPEM, keyPEM []byte) {
	t.Helper()
	for _, f := range []struct {
		path string
		b    []byte
	}{{keyFile, keyPEM}, {certFile, certPEM}} {
		tmp := f.path + ".new"
		if err := os.WriteFile(tmp, f.b, 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(tmp, f.path); err != nil {
			t.Fatal(err)
		}
	}
}

// servedSerial connects afresh and returns the serial of the certificate
// the server presented.
func servedSerial(t *testing.T, base string, roots *x509.CertPool) int64 {
	t.Helper()
	tr := &http.Transport{TLSClientConfig: &tls.Config{RootCAs: roots}}
	defer tr.CloseIdleConnections()
	resp, err := (&http.Client{Transport: tr, Timeout: 10 * time.Second}).Get(base + "/healthz")
	if err != nil {
		t.Fatalf("GET /healthz over TLS: %v", err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK || resp.TLS == nil {
		t.Fatalf("GET /healthz over TLS: %d, TLS %v", resp.StatusCode, resp.TLS)
	}
	return resp.TLS.PeerCertificates[0].SerialNumber.Int64()
}

// TestServeTLS: with tls.cert_file and key_file serve answers HTTPS (and
// HTTP/2) with a certificate a client verifies against the test's CA;
// a renewed pair is served once the files change, a broken one is
// refused (the previous one stays, the log says why), and a SIGHUP
// reloads too.
func TestServeTLS(t *testing.T) {
	ca := newTestCA(t, "kvgate test CA")
	dir := t.TempDir()
	certFile, keyFile := filepath.Join(dir, "tls.crt"), filepath.Join(dir, "tls.key")
	c1, k1 := ca.issue(t, 1001, false)
	writePair(t, certFile, keyFile, c1, k1)
	cfg := writeConfig(t, "tls:\n  cert_file: "+certFile+"\n  key_file: "+keyFile+"\n")
	base, stderr := startServe(t, "--config", cfg, "--data-dir", t.TempDir())
	if !strings.HasPrefix(base, "https://") {
		t.Fatalf("serve printed %s, want an https:// address", base)
	}
	if got := servedSerial(t, base, ca.pool()); got != 1001 {
		t.Errorf("serial %d, want 1001", got)
	}
	// A client that does not trust the CA is refused the handshake.
	if _, err := http.Get(base + "/healthz"); err == nil || !strings.Contains(err.Error(), "certificate") {
		t.Errorf("a client without the CA: %v, want a certificate error", err)
	}
	// HTTP/2 is negotiated.
	tr := &http.Transport{TLSClientConfig: &tls.Config{RootCAs: ca.pool()}, ForceAttemptHTTP2: true}
	resp, err := (&http.Client{Transport: tr}).Get(base + "/healthz")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	tr.CloseIdleConnections()
	if resp.ProtoMajor != 2 {
		t.Errorf("protocol %s, want HTTP/2", resp.Proto)
	}

	// Renewed on disk: served without a restart.
	c2, k2 := ca.issue(t, 1002, false)
	writePair(t, certFile, keyFile, c2, k2)
	eventually.True(t, "the renewed certificate served", func() bool { return servedSerial(t, base, ca.pool()) == 1002 })

	// A broken pair (a key that does not match): refused, the old one stays.
	_, kOther := ca.issue(t, 1003, false)
	c3, _ := ca.issue(t, 1003, false)
	writePair(t, certFile, keyFile, c3, kOther)
	eventually.True(t, "the refusal logged", func() bool {
		return strings.Contains(stderr.String(), "tls certificate not reloaded")
	})
	if got := servedSerial(t, base, ca.pool()); got != 1002 {
		t.Errorf("after a broken renewal: serial %d, want the previous 1002", got)
	}

	// A SIGHUP reloads (the watcher would too, in its second: both lead
	// to the one load, which the log attributes).
	c4, k4 := ca.issue(t, 1004, false)
	writePair(t, certFile, keyFile, c4, k4)
	if err := syscall.Kill(os.Getpid(), syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	eventually.True(t, "the certificate reloaded after SIGHUP", func() bool { return servedSerial(t, base, ca.pool()) == 1004 })
	if !strings.Contains(stderr.String(), `msg="tls certificate reloaded"`) {
		t.Errorf("no reload in the log:\n%s", stderr.String())
	}
}

// TestCertReloaderSIGHUP: a SIGHUP alone, with the files' change not yet
// looked at, loads the new pair.
func TestCertReloaderSIGHUP(t *testing.T) {
	ca := newTestCA(t, "kvgate test CA")
	dir := t.TempDir()
	certFile, keyFile := filepath.Join(dir, "tls.crt"), filepath.Join(dir, "tls.key")
	c1, k1 := ca.issue(t, 1, false)
	writePair(t, certFile, keyFile, c1, k1)
	r, err := newCertReloader(certFile, keyFile, discardLogger())
	if err != nil {
		t.Fatal(err)
	}
	hup := make(chan os.Signal, 1)
	done := make(chan struct{})
	ctx, cancel := context.WithCancel(t.Context())
	go func() { defer close(done); r.watch(ctx, time.Hour, hup) }()
	defer func() { cancel(); <-done }()
	c2, k2 := ca.issue(t, 2, false)
	writePair(t, certFile, keyFile, c2, k2)
	hup <- syscall.SIGHUP
	eventually.True(t, "the pair reloaded on SIGHUP", func() bool {
		c, _ := r.GetCertificate(nil)
		return c.Leaf.SerialNumber.Int64() == 2
	})
	// Missing files at start are an error that names them.
	if _, err := newCertReloader(filepath.Join(dir, "none.crt"), keyFile, discardLogger()); err == nil || !strings.Contains(err.Error(), "none.crt") {
		t.Errorf("missing certificate: %v", err)
	}
}

func discardLogger() *slog.Logger { return slog.New(slog.DiscardHandler) }
