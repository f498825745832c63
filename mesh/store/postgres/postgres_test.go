package postgres_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"go.uber.org/goleak"

	"github.com/curfew-mesh/curfew/mesh/store"
	"github.com/curfew-mesh/curfew/mesh/store/postgres"
	"github.com/curfew-mesh/curfew/mesh/store/storetest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func fresh(t *testing.T) string { return storetest.PostgresDSN(t) }

func TestContract(t *testing.T) { storetest.Run(t, fresh) }

// TestSchemaTooNew: a database migrated by a newer curfew is refused, not modified.
func TestSchemaTooNew(t *testing.T) {
	ctx := context.Background()
	dsn := fresh(t)
	s, err := postgres.Open(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = conn.Close(ctx) }()
	if _, err := conn.Exec(ctx, "INSERT INTO schema_migrations (version, name, applied_ms) VALUES (999, 'future', 1)"); err != nil {
		t.Fatal(err)
	}
	_, err = store.Open(ctx, dsn)
	if !errors.Is(err, store.ErrSchemaTooNew) {
		t.Fatalf("open a newer schema: %v, want ErrSchemaTooNew", err)
	}
	t.Logf("error: %v", err)
}

// PostgreSQL is shared: replicas open the same database.
func TestShared(t *testing.T) {
	s, err := postgres.Open(context.Background(), fresh(t))
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = s.Close() }()
	if !s.Shared() {
		t.Fatal("a PostgreSQL store says no other process shares it")
	}
}

func TestBadDSN(t *testing.T) {
	if _, err := postgres.Open(context.Background(), "postgres://%zz"); !errors.Is(err, store.ErrInvalidArgument) {
		t.Fatalf("bad DSN: %v", err)
	}
}

func BenchmarkCheckpoint(b *testing.B) {
	storetest.BenchmarkCheckpoint(b, storetest.PostgresDSN(b))
}

// BenchmarkTokenBudget is one model call's reservation and settlement.
func BenchmarkTokenBudget(b *testing.B) {
	storetest.BenchmarkTokenBudget(b, storetest.PostgresDSN(b))
}

// BenchmarkRunList is the console's filtered run lists over 10,000 runs
// (docs/benchmarks.md, "Run list filters"). It logs PostgreSQL's plan of the rare
// model's query as it stands after seeding (autovacuum may not have analyzed the table
// yet: the plan the first pages get), to show which index serves it.
func BenchmarkRunList(b *testing.B) {
	dsn := storetest.PostgresDSN(b)
	storetest.BenchmarkRunList(b, dsn, func(b *testing.B, q store.RunQuery) {
		ctx := context.Background()
		conn, err := pgx.Connect(ctx, dsn)
		if err != nil {
			b.Fatal(err)
		}
		defer func() { _ = conn.Close(ctx) }()
		// The statement ListRuns builds for this query (sqlcore.runFilter), less the
		// column list.
		rows, err := conn.Query(ctx, `EXPLAIN (ANALYZE, BUFFERS, COSTS OFF) SELECT run_id FROM runs
			WHERE model = $1 AND created_ms >= $2 AND created_ms < $3 ORDER BY run_id DESC LIMIT $4`,
			q.Model, q.CreatedAfter.UnixMilli(), q.CreatedBefore.UnixMilli(), q.Limit+1)
		if err != nil {
			b.Fatal(err)
		}
		defer rows.Close()
		plan := "plan of the rare model's query:"
		for rows.Next() {
			var line string
			if err := rows.Scan(&line); err != nil {
				b.Fatal(err)
			}
			plan += "\n  " + line
		}
		if err := rows.Err(); err != nil {
			b.Fatal(err)
		}
		b.Log(plan)
	})
}

// BenchmarkCheckpointNoSyncCommit is the same with synchronous_commit=off for the
// session: the cost without waiting for the WAL flush, to tell the statement's cost
// from the disk's. Not a recommended setting (a crash may lose the last commits).
func BenchmarkCheckpointNoSyncCommit(b *testing.B) {
	storetest.BenchmarkCheckpoint(b, storetest.PostgresDSN(b)+"&synchronous_commit=off")
}

// TestSlotReleasesNotify: a release on one store wakes a watcher on another, through
// the trigger of migration 0010 and LISTEN.
func TestSlotReleasesNotify(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	dsn := fresh(t)
	a, err := postgres.Open(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = a.Close() }()
	b, err := postgres.Open(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = b.Close() }()
	scope := "pool/notify-" + t.Name() // channels are per database: other tests may notify too
	got := make(chan string, 16)
	wctx, stop := context.WithCancel(ctx)
	done, err := b.(store.SlotReleases).WatchSlotReleases(wctx, func(s string) {
		if s == scope {
			got <- s
		}
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := a.SizeSlots(ctx, scope, 1); err != nil {
		t.Fatal(err)
	}
	sl, ok, err := a.ClaimSlot(ctx, scope, "a", time.Minute)
	if err != nil || !ok {
		t.Fatalf("claim: %v %v", ok, err)
	}
	if _, err := a.RenewSlots(ctx, "a", time.Minute); err != nil {
		t.Fatal(err)
	}
	if err := a.ReleaseSlot(ctx, sl); err != nil {
		t.Fatal(err)
	}
	select {
	case <-got:
	case <-ctx.Done():
		t.Fatal("no notification of the release")
	}
	select {
	case s := <-got:
		t.Fatalf("a second notification %q: claims and renewals must not notify", s)
	case <-time.After(200 * time.Millisecond):
	}
	stop()
	if err := <-done; err != nil {
		t.Fatalf("watch ended with %v", err)
	}
}
