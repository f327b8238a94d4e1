package scheduler

import (
	"testing"

	"go.uber.org/goleak"
)

// TestMain fails the package's tests if any leaves a goroutine running:
// every component's Run must have returned.
func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }
