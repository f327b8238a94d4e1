package webhook

import (
	"context"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/net/dns/dnsmessage"
)

// loopDNS is a DNS server on 127.0.0.1 answering A and AAAA queries from a
// fixed table, so that the Client's dialer resolves names the way it would
// in production (through a real DNS exchange) without a hosts entry.
type loopDNS struct {
	pc      net.PacketConn
	records map[string][]netip.Addr // lower-case FQDN with the final dot
	queries atomic.Int64
	done    chan struct{}
}

func startDNS(t *testing.T, records map[string][]string) *loopDNS {
	t.Helper()
	pc, err := net.ListenPacket("udp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	d := &loopDNS{pc: pc, records: map[string][]netip.Addr{}, done: make(chan struct{})}
	for name, addrs := range records {
		for _, a := range addrs {
			d.records[strings.ToLower(name)+"."] = append(d.records[strings.ToLower(name)+"."], netip.MustParseAddr(a))
		}
	}
	go d.serve()
	t.Cleanup(func() { pc.Close(); <-d.done })
	return d
}

func (d *loopDNS) serve() {
	defer close(d.done)
	buf := make([]byte, 1500)
	for {
		n, from, err := d.pc.ReadFrom(buf)
		if err != nil {
			return
		}
		if resp, ok := d.answer(buf[:n]); ok {
			d.pc.WriteTo(resp, from)
		}
	}
}

func (d *loopDNS) answer(query []byte) ([]byte, bool) {
	var p dnsmessage.Parser
	h, err := p.Start(query)
	if err != nil {
		return nil, false
	}
	q, err := p.Question()
	if err != nil {
		return nil, false
	}
	d.queries.Add(1)
	addrs, known := d.records[strings.ToLower(q.Name.String())]
	rh := dnsmessage.Header{ID: h.ID, Response: true, Authoritative: true, RecursionDesired: h.RecursionDesired}
	if !known {
		rh.RCode = dnsmessage.RCodeNameError
	}
	b := dnsmessage.NewBuilder(nil, rh)
	b.EnableCompression()
	if b.StartQuestions() != nil || b.Question(q) != nil || b.StartAnswers() != nil {
		return nil, false
	}
	for _, a := range addrs {
		rr := dnsmessage.ResourceHeader{Name: q.Name, Class: dnsmessage.ClassINET, TTL: 0}
		switch {
		case q.Type == dnsmessage.TypeA && a.Is4():
			err = b.AResource(rr, dnsmessage.AResource{A: a.As4()})
		case q.Type == dnsmessage.TypeAAAA && a.Is6():
			err = b.AAAAResource(rr, dnsmessage.AAAAResource{AAAA: a.As16()})
		}
		if err != nil {
			return nil, false
		}
	}
	resp, err := b.Finish()
	return resp, err == nil
}

// resolver sends every query to the loopback DNS server.
func (d *loopDNS) resolver() *net.Resolver {
	addr := d.pc.LocalAddr().String()
	return &net.Resolver{
		PreferGo: true,
		Dial: func(ctx context.Context, _, _ string) (net.Conn, error) {
			var dl net.Dialer
			return dl.DialContext(ctx, "udp", addr)
		},
	}
}

// receiver is an HTTP server on a loopback address that counts requests.
type receiver struct {
	srv  *httptest.Server
	hits atomic.Int64
	port string
}

func startReceiver(t *testing.T, ip string, tlsOn bool, h http.HandlerFunc) *receiver {
	t.Helper()
	ln, err := net.Listen("tcp", net.JoinHostPort(ip, "0"))
	if err != nil {
		t.Fatal(err)
	}
	r := &receiver{}
	r.srv = httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		r.hits.Add(1)
		if h != nil {
			h(w, req)
			return
		}
		io.Copy(io.Discard, req.Body)
		w.WriteHeader(http.StatusNoContent)
	}))
	r.srv.Listener.Close()
	r.srv.Listener = ln
	if tlsOn {
		r.srv.StartTLS()
	} else {
		r.srv.Start()
	}
	_, r.port, _ = net.SplitHostPort(ln.Addr().String())
	t.Cleanup(r.srv.Close)
	return r
}

