package meshtest

import (
	"context"
	"slices"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	modelproxyv1 "github.com/curfew-mesh/curfew/gen/curfew/modelproxy/v1"
	toolrunnerv1 "github.com/curfew-mesh/curfew/gen/curfew/toolrunner/v1"
	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/mesh/nodes"
)

// Call is one call a fake received.
type Call struct {
	// ID is the identity the call carried (md.IdentityFrom of the handler's context).
	ID md.Identity
	// Name is the model name of a Generate call, the tool name of an Execute call.
	Name string
	// Args is the arguments JSON of an Execute call.
	Args string
	// Messages are the messages of a Generate call.
	Messages []*modelproxyv1.Message
	// Request is the whole request of a Generate call.
	Request *modelproxyv1.GenerateRequest
	// Tools are the names of the tools a Generate call told the model about; Specs are
	// their specs.
	Tools []string
	Specs []*modelproxyv1.ToolSpec
	// Deadline is the handler context's deadline, zero when it had none.
	Deadline time.Time
	// Start is when the handler began; End when it returned (zero while it runs).
	Start, End time.Time
	// Err is what the handler returned.
	Err error
	// CtxErr is the work context's error when the handler returned: non-nil when the call
	// was cancelled (by its caller or by CancelNodes) or its deadline passed while it ran.
	CtxErr error
}

// recorder records calls and the node of each call in a nodes.Table.
type recorder struct {
	kind  meshv1.NodeKind
	table *nodes.Table
	mu    sync.Mutex
	calls []*Call
}

func newRecorder(kind meshv1.NodeKind) recorder {
	return recorder{kind: kind, table: nodes.New(0)}
}

// Calls returns a snapshot of the calls received so far, in the order they started.
func (r *recorder) Calls() []Call {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make([]Call, len(r.calls))
	for i, c := range r.calls {
		out[i] = *c
	}
	return out
}

// Table returns the table the fake records its nodes in (and serves as
// NodeReportService).
func (r *recorder) Table() *nodes.Table { return r.table }

// start records the call and begins its node, as the real executors do: the work runs
// under the returned context, which CancelNodes can cancel with a cause.
func (r *recorder) start(ctx context.Context, c *Call) context.Context {
	c.ID = md.IdentityFrom(ctx)
	c.Deadline, _ = ctx.Deadline()
	c.Start = time.Now()
	ctx, _ = r.table.Begin(ctx, c.ID.RunID, &meshv1.Node{Id: c.ID.NodeID, Kind: r.kind, Name: c.Name})
	r.mu.Lock()
	r.calls = append(r.calls, c)
	r.mu.Unlock()
	return ctx
}

// end records the call's end, then ends its node: whoever sees the node ended in the
// table also sees the call's End.
func (r *recorder) end(ctx context.Context, c *Call, err error) {
	r.mu.Lock()
	c.End, c.Err, c.CtxErr = time.Now(), err, ctx.Err()
	r.mu.Unlock()
	r.table.Finish(ctx, c.ID.RunID, c.ID.NodeID, err, nil)
}

// ModelStep is one scripted reply of a [Model].
type ModelStep struct {
	// Before, if set, runs first with the handler's context; an error it returns ends the
	// call with that error. Use it to block, to signal, or to fail.
	Before func(ctx context.Context) error
	// Text is streamed word by word, one token per chunk.
	Text string
	// After, if set, runs once Text is streamed; an error it returns ends the call with
	// that error instead of the last chunk (a decoder cut mid-stream).
	After func(ctx context.Context) error
	// ToolCalls, when not empty, are sent on the last chunk with finish reason
	// "tool_calls"; otherwise the finish reason is "stop".
	ToolCalls []*modelproxyv1.ToolCall
	// FinishReason, if set, overrides the finish reason of the last chunk.
	FinishReason string
}

// Model is a scripted ModelProxyService. Like the sim model it picks its reply from the
// number of assistant turns in the request: the i-th step answers a conversation with i
// assistant messages. A conversation beyond the script fails with OUT_OF_RANGE.
type Model struct {
	modelproxyv1.UnimplementedModelProxyServiceServer
	recorder
	steps []ModelStep
}

// NewModel returns a Model that replies with steps.
func NewModel(steps ...ModelStep) *Model {
	return &Model{recorder: newRecorder(meshv1.NodeKind_NODE_KIND_MODEL), steps: steps}
}

// Register registers the model as ModelProxyService and its table as NodeReportService.
func (m *Model) Register(s *grpc.Server) {
	modelproxyv1.RegisterModelProxyServiceServer(s, m)
	meshv1.RegisterNodeReportServiceServer(s, &nodes.Server{Table: m.table})
}

// Generate implements ModelProxyService.
func (m *Model) Generate(req *modelproxyv1.GenerateRequest, ss grpc.ServerStreamingServer[modelproxyv1.GenerateResponse]) (err error) {
	ctx := ss.Context()
	c := &Call{Name: req.GetModel(), Messages: req.GetMessages(), Request: req}
	for _, t := range req.GetTools() {
		c.Tools = append(c.Tools, t.GetName())
	}
	c.Specs = req.GetTools()
	ctx = m.start(ctx, c)
	defer func() { m.end(ctx, c, err) }()
	turn := 0
	for _, msg := range req.GetMessages() {
		if msg.GetRole() == modelproxyv1.Role_ROLE_ASSISTANT {
			turn++
		}
	}
	if turn >= len(m.steps) {
		return status.Errorf(codes.OutOfRange, "meshtest: the script has no step %d", turn)
	}
	step := m.steps[turn]
	if step.Before != nil {
		if err := step.Before(ctx); err != nil {
			return err
		}
	}
	for i, w := range strings.Fields(step.Text) {
		if i > 0 {
			w = " " + w
		}
		if err := ss.Send(&modelproxyv1.GenerateResponse{Delta: w, Tokens: 1}); err != nil {
			return err
		}
	}
	if step.After != nil {
		if err := step.After(ctx); err != nil {
			return err
		}
	}
	final := &modelproxyv1.GenerateResponse{FinishReason: "stop",
		Usage: &modelproxyv1.Usage{CompletionTokens: int64(len(strings.Fields(step.Text)))}}
	if len(step.ToolCalls) > 0 {
		final.FinishReason, final.ToolCalls = "tool_calls", step.ToolCalls
	}
	if step.FinishReason != "" {
		final.FinishReason = step.FinishReason
	}
	return ss.Send(final)
}

// ToolFunc is the behaviour of one fake tool: it gets the handler's context and the
// call's arguments JSON and returns the output JSON or an error (returned to the caller
// as the call's status). It may send node events with SendEvent.
type ToolFunc func(ctx context.Context, args string) (string, error)

type eventsKey struct{}

// SendEvent sends ev on the Execute stream of the fake tool call whose context ctx is
// (a ToolFunc's), with the call's node id when ev names none. It returns the stream's
// error, and FAILED_PRECONDITION outside a tool call.
func SendEvent(ctx context.Context, ev *meshv1.NodeEvent) error {
	send, _ := ctx.Value(eventsKey{}).(func(*meshv1.NodeEvent) error)
	if send == nil {
		return status.Error(codes.FailedPrecondition, "meshtest: SendEvent outside a fake tool call")
	}
	return send(ev)
}

// Tools is a scripted ToolRunnerService. A call to a tool it does not know fails with
// NOT_FOUND. ListTools answers what SetList gave it, and is UNIMPLEMENTED (as on a
// toolrunner older than it) until then; its calls are counted (Lists), not recorded.
type Tools struct {
	toolrunnerv1.UnimplementedToolRunnerServiceServer
	recorder
	funcs map[string]ToolFunc

	listMu sync.Mutex
	list   func(ctx context.Context) (*toolrunnerv1.ListToolsResponse, error)
	lists  int
}

// SetList makes ListTools answer list(ctx) of the call's handler context (md.IdentityFrom
// has its tenant); nil makes it UNIMPLEMENTED again.
func (t *Tools) SetList(list func(ctx context.Context) (*toolrunnerv1.ListToolsResponse, error)) {
	t.listMu.Lock()
	defer t.listMu.Unlock()
	t.list = list
}

// Lists returns how many ListTools calls the fake received.
func (t *Tools) Lists() int {
	t.listMu.Lock()
	defer t.listMu.Unlock()
	return t.lists
}

// ListTools implements ToolRunnerService.
func (t *Tools) ListTools(ctx context.Context, _ *toolrunnerv1.ListToolsRequest) (*toolrunnerv1.ListToolsResponse, error) {
	t.listMu.Lock()
	t.lists++
	list := t.list
	t.listMu.Unlock()
	if list == nil {
		return nil, status.Error(codes.Unimplemented, "meshtest: ListTools has no answer (SetList)")
	}
	return list(ctx)
}

// NewTools returns a Tools that runs funcs by tool name.
func NewTools(funcs map[string]ToolFunc) *Tools {
	return &Tools{recorder: newRecorder(meshv1.NodeKind_NODE_KIND_TOOL), funcs: funcs}
}

// Register registers the tools as ToolRunnerService and their table as
// NodeReportService.
func (t *Tools) Register(s *grpc.Server) {
	toolrunnerv1.RegisterToolRunnerServiceServer(s, t)
	meshv1.RegisterNodeReportServiceServer(s, &nodes.Server{Table: t.table})
}

// Execute implements ToolRunnerService.
func (t *Tools) Execute(req *toolrunnerv1.ExecuteRequest, ss grpc.ServerStreamingServer[toolrunnerv1.ExecuteResponse]) (err error) {
	ctx := ss.Context()
	c := &Call{Name: req.GetName(), Args: req.GetArgsJson()}
	ctx = t.start(ctx, c)
	defer func() { t.end(ctx, c, err) }()
	fn := t.funcs[req.GetName()]
	if fn == nil {
		return status.Errorf(codes.NotFound, "meshtest: unknown tool %q", req.GetName())
	}
	node := c.ID.NodeID
	ctx = context.WithValue(ctx, eventsKey{}, func(ev *meshv1.NodeEvent) error {
		if ev.GetNodeId() == "" {
			ev.NodeId = node
		}
		return ss.Send(&toolrunnerv1.ExecuteResponse{Event: &toolrunnerv1.ExecuteResponse_NodeEvent{NodeEvent: ev}})
	})
	out, err := fn(ctx, req.GetArgsJson())
	if err != nil {
		return err
	}
	return ss.Send(&toolrunnerv1.ExecuteResponse{Event: &toolrunnerv1.ExecuteResponse_Result{
		Result: &toolrunnerv1.ExecuteResult{OutputJson: out}}})
}

// ByNode returns the calls sorted by node id (then start), for comparing calls that ran
// concurrently.
func ByNode(calls []Call) []Call {
	out := slices.Clone(calls)
	slices.SortStableFunc(out, func(a, b Call) int { return strings.Compare(a.ID.NodeID, b.ID.NodeID) })
	return out
}
