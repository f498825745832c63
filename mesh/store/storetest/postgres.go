package storetest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"net/url"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// PostgresEnv names the variable that holds the DSN of the test PostgreSQL server
// (scripts/test.sh exports it). Without it the local default DefaultPostgresDSN is
// tried.
const PostgresEnv = "CURFEW_TEST_POSTGRES_DSN"

// DefaultPostgresDSN is the machine's local server (trust auth, database test).
const DefaultPostgresDSN = "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"

var (
	pgOnce sync.Once
	pgBase string
	pgErr  error
)

// PostgresDSN returns the DSN of a new, empty schema on the test server, selected
// through search_path, and drops the schema (CASCADE) when t ends. Parallel runs and
// packages never collide. When the server cannot be reached, t is skipped with the
// reason, or, under CI (CI=true), fails: CI must test the real PostgreSQL.
func PostgresDSN(t testing.TB) string {
	t.Helper()
	pgOnce.Do(func() {
		pgBase = os.Getenv(PostgresEnv)
		if pgBase == "" {
			pgBase = DefaultPostgresDSN
		}
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		conn, err := pgx.Connect(ctx, pgBase)
		if err != nil {
			pgErr = err
			return
		}
		pgErr = conn.Ping(ctx)
		_ = conn.Close(ctx)
	})
	if pgErr != nil {
		msg := "PostgreSQL at " + redact(pgBase) + " unreachable (" + pgErr.Error() + "); set " + PostgresEnv +
			" or start it: pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start"
		if os.Getenv("CI") == "true" {
			t.Fatal(msg)
		}
		t.Skip(msg)
	}
	var b [6]byte
	_, _ = rand.Read(b[:])
	schema := "curfew_test_" + hex.EncodeToString(b[:])
	admin(t, "CREATE SCHEMA "+schema)
	t.Cleanup(func() { admin(t, "DROP SCHEMA IF EXISTS "+schema+" CASCADE") })
	u, err := url.Parse(pgBase)
	if err != nil {
		t.Fatalf("%s: %v", PostgresEnv, err)
	}
	q := u.Query()
	q.Set("search_path", schema)
	u.RawQuery = q.Encode()
	return u.String()
}

func admin(t testing.TB, sql string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, pgBase)
	if err != nil {
		t.Fatalf("postgres: %v", err)
	}
	defer func() { _ = conn.Close(ctx) }()
	if _, err := conn.Exec(ctx, sql); err != nil {
		t.Fatalf("postgres %q: %v", sql, err)
	}
}

func redact(dsn string) string {
	u, err := url.Parse(dsn)
	if err != nil {
		return "(unparsable DSN)"
	}
	return u.Redacted()
}