func allow(cidrs ...string) []netip.Prefix {
	var out []netip.Prefix
	for _, c := range cidrs {
		out = append(out, netip.MustParsePrefix(c))
	}
	return out
}

func post(t *testing.T, g *Guard, timeout time.Duration, url string) (*http.Response, error) {
	t.Helper()
	c := g.Client(timeout)
	t.Cleanup(c.CloseIdleConnections)
	req, err := http.NewRequest(http.MethodPost, url, strings.NewReader(`{"type":"webhook.test"}`))
	if err != nil {
		t.Fatal(err)
	}
	resp, err := c.Do(req)
	if resp != nil {
		t.Cleanup(func() { resp.Body.Close() })
	}
	return resp, err
}

// TestClientRefusesResolvedAddress is the connect-time half of the SSRF
// matrix: names pass CheckURL, and the dialer refuses the loopback address
// they resolve to unless the allow-list names it.
func TestClientRefusesResolvedAddress(t *testing.T) {
	rcv4 := startReceiver(t, "127.0.0.1", false, nil)
	rcv2 := startReceiver(t, "127.0.0.2", false, nil)
	dns := startDNS(t, map[string][]string{
		"hook.kvgate.test":   {"127.0.0.1"},
		"second.kvgate.test": {"127.0.0.2"},
		"mapped.kvgate.test": {"::ffff:127.0.0.1"},
		"rebind.kvgate.test": {"127.0.0.1", "127.0.0.2"},
	})
	for _, tc := range []struct {
		name  string
		host  string
		rcv   *receiver
		allow []netip.Prefix
		ok    bool
	}{
		{"loopback, no allow-list", "hook.kvgate.test", rcv4, nil, false},
		{"loopback, 127.0.0.0/8 allowed", "hook.kvgate.test", rcv4, allow("127.0.0.0/8"), true},
		{"loopback, another range allowed", "hook.kvgate.test", rcv4, allow("10.0.0.0/8", "::1/128"), false},
		{"127.0.0.2, only 127.0.0.1 allowed", "second.kvgate.test", rcv2, allow("127.0.0.1/32"), false},
		{"127.0.0.2, 127.0.0.0/8 allowed", "second.kvgate.test", rcv2, allow("127.0.0.0/8"), true},
		{"IPv4-mapped AAAA record, no allow-list", "mapped.kvgate.test", rcv4, nil, false},
		{"IPv4-mapped AAAA record, 127.0.0.0/8 allowed", "mapped.kvgate.test", rcv4, allow("127.0.0.0/8"), true},
		{"two loopback records, only one allowed", "rebind.kvgate.test", nil, allow("127.0.0.2/32"), true},
		{"two loopback records, none allowed", "rebind.kvgate.test", nil, nil, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			// The two-record name uses 127.0.0.2's port: the dialer tries
			// 127.0.0.1 first, which must be refused before it connects.
			port := rcv2.port
			if tc.rcv != nil {
				port = tc.rcv.port
			}
			g := &Guard{AllowCIDRs: tc.allow, AllowHTTP: true, Resolver: dns.resolver()}
			url := fmt.Sprintf("http://%s:%s/hook", tc.host, port)
			if err := g.CheckURL(url); err != nil {
				t.Fatalf("CheckURL(%q) = %v; a name passes registration", url, err)
			}
			before4, before2 := rcv4.hits.Load(), rcv2.hits.Load()
			resp, err := post(t, g, 5*time.Second, url)
			sent := rcv4.hits.Load() - before4 + rcv2.hits.Load() - before2
			if tc.ok {
				if err != nil {
					t.Fatalf("POST %s: %v, want delivered", url, err)
				}
				if resp.StatusCode != http.StatusNoContent || sent != 1 {
					t.Fatalf("POST %s: status %d, %d requests received; want 204 and 1", url, resp.StatusCode, sent)
				}
				return
			}
			if !errors.Is(err, ErrRefusedAddress) {
				t.Fatalf("POST %s: %v, want an error wrapping ErrRefusedAddress", url, err)
			}
			if sent != 0 {
				t.Fatalf("POST %s was refused but %d requests reached a receiver", url, sent)
			}
		})
	}
	if dns.queries.Load() == 0 {
		t.Fatal("the loopback DNS server got no queries: the guard's Resolver was not used")
	}
}

