// Package sqlcore implements store.Store once, in SQL that SQLite (3.35+) and
// PostgreSQL both accept ($N placeholders, ON CONFLICT, RETURNING), over a small driver
// abstraction: [SQLDB] over database/sql for the SQLite backends (sqlite, memory), and
// pgxpool in the postgres package. The backends differ only in the driver, the DDL
// (migrations) and the row locking clause (FOR UPDATE on PostgreSQL; SQLite's write
// transactions are BEGIN IMMEDIATE and so already serialized).
package sqlcore

import (
	"context"
	"errors"
)

// ErrNoRows is what a driver's Row.Scan returns for an empty result.
var ErrNoRows = errors.New("sqlcore: no rows")

// Row is a single-row result.
type Row interface{ Scan(dest ...any) error }

// Rows is a multi-row result; Close must be called.
type Rows interface {
	Next() bool
	Scan(dest ...any) error
	Err() error
	Close()
}

// Querier runs statements, inside or outside a transaction.
type Querier interface {
	Exec(ctx context.Context, sql string, args ...any) (rowsAffected int64, err error)
	QueryRow(ctx context.Context, sql string, args ...any) Row
	Query(ctx context.Context, sql string, args ...any) (Rows, error)
}

// Driver is one backend's connection pool.
type Driver interface {
	// Read returns a Querier for reads outside a transaction.
	Read() Querier
	// Exec runs one write statement in its own (implicit) transaction: one round trip.
	Exec(ctx context.Context, sql string, args ...any) (rowsAffected int64, err error)
	// Write runs one write statement that returns rows (UPDATE ... RETURNING) in its
	// own implicit transaction: one round trip, where Tx costs three on PostgreSQL.
	Write(ctx context.Context, sql string, args ...any) (Rows, error)
	// Tx runs fn in one write transaction (READ COMMITTED on PostgreSQL, BEGIN
	// IMMEDIATE on SQLite), committing if fn returns nil.
	Tx(ctx context.Context, fn func(q Querier) error) error
	Close() error
}

// Dialect is what differs in the SQL.
type Dialect struct {
	Name string // "sqlite" or "postgres": the migrations directory
	// ForUpdate is appended to a SELECT that locks the row for the rest of the
	// transaction.
	ForUpdate string
	// SkipLocked is appended to a SELECT that locks the first rows no other
	// transaction has locked, skipping the others (claiming one of many slots).
	SkipLocked string
	// MigrationLock is run first in the migration transaction, to serialize replicas
	// migrating at once ("" for none).
	MigrationLock string
	// Blob is the binary column type, for CASTs of parameters whose type the
	// statement does not otherwise fix.
	Blob string
	// WritableCTEs says that a WITH clause may hold DELETE … RETURNING (PostgreSQL):
	// several writes then go in one statement, one round trip, where SQLite runs them
	// as statements of one transaction (local calls, and its single writer serializes
	// them anyway).
	WritableCTEs bool
}

// SQLite is the dialect of the SQLite backends. BEGIN IMMEDIATE already locks the
// database: no FOR UPDATE.
var SQLite = Dialect{Name: "sqlite", Blob: "BLOB"}
