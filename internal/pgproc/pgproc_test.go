package pgproc_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/curfew-mesh/curfew/internal/meshproc"
	"github.com/curfew-mesh/curfew/internal/pgproc"
)

// A server of its own answers, refuses connections while stopped, and answers again,
// with its data, once up.
func TestServerStopsAndComesBack(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	pg, err := pgproc.Start(ctx)
	if errors.Is(err, pgproc.ErrNotInstalled) {
		meshproc.Missing(t, "%v", err)
	}
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = pg.Close() }()
	exec := func(sql string) error {
		c, err := pgx.Connect(ctx, pg.DSN())
		if err != nil {
			return err
		}
		defer func() { _ = c.Close(ctx) }()
		_, err = c.Exec(ctx, sql)
		return err
	}
	if err := exec("CREATE TABLE kept (n int); INSERT INTO kept VALUES (1)"); err != nil {
		t.Fatal(err)
	}
	if err := pg.Stop(); err != nil {
		t.Fatal(err)
	}
	if err := exec("SELECT 1"); err == nil {
		t.Fatal("the stopped server answered")
	}
	if err := pg.Up(ctx); err != nil {
		t.Fatal(err)
	}
	if err := exec("INSERT INTO kept VALUES (2)"); err != nil {
		t.Fatalf("after the restart: %v", err)
	}
}
