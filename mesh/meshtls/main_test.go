package meshtls_test

import (
	"testing"

	"go.uber.org/goleak"
)

// TestMain checks that no test leaves a goroutine behind: a Source polls nothing, and
// every server and connection of the tests is stopped.
func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }
