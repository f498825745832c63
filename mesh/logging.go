package mesh

import (
	"context"
	"log/slog"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/curfew-mesh/curfew/mesh/md"
)

// FinishLevel is the level of the log line that ends every call a server handled: what
// the call's code says about the service, after go-grpc-middleware's logging defaults
// (DefaultServerCodeToLevel), except that a success is Debug, not Info, since a mesh
// serves many small calls and health probes.
//
//   - Debug: OK.
//   - Info: the caller's own doing or an ordinary end of agent work: CANCELED,
//     DEADLINE_EXCEEDED, INVALID_ARGUMENT, NOT_FOUND, ALREADY_EXISTS, ABORTED (a late
//     duplicate attempt), FAILED_PRECONDITION, OUT_OF_RANGE.
//   - Warn: UNAVAILABLE, RESOURCE_EXHAUSTED, PERMISSION_DENIED, UNAUTHENTICATED.
//   - Error: UNKNOWN, INTERNAL, UNIMPLEMENTED, DATA_LOSS.
func FinishLevel(c codes.Code) slog.Level {
	switch c {
	case codes.OK:
		return slog.LevelDebug
	case codes.Canceled, codes.DeadlineExceeded, codes.InvalidArgument, codes.NotFound, codes.AlreadyExists,
		codes.Aborted, codes.FailedPrecondition, codes.OutOfRange:
		return slog.LevelInfo
	case codes.Unavailable, codes.ResourceExhausted, codes.PermissionDenied, codes.Unauthenticated:
		return slog.LevelWarn
	}
	return slog.LevelError
}

// finished logs the end of a call the server handled: the method, the work's identity
// (run_id, node_id, retry_id, attempt, from the call's metadata), the code as error_type
// and the status message, and elapsed_ms since it arrived. Request and response bodies
// are never logged: they hold prompts.
//
// This is not go-grpc-middleware's logging interceptor because that one cannot write
// this line: its message ("finished call") and keys (grpc.code, grpc.error with the
// whole error text, grpc.service and grpc.method apart, grpc.start_time, peer.address)
// are fixed, so keeping today's fields would mean an adapter that throws away every
// field it builds.
func finished(ctx context.Context, log *slog.Logger, method string, start time.Time, err error) {
	s, _ := status.FromError(err)
	lvl := FinishLevel(s.Code())
	if !log.Enabled(ctx, lvl) {
		return
	}
	id := md.FromIncoming(ctx)
	attrs := []slog.Attr{slog.String("method", method)}
	if id.RunID != "" {
		attrs = append(attrs, slog.String("run_id", id.RunID), slog.String("node_id", id.NodeID))
	}
	if id.RetryID != "" {
		attrs = append(attrs, slog.String("retry_id", id.RetryID), slog.Int("attempt", max(id.Attempt, 1)))
	}
	attrs = append(attrs, slog.String("error_type", s.Code().String()))
	if s.Code() != codes.OK {
		attrs = append(attrs, slog.String("error", s.Message()))
	}
	attrs = append(attrs, slog.Int64("elapsed_ms", time.Since(start).Milliseconds()))
	log.LogAttrs(ctx, lvl, "call finished", attrs...)
}
