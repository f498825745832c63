package nodes

import (
	"context"
	"time"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	"github.com/curfew-mesh/curfew/mesh/cancel"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// MaxSettle bounds how long a ListNodes call may ask to wait.
const MaxSettle = 60_000_000_000 // 60 s, as a time.Duration

// Server serves a Table as curfew.mesh.v1.NodeReportService.
type Server struct {
	meshv1.UnimplementedNodeReportServiceServer
	Table *Table
	// Decorate, if set, fills in figures the table does not hold (modelproxy's token
	// ledger) on every node listed.
	Decorate func(runID string, req *meshv1.ListNodesRequest, n *meshv1.Node)
	// Metrics, if set, observe the cancel propagation of every cancelled node a summary
	// lists (see Summarized).
	Metrics *Metrics
	// Summarized, if set, is called once for each ended node, after Decorate, the first
	// time a ListNodes that carries the run's cancel instant lists it: that is the
	// orchestrator assembling the run's summary, with final token figures.
	Summarized func(runID string, n *meshv1.Node)
}

// maxCancelSettle caps a CancelNodes request's settle_timeout.
const maxCancelSettle = time.Second

// CancelNodes implements NodeReportService: it cancels the selected running nodes with the
// request's cause and returns at once or, with a settle_timeout, once they have ended.
func (s *Server) CancelNodes(ctx context.Context, req *meshv1.CancelNodesRequest) (*meshv1.CancelNodesResponse, error) {
	if req.GetRunId() == "" {
		return nil, status.Error(codes.InvalidArgument, "run_id is required")
	}
	cause := cancel.ErrorOf(req.GetCause())
	if cause == nil {
		return nil, status.Error(codes.InvalidArgument, "cause is required")
	}
	settle := req.GetSettleTimeout().AsDuration()
	if settle < 0 {
		return nil, status.Errorf(codes.InvalidArgument, "settle_timeout must be 0 or more, got %v", settle)
	}
	settle = min(settle, maxCancelSettle)
	n := s.Table.CancelRun(req.GetRunId(), req.GetNodePrefixes(), cause)
	settled := settle > 0 && (n == 0 || s.Table.Settle(ctx, req.GetRunId(), req.GetNodePrefixes(), settle))
	return &meshv1.CancelNodesResponse{Cancelled: int32(n), Settled: settled}, nil //nolint:gosec // a count of one run's nodes in this process, far below 2^31
}

// ListNodes implements NodeReportService.
func (s *Server) ListNodes(ctx context.Context, req *meshv1.ListNodesRequest) (*meshv1.ListNodesResponse, error) {
	if req.GetRunId() == "" {
		return nil, status.Error(codes.InvalidArgument, "run_id is required")
	}
	settle := req.GetSettleTimeout().AsDuration()
	if settle < 0 || settle > MaxSettle {
		return nil, status.Errorf(codes.InvalidArgument, "settle_timeout must be between 0 and 60s, got %v", settle)
	}
	ns, settled := s.Table.List(ctx, req.GetRunId(), req.GetNodePrefixes(), settle)
	if s.Decorate != nil {
		for _, n := range ns {
			s.Decorate(req.GetRunId(), req, n)
		}
	}
	if at := req.GetCancelAt(); at != nil && (s.Metrics != nil || s.Summarized != nil) {
		cancelAt := at.AsTime()
		for _, n := range ns {
			if n.GetKind() == meshv1.NodeKind_NODE_KIND_UNSPECIFIED || isRunning(n) || !s.Table.firstSummary(req.GetRunId(), n.GetId()) {
				continue // a note, or not over yet, or already counted
			}
			s.Metrics.observe(n, cancelAt)
			if s.Summarized != nil {
				s.Summarized(req.GetRunId(), n)
			}
		}
	}
	return &meshv1.ListNodesResponse{Nodes: ns, Settled: settled}, nil
}
