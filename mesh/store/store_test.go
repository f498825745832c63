package store_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"go.uber.org/goleak"
	"google.golang.org/grpc/codes"

	"github.com/curfew-mesh/curfew/mesh/store"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestCode(t *testing.T) {
	for err, want := range map[error]codes.Code{
		nil:                                           codes.OK,
		fmt.Errorf("x: %w", store.ErrNotFound):        codes.NotFound,
		store.ErrAlreadyExists:                        codes.AlreadyExists,
		store.ErrAlreadyReplayed:                      codes.AlreadyExists,
		store.ErrStaleEpoch:                           codes.Aborted,
		&store.LeaseHeldError{RunID: "r"}:             codes.Aborted,
		store.ErrConflict:                             codes.Aborted,
		store.ErrRunFinished:                          codes.FailedPrecondition,
		store.ErrSchemaTooNew:                         codes.FailedPrecondition,
		store.ErrInvalidArgument:                      codes.InvalidArgument,
		context.Canceled:                              codes.Canceled,
		fmt.Errorf("q: %w", context.DeadlineExceeded): codes.DeadlineExceeded,
		errors.New("connection reset"):                codes.Internal,
		fmt.Errorf("%w: dial", store.ErrUnavailable):  codes.Unavailable,
	} {
		if got := store.Code(err); got != want {
			t.Errorf("Code(%v) = %v, want %v", err, got, want)
		}
	}
}

func TestLeaseHeldError(t *testing.T) {
	err := error(&store.LeaseHeldError{RunID: "r1", Owner: "o", Epoch: 3, Expires: time.UnixMilli(0)})
	var held *store.LeaseHeldError
	if !errors.Is(err, store.ErrLeaseHeld) || !errors.As(err, &held) || held.Owner != "o" {
		t.Fatalf("%v", err)
	}
}

func TestScheme(t *testing.T) {
	for dsn, want := range map[string]string{
		"postgres://u@h/db":      "postgres",
		"postgresql://u@h/db":    "postgres",
		"sqlite:///var/lib/c.db": "sqlite",
		"sqlite://data/c.db":     "sqlite",
		"/var/lib/curfew/c.db":   "sqlite",
		"data/c.db":              "sqlite",
		"mysql://x":              "mysql",
	} {
		if got := store.Scheme(dsn); got != want {
			t.Errorf("Scheme(%q) = %q, want %q", dsn, got, want)
		}
	}
}

func TestOpenUnknownScheme(t *testing.T) {
	_, err := store.Open(context.Background(), "mysql://x")
	if !errors.Is(err, store.ErrInvalidArgument) {
		t.Fatalf("open mysql: %v", err)
	}
}

func TestStatusTerminal(t *testing.T) {
	for s, want := range map[store.RunStatus]bool{
		store.StatusPending: false, store.StatusRunning: false, store.StatusSucceeded: true,
		store.StatusFailed: true, store.StatusCancelled: true, store.StatusDeadlineExceeded: true,
	} {
		if s.Terminal() != want {
			t.Errorf("%s.Terminal() = %v", s, !want)
		}
	}
}
