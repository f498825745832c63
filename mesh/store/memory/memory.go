package memory

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"

	_ "modernc.org/sqlite" // the pure-Go driver, registered as "sqlite"

	"github.com/curfew-mesh/curfew/mesh/store"
	"github.com/curfew-mesh/curfew/mesh/store/internal/sqlcore"
)

func init() { store.Register(scheme, Open) }

const scheme = "memory"

// DefaultName is the name memory:// opens when it names none.
const DefaultName = "default"

// The open databases by name. A database is created by the first Open of its name and
// dropped by the last Close.
var (
	mu  sync.Mutex
	dbs = map[string]*db{}
	seq atomic.Int64 // makes each creation's memdb file new, so a dropped name starts empty
)

// db is one named in-memory database and the number of stores open on it.
type db struct {
	name string
	sql  sqlcore.SQLDB
	pin  *sql.Conn // keeps the memdb alive whatever the pools do with idle connections
	refs int
}

// Open opens a store on the in-memory database dsn names (memory://NAME, or memory://
// for DefaultName), creating and migrating it if no store is open on it. See the
// package documentation for what is shared and for how long.
func Open(ctx context.Context, dsn string, opts ...store.Option) (store.Store, error) {
	name, err := parse(dsn)
	if err != nil {
		return nil, err
	}
	o := store.BuildOptions(opts...)
	d, err := acquire(ctx, name, o)
	if err != nil {
		return nil, err
	}
	c := &conn{db: d}
	return private{sqlcore.New(c, sqlcore.SQLite, o)}, nil
}

// OpenOr opens the store at dsn, of any backend store.Open knows, or, when dsn is "",
// memory://name: a service started without --store keeps its data in a store of its
// own that lives as long as the process.
func OpenOr(ctx context.Context, dsn, name string, opts ...store.Option) (store.Store, error) {
	if dsn == "" {
		dsn = scheme + "://" + name
	}
	return store.Open(ctx, dsn, opts...)
}

// parse returns the name in a memory:// DSN.
func parse(dsn string) (string, error) {
	if store.Scheme(dsn) != scheme {
		return "", fmt.Errorf("%w: %q is not a memory:// DSN", store.ErrInvalidArgument, dsn)
	}
	name := dsn[len(scheme+"://"):]
	if strings.ContainsAny(name, "?#") {
		return "", fmt.Errorf("%w: memory store name %q (without ? or #)", store.ErrInvalidArgument, name)
	}
	if name == "" {
		name = DefaultName
	}
	return name, nil
}

// acquire returns the named database with one more reference, creating it if needed.
func acquire(ctx context.Context, name string, o store.Options) (*db, error) {
	mu.Lock()
	defer mu.Unlock()
	if d := dbs[name]; d != nil {
		d.refs++
		return d, nil
	}
	d, err := create(ctx, name, o)
	if err != nil {
		return nil, err
	}
	dbs[name] = d
	return d, nil
}

// create opens a new memdb database: the writer and reader pools, the pinned
// connection, and the schema.
func create(ctx context.Context, name string, o store.Options) (*db, error) {
	base := fmt.Sprintf("file:/curfew-memory-%d?vfs=memdb&_pragma=busy_timeout(%d)&_pragma=foreign_keys(1)",
		seq.Add(1), o.BusyTimeout.Milliseconds())
	pools, err := sqlcore.OpenSQLite(base, o.MaxConns, 1) // + the pin
	if err != nil {
		return nil, err
	}
	d := &db{name: name, sql: pools, refs: 1}
	if d.pin, err = pools.R.Conn(ctx); err != nil {
		return nil, errors.Join(fmt.Errorf("memory %s: %w", name, err), d.sql.Close())
	}
	if _, err := sqlcore.Migrate(ctx, d.sql, sqlcore.SQLite, max(o.Clock().UnixMilli(), 1)); err != nil {
		return nil, errors.Join(fmt.Errorf("memory %s: %w", name, err), d.close())
	}
	return d, nil
}

// release drops one reference, and the database with the last.
func (d *db) release() error {
	mu.Lock()
	defer mu.Unlock()
	if d.refs--; d.refs > 0 {
		return nil
	}
	delete(dbs, d.name)
	return d.close()
}

func (d *db) close() error { return errors.Join(d.pin.Close(), d.sql.Close()) }

// private is a store on a memory database: the SQL store, private to this process.
type private struct{ *sqlcore.Store }

// Shared implements store.Sharing: no other process sees a memory store.
func (private) Shared() bool { return false }

// errClosed is what a closed store's calls fail with.
var errClosed = errors.New("memory: store is closed")

// conn is one open store's driver: the shared database until Close, then errors.
type conn struct {
	db     *db
	closed atomic.Bool
}

func (c *conn) Read() sqlcore.Querier {
	if c.closed.Load() {
		return closedQuerier{}
	}
	return c.db.sql.Read()
}

func (c *conn) Exec(ctx context.Context, s string, args ...any) (int64, error) {
	if c.closed.Load() {
		return 0, errClosed
	}
	return c.db.sql.Exec(ctx, s, args...)
}

func (c *conn) Write(ctx context.Context, s string, args ...any) (sqlcore.Rows, error) {
	if c.closed.Load() {
		return nil, errClosed
	}
	return c.db.sql.Write(ctx, s, args...)
}

func (c *conn) Tx(ctx context.Context, fn func(sqlcore.Querier) error) error {
	if c.closed.Load() {
		return errClosed
	}
	return c.db.sql.Tx(ctx, fn)
}

// Close releases the store's reference once; closing it again does nothing.
func (c *conn) Close() error {
	if c.closed.Swap(true) {
		return nil
	}
	return c.db.release()
}

type closedQuerier struct{}

func (closedQuerier) Exec(context.Context, string, ...any) (int64, error)  { return 0, errClosed }
func (closedQuerier) QueryRow(context.Context, string, ...any) sqlcore.Row { return closedRow{} }
func (closedQuerier) Query(context.Context, string, ...any) (sqlcore.Rows, error) {
	return nil, errClosed
}

type closedRow struct{}

func (closedRow) Scan(...any) error { return errClosed }
