package cancel

import (
	"context"
	"errors"
	"strings"
	"time"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
)

// Causes passed to a context.CancelCauseFunc.
var (
	ErrClientDisconnect = errors.New("client disconnected")
	ErrDeadline         = errors.New("run deadline exceeded")
	ErrOperator         = errors.New("cancelled by operator")
	ErrSiblingFailed    = errors.New("a sibling failed")
	ErrSuperseded       = errors.New("superseded by a newer attempt")
	ErrBudget           = errors.New("budget exhausted")
	ErrLeaseExpired     = errors.New("decoder lease expired")
	// ErrApprovalTimeout: a tool call that waited for a human's approval got no
	// decision before its wait's cap, and was denied without its effect.
	ErrApprovalTimeout = errors.New("no approval before the wait's cap")
)

// DefaultCleanupBudget is the time cleanup gets after a cancel when the caller names none.
const DefaultCleanupBudget = 5 * time.Second

// CauseOf returns the recorded cause of ctx's cancellation: the Err* cause it was cancelled
// with, DEADLINE when its deadline passed, and UNSPECIFIED when it is not done or was
// cancelled without a known cause (for example by an upstream RST_STREAM).
func CauseOf(ctx context.Context) meshv1.CancelCause {
	if ctx.Err() == nil {
		return meshv1.CancelCause_CANCEL_CAUSE_UNSPECIFIED
	}
	return FromError(context.Cause(ctx))
}

// FromError maps a cause error to the wire enum.
func FromError(err error) meshv1.CancelCause {
	switch {
	case err == nil:
		return meshv1.CancelCause_CANCEL_CAUSE_UNSPECIFIED
	case errors.Is(err, ErrClientDisconnect):
		return meshv1.CancelCause_CANCEL_CAUSE_CLIENT_DISCONNECT
	case errors.Is(err, ErrDeadline), errors.Is(err, context.DeadlineExceeded):
		return meshv1.CancelCause_CANCEL_CAUSE_DEADLINE
	case errors.Is(err, ErrOperator):
		return meshv1.CancelCause_CANCEL_CAUSE_OPERATOR
	case errors.Is(err, ErrSiblingFailed):
		return meshv1.CancelCause_CANCEL_CAUSE_SIBLING_FAILED
	case errors.Is(err, ErrSuperseded):
		return meshv1.CancelCause_CANCEL_CAUSE_SUPERSEDED
	case errors.Is(err, ErrBudget):
		return meshv1.CancelCause_CANCEL_CAUSE_BUDGET
	case errors.Is(err, ErrLeaseExpired):
		return meshv1.CancelCause_CANCEL_CAUSE_LEASE_EXPIRED
	case errors.Is(err, ErrApprovalTimeout):
		return meshv1.CancelCause_CANCEL_CAUSE_APPROVAL_TIMEOUT
	}
	return meshv1.CancelCause_CANCEL_CAUSE_UNSPECIFIED
}

// ErrorOf returns the cause error of a wire cause, nil for UNSPECIFIED.
func ErrorOf(c meshv1.CancelCause) error {
	switch c {
	case meshv1.CancelCause_CANCEL_CAUSE_CLIENT_DISCONNECT:
		return ErrClientDisconnect
	case meshv1.CancelCause_CANCEL_CAUSE_DEADLINE:
		return ErrDeadline
	case meshv1.CancelCause_CANCEL_CAUSE_OPERATOR:
		return ErrOperator
	case meshv1.CancelCause_CANCEL_CAUSE_SIBLING_FAILED:
		return ErrSiblingFailed
	case meshv1.CancelCause_CANCEL_CAUSE_SUPERSEDED:
		return ErrSuperseded
	case meshv1.CancelCause_CANCEL_CAUSE_BUDGET:
		return ErrBudget
	case meshv1.CancelCause_CANCEL_CAUSE_LEASE_EXPIRED:
		return ErrLeaseExpired
	case meshv1.CancelCause_CANCEL_CAUSE_APPROVAL_TIMEOUT:
		return ErrApprovalTimeout
	}
	return nil
}

// Name returns the short, lower-case name of a cause ("client_disconnect", ...), or "" for
// UNSPECIFIED.
func Name(c meshv1.CancelCause) string {
	if c == meshv1.CancelCause_CANCEL_CAUSE_UNSPECIFIED {
		return ""
	}
	return strings.ToLower(strings.TrimPrefix(c.String(), "CANCEL_CAUSE_"))
}

// Parse is Name's inverse: the cause named name ("client_disconnect", ...), or
// CANCEL_CAUSE_UNSPECIFIED for "" and for a name it does not know.
func Parse(name string) meshv1.CancelCause {
	if name == "" {
		return meshv1.CancelCause_CANCEL_CAUSE_UNSPECIFIED
	}
	return meshv1.CancelCause(meshv1.CancelCause_value["CANCEL_CAUSE_"+strings.ToUpper(name)])
}

// Cleanup runs fn on a context detached from ctx's cancellation and deadline (its values
// are kept), bounded by budget (DefaultCleanupBudget when budget <= 0). Use it only on the
// way out of a cancelled operation, and return the original cancellation afterwards.
func Cleanup(ctx context.Context, budget time.Duration, fn func(context.Context) error) error {
	if budget <= 0 {
		budget = DefaultCleanupBudget
	}
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), budget)
	defer cancel()
	return fn(cctx)
}

// Resolve fills in the cause of cancelled nodes that do not know it from their nearest
// ancestor (by node path) that does. parentOf returns a node id's parent id, "" at the root.
func Resolve(causes map[string]meshv1.CancelCause, id string, parentOf func(string) string) meshv1.CancelCause {
	for cur := id; cur != ""; cur = parentOf(cur) {
		if c := causes[cur]; c != meshv1.CancelCause_CANCEL_CAUSE_UNSPECIFIED {
			return c
		}
	}
	return meshv1.CancelCause_CANCEL_CAUSE_UNSPECIFIED
}
