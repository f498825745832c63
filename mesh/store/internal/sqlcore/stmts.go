package sqlcore

import (
	"context"
	"database/sql"
	"errors"
	"sync"
)

// maxStmts is how many query texts a pool keeps prepared. The store's queries are a
// fixed set, bar a few built per call (a list's filters, a batch's size); past this
// many, a new text runs unprepared.
const maxStmts = 256

// stmts keeps each query text's prepared statement on one pool, so that SQLite parses
// and plans a query once, not on every call (database/sql prepares a text anew on every
// call made with it; the cost is in docs/benchmarks.md). database/sql prepares a kept
// statement again on each connection it runs on, and a transaction runs it through
// Tx.StmtContext. A nil *stmts keeps nothing.
type stmts struct {
	db      *sql.DB
	mu      sync.Mutex
	m       map[string]*sql.Stmt
	pending map[string]bool // run unprepared in a transaction, to prepare after it
	closed  bool
}

func newStmts(db *sql.DB) *stmts {
	return &stmts{db: db, m: map[string]*sql.Stmt{}, pending: map[string]bool{}}
}

// get returns the prepared statement of s, preparing it now if prepare is set, else
// noting it for preparePending (a transaction holds the writer connection, which
// preparing on the pool would wait for). It returns nil when s is to run unprepared:
// the pool keeps maxStmts already, or preparing failed (running it reports why).
func (c *stmts) get(ctx context.Context, s string, prepare bool) *sql.Stmt {
	if c == nil {
		return nil
	}
	c.mu.Lock()
	st, ok := c.m[s]
	if ok || c.closed || len(c.m)+len(c.pending) >= maxStmts {
		c.mu.Unlock()
		return st
	}
	if !prepare {
		c.pending[s] = true
		c.mu.Unlock()
		return nil
	}
	c.mu.Unlock()
	return c.prepare(ctx, s)
}

// prepare prepares s on the pool and keeps it, unless another caller did first.
func (c *stmts) prepare(ctx context.Context, s string) *sql.Stmt {
	st, err := c.db.PrepareContext(ctx, s)
	if err != nil {
		return nil
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if old, ok := c.m[s]; ok || c.closed {
		_ = st.Close()
		return old
	}
	c.m[s] = st
	return st
}

// preparePending prepares the texts get noted, once no transaction of the caller holds
// the connection.
func (c *stmts) preparePending(ctx context.Context) {
	if c == nil {
		return
	}
	c.mu.Lock()
	var todo []string
	for s := range c.pending {
		todo = append(todo, s)
	}
	clear(c.pending)
	c.mu.Unlock()
	for _, s := range todo {
		if ctx.Err() != nil {
			return
		}
		c.prepare(ctx, s)
	}
}

// close closes the statements kept; later calls run unprepared.
func (c *stmts) close() error {
	if c == nil {
		return nil
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.closed = true
	var errs []error
	for s, st := range c.m {
		errs = append(errs, st.Close())
		delete(c.m, s)
	}
	return errors.Join(errs...)
}
