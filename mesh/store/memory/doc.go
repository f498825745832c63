// Package memory is the process-private store backend: an in-memory SQLite database
// per name, for a service that needs a store but not a durable or shared one (the
// default of every service started without --store, and tests).
//
// It runs the same SQL as the sqlite and postgres backends (internal/sqlcore) on
// SQLite's memdb VFS through modernc.org/sqlite, so the semantics of every call
// (fencing epochs, idempotent appends, dead-letter de-duplication, expiry) are the
// ones the contract suite checks, not a second copy of them.
//
// DSNs are memory://NAME; memory:// alone names [DefaultName]. A name may not contain
// ? or #. Within one process, every Open of a name returns a store on the same data,
// so reopening a name keeps what was written; different names are independent, and
// no other process ever sees them: [store.Sharing.Shared] is false.
//
// Lifetime: a name's data lives while at least one store opened on it is open. Close
// releases that store (calls on it fail afterwards); the last Close of a name drops
// its data, and a later Open of the name starts empty.
//
// Settings: one writer connection whose transactions are BEGIN IMMEDIATE and
// max(4, GOMAXPROCS) reader connections ([store.WithMaxConns]), as for a SQLite file;
// busy timeout 5 s ([store.WithBusyTimeout]) for a reader that meets a commit; foreign
// keys on. A rollback journal in memory (WAL does not apply). The pool settings are
// those of a name's first Open; the clock ([store.WithClock]) is each store's own.
//
// Importing the package registers it with store.Open for memory:// DSNs.
package memory