// TestControlRefusesMetadata calls the dialer's Control hook with the
// addresses a name might resolve to; no traffic leaves loopback.
func TestControlRefusesMetadata(t *testing.T) {
	g := &Guard{AllowCIDRs: allow("127.0.0.0/8")}
	for _, addr := range []string{"169.254.169.254:80", "[fd00:ec2::254]:80", "[::ffff:169.254.169.254]:443", "10.0.0.1:443", "[::1]:80", "0.0.0.0:80", "100.100.100.200:80", "[64:ff9b::a9fe:a9fe]:80", "[fe80::1%lo]:80"} {
		if err := g.control("tcp", addr, nil); !errors.Is(err, ErrRefusedAddress) {
			t.Errorf("control(%s) = %v, want a refusal", addr, err)
		}
	}
	for _, addr := range []string{"127.0.0.1:80", "[::ffff:127.0.0.1]:80", "93.184.215.14:443", "[2606:4700::1111]:443"} {
		if err := g.control("tcp", addr, nil); err != nil {
			t.Errorf("control(%s) = %v, want allowed", addr, err)
		}
	}
	if err := g.control("tcp", "not-an-address", nil); !errors.Is(err, ErrRefusedAddress) {
		t.Errorf("control of an unparsable address = %v, want a refusal", err)
	}
}

func TestClientLiteralLoopbackRefused(t *testing.T) {
	rcv := startReceiver(t, "127.0.0.1", false, nil)
	g := &Guard{AllowHTTP: true}
	_, err := post(t, g, 5*time.Second, "http://127.0.0.1:"+rcv.port+"/")
	if !errors.Is(err, ErrRefusedAddress) || rcv.hits.Load() != 0 {
		t.Fatalf("literal 127.0.0.1 without an allow-list: %v, %d requests received; want refused, 0", err, rcv.hits.Load())
	}
}

// TestClientFullWidthLiteral: net/http dials the IDNA form of a host, so
// full-width digits reach 127.0.0.1; the dialer refuses it all the same.
func TestClientFullWidthLiteral(t *testing.T) {
	rcv := startReceiver(t, "127.0.0.1", false, nil)
	_, err := post(t, &Guard{AllowHTTP: true}, 5*time.Second, "http://１２７.０.０.１:"+rcv.port+"/")
	if !errors.Is(err, ErrRefusedAddress) || rcv.hits.Load() != 0 {
		t.Fatalf("full-width 127.0.0.1: %v, %d requests received; want refused, 0", err, rcv.hits.Load())
	}
	resp, err := post(t, &Guard{AllowHTTP: true, AllowCIDRs: allow("127.0.0.0/8")}, 5*time.Second, "http://１２７.０.０.１:"+rcv.port+"/")
	if err != nil || resp.StatusCode != http.StatusNoContent || rcv.hits.Load() != 1 {
		t.Fatalf("full-width 127.0.0.1, allowed: %v (hits %d); want delivered", err, rcv.hits.Load())
	}
}

// TestClientIPv6Loopback: a name with only an AAAA record for ::1 is
// refused unless ::1/128 is allowed; 127.0.0.0/8 does not cover it.
func TestClientIPv6Loopback(t *testing.T) {
	ln, err := net.Listen("tcp", "[::1]:0")
	if err != nil {
		t.Skipf("no IPv6 loopback here: %v", err)
	}
	ln.Close()
	rcv := startReceiver(t, "::1", false, nil)
	dns := startDNS(t, map[string][]string{"v6.kvgate.test": {"::1"}})
	url := "http://v6.kvgate.test:" + rcv.port + "/"
	for _, tc := range []struct {
		allow []netip.Prefix
		ok    bool
	}{{nil, false}, {allow("127.0.0.0/8"), false}, {allow("::1/128"), true}} {
		before := rcv.hits.Load()
		resp, err := post(t, &Guard{AllowHTTP: true, AllowCIDRs: tc.allow, Resolver: dns.resolver()}, 5*time.Second, url)
		sent := rcv.hits.Load() - before
		if tc.ok {
			if err != nil || resp.StatusCode != http.StatusNoContent || sent != 1 {
				t.Fatalf("allow=%v: %v (sent %d); want delivered", tc.allow, err, sent)
			}
		} else if !errors.Is(err, ErrRefusedAddress) || sent != 0 {
			t.Fatalf("allow=%v: %v (sent %d); want refused, nothing sent", tc.allow, err, sent)
		}
	}
}

