package store

import (
	"context"
	"errors"
	"fmt"
	"time"

	"google.golang.org/grpc/codes"
)

// Sentinel errors. Every error a Store returns for a condition the caller can act on wraps
// exactly one of these (test with errors.Is); anything else is an infrastructure failure
// (connection lost, disk full) and maps to UNAVAILABLE or INTERNAL. [Code] maps them to
// gRPC codes in one place.
var (
	// ErrNotFound: no such run, tool record, dead letter or kv key in this tenant.
	ErrNotFound = errors.New("store: not found")
	// ErrAlreadyExists: a row with this identity already exists and the operation does
	// not return it (for example a caller-chosen run ID that is taken).
	ErrAlreadyExists = errors.New("store: already exists")
	// ErrConflict: the row is in a state the operation does not accept (for example a
	// checkpoint for a step that was already written with different content).
	ErrConflict = errors.New("store: conflict")
	// ErrStaleEpoch: a fenced write (run lease or tool record) carried an owner and epoch
	// that are no longer current: someone else took the run or the record over. The
	// writer must stop working on it.
	ErrStaleEpoch = errors.New("store: stale epoch")
	// ErrLeaseHeld: the run is leased by another owner whose lease has not expired.
	// Wrapped in a *LeaseHeldError that says by whom and until when.
	ErrLeaseHeld = errors.New("store: lease held by another owner")
	// ErrRunFinished: the run has ended; it can be neither claimed nor written.
	ErrRunFinished = errors.New("store: run finished")
	// ErrAlreadyReplayed: the dead letter was already replayed (MarkReplayed is
	// idempotent: a second replay does nothing and says so).
	ErrAlreadyReplayed = errors.New("store: dead letter already replayed")
	// ErrInvalidArgument: a required field is empty or a value is out of range.
	ErrInvalidArgument = errors.New("store: invalid argument")
	// ErrSchemaTooNew: the database was migrated by a newer curfew than this binary; it
	// refuses to run against a schema it does not know.
	ErrSchemaTooNew = errors.New("store: database schema is newer than this binary")
	// ErrUnavailable: the store could not be reached or could not answer now (connection
	// refused or cut, the server shutting down or starting up, too many connections).
	// The same call may succeed once the store is back: it is the one store error a
	// caller may wait out (the orchestrator's checkpoints do, within the run's deadline).
	// A backend marks only errors it knows to be such; a constraint violation, a fenced
	// write or any error it cannot classify is never ErrUnavailable.
	ErrUnavailable = errors.New("store: unavailable")
)

// LeaseHeldError is returned (wrapping ErrLeaseHeld) when a run is leased by someone else.
type LeaseHeldError struct {
	RunID   string
	Owner   string
	Epoch   int64
	Expires time.Time
}

func (e *LeaseHeldError) Error() string {
	return fmt.Sprintf("store: run %s is leased by %q (epoch %d) until %s",
		e.RunID, e.Owner, e.Epoch, e.Expires.UTC().Format(time.RFC3339Nano))
}

// Unwrap makes errors.Is(err, ErrLeaseHeld) true.
func (e *LeaseHeldError) Unwrap() error { return ErrLeaseHeld }

// Code maps a store error to the gRPC code a service should answer with. Errors that wrap
// none of the sentinels are a cancelled or expired context (CANCELED, DEADLINE_EXCEEDED)
// or an infrastructure failure (INTERNAL, whose text must not be sent to the client).
// ErrUnavailable is UNAVAILABLE; its text, like INTERNAL's, is the backend's own.
func Code(err error) codes.Code {
	switch {
	case err == nil:
		return codes.OK
	case errors.Is(err, ErrNotFound):
		return codes.NotFound
	case errors.Is(err, ErrAlreadyExists), errors.Is(err, ErrAlreadyReplayed):
		return codes.AlreadyExists
	case errors.Is(err, ErrStaleEpoch), errors.Is(err, ErrLeaseHeld), errors.Is(err, ErrConflict):
		return codes.Aborted
	case errors.Is(err, ErrRunFinished), errors.Is(err, ErrSchemaTooNew):
		return codes.FailedPrecondition
	case errors.Is(err, ErrInvalidArgument):
		return codes.InvalidArgument
	case errors.Is(err, ErrUnavailable):
		return codes.Unavailable
	case errors.Is(err, context.Canceled):
		return codes.Canceled
	case errors.Is(err, context.DeadlineExceeded):
		return codes.DeadlineExceeded
	default:
		return codes.Internal
	}
}
