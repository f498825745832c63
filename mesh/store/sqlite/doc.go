// Package sqlite is the embedded store backend: a SQLite file under the data
// directory through the pure-Go driver modernc.org/sqlite (no cgo).
//
// Settings (see store.Options for the knobs):
//   - journal_mode=WAL: readers never block the writer nor the writer readers; checked
//     at Open, which fails on a filesystem where WAL is unavailable.
//   - busy_timeout 5 s: how long a write waits for another process's write lock (the
//     CLI, a second orchestrator on the same file) before SQLITE_BUSY.
//   - synchronous=NORMAL: commits survive a killed process; WithSyncFull(true) for
//     FULL, which also survives power loss at the price of an fsync per commit.
//   - foreign_keys=ON.
//   - One writer connection whose transactions are BEGIN IMMEDIATE: SQLite admits one
//     writer at a time anyway; queuing in the pool is cheaper than spinning on the busy
//     handler, and taking the lock up front means a transaction never fails half-way
//     on a lock upgrade. Reads outside transactions use max(4, GOMAXPROCS) query_only
//     connections.
//
// Importing the package registers it with store.Open for sqlite:// DSNs and plain
// paths.
package sqlite
