package sqlite

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"time"

	_ "modernc.org/sqlite" // the pure-Go driver, registered as "sqlite"

	"github.com/curfew-mesh/curfew/mesh/store"
	"github.com/curfew-mesh/curfew/mesh/store/internal/sqlcore"
)

func init() { store.Register("sqlite", Open) }

// Open opens (creating it and its directory if needed) the SQLite database at
// dsnOrPath, a path or a sqlite:// URL (sqlite:///abs/path, sqlite://rel/path), and
// applies pending migrations. See the package documentation for the settings.
func Open(ctx context.Context, dsnOrPath string, opts ...store.Option) (store.Store, error) {
	o := store.BuildOptions(opts...)
	path := strings.TrimPrefix(dsnOrPath, "sqlite://")
	if path == "" || strings.ContainsAny(path, "?#") {
		return nil, fmt.Errorf("%w: sqlite path %q (want a file path, without ? or #)", store.ErrInvalidArgument, dsnOrPath)
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o750); err != nil {
		return nil, fmt.Errorf("sqlite: data directory: %w", err)
	}
	sync := "NORMAL"
	if o.SyncFull {
		sync = "FULL"
	}
	base := fmt.Sprintf("file:%s?_pragma=busy_timeout(%d)&_pragma=journal_mode(WAL)&_pragma=synchronous(%s)&_pragma=foreign_keys(1)",
		path, o.BusyTimeout.Milliseconds(), sync)
	// One writer connection: SQLite has one writer per database anyway, and queuing
	// writers in the pool is cheaper and fairer than letting them spin on the busy
	// handler. BEGIN IMMEDIATE takes the write lock up front, so a transaction never
	// fails half-way trying to upgrade a read lock.
	// A new file's switch to WAL needs the database to itself, and SQLite answers
	// SQLITE_BUSY at once, without its busy handler, when replicas open it at the same
	// instant; so those opens are tried again, until the busy timeout.
	deadline := time.Now().Add(max(o.BusyTimeout, time.Second))
	for attempt := 0; ; attempt++ {
		d, err := open(ctx, base, path, o)
		if err == nil {
			return sqlcore.New(d, sqlcore.SQLite, o), nil
		}
		if !busy(err) || time.Now().After(deadline) {
			return nil, err
		}
		t := time.NewTimer(time.Duration(1+rand.IntN(10<<min(attempt, 4))) * time.Millisecond) //nolint:gosec // jitter, not secrets
		select {
		case <-ctx.Done():
			t.Stop()
			return nil, errors.Join(err, ctx.Err())
		case <-t.C:
		}
	}
}

// open opens the writer and reader pools, checks WAL mode and migrates.
func open(ctx context.Context, base, path string, o store.Options) (sqlcore.SQLDB, error) {
	d, err := sqlcore.OpenSQLite(base, o.MaxConns, 0)
	if err != nil {
		return sqlcore.SQLDB{}, err
	}
	if err := check(ctx, d.W); err != nil {
		return sqlcore.SQLDB{}, errors.Join(fmt.Errorf("sqlite %s: %w", path, err), d.Close())
	}
	if _, err := sqlcore.Migrate(ctx, d, sqlcore.SQLite, max(o.Clock().UnixMilli(), 1)); err != nil {
		return sqlcore.SQLDB{}, errors.Join(fmt.Errorf("sqlite %s: %w", path, err), d.Close())
	}
	return d, nil
}

// busy reports whether err is SQLite's SQLITE_BUSY or SQLITE_LOCKED.
func busy(err error) bool {
	var c interface{ Code() int }
	if errors.As(err, &c) {
		switch c.Code() & 0xff { // the primary result code
		case 5, 6:
			return true
		}
	}
	return strings.Contains(err.Error(), "database is locked")
}

// check makes sure the file opened in WAL mode (it cannot on some network filesystems).
func check(ctx context.Context, w *sql.DB) error {
	var mode string
	if err := w.QueryRowContext(ctx, "PRAGMA journal_mode").Scan(&mode); err != nil {
		return err
	}
	if !strings.EqualFold(mode, "wal") {
		return fmt.Errorf("journal_mode is %q, want wal", mode)
	}
	return nil
}
