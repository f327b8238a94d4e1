package webhook

import (
	"testing"

	"go.uber.org/goleak"
)

// TestMain fails the package's tests if one leaves a goroutine running
// (the loopback DNS server and receivers must stop).
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}
