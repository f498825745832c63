// Package storetest is the contract test suite of store.Store. Every backend runs the
// same suite:
//
//	func TestContract(t *testing.T) { storetest.Run(t, freshDSN) }
//
// where freshDSN returns the DSN of a new, empty database (a file in t.TempDir(), a
// PostgreSQL schema of its own) for each subtest. The suite opens it with store.Open,
// so the backend's package must be linked. Leases are expired with a fake [Clock], never
// with sleeps, so the suite is deterministic on a loaded machine.
package storetest

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/curfew-mesh/curfew/mesh/store"
)

// Clock is a settable clock for store.WithClock, safe for concurrent use.
type Clock struct {
	mu sync.Mutex
	t  time.Time
}

// NewClock returns a clock at a fixed instant (2026-01-01T00:00:00Z).
func NewClock() *Clock { return &Clock{t: time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)} }

// Now returns the clock's time.
func (c *Clock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

// Advance moves the clock forward by d.
func (c *Clock) Advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = c.t.Add(d)
}

// env is one subtest's database.
type env struct {
	t     *testing.T
	ctx   context.Context
	dsn   string
	clock *Clock
	s     store.Store
	fresh func(t *testing.T) string
}

func newEnv(t *testing.T, fresh func(t *testing.T) string) *env {
	t.Helper()
	e := &env{t: t, ctx: context.Background(), dsn: fresh(t), clock: NewClock(), fresh: fresh}
	e.s = e.open()
	return e
}

// open opens another Store on the subtest's database (another replica), closed at the
// end of the subtest.
func (e *env) open() store.Store {
	e.t.Helper()
	s, err := store.Open(e.ctx, e.dsn, store.WithClock(e.clock.Now))
	if err != nil {
		e.t.Fatalf("open %s: %v", e.dsn, err)
	}
	e.t.Cleanup(func() {
		if err := s.Close(); err != nil {
			e.t.Errorf("close: %v", err)
		}
	})
	return s
}

// Run runs the whole contract against the backend whose fresh databases fresh returns.
func Run(t *testing.T, fresh func(t *testing.T) string) {
	groups := []struct {
		name  string
		tests map[string]func(*env)
	}{
		{"Runs", runTests},
		{"Leases", leaseTests},
		{"Checkpoints", checkpointTests},
		{"Tools", toolTests},
		{"Outbox", outboxTests},
		{"DeadLetters", deadLetterTests},
		{"Ledger", ledgerTests},
		{"APIKeys", apiKeyTests},
		{"Operators", operatorTests},
		{"Approvals", approvalTests},
		{"Replicas", replicaTests},
		{"Slots", slotTests},
		{"Budgets", budgetTests},
		{"Migrations", migrationTests},
	}
	for _, g := range groups {
		t.Run(g.name, func(t *testing.T) {
			for _, name := range sortedKeys(g.tests) {
				t.Run(name, func(t *testing.T) { g.tests[name](newEnv(t, fresh)) })
			}
		})
	}
}

func sortedKeys(m map[string]func(*env)) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	for i := 1; i < len(keys); i++ {
		for j := i; j > 0 && keys[j] < keys[j-1]; j-- {
			keys[j], keys[j-1] = keys[j-1], keys[j]
		}
	}
	return keys
}

// parallel runs f(i) for i in [0, n) on n goroutines released together, and waits.
func parallel(n int, f func(i int)) {
	var start, done sync.WaitGroup
	start.Add(1)
	for i := range n {
		done.Add(1)
		go func() {
			defer done.Done()
			start.Wait()
			f(i)
		}()
	}
	start.Done()
	done.Wait()
}
