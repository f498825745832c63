package nodes

import (
	"context"
	"errors"

	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	"github.com/curfew-mesh/curfew/mesh/cancel"
	"github.com/curfew-mesh/curfew/mesh/tracing"
)

// Outcome is how a node ended.
type Outcome struct {
	Status  meshv1.NodeStatus
	Cause   meshv1.CancelCause
	Code    string // gRPC code name, "" on success
	Message string
}

// OutcomeOf returns the outcome of work that ran under ctx and returned err. When ctx is
// done the work counts as cancelled (or deadline-exceeded) whatever err says, with the
// cause ctx carries; UNSPECIFIED means it was cancelled from upstream.
func OutcomeOf(ctx context.Context, err error) Outcome {
	if ctx.Err() != nil {
		o := Outcome{Status: meshv1.NodeStatus_NODE_STATUS_CANCELLED, Cause: cancel.CauseOf(ctx), Code: CodeName(codes.Canceled), Message: "cancelled"}
		if errors.Is(ctx.Err(), context.DeadlineExceeded) || o.Cause == meshv1.CancelCause_CANCEL_CAUSE_DEADLINE {
			o.Status, o.Cause, o.Code, o.Message = meshv1.NodeStatus_NODE_STATUS_DEADLINE_EXCEEDED, meshv1.CancelCause_CANCEL_CAUSE_DEADLINE, CodeName(codes.DeadlineExceeded), "deadline exceeded"
		}
		if c := context.Cause(ctx); c != nil && !errors.Is(c, ctx.Err()) {
			o.Message = c.Error()
		}
		return o
	}
	return ErrOutcome(err)
}

// ErrOutcome returns the outcome of work that returned err, judged by err's status alone.
func ErrOutcome(err error) Outcome {
	if err == nil {
		return Outcome{Status: meshv1.NodeStatus_NODE_STATUS_SUCCEEDED}
	}
	s, _ := status.FromError(err)
	o := Outcome{Status: meshv1.NodeStatus_NODE_STATUS_FAILED, Code: CodeName(s.Code()), Message: s.Message()}
	switch s.Code() {
	case codes.Canceled:
		o.Status = meshv1.NodeStatus_NODE_STATUS_CANCELLED
	case codes.DeadlineExceeded:
		o.Status = meshv1.NodeStatus_NODE_STATUS_DEADLINE_EXCEEDED
	}
	return o
}

// Finish records the end of node id of run with the outcome of (ctx, err). fn, if not nil,
// may set further fields. The outcome (status and cancel cause) also goes on ctx's span,
// the span of the call that executed the node (package tracing).
func (t *Table) Finish(ctx context.Context, runID, id string, err error, fn func(*meshv1.Node)) *meshv1.Node {
	o := OutcomeOf(ctx, err)
	tracing.EndNode(trace.SpanFromContext(ctx), o.Status, o.Cause, o.Code, o.Message)
	return t.End(runID, id, o.Status, o.Cause, o.Code, o.Message, fn)
}

var codeNames = map[codes.Code]string{
	codes.OK: "OK", codes.Canceled: "CANCELLED", codes.Unknown: "UNKNOWN", codes.InvalidArgument: "INVALID_ARGUMENT",
	codes.DeadlineExceeded: "DEADLINE_EXCEEDED", codes.NotFound: "NOT_FOUND", codes.AlreadyExists: "ALREADY_EXISTS",
	codes.PermissionDenied: "PERMISSION_DENIED", codes.ResourceExhausted: "RESOURCE_EXHAUSTED",
	codes.FailedPrecondition: "FAILED_PRECONDITION", codes.Aborted: "ABORTED", codes.OutOfRange: "OUT_OF_RANGE",
	codes.Unimplemented: "UNIMPLEMENTED", codes.Internal: "INTERNAL", codes.Unavailable: "UNAVAILABLE",
	codes.DataLoss: "DATA_LOSS", codes.Unauthenticated: "UNAUTHENTICATED",
}

// CodeName returns the canonical name of a gRPC code ("DEADLINE_EXCEEDED"), the form
// every language's gRPC library documents.
func CodeName(c codes.Code) string {
	if n, ok := codeNames[c]; ok {
		return n
	}
	return c.String()
}
