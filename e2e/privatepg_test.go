package e2e

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/curfew-mesh/curfew/internal/meshproc"
	"github.com/curfew-mesh/curfew/internal/pgproc"
)

// privatePG is a PostgreSQL server of the test's own (internal/pgproc), so that a test
// can stop the store under a running mesh and start it again: the shared server of the
// machine must stay up for the other tests.
type privatePG struct{ *pgproc.Server }

// startPrivatePG initdbs and starts a server; the test's end stops it and removes its
// directory.
func startPrivatePG(t *testing.T) *privatePG {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	s, err := pgproc.Start(ctx)
	if errors.Is(err, pgproc.ErrNotInstalled) {
		meshproc.Missing(t, "%v", err)
	}
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	return &privatePG{s}
}

// start starts the server again and waits until it answers.
func (pg *privatePG) start(t *testing.T) {
	t.Helper()
	if err := pg.Up(context.Background()); err != nil {
		t.Fatal(err)
	}
}

// stop stops the server at once (connections are cut, as when its host goes away).
func (pg *privatePG) stop(t *testing.T) {
	t.Helper()
	if err := pg.Stop(); err != nil {
		t.Fatal(err)
	}
}

// dsn is the store DSN of the server's postgres database.
func (pg *privatePG) dsn() string { return pg.DSN() }
