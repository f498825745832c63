package store

import (
	"context"
	"fmt"
	"sort"
	"strings"
	"sync"
	"time"
)

// Options configure a backend. The zero value of every field means its documented
// default; backends ignore the fields that do not concern them.
type Options struct {
	// Clock is the time source for lease expiry, timestamps and expiry checks.
	// Default time.Now. Tests inject a fake clock to expire leases without sleeping.
	Clock func() time.Time
	// BusyTimeout (SQLite) is how long a writer waits for another connection's or
	// process's write lock before failing with SQLITE_BUSY. Default 5 s.
	BusyTimeout time.Duration
	// MaxConns is the pool size: PostgreSQL connections (default 10), or SQLite reader
	// connections (default 4; SQLite always has exactly one writer connection).
	MaxConns int
	// SyncFull (SQLite) sets synchronous=FULL: every commit is fsynced, surviving power
	// loss. The default, synchronous=NORMAL in WAL mode, survives a killed process
	// (SIGKILL) but may lose the last commits on power loss or an OS crash.
	SyncFull bool
}

// Option sets one field of Options.
type Option func(*Options)

// WithClock sets Options.Clock.
func WithClock(now func() time.Time) Option { return func(o *Options) { o.Clock = now } }

// WithBusyTimeout sets Options.BusyTimeout.
func WithBusyTimeout(d time.Duration) Option { return func(o *Options) { o.BusyTimeout = d } }

// WithMaxConns sets Options.MaxConns.
func WithMaxConns(n int) Option { return func(o *Options) { o.MaxConns = n } }

// WithSyncFull sets Options.SyncFull.
func WithSyncFull(on bool) Option { return func(o *Options) { o.SyncFull = on } }

// BuildOptions applies opts over the defaults. For backends.
func BuildOptions(opts ...Option) Options {
	o := Options{Clock: time.Now, BusyTimeout: 5 * time.Second}
	for _, f := range opts {
		f(&o)
	}
	if o.Clock == nil {
		o.Clock = time.Now
	}
	if o.BusyTimeout <= 0 {
		o.BusyTimeout = 5 * time.Second
	}
	return o
}

// OpenFunc opens a backend on a DSN (or path) and applies its migrations.
type OpenFunc func(ctx context.Context, dsn string, opts ...Option) (Store, error)

var (
	mu       sync.RWMutex
	backends = map[string]OpenFunc{}
)

// Register makes a backend available to Open under a DSN scheme ("sqlite",
// "postgres", "memory"). Backends call it from init; a program links a backend by importing it,
// usually for its side effect:
//
//	import _ "github.com/curfew-mesh/curfew/mesh/store/sqlite"
func Register(scheme string, open OpenFunc) {
	mu.Lock()
	defer mu.Unlock()
	if _, dup := backends[scheme]; dup {
		panic("store: Register called twice for scheme " + scheme)
	}
	backends[scheme] = open
}

// Open opens the store named by dsn and applies pending migrations:
//
//	postgres://user@host:5432/db?sslmode=disable   PostgreSQL (also postgresql://)
//	sqlite:///var/lib/curfew/curfew.db             SQLite, absolute path
//	sqlite://data/curfew.db                        SQLite, relative path
//	/var/lib/curfew/curfew.db or data/curfew.db    a plain path is SQLite
//	memory://NAME                                  in this process's memory (memory:// for "default")
//
// It fails with ErrSchemaTooNew if a newer curfew migrated the database.
func Open(ctx context.Context, dsn string, opts ...Option) (Store, error) {
	scheme := Scheme(dsn)
	mu.RLock()
	open, ok := backends[scheme]
	mu.RUnlock()
	if !ok {
		mu.RLock()
		names := make([]string, 0, len(backends))
		for n := range backends {
			names = append(names, n)
		}
		mu.RUnlock()
		sort.Strings(names)
		return nil, fmt.Errorf("%w: no store backend for scheme %q (linked: %v; import mesh/store/%s)",
			ErrInvalidArgument, scheme, names, scheme)
	}
	return open(ctx, dsn, opts...)
}

// Scheme returns the backend a DSN names: "postgres" for postgres:// and
// postgresql://, "sqlite" for sqlite:// and plain paths, otherwise the DSN's scheme
// ("memory" for memory://).
func Scheme(dsn string) string {
	i := strings.Index(dsn, "://")
	if i < 0 {
		return "sqlite"
	}
	switch s := strings.ToLower(dsn[:i]); s {
	case "postgresql":
		return "postgres"
	default:
		return s
	}
}
