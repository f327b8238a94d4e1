package gateway

import (
	"net/netip"

	"github.com/kvgate/kvgate/gateway/webhook"
)

// loopbackGuard lets deliveries reach loopback receivers over plain http:
// the tests' only destinations.
func loopbackGuard() *webhook.Guard {
	return &webhook.Guard{AllowCIDRs: []netip.Prefix{netip.MustParsePrefix("127.0.0.0/8")}, AllowHTTP: true}
}
