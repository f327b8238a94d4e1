package webhook

import (
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"strconv"
	"strings"
	"syscall"
	"time"
	"unicode/utf8"

	"golang.org/x/net/idna"
)

// ErrRefusedAddress is wrapped by every refusal of an address: by CheckURL
// for a literal address and by the Client's dialer for the address a name
// resolved to. errors.Is(err, ErrRefusedAddress) finds it through the
// *url.Error and *net.OpError around a dial error.
var ErrRefusedAddress = errors.New("address refused by the webhook egress guard")

// RefusedError says which address was refused and why.
type RefusedError struct {
	Addr  netip.Addr
	Range string // e.g. "loopback 127.0.0.0/8"
}

func (e *RefusedError) Error() string {
	return fmt.Sprintf("%s is in a refused range (%s); webhooks.allow_cidrs can allow it", e.Addr, e.Range)
}

// Unwrap makes errors.Is(err, ErrRefusedAddress) true.
func (e *RefusedError) Unwrap() error { return ErrRefusedAddress }

// Guard is the webhook egress policy. The zero value refuses plain http and
// every special-purpose address.
type Guard struct {
	// AllowCIDRs names ranges that are reachable even though they are
	// refused by default (webhooks.allow_cidrs), e.g. 127.0.0.0/8 in tests
	// or 10.0.0.0/8 for an on-premises ERP.
	AllowCIDRs []netip.Prefix
	// AllowHTTP permits plain http URLs (webhooks.allow_http).
	AllowHTTP bool
	// Resolver, when set, resolves names for the Client's dialer instead of
	// net.DefaultResolver. Tests point it at a DNS server on loopback.
	Resolver *net.Resolver
	// TLSConfig, when set, is cloned into the Client's transport (tests use
	// it to trust a loopback server's certificate).
	TLSConfig *tls.Config
}

type namedPrefix struct {
	p    netip.Prefix
	name string
}

func pfx(s, name string) namedPrefix {
	return namedPrefix{netip.MustParsePrefix(s), name + " " + s}
}

// refused4 are the IPv4 ranges a webhook never reaches unless allowed:
// every block of the IANA IPv4 special-purpose registry that is not
// globally reachable, plus multicast and the reserved 240/4.
var refused4 = []namedPrefix{
	pfx("0.0.0.0/8", "this network"),
	pfx("10.0.0.0/8", "private (RFC 1918)"),
	pfx("100.64.0.0/10", "shared address space (CGNAT)"),
	pfx("127.0.0.0/8", "loopback"),
	pfx("169.254.0.0/16", "link-local (cloud metadata)"),
	pfx("172.16.0.0/12", "private (RFC 1918)"),
	pfx("192.0.0.0/24", "IETF protocol assignments"),
	pfx("192.0.2.0/24", "documentation (TEST-NET-1)"),
	pfx("192.88.99.0/24", "6to4 relay anycast (deprecated)"),
	pfx("192.168.0.0/16", "private (RFC 1918)"),
	pfx("198.18.0.0/15", "benchmarking"),
	pfx("198.51.100.0/24", "documentation (TEST-NET-2)"),
	pfx("203.0.113.0/24", "documentation (TEST-NET-3)"),
	pfx("224.0.0.0/4", "multicast"),
	pfx("255.255.255.255/32", "limited broadcast"),
	pfx("240.0.0.0/4", "reserved"),
}

// refused6 are the IPv6 ranges refused outright. IPv4-mapped addresses
// (::ffff:0:0/96) are judged as the IPv4 address they carry; NAT64
// (64:ff9b::/96) and 6to4 (2002::/16) by the IPv4 address they embed.
var refused6 = []namedPrefix{
	pfx("::/128", "unspecified"),
	pfx("::1/128", "loopback"),
	pfx("::/96", "IPv4-compatible (deprecated)"),
	pfx("::ffff:0:0:0/96", "IPv4-translated (SIIT)"),
	pfx("64:ff9b:1::/48", "local-use NAT64"),
	pfx("100::/64", "discard-only"),
	pfx("2001::/32", "Teredo"),
	pfx("2001:2::/48", "benchmarking"),
	pfx("2001:10::/28", "ORCHID (deprecated)"),
	pfx("2001:20::/28", "ORCHIDv2"),
	pfx("2001:db8::/32", "documentation"),
	pfx("3fff::/20", "documentation"),
	pfx("5f00::/16", "segment routing (SRv6) SIDs"),
	pfx("fc00::/7", "unique-local"),
	pfx("fe80::/10", "link-local"),
	pfx("fec0::/10", "site-local (deprecated)"),
	pfx("ff00::/8", "multicast"),
}

var (
	nat64WKP  = netip.MustParsePrefix("64:ff9b::/96")
	sixToFour = netip.MustParsePrefix("2002::/16")
)