// TestClientDoesNotFollowRedirects: a 3xx comes back as the response, and
// the target (allowed or not) receives nothing.
func TestClientDoesNotFollowRedirects(t *testing.T) {
	target := startReceiver(t, "127.0.0.2", false, nil)
	for _, loc := range []string{
		"http://127.0.0.2:" + target.port + "/",
		"http://[::1]:" + target.port + "/", // refused by the allow-list even if followed
	} {
		for _, code := range []int{301, 302, 303, 307, 308} {
			src := startReceiver(t, "127.0.0.1", false, func(w http.ResponseWriter, r *http.Request) {
				http.Redirect(w, r, loc, code)
			})
			g := &Guard{AllowCIDRs: allow("127.0.0.0/8"), AllowHTTP: true}
			resp, err := post(t, g, 5*time.Second, "http://127.0.0.1:"+src.port+"/")
			if err != nil {
				t.Fatalf("redirect %d to %s: %v, want the %d response", code, loc, err, code)
			}
			if resp.StatusCode != code || resp.Header.Get("Location") != loc {
				t.Fatalf("redirect %d to %s: got %d Location %q", code, loc, resp.StatusCode, resp.Header.Get("Location"))
			}
		}
	}
	if n := target.hits.Load(); n != 0 {
		t.Fatalf("the redirect target received %d requests; redirects must not be followed", n)
	}
}

func TestClientHTTPSRequired(t *testing.T) {
	plain := startReceiver(t, "127.0.0.1", false, nil)
	secure := startReceiver(t, "127.0.0.1", true, nil)
	g := &Guard{AllowCIDRs: allow("127.0.0.0/8")}
	if _, err := post(t, g, 5*time.Second, "http://127.0.0.1:"+plain.port+"/"); err == nil || !strings.Contains(err.Error(), "https") {
		t.Fatalf("plain http without AllowHTTP: %v, want refused", err)
	}
	if n := plain.hits.Load(); n != 0 {
		t.Fatalf("plain http refused, yet the receiver got %d requests", n)
	}
	// https to the same guard: trusted through TLSConfig (as a private CA
	// would be).
	pool := x509.NewCertPool()
	pool.AddCert(secure.srv.Certificate())
	g.TLSConfig = secure.srv.Client().Transport.(*http.Transport).TLSClientConfig.Clone()
	g.TLSConfig.RootCAs = pool
	resp, err := post(t, g, 5*time.Second, "https://127.0.0.1:"+secure.port+"/")
	if err != nil || resp.StatusCode != http.StatusNoContent || secure.hits.Load() != 1 {
		t.Fatalf("https: %v (hits %d), want delivered", err, secure.hits.Load())
	}
	// Without trusting the certificate, https fails: no InsecureSkipVerify.
	g2 := &Guard{AllowCIDRs: allow("127.0.0.0/8")}
	if _, err := post(t, g2, 5*time.Second, "https://127.0.0.1:"+secure.port+"/"); err == nil {
		t.Fatal("https to an untrusted certificate succeeded")
	}
	// With AllowHTTP, plain http goes through.
	g3 := &Guard{AllowCIDRs: allow("127.0.0.0/8"), AllowHTTP: true}
	if resp, err := post(t, g3, 5*time.Second, "http://127.0.0.1:"+plain.port+"/"); err != nil || resp.StatusCode != http.StatusNoContent {
		t.Fatalf("plain http with AllowHTTP: %v", err)
	}
	// User info is refused at send time too.
	if _, err := post(t, g3, 5*time.Second, "http://u:p@127.0.0.1:"+plain.port+"/"); err == nil {
		t.Fatal("user info in the URL was sent")
	}
	if n := plain.hits.Load(); n != 1 {
		t.Fatalf("plain receiver got %d requests, want 1", n)
	}
}

