// Package postgres is the shared store backend: PostgreSQL through a
// github.com/jackc/pgx/v5 pgxpool, for replicas that share runs and leases.
//
// Transactions are READ COMMITTED. Concurrency is handled by the statements
// themselves: INSERT ... ON CONFLICT (idempotency keys, tool records, dead letters),
// conditional UPDATE ... WHERE (claims and fenced writes, re-evaluated by PostgreSQL
// after a concurrent commit), and SELECT ... FOR UPDATE on the run row where a write
// must be fenced against a concurrent claim (checkpoints). Migrations run under a
// transaction-scoped advisory lock, so replicas starting together migrate once.
//
// The schema is the connection's search_path: put search_path=NAME in the DSN to keep
// curfew's tables out of public (the tests use one random schema per test).
//
// Importing the package registers it with store.Open for postgres:// and
// postgresql:// DSNs.
package postgres
