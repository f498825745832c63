// Package store is curfew's state: one interface ([Store]), three backends.
//
//   - store/sqlite: the embedded default. A file under the data directory, the pure-Go
//     driver modernc.org/sqlite, WAL journal, busy timeout, one writer connection
//     (transactions are BEGIN IMMEDIATE) and a small pool of read-only readers.
//   - store/postgres: PostgreSQL through a pgx v5 pool, shared by replicas.
//   - store/memory: an in-memory SQLite database private to the process (memory://NAME),
//     the store of a service started without one. Not durable, not shared.
//   - store/migrations: the versioned schema, embedded, applied at Open.
//   - store/storetest: the contract suite every backend passes, and test helpers.
//
// Open a store by DSN with [Open] after linking the backends you want:
//
//	import (
//		"github.com/curfew-mesh/curfew/mesh/store"
//		_ "github.com/curfew-mesh/curfew/mesh/store/memory"
//		_ "github.com/curfew-mesh/curfew/mesh/store/postgres"
//		_ "github.com/curfew-mesh/curfew/mesh/store/sqlite"
//	)
//	s, err := store.Open(ctx, "sqlite:///var/lib/curfew/curfew.db") // or a plain path, postgres://..., memory://
//
// # Shared or private
//
// Every service has a store; what differs is who else sees it. [Sharing.Shared] says
// so: a SQLite file and PostgreSQL are shared (another orchestrator can take a run
// over, the CLI reads what a service wrote); a memory store is private to its process
// and lost with it. Code whose behaviour depends on that asks Shared, never whether a
// store is configured.
//
// # What it holds
//
// Runs (absolute deadline, tenant, task, status, cause, answer) with leases; checkpoints
// per completed step; tool idempotency records with the state of the side-effect
// built-ins (kv, outbox) that they commit together with; dead letters; the token
// ledger. Every row belongs to a tenant and every read names one: another tenant's
// row reads as ErrNotFound. The exceptions are deliberate: ClaimExpiredRuns sweeps all
// tenants (orchestrators serve all of them), the dead-letter methods take tenant ""
// as the operator's view of all tenants, and ListRuns lists every tenant's runs only
// when asked by name (RunQuery.AllTenants; a query without a tenant is refused).
//
// # Fencing
//
// A run is advanced by whoever holds its lease (owner, epoch, expiry). Every claim
// increments the epoch; every write on the run's behalf (PutCheckpoint, HeartbeatRun,
// FinishRun, ReleaseRun) carries the writer's [Lease] and is checked against the
// current epoch in the same transaction, failing with ErrStaleEpoch once someone else
// has claimed the run. Tool records work the same way with a [ToolClaim]: a takeover
// after the lease expired increments the record's epoch and fences the old owner's
// CompleteTool. Expiry decides liveness only (when someone else may claim); the epoch
// decides safety. Leases are compared against the store's clock ([Options].Clock, the
// local wall clock by default), so replicas on PostgreSQL should run NTP: skew makes a
// takeover early or late by the skew, and never lets two owners advance one run.
//
// # Defaults
//
//   - Lease TTLs belong to the callers (orchestrator, toolrunner) and are passed to
//     every claim and heartbeat; the store has none. The rule: heartbeat every
//     third of the TTL.
//   - SQLite: busy timeout 5 s ([WithBusyTimeout]); synchronous=NORMAL in WAL mode,
//     which survives a killed process but may lose the last commits on power loss
//     ([WithSyncFull] for FULL); foreign keys on; 1 writer connection and
//     max(4, GOMAXPROCS) readers ([WithMaxConns]); the file's directory is created.
//   - PostgreSQL: pool of 10 connections unless the DSN says pool_max_conns or
//     [WithMaxConns] is given; READ COMMITTED transactions; the schema is the
//     connection's search_path (add search_path=NAME to the DSN to use another).
//   - Times are stored as Unix milliseconds: values read back are truncated to the
//     millisecond and in UTC.
//   - List pages hold 100 rows unless Limit says otherwise (at most 1000); cursors
//     are the last ID of the page (UUIDv7, so pages run newest first).
//   - ListRuns filters by tenant (or every tenant), status, model and a creation window
//     [CreatedAfter, CreatedBefore), lower bound inclusive, upper exclusive; each filter
//     has an index (migration 0012), so a page costs a range of one index, not a scan
//     of the table (docs/benchmarks.md, "Run list filters").
//   - [WaitTool] polls (5 ms doubling to 250 ms) rather than LISTEN/NOTIFY, so both
//     backends behave alike; its cost is one poll interval of extra latency.
//
// # Errors
//
// Errors callers act on wrap one sentinel (ErrNotFound, ErrAlreadyExists, ErrConflict,
// ErrStaleEpoch, ErrLeaseHeld, ErrRunFinished, ErrAlreadyReplayed,
// ErrInvalidArgument, ErrSchemaTooNew, ErrUnavailable); [Code] maps them to gRPC codes.
// ErrUnavailable marks a store that could not be reached or could not answer now, which
// the same call may get past later: the PostgreSQL backend marks the errors of a
// connection refused, cut or timed out and of a server shutting down or starting up
// (postgres/errors.go). Anything else is an infrastructure error (INTERNAL; do not send
// its text to clients).
package store
