package cancel

import (
	"context"
	"errors"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	"github.com/curfew-mesh/curfew/mesh/md"
)

// DeadlineSlop is how close to a deadline an end counts as that deadline: a child's
// DEADLINE_EXCEEDED, or a client's cancel, that comes this little before the caller's own
// copy of the deadline fires (each hop measures its copy from its own arrival).
const DeadlineSlop = 250 * time.Millisecond

// AwaitWindow bounds how long a caller whose child was cancelled, while the caller itself
// was not, waits for its own cancel before it takes the child's CANCELLED as the child's
// error: the run's cancel reaches the decoders first and the loops above them a moment
// later (about a millisecond; at most the orchestrator's 5 ms wait for modelproxy plus a
// hop). A child cancelled by something that does not also cancel the caller costs this
// much before its error is returned.
const AwaitWindow = time.Second

// DefaultSettleTimeout is how long a caller waits for a cancelled child's teardown when
// it names no bound: a tool's default cleanup budget and a second more.
const DefaultSettleTimeout = DefaultCleanupBudget + time.Second

// Await waits, when err is a child's CANCELLED while ctx is still alive, until ctx ends
// too or AwaitWindow has passed. The run's cancel reaches the decoders first (the
// orchestrator tells modelproxy before the rest of the tree), and a broadcast can reach
// any executor before the RST_STREAM reaches this one: such a child's CANCELLED is the
// run's cancel on its way, not a failure, and whoever waits for it records the run's
// cause (its context's) instead of a failed child's. The agent loop waits before judging
// a failed model, tool or subagent call; toolrunner before ending a spawn_subagent tool.
func Await(ctx context.Context, err error) {
	if status.Code(err) != codes.Canceled || ctx.Err() != nil {
		return
	}
	t := time.NewTimer(AwaitWindow)
	defer t.Stop()
	select {
	case <-ctx.Done():
	case <-t.C:
	}
}

// Settle waits, up to timeout and on a context detached from ctx's cancellation, until
// the executor behind reports has recorded the end of node id and its subtree. A gRPC
// cancel is not acknowledged: asking the executor is how a caller knows its cancelled
// child has stopped.
func Settle(ctx context.Context, reports meshv1.NodeReportServiceClient, id string, timeout time.Duration) error {
	run := md.IdentityFrom(ctx).RunID
	return Cleanup(ctx, timeout+time.Second, func(cctx context.Context) error {
		resp, err := reports.ListNodes(cctx, &meshv1.ListNodesRequest{
			RunId: run, NodePrefixes: []string{id}, SettleTimeout: durationpb.New(timeout)})
		if err != nil {
			return err
		}
		if !resp.GetSettled() {
			return status.Errorf(codes.DeadlineExceeded, "node %s did not stop within %v", id, timeout)
		}
		return nil
	})
}

// Status is the status a cancelled operation returns: DEADLINE_EXCEEDED when its deadline
// passed (or it was cancelled with ErrDeadline), CANCELED with the cause otherwise.
func Status(ctx context.Context) error {
	cause := context.Cause(ctx)
	if errors.Is(ctx.Err(), context.DeadlineExceeded) || errors.Is(cause, ErrDeadline) {
		return status.Error(codes.DeadlineExceeded, "run deadline exceeded")
	}
	if cause != nil && !errors.Is(cause, context.Canceled) {
		return status.Errorf(codes.Canceled, "cancelled: %v", cause)
	}
	return status.Error(codes.Canceled, "cancelled")
}
