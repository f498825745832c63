package sqlite_test

import (
	"context"
	"database/sql"
	"errors"
	"os"
	"path/filepath"
	"testing"

	"go.uber.org/goleak"

	"github.com/curfew-mesh/curfew/mesh/store"
	"github.com/curfew-mesh/curfew/mesh/store/sqlite"
	"github.com/curfew-mesh/curfew/mesh/store/storetest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func fresh(t *testing.T) string { return filepath.Join(t.TempDir(), "data", "curfew.db") }

func TestContract(t *testing.T) { storetest.Run(t, fresh) }

func TestOpenForms(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	for _, dsn := range []string{
		filepath.Join(dir, "plain", "a.db"),
		"sqlite://" + filepath.Join(dir, "url", "b.db"), // sqlite:///abs/path
	} {
		s, err := store.Open(ctx, dsn)
		if err != nil {
			t.Fatalf("open %s: %v", dsn, err)
		}
		if _, _, err := s.CreateRun(ctx, store.NewRun{Tenant: "t", Deadline: storetest.NewClock().Now()}); err != nil {
			t.Fatal(err)
		}
		if err := s.Close(); err != nil {
			t.Fatal(err)
		}
	}
	for _, f := range []string{"plain/a.db", "url/b.db"} {
		if _, err := os.Stat(filepath.Join(dir, f)); err != nil {
			t.Errorf("database file: %v", err)
		}
	}
	if _, err := sqlite.Open(ctx, "x.db?mode=memory"); !errors.Is(err, store.ErrInvalidArgument) {
		t.Errorf("path with a query: %v, want ErrInvalidArgument", err)
	}
}

// A SQLite file is shared: another process can open it.
func TestShared(t *testing.T) {
	s, err := sqlite.Open(context.Background(), fresh(t))
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = s.Close() }()
	if !s.Shared() {
		t.Fatal("a SQLite file store says no other process shares it")
	}
}

// TestPragmas checks the file is in WAL mode and the busy timeout reaches connections.
func TestPragmas(t *testing.T) {
	ctx := context.Background()
	path := fresh(t)
	s, err := sqlite.Open(ctx, path, store.WithBusyTimeout(1234))
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = s.Close() }()
	db := raw(t, path+"?_pragma=busy_timeout(1234)")
	var mode string
	var timeout int
	if err := db.QueryRowContext(ctx, "PRAGMA journal_mode").Scan(&mode); err != nil || mode != "wal" {
		t.Errorf("journal_mode %q %v, want wal (persistent in the file)", mode, err)
	}
	if err := db.QueryRowContext(ctx, "PRAGMA busy_timeout").Scan(&timeout); err != nil || timeout != 1234 {
		t.Errorf("busy_timeout %d %v", timeout, err)
	}
}

func raw(t *testing.T, dsn string) *sql.DB {
	t.Helper()
	db, err := sql.Open("sqlite", "file:"+dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = db.Close() })
	return db
}

// TestSchemaTooNew: a database migrated by a newer curfew is refused, not modified.
func TestSchemaTooNew(t *testing.T) {
	ctx := context.Background()
	path := fresh(t)
	s, err := sqlite.Open(ctx, path)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	db := raw(t, path)
	if _, err := db.ExecContext(ctx, "INSERT INTO schema_migrations (version, name, applied_ms) VALUES (999, 'future', 1)"); err != nil {
		t.Fatal(err)
	}
	_, err = store.Open(ctx, path)
	if !errors.Is(err, store.ErrSchemaTooNew) {
		t.Fatalf("open a newer schema: %v, want ErrSchemaTooNew", err)
	}
	t.Logf("error: %v", err)
}

func BenchmarkCheckpoint(b *testing.B) {
	storetest.BenchmarkCheckpoint(b, filepath.Join(b.TempDir(), "curfew.db"))
}

// BenchmarkRunList is the console's filtered run lists over 10,000 runs, on a file
// (docs/benchmarks.md, "Run list filters").
func BenchmarkRunList(b *testing.B) {
	storetest.BenchmarkRunList(b, filepath.Join(b.TempDir(), "curfew.db"), nil)
}

func BenchmarkCheckpointSyncFull(b *testing.B) {
	storetest.BenchmarkCheckpoint(b, filepath.Join(b.TempDir(), "curfew.db"), store.WithSyncFull(true))
}