// CheckAddr reports whether the guard lets a delivery connect to a; the
// error wraps ErrRefusedAddress (as a *RefusedError) when it does not.
func (g *Guard) CheckAddr(a netip.Addr) error {
	if !a.IsValid() {
		return &RefusedError{Addr: a, Range: "invalid address"}
	}
	a = a.WithZone("")
	if g.allowed(a) {
		return nil
	}
	if a.Is4In6() {
		return g.CheckAddr(a.Unmap())
	}
	table := refused6
	if a.Is4() {
		table = refused4
	}
	for _, r := range table {
		if r.p.Contains(a) {
			return &RefusedError{Addr: a, Range: r.name}
		}
	}
	if a.Is6() {
		b := a.As16()
		var v4 netip.Addr
		var via string
		switch {
		case nat64WKP.Contains(a):
			v4, via = netip.AddrFrom4([4]byte(b[12:16])), "NAT64 64:ff9b::/96"
		case sixToFour.Contains(a):
			v4, via = netip.AddrFrom4([4]byte(b[2:6])), "6to4 2002::/16"
		}
		if v4.IsValid() {
			if err := g.CheckAddr(v4); err != nil {
				var re *RefusedError
				errors.As(err, &re)
				return &RefusedError{Addr: a, Range: via + " embedding " + v4.String() + ", " + re.Range}
			}
		}
	}
	return nil
}

func (g *Guard) allowed(a netip.Addr) bool {
	for _, p := range g.AllowCIDRs {
		if p.Contains(a) {
			return true
		}
		// An IPv4 allowance covers the IPv4-mapped form too, and the
		// reverse: both reach the same host.
		if a.Is4In6() && p.Contains(a.Unmap()) {
			return true
		}
		if a.Is4() && p.Contains(netip.AddrFrom16(a.As16())) {
			return true
		}
	}
	return false
}

// URLError is CheckURL's refusal; its message suits a 400 response.
type URLError struct {
	Reason string
	Err    error // ErrRefusedAddress (via *RefusedError) for a refused literal address
}

func (e *URLError) Error() string { return "webhook url: " + e.Reason }

// Unwrap returns the refused-address error, if any.
func (e *URLError) Unwrap() error { return e.Err }

func urlErr(format string, args ...any) error {
	return &URLError{Reason: fmt.Sprintf(format, args...)}
}

// CheckURL judges a URL at registration: an absolute http(s) URL (https
// only unless AllowHTTP), no user info, a host, a valid port, and no
// literal address (in any of the numeric spellings resolvers accept) or
// localhost name that the guard refuses. Names are judged again, on the
// address they resolve to, every time the Client dials; this check is a
// courtesy to the registrant, not the boundary.
func (g *Guard) CheckURL(raw string) error {
	if strings.TrimSpace(raw) == "" {
		return urlErr("url is required")
	}
	u, err := url.Parse(raw)
	if err != nil {
		return urlErr("%q is not a URL", raw)
	}
	if err := g.checkScheme(u.Scheme); err != nil {
		return err
	}
	if u.Opaque != "" {
		return urlErr("%q is not an absolute URL of the form %s://host/path", raw, u.Scheme)
	}
	if u.User != nil {
		return urlErr("user info (user:password@) is not allowed in a webhook URL; the signature authenticates deliveries")
	}
	host := u.Hostname()
	if host == "" {
		return urlErr("%q has no host", raw)
	}
	if p := u.Port(); p != "" {
		n, err := strconv.Atoi(p)
		if err != nil || n < 1 || n > 65535 {
			return urlErr("port %q is not between 1 and 65535", p)
		}
	} else if strings.HasSuffix(u.Host, ":") {
		return urlErr("%q has an empty port", raw)
	}
	if !isASCII(host) {
		// net/http dials the IDNA form of a host; judge that one, so
		// that full-width digits or dots (１２７.０.０.１) are seen for the
		// address they spell.
		ascii, err := idna.Lookup.ToASCII(host)
		if err != nil {
			return urlErr("host %q is not a valid host name", host)
		}
		host = ascii
	}
	if a, ok := literalAddr(host); ok {
		if err := g.CheckAddr(a); err != nil {
			return &URLError{Reason: "host " + err.Error(), Err: err}
		}
		return nil
	}
	name := strings.TrimSuffix(strings.ToLower(host), ".")
	if name == "localhost" || strings.HasSuffix(name, ".localhost") {
		// RFC 6761: these names always mean loopback.
		if err := g.CheckAddr(netip.MustParseAddr("127.0.0.1")); err != nil {
			return &URLError{Reason: "host " + host + " is loopback: " + err.Error(), Err: err}
		}
	}
	return nil
}

func isASCII(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] >= utf8.RuneSelf {
			return false
		}
	}
	return true
}

func (g *Guard) checkScheme(scheme string) error {
	switch strings.ToLower(scheme) {
	case "https":
		return nil
	case "http":
		if g.AllowHTTP {
			return nil
		}
		return urlErr("the URL must use https (plain http needs webhooks.allow_http)")
	case "":
		return urlErr("the URL needs a scheme: https://host/path")
	default:
		return urlErr("scheme %q is not allowed: use https", scheme)
	}
}