// TestClientDeadline: a receiver that never answers, or stalls mid-body,
// fails the attempt at the client's deadline instead of holding it.
func TestClientDeadline(t *testing.T) {
	release := make(chan struct{})
	var once sync.Once
	stop := func() { once.Do(func() { close(release) }) }
	t.Cleanup(stop)
	hang := startReceiver(t, "127.0.0.1", false, func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-r.Context().Done():
		case <-release:
		}
	})
	stall := startReceiver(t, "127.0.0.1", false, func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusOK)
		w.Write([]byte("partial"))
		w.(http.Flusher).Flush()
		select {
		case <-r.Context().Done():
		case <-release:
		}
	})
	g := &Guard{AllowCIDRs: allow("127.0.0.0/8"), AllowHTTP: true}
	const timeout = 100 * time.Millisecond
	if c := g.Client(timeout); c.Timeout != timeout {
		t.Fatalf("Client.Timeout = %v, want %v", c.Timeout, timeout)
	}
	if c := g.Client(0); c.Timeout != DefaultTimeout {
		t.Fatalf("Client(0).Timeout = %v, want DefaultTimeout", c.Timeout)
	}
	_, err := post(t, g, timeout, "http://127.0.0.1:"+hang.port+"/")
	var ne net.Error
	if !errors.As(err, &ne) || !ne.Timeout() {
		t.Fatalf("hanging receiver: %v, want a timeout", err)
	}
	// The stalling receiver gets a longer deadline, so that its headers
	// arrive before it even on a loaded machine; the body cannot.
	resp, err := post(t, g, 10*timeout, "http://127.0.0.1:"+stall.port+"/")
	if err != nil {
		t.Fatalf("stalling receiver: headers: %v", err)
	}
	_, _, err = ReadCapped(resp.Body, 1<<20)
	if !errors.As(err, &ne) || !ne.Timeout() {
		t.Fatalf("stalling receiver: reading the body: %v, want a timeout", err)
	}
	stop()
}

// TestClientHugeBodyTruncated: a receiver answering with 32 MiB is read
// only up to the cap.
func TestClientHugeBodyTruncated(t *testing.T) {
	chunk := make([]byte, 64<<10)
	var written atomic.Int64
	rcv := startReceiver(t, "127.0.0.1", false, func(w http.ResponseWriter, r *http.Request) {
		for range 512 {
			n, err := w.Write(chunk)
			written.Add(int64(n))
			if err != nil {
				return
			}
		}
	})
	g := &Guard{AllowCIDRs: allow("127.0.0.0/8"), AllowHTTP: true}
	resp, err := post(t, g, 10*time.Second, "http://127.0.0.1:"+rcv.port+"/")
	if err != nil {
		t.Fatal(err)
	}
	const limit = 16 << 10
	b, truncated, err := ReadCapped(resp.Body, limit)
	if err != nil || !truncated || len(b) != limit {
		t.Fatalf("ReadCapped = %d bytes, truncated=%v, %v; want %d, true", len(b), truncated, err, limit)
	}
	resp.Body.Close()
}

// TestClientIgnoresProxyEnvironment: the transport takes no proxy from
// HTTP(S)_PROXY (a proxy would do its own resolution, out of the guard's
// reach).
func TestClientIgnoresProxyEnvironment(t *testing.T) {
	t.Setenv("HTTPS_PROXY", "http://127.0.0.1:1")
	t.Setenv("HTTP_PROXY", "http://127.0.0.1:1")
	c := (&Guard{}).Client(time.Second)
	tr := c.Transport.(*schemeCheck).next
	if tr.Proxy != nil {
		t.Fatal("the transport has a Proxy function; deliveries must not go through the environment's proxy")
	}
	if c.CheckRedirect == nil || c.CheckRedirect(nil, nil) != http.ErrUseLastResponse {
		t.Fatal("CheckRedirect does not stop at the first response")
	}
}
