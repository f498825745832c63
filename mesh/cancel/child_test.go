package cancel_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	"github.com/curfew-mesh/curfew/mesh"
	"github.com/curfew-mesh/curfew/mesh/cancel"
	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/mesh/meshtest"
	"github.com/curfew-mesh/curfew/mesh/nodes"
)

const runID = "run-1"

func TestSettle(t *testing.T) {
	tb := nodes.New(0)
	cc := meshtest.Serve(t, mesh.ServerConfig{}, func(s *grpc.Server) { meshv1.RegisterNodeReportServiceServer(s, &nodes.Server{Table: tb}) })
	reports := meshv1.NewNodeReportServiceClient(cc)
	tb.Start(runID, &meshv1.Node{Id: "root/s0.t0", Kind: meshv1.NodeKind_NODE_KIND_TOOL})
	tb.Start(runID, &meshv1.Node{Id: "root/s0.t1", Kind: meshv1.NodeKind_NODE_KIND_TOOL})
	ctx, stop := context.WithTimeout(md.WithIdentity(context.Background(), md.Identity{Tenant: "acme", RunID: runID, NodeID: "root"}), 5*time.Second)
	defer stop()

	// A cancelled ctx: Settle still asks, on its own budget.
	cctx, cancelNow := context.WithCancel(ctx)
	cancelNow()
	err := cancel.Settle(cctx, reports, "root/s0.t0", 100*time.Millisecond)
	if status.Code(err) != codes.DeadlineExceeded || !strings.Contains(err.Error(), "did not stop within") {
		t.Fatalf("Settle on a running node = %v, want DEADLINE_EXCEEDED \"did not stop within\"", err)
	}
	time.AfterFunc(50*time.Millisecond, func() {
		tb.End(runID, "root/s0.t0", meshv1.NodeStatus_NODE_STATUS_CANCELLED, 0, "CANCELLED", "", nil)
	})
	// root/s0.t1 still runs, but is not beneath the node settled.
	if err := cancel.Settle(cctx, reports, "root/s0.t0", 2*time.Second); err != nil {
		t.Fatalf("Settle once the node ends = %v", err)
	}
}

func TestStatus(t *testing.T) {
	expired, stop := context.WithDeadline(context.Background(), time.Now().Add(-time.Second))
	defer stop()
	withCause := func(cause error) context.Context {
		ctx, stop := context.WithCancelCause(context.Background())
		stop(cause)
		return ctx
	}
	plain, stopPlain := context.WithCancel(context.Background())
	stopPlain()
	for _, tc := range []struct {
		name string
		ctx  context.Context
		code codes.Code
		msg  string
	}{
		{"deadline passed", expired, codes.DeadlineExceeded, "run deadline exceeded"},
		{"cancelled for the deadline", withCause(cancel.ErrDeadline), codes.DeadlineExceeded, "run deadline exceeded"},
		{"cancelled with a cause", withCause(cancel.ErrOperator), codes.Canceled, "cancelled: cancelled by operator"},
		{"cancelled with context.Canceled", withCause(context.Canceled), codes.Canceled, "cancelled"},
		{"cancelled without a cause", plain, codes.Canceled, "cancelled"},
	} {
		st, _ := status.FromError(cancel.Status(tc.ctx))
		if st.Code() != tc.code || st.Message() != tc.msg {
			t.Errorf("%s: Status = %v %q, want %v %q", tc.name, st.Code(), st.Message(), tc.code, tc.msg)
		}
	}
}

func TestAwait(t *testing.T) {
	cancelled := status.Error(codes.Canceled, "child cancelled")

	// Not a child's CANCELLED, or ctx already done: no wait.
	live := context.Background()
	done, stop := context.WithCancel(context.Background())
	stop()
	for _, tc := range []struct {
		ctx context.Context
		err error
	}{{live, status.Error(codes.Unavailable, "down")}, {live, errors.New("plain")}, {done, cancelled}} {
		start := time.Now()
		cancel.Await(tc.ctx, tc.err)
		if d := time.Since(start); d > 100*time.Millisecond {
			t.Errorf("Await(%v) waited %v, want no wait", tc.err, d)
		}
	}

	// A child's CANCELLED while ctx lives: the wait ends when ctx's cancel arrives.
	ctx, stopCtx := context.WithCancel(context.Background())
	time.AfterFunc(50*time.Millisecond, stopCtx)
	start := time.Now()
	cancel.Await(ctx, cancelled)
	if d := time.Since(start); d < 50*time.Millisecond || d >= cancel.AwaitWindow {
		t.Errorf("Await ended after %v, want when ctx was cancelled (50ms)", d)
	}

	// No cancel arrives: the wait is bounded by AwaitWindow.
	start = time.Now()
	cancel.Await(context.Background(), cancelled)
	if d := time.Since(start); d < cancel.AwaitWindow || d > cancel.AwaitWindow+time.Second {
		t.Errorf("Await without a cancel waited %v, want AwaitWindow %v", d, cancel.AwaitWindow)
	}
}
