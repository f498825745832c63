package admission

import (
	"testing"

	"go.uber.org/goleak"
)

// TestMain checks that no test leaves a goroutine behind: a queued Admit whose caller
// left, or a Close that forgot a waiter, would.
func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }
