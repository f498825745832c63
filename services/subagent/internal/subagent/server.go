package subagent

import (
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/timestamppb"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	subagentv1 "github.com/curfew-mesh/curfew/gen/curfew/subagent/v1"
	"github.com/curfew-mesh/curfew/mesh/agent"
	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/mesh/nodes"
	"github.com/curfew-mesh/curfew/mesh/plan"
)

// DefaultMaxDepth is the deepest nesting of subagents served.
const DefaultMaxDepth = 3

// Config configures a Server. Loop's Emit, EmitEvent and Notes are set per call and by New.
type Config struct {
	Loop     agent.Config
	MaxDepth int // DefaultMaxDepth when 0
	// NodeRetention is how long a run's node records stay in memory after it ended
	// (nodes.DefaultRetention when 0).
	NodeRetention time.Duration
}

// Server implements SubagentService.
type Server struct {
	subagentv1.UnimplementedSubagentServiceServer
	cfg   Config
	Nodes *nodes.Table
}

// New returns a server.
func New(cfg Config) *Server {
	if cfg.MaxDepth == 0 {
		cfg.MaxDepth = DefaultMaxDepth
	}
	s := &Server{cfg: cfg, Nodes: nodes.New(cfg.NodeRetention)}
	s.cfg.Loop.Notes = s.Nodes
	return s
}

// Report returns the NodeReportService of this server's subagent nodes and notes.
func (s *Server) Report() *nodes.Server { return &nodes.Server{Table: s.Nodes} }

// Spawn implements SubagentService.
func (s *Server) Spawn(req *subagentv1.SpawnRequest, stream subagentv1.SubagentService_SpawnServer) error {
	ctx := stream.Context()
	id := md.IdentityFrom(ctx)
	if id.RunID == "" || id.NodeID == "" {
		return status.Errorf(codes.InvalidArgument, "metadata %s and %s are required", md.RunID, md.NodeID)
	}
	if req.GetTask() == "" {
		return status.Error(codes.InvalidArgument, "task is required")
	}
	if n := req.GetMaxTokens(); n < 0 {
		return status.Errorf(codes.InvalidArgument, "max_tokens must be 0 (the provider's default) or more, got %d", n)
	}
	for i, t := range req.GetTools() {
		if t == "" {
			return status.Errorf(codes.InvalidArgument, "tools[%d]: a tool name is required", i)
		}
	}
	reserve, err := plan.ParseReserve(req.GetReserve())
	if err != nil {
		return status.Errorf(codes.InvalidArgument, "reserve: %v", err)
	}
	node := id.NodeID + "/sub"
	if depth := strings.Count(node, "/sub"); depth > s.cfg.MaxDepth {
		return status.Errorf(codes.FailedPrecondition, "subagent depth %d exceeds the limit %d", depth, s.cfg.MaxDepth)
	}
	// The nested loop runs under the call's deadline, which the caller's loop has already
	// shortened by its own reserve (docs/reserve.md); reserve is the nested loop's own.
	if err := ctx.Err(); err != nil {
		return err
	}
	var mu sync.Mutex
	emit := func(n *meshv1.Node) {
		mu.Lock()
		defer mu.Unlock()
		_ = stream.Send(&subagentv1.SpawnResponse{Event: &subagentv1.SpawnResponse_Node{Node: n}})
	}
	// The loop's node events (its tools', and beneath them) go up in the order it hands
	// them over, among its nodes: all of them before the subagent node's end below.
	event := func(ev *meshv1.NodeEvent) {
		mu.Lock()
		defer mu.Unlock()
		_ = stream.Send(&subagentv1.SpawnResponse{Event: &subagentv1.SpawnResponse_NodeEvent{NodeEvent: ev}})
	}
	n := &meshv1.Node{Id: node, Kind: meshv1.NodeKind_NODE_KIND_SUBAGENT, Name: "subagent"}
	if dl, ok := ctx.Deadline(); ok {
		n.Deadline = timestamppb.New(dl)
	}
	wctx, started := s.Nodes.Begin(ctx, id.RunID, n)
	emit(started)
	lc := s.cfg.Loop
	lc.Emit, lc.EmitEvent = emit, event
	// The same run input as a root's: a real model is told of its tool failures and goes
	// on (the sim model's plan still fails on them), unless the run's policy says a
	// failed tool fails the run. A nested loop out of time returns what it has, so that
	// its caller's model can answer with it.
	res, err := agent.New(lc).RunResult(md.WithNode(wctx, node), node, agent.Input{
		Model: req.GetModel(), Task: req.GetTask(), Tools: req.GetTools(), MaxTokens: req.GetMaxTokens(),
		FailOnToolError: req.GetToolErrors() == subagentv1.ToolErrors_TOOL_ERRORS_FAIL_RUN,
		Reserve:         reserve, Partial: true}, nil)
	cancelled := wctx.Err() != nil
	emit(s.Nodes.Finish(wctx, id.RunID, node, err, func(n *meshv1.Node) {
		if cancelled {
			n.CancelledAt = timestamppb.Now()
		}
		n.Partial = res.Partial
	}))
	if err != nil {
		return err
	}
	mu.Lock()
	defer mu.Unlock()
	return stream.Send(&subagentv1.SpawnResponse{Event: &subagentv1.SpawnResponse_Result{Result: &subagentv1.SpawnResult{
		Answer: res.Answer, Partial: res.Partial}}})
}
