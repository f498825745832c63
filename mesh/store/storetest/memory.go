package storetest

import (
	"context"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/curfew-mesh/curfew/mesh/store"
	"github.com/curfew-mesh/curfew/mesh/store/memory"
)

var memorySeq atomic.Int64

// MemoryDSN returns the DSN of a new, empty memory store named after t: each call a
// name of its own.
func MemoryDSN(t testing.TB) string {
	name := strings.NewReplacer("?", "_", "#", "_").Replace(t.Name())
	return fmt.Sprintf("memory://%s/%d", name, memorySeq.Add(1))
}

// OpenMemory opens a new, empty memory store for t, closed when t ends: for a test of a
// component that needs a store but not a shared one, as a service started without
// --store has.
func OpenMemory(t testing.TB, opts ...store.Option) store.Store {
	t.Helper()
	s, err := memory.Open(context.Background(), MemoryDSN(t), opts...)
	if err != nil {
		t.Fatalf("open a memory store: %v", err)
	}
	t.Cleanup(func() { _ = s.Close() })
	return s
}
