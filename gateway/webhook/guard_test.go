package webhook

import (
	"errors"
	"net/netip"
	"strings"
	"testing"
)

// refusedByDefault lists, independently of guard.go's tables, every range
// the guard must refuse without an allow-list. Each is checked at its first
// and last address.
var refusedByDefault = []string{
	// IPv4
	"0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "169.254.0.0/16",
	"172.16.0.0/12", "192.0.0.0/24", "192.0.2.0/24", "192.88.99.0/24", "192.168.0.0/16",
	"198.18.0.0/15", "198.51.100.0/24", "203.0.113.0/24", "224.0.0.0/4", "240.0.0.0/4",
	"255.255.255.255/32",
	// IPv6
	"::/128", "::1/128", "::/96", "::ffff:0:0:0/96", "64:ff9b:1::/48", "100::/64",
	"2001::/32", "2001:2::/48", "2001:10::/28", "2001:20::/28", "2001:db8::/32", "3fff::/20",
	"5f00::/16", "fc00::/7", "fe80::/10", "fec0::/10", "ff00::/8",
	// IPv4-mapped forms of the IPv4 ranges
	"::ffff:0.0.0.0/104", "::ffff:10.0.0.0/104", "::ffff:100.64.0.0/106", "::ffff:127.0.0.0/104",
	"::ffff:169.254.0.0/112", "::ffff:172.16.0.0/108", "::ffff:192.168.0.0/112", "::ffff:224.0.0.0/100",
	"::ffff:240.0.0.0/100", "::ffff:198.18.0.0/111", "::ffff:192.0.0.0/120",
	// NAT64 and 6to4 embedding refused IPv4 addresses
	"64:ff9b::7f00:0/104", "64:ff9b::a9fe:0/112", "64:ff9b::a00:0/104", "64:ff9b::/104",
	"2002:7f00::/24", "2002:a9fe::/32", "2002:c0a8::/32",
}

func lastAddr(p netip.Prefix) netip.Addr {
	b := p.Addr().AsSlice()
	for i := p.Bits(); i < len(b)*8; i++ {
		b[i/8] |= 0x80 >> (i % 8)
	}
	a, _ := netip.AddrFromSlice(b)
	return a
}

func TestGuardRefusesSpecialRanges(t *testing.T) {
	var g Guard
	for _, s := range refusedByDefault {
		p := netip.MustParsePrefix(s)
		for _, a := range []netip.Addr{p.Addr(), lastAddr(p)} {
			err := g.CheckAddr(a)
			if !errors.Is(err, ErrRefusedAddress) {
				t.Errorf("%s (in %s): CheckAddr = %v, want a refusal", a, s, err)
				continue
			}
			var re *RefusedError
			if !errors.As(err, &re) || re.Range == "" {
				t.Errorf("%s: refusal %v does not name its range", a, err)
			}
		}
	}
}

func TestGuardAddressTable(t *testing.T) {
	for _, tc := range []struct {
		addr   string
		allow  []string
		range_ string // substring of the refused range; "" means allowed
	}{
		// Public addresses, and the addresses just outside refused ranges.
		{"8.8.8.8", nil, ""},
		{"1.1.1.1", nil, ""},
		{"1.0.0.0", nil, ""},
		{"9.255.255.255", nil, ""},
		{"11.0.0.0", nil, ""},
		{"100.63.255.255", nil, ""},
		{"100.128.0.0", nil, ""},
		{"126.255.255.255", nil, ""},
		{"128.0.0.0", nil, ""},
		{"169.253.255.255", nil, ""},
		{"169.255.0.0", nil, ""},
		{"172.15.255.255", nil, ""},
		{"172.32.0.0", nil, ""},
		{"192.0.1.0", nil, ""},
		{"192.167.255.255", nil, ""},
		{"192.169.0.0", nil, ""},
		{"198.17.255.255", nil, ""},
		{"198.20.0.0", nil, ""},
		{"223.255.255.255", nil, ""},
		{"2606:4700:4700::1111", nil, ""},
		{"2001:4860:4860::8888", nil, ""},
		{"::ffff:8.8.8.8", nil, ""},
		{"64:ff9b::808:808", nil, ""}, // NAT64 of 8.8.8.8
		{"2002:808:808::1", nil, ""},  // 6to4 of 8.8.8.8
		{"fbff:ffff:ffff:ffff:ffff:ffff:ffff:ffff", nil, ""},
		{"fe00::", nil, ""}, // between fc00::/7 and fe80::/10
		// Named refusals.
		{"127.0.0.1", nil, "loopback"},
		{"::1", nil, "loopback"},
		{"10.1.2.3", nil, "RFC 1918"},
		{"172.20.0.1", nil, "RFC 1918"},
		{"192.168.1.1", nil, "RFC 1918"},
		{"169.254.169.254", nil, "link-local"}, // AWS, GCP, Azure metadata
		{"fd00:ec2::254", nil, "unique-local"}, // AWS IPv6 metadata
		{"fe80::a9fe:a9fe", nil, "link-local"},
		{"fe80::1%eth0", nil, "link-local"},
		{"100.100.100.200", nil, "CGNAT"}, // Alibaba metadata
		{"0.0.0.0", nil, "this network"},
		{"::", nil, "unspecified"},
		{"224.0.0.1", nil, "multicast"},
		{"ff02::1", nil, "multicast"},
		{"255.255.255.255", nil, "broadcast"},
		{"::ffff:127.0.0.1", nil, "loopback"},
		{"::ffff:169.254.169.254", nil, "link-local"},
		{"::ffff:10.0.0.1", nil, "RFC 1918"},
		{"::127.0.0.1", nil, "IPv4-compatible"},
		{"64:ff9b::7f00:1", nil, "NAT64"},
		{"64:ff9b::a9fe:a9fe", nil, "link-local"},
		{"2002:7f00:1::", nil, "6to4"},
		{"2002:a9fe:a9fe::1", nil, "link-local"},
		{"2001:0:4136:e378:8000:63bf:3fff:fdd2", nil, "Teredo"},
		// Allow-lists.
		{"127.0.0.1", []string{"127.0.0.0/8"}, ""},
		{"127.9.9.9", []string{"127.0.0.0/8"}, ""},
		{"::ffff:127.0.0.1", []string{"127.0.0.0/8"}, ""},
		{"::1", []string{"127.0.0.0/8"}, "loopback"},
		{"10.0.0.1", []string{"127.0.0.0/8"}, "RFC 1918"},
		{"127.0.0.2", []string{"127.0.0.1/32"}, "loopback"},
		{"::1", []string{"::1/128"}, ""},
		{"127.0.0.1", []string{"::1/128"}, "loopback"},
		{"10.1.2.3", []string{"10.0.0.0/8"}, ""},
		{"10.1.2.3", []string{"::ffff:10.0.0.0/104"}, ""},
		{"::ffff:10.1.2.3", []string{"::ffff:10.0.0.0/104"}, ""},
		{"64:ff9b::a01:203", []string{"10.0.0.0/8"}, ""}, // NAT64 of an allowed 10.1.2.3
		{"64:ff9b::a01:203", []string{"192.168.0.0/16"}, "NAT64"},
		{"169.254.169.254", []string{"169.254.169.253/32"}, "link-local"},
		{"fd12:3456::1", []string{"fd12:3456::/32"}, ""},
		{"fd12:3457::1", []string{"fd12:3456::/32"}, "unique-local"},
	} {
		g := Guard{}
		for _, s := range tc.allow {
			g.AllowCIDRs = append(g.AllowCIDRs, netip.MustParsePrefix(s))
		}
		err := g.CheckAddr(netip.MustParseAddr(tc.addr))
		switch {
		case tc.range_ == "" && err != nil:
			t.Errorf("%s allow=%v: refused (%v), want allowed", tc.addr, tc.allow, err)
		case tc.range_ != "" && (!errors.Is(err, ErrRefusedAddress) || !strings.Contains(err.Error(), tc.range_)):
			t.Errorf("%s allow=%v: CheckAddr = %v, want a refusal naming %q", tc.addr, tc.allow, err, tc.range_)
		}
	}
	if err := (&Guard{}).CheckAddr(netip.Addr{}); !errors.Is(err, ErrRefusedAddress) {
		t.Errorf("the zero Addr: %v, want a refusal", err)
	}
}

func TestCheckURL(t *testing.T) {
	loop := []netip.Prefix{netip.MustParsePrefix("127.0.0.0/8")}
	for _, tc := range []struct {
		url       string
		g         Guard
		want      string // substring of the error; "" means accepted
		refusedIP bool   // the error wraps ErrRefusedAddress
	}{
		{"https://erp.example.com/hooks/kvgate", Guard{}, "", false},
		{"HTTPS://erp.example.com:8443/h?x=1", Guard{}, "", false},
		{"https://8.8.8.8/hook", Guard{}, "", false},
		{"https://[2606:4700::1111]/hook", Guard{}, "", false},
		{"http://erp.example.com/", Guard{}, "https", false},
		{"http://erp.example.com/", Guard{AllowHTTP: true}, "", false},
		{"ftp://erp.example.com/", Guard{AllowHTTP: true}, "scheme", false},
		{"file:///etc/passwd", Guard{}, "scheme", false},
		{"gopher://127.0.0.1:6379/_", Guard{}, "scheme", false},
		{"erp.example.com/hook", Guard{}, "scheme", false},
		{"//erp.example.com/hook", Guard{}, "scheme", false},
		{"", Guard{}, "required", false},
		{"https://", Guard{}, "no host", false},
		{"https:erp.example.com", Guard{}, "absolute", false},
		{"https://user:pw@erp.example.com/", Guard{}, "user info", false},
		{"https://user@erp.example.com/", Guard{}, "user info", false},
		{"https://erp.example.com:0/", Guard{}, "port", false},
		{"https://erp.example.com:65536/", Guard{}, "port", false},
		{"https://erp.example.com:/", Guard{}, "empty port", false},
		{"https://%zz/", Guard{}, "not a URL", false},
		// Literal addresses, in every spelling.
		{"https://127.0.0.1/", Guard{}, "loopback", true},
		{"https://127.0.0.1:8080/hook", Guard{}, "loopback", true},
		{"https://[::1]/", Guard{}, "loopback", true},
		{"https://[::ffff:127.0.0.1]/", Guard{}, "loopback", true},
		{"https://[::ffff:7f00:1]/", Guard{}, "loopback", true},
		{"https://2130706433/", Guard{}, "loopback", true},
		{"https://0x7f000001/", Guard{}, "loopback", true},
		{"https://0x7f.1/", Guard{}, "loopback", true},
		{"https://0177.0.0.1/", Guard{}, "loopback", true},
		{"https://127.1/", Guard{}, "loopback", true},
		{"https://127.0.0.1./", Guard{}, "loopback", true},
		{"https://169.254.169.254/latest/meta-data/", Guard{}, "link-local", true},
		{"https://[fe80::1%25eth0]/", Guard{}, "link-local", true},
		{"https://[fd00:ec2::254]/", Guard{}, "unique-local", true},
		{"https://10.0.0.5:8443/", Guard{}, "RFC 1918", true},
		{"https://192.168.0.1/", Guard{}, "RFC 1918", true},
		{"https://100.100.100.200/", Guard{}, "CGNAT", true},
		{"https://0.0.0.0/", Guard{}, "this network", true},
		{"https://0/", Guard{}, "this network", true},
		{"https://[::]/", Guard{}, "unspecified", true},
		{"https://224.0.0.251/", Guard{}, "multicast", true},
		{"https://[64:ff9b::a9fe:a9fe]/", Guard{}, "NAT64", true},
		{"https://１２７.０.０.１/", Guard{}, "loopback", true},
		{"https://127。0。0。1/", Guard{}, "loopback", true},
		{"https://%EF%BC%91%EF%BC%92%EF%BC%97.0.0.1/", Guard{}, "loopback", true},
		{"https://ｌｏｃａｌｈｏｓｔ/", Guard{}, "loopback", true},
		{"https://bücher.example/", Guard{}, "", false},
		{"https://a\u00a0b.example/", Guard{}, "not a valid host name", false},
		{"https://127.000.000.001/", Guard{}, "loopback", true},
		{"https://localhost/", Guard{}, "loopback", true},
		{"https://LOCALHOST./", Guard{}, "loopback", true},
		{"https://api.localhost:8080/", Guard{}, "loopback", true},
		// Allow-lists.
		{"http://127.0.0.1:8080/hook", Guard{AllowCIDRs: loop, AllowHTTP: true}, "", false},
		{"http://localhost:8080/hook", Guard{AllowCIDRs: loop, AllowHTTP: true}, "", false},
		{"https://[::ffff:127.0.0.1]/", Guard{AllowCIDRs: loop}, "", false},
		{"http://127.0.0.1:8080/hook", Guard{AllowCIDRs: loop}, "https", false},
		{"https://[::1]/", Guard{AllowCIDRs: loop}, "loopback", true},
		{"https://169.254.169.254/", Guard{AllowCIDRs: loop}, "link-local", true},
	} {
		err := tc.g.CheckURL(tc.url)
		if tc.want == "" {
			if err != nil {
				t.Errorf("CheckURL(%q) = %v, want accepted", tc.url, err)
			}
			continue
		}
		var ue *URLError
		if !errors.As(err, &ue) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("CheckURL(%q) = %v, want a *URLError mentioning %q", tc.url, err, tc.want)
			continue
		}
		if got := errors.Is(err, ErrRefusedAddress); got != tc.refusedIP {
			t.Errorf("CheckURL(%q) = %v: errors.Is(ErrRefusedAddress) = %v, want %v", tc.url, err, got, tc.refusedIP)
		}
	}
}

func TestParseInetAton(t *testing.T) {
	for in, want := range map[string]string{
		"127.0.0.1": "127.0.0.1", "2130706433": "127.0.0.1", "0x7f000001": "127.0.0.1",
		"0x7f.1": "127.0.0.1", "0177.0.0.1": "127.0.0.1", "127.1": "127.0.0.1",
		"10.1.65535": "10.1.255.255", "0": "0.0.0.0", "0X7F.0.0.1": "127.0.0.1",
		"127.000.000.001": "127.0.0.1", "0x0a.0x00.0x00.0x01": "10.0.0.1", "169.254.43518": "169.254.169.254",
	} {
		a, ok := parseInetAton(in)
		if !ok || a.String() != want {
			t.Errorf("parseInetAton(%q) = %v, %v; want %s", in, a, ok, want)
		}
	}
	for _, in := range []string{"", "example.com", "1.2.3.4.5", "256.0.0.1", "1.2.3.256", "1.2.65536", "0x", "08.0.0.1", "1..2", "4294967296", "-1", "1e3"} {
		if a, ok := parseInetAton(in); ok {
			t.Errorf("parseInetAton(%q) = %v, want not an address", in, a)
		}
	}
}
