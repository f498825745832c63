package sqlcore

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"testing"

	_ "modernc.org/sqlite"
)

func openTestDB(t *testing.T) SQLDB {
	t.Helper()
	d, err := OpenSQLite("file:"+filepath.Join(t.TempDir(), "t.db")+"?_pragma=journal_mode(wal)&_pragma=busy_timeout(5000)", 2, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d.Close() })
	if _, err := d.Exec(context.Background(), `CREATE TABLE kv (k TEXT PRIMARY KEY, v INTEGER NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	return d
}

func kept(c *stmts, s string) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.m[s] != nil
}

// A query is prepared on its first run and reused; one first run inside a transaction
// is prepared after it, since the transaction holds the single writer connection; the
// prepared statement then runs inside the next transaction. Every answer is right.
func TestStatementsArePreparedOnceAndUsedInTransactions(t *testing.T) {
	ctx := context.Background()
	d := openTestDB(t)
	const ins = `INSERT INTO kv (k, v) VALUES ($1, $2)`
	const upd = `UPDATE kv SET v = v + $2 WHERE k = $1`
	const get = `SELECT v FROM kv WHERE k = $1`
	if _, err := d.Exec(ctx, ins, "a", 1); err != nil {
		t.Fatal(err)
	}
	if !kept(d.ws, ins) {
		t.Fatal("the writer's query is not kept prepared after its first run")
	}
	if _, err := d.Exec(ctx, ins, "b", 2); err != nil {
		t.Fatal(err)
	}
	for i := range 3 {
		err := d.Tx(ctx, func(q Querier) error {
			n, err := q.Exec(ctx, upd, "a", 10)
			if err != nil || n != 1 {
				return fmt.Errorf("update: %d rows, %w", n, err)
			}
			_, err = q.Exec(ctx, ins, fmt.Sprintf("t%d", i), i)
			return err
		})
		if err != nil {
			t.Fatalf("transaction %d: %v", i, err)
		}
		if !kept(d.ws, upd) {
			t.Fatalf("after transaction %d the update run in it is not prepared", i)
		}
	}
	var v int
	if err := d.Read().QueryRow(ctx, get, "a").Scan(&v); err != nil || v != 31 {
		t.Fatalf("a = %d, %v; want 31", v, err)
	}
	if err := d.Read().QueryRow(ctx, get, "a").Scan(&v); err != nil || v != 31 || !kept(d.rs, get) {
		t.Fatalf("a = %d, %v, kept %v; want 31 from the prepared read", v, err, kept(d.rs, get))
	}
	if err := d.Read().QueryRow(ctx, get, "zz").Scan(&v); !errors.Is(err, ErrNoRows) {
		t.Fatalf("a missing key: %v, want ErrNoRows", err)
	}
	if _, err := d.Exec(ctx, `INSERT INTO nowhere VALUES (1)`); err == nil {
		t.Fatal("a query on a missing table succeeded")
	}
}

// Past maxStmts texts a pool keeps no more, and the queries still run.
func TestStatementsKeptAreBounded(t *testing.T) {
	ctx := context.Background()
	d := openTestDB(t)
	for i := range maxStmts + 10 {
		var v int
		if err := d.Read().QueryRow(ctx, fmt.Sprintf(`SELECT %d`, i)).Scan(&v); err != nil || v != i {
			t.Fatalf("SELECT %d: %d, %v", i, v, err)
		}
	}
	d.rs.mu.Lock()
	n := len(d.rs.m)
	d.rs.mu.Unlock()
	if n != maxStmts {
		t.Fatalf("%d statements kept, want %d", n, maxStmts)
	}
}