// literalAddr parses host as an IP address, including the legacy IPv4
// spellings inet_aton accepts (2130706433, 0x7f.1, 0177.0.0.1, 127.1),
// which some resolvers would turn into an address without a DNS query.
func literalAddr(host string) (netip.Addr, bool) {
	if a, err := netip.ParseAddr(host); err == nil {
		return a, true
	}
	return parseInetAton(host)
}

func parseInetAton(s string) (netip.Addr, bool) {
	s = strings.TrimSuffix(s, ".")
	parts := strings.Split(s, ".")
	if len(parts) == 0 || len(parts) > 4 {
		return netip.Addr{}, false
	}
	vals := make([]uint64, len(parts))
	for i, p := range parts {
		if p == "" {
			return netip.Addr{}, false
		}
		base := 10
		switch {
		case len(p) > 2 && (p[:2] == "0x" || p[:2] == "0X"):
			base, p = 16, p[2:]
		case len(p) > 1 && p[0] == '0':
			base, p = 8, p[1:]
		}
		v, err := strconv.ParseUint(p, base, 32)
		if err != nil {
			return netip.Addr{}, false
		}
		vals[i] = v
	}
	var n uint64
	last := len(vals) - 1
	for i, v := range vals[:last] {
		if v > 0xff {
			return netip.Addr{}, false
		}
		n |= v << (24 - 8*uint(i))
	}
	if vals[last] >= 1<<(8*uint(4-last)) {
		return netip.Addr{}, false
	}
	n |= vals[last]
	return netip.AddrFrom4([4]byte{byte(n >> 24), byte(n >> 16), byte(n >> 8), byte(n)}), true
}

// control is the dialer's Control hook: it runs after name resolution, on
// the very address the socket is about to connect to.
func (g *Guard) control(network, address string, _ syscall.RawConn) error {
	ap, err := netip.ParseAddrPort(address)
	if err != nil {
		return &RefusedError{Range: "unparsable dial address " + strconv.Quote(address)}
	}
	return g.CheckAddr(ap.Addr())
}

// DefaultTimeout is the per-attempt deadline Client uses when given none
// (the spec recommends 15 to 30 seconds).
const DefaultTimeout = 15 * time.Second

// maxResponseHeaderBytes caps a receiver's response headers.
const maxResponseHeaderBytes = 64 << 10

// Client returns an HTTP client for deliveries. Every connection's address
// is checked by the dialer's Control hook after resolution (so a name that
// resolves, or rebinds, to a refused address is refused); redirects are not
// followed (the 3xx response is returned, a failed attempt); each request
// has timeout as its whole deadline, body included; the environment's
// proxy settings are ignored; plain http is refused unless AllowHTTP. A
// timeout of zero or less means DefaultTimeout: no attempt is unbounded.
func (g *Guard) Client(timeout time.Duration) *http.Client {
	if timeout <= 0 {
		timeout = DefaultTimeout
	}
	dialer := &net.Dialer{
		Timeout:   timeout,
		KeepAlive: 30 * time.Second,
		Resolver:  g.Resolver,
		Control:   g.control,
	}
	var tlsConf *tls.Config
	if g.TLSConfig != nil {
		tlsConf = g.TLSConfig.Clone()
	} else {
		tlsConf = &tls.Config{}
	}
	if tlsConf.MinVersion == 0 {
		tlsConf.MinVersion = tls.VersionTLS12
	}
	tr := &http.Transport{
		Proxy:                  nil,
		DialContext:            dialer.DialContext,
		TLSClientConfig:        tlsConf,
		ForceAttemptHTTP2:      true,
		TLSHandshakeTimeout:    timeout,
		ResponseHeaderTimeout:  timeout,
		MaxResponseHeaderBytes: maxResponseHeaderBytes,
		MaxIdleConns:           256,
		MaxIdleConnsPerHost:    64,
		IdleConnTimeout:        90 * time.Second,
	}
	return &http.Client{
		Transport: &schemeCheck{g: g, next: tr},
		Timeout:   timeout,
		CheckRedirect: func(*http.Request, []*http.Request) error {
			return http.ErrUseLastResponse
		},
	}
}

// schemeCheck refuses plain http at send time too, so an endpoint
// registered while webhooks.allow_http was on is not sent to in clear
// after it is turned off.
type schemeCheck struct {
	g    *Guard
	next *http.Transport
}

func (s *schemeCheck) RoundTrip(r *http.Request) (*http.Response, error) {
	if err := s.g.checkScheme(r.URL.Scheme); err != nil {
		if r.Body != nil {
			r.Body.Close()
		}
		return nil, err
	}
	if r.URL.User != nil {
		if r.Body != nil {
			r.Body.Close()
		}
		return nil, urlErr("user info is not allowed in a webhook URL")
	}
	return s.next.RoundTrip(r)
}

// CloseIdleConnections lets http.Client.CloseIdleConnections reach the
// transport.
func (s *schemeCheck) CloseIdleConnections() { s.next.CloseIdleConnections() }
