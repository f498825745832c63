package toolserver

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	toolv1 "github.com/curfew-mesh/curfew/gen/curfew/tool/v1"
	meshcancel "github.com/curfew-mesh/curfew/mesh/cancel"
	"github.com/curfew-mesh/curfew/mesh/md"
)

// Tool is one tool the server offers.
type Tool struct {
	// Name is the tool's name on this server; toolrunner shows it to models prefixed
	// with the source's name. Required, unique on the server.
	Name string
	// Description says what the tool does, for the model.
	Description string
	// InputSchema is the JSON Schema of the arguments, a JSON object; nil means any
	// object. toolrunner validates the arguments against it before calling.
	InputSchema json.RawMessage
	// SideEffects says what a call does to the world; the zero value,
	// SIDE_EFFECTS_UNSPECIFIED, is taken as irreversible.
	SideEffects toolv1.SideEffects
	// Handler runs one call. Required.
	Handler Handler
}

// Handler runs one call of a tool and returns its output as JSON. ctx ends with the
// call (the package doc); progress reports how far it has come (done of total; total 0
// when unknown). A failure in the tool's own terms is a ToolError; any other error
// fails the call with a gRPC status.
type Handler func(ctx context.Context, call Call, progress func(done, total float64, msg string)) (json.RawMessage, error)

// Call is one call as its handler sees it: the arguments and what curfew says of the
// call. The curfew fields are empty when the caller did not send them (a caller other
// than toolrunner).
type Call struct {
	// Tool is the name of the tool called.
	Tool string
	// Args are the arguments, a JSON object.
	Args json.RawMessage
	// RunID is the run the call belongs to (curfew-run-id).
	RunID string
	// NodeID is the tool's node, its path in the run tree (curfew-node-id).
	NodeID string
	// RetryID names the logical call; it is the same on every attempt (curfew-retry-id).
	RetryID string
	// Attempt is the attempt's number, from 1 (curfew-attempt); 0 when not sent.
	Attempt int
	// IdempotencyKey, when set, names the call's effect: do it at most once per key
	// (curfew-idempotency-key).
	IdempotencyKey string
	// Hedge says the call is a hedged call's backup (curfew-hedge): a second call with
	// the same RetryID, running beside the first; the caller keeps the first answer and
	// cancels the other.
	Hedge bool
	// Deadline is the run's absolute deadline (curfew-deadline); zero when not sent.
	// ctx's deadline, from grpc-timeout, is the one that ends the call; this one is the
	// same instant on the caller's clock, for logs and records.
	Deadline time.Time
}

// Causes of a handler's context's end, as context.Cause reports them.
var (
	// ErrCancelled: the caller cancelled the call (toolrunner cancelled the node, or the
	// connection went away).
	ErrCancelled = fmt.Errorf("curfew: the call was cancelled by its caller: %w", context.Canceled)
	// ErrDeadline: the call's deadline passed.
	ErrDeadline = fmt.Errorf("curfew: the call's deadline passed: %w", context.DeadlineExceeded)
)

// ToolError returns the error a handler returns when its tool fails in its own terms:
// the call succeeds with a result that has is_error set and text as its error_text.
func ToolError(text string) error { return &toolError{text: text} }

type toolError struct{ text string }

func (e *toolError) Error() string { return e.text }

// Server is a curfew.tool.v1.ToolService serving a fixed set of tools.
type Server struct {
	toolv1.UnimplementedToolServiceServer
	tools  []Tool
	byName map[string]*Tool
	list   *toolv1.ListToolsResponse
}

// New returns a server of tools, listed in this order. It panics on a tool without a
// name or handler, a duplicate name, or an InputSchema that is not a JSON object:
// mistakes in the program, not in its input.
func New(tools ...Tool) *Server {
	s := &Server{tools: tools, byName: make(map[string]*Tool, len(tools)), list: &toolv1.ListToolsResponse{}}
	for i := range tools {
		t := &s.tools[i]
		switch {
		case t.Name == "":
			panic(fmt.Sprintf("toolserver: tool %d has no name", i))
		case t.Handler == nil:
			panic(fmt.Sprintf("toolserver: tool %q has no handler", t.Name))
		case s.byName[t.Name] != nil:
			panic(fmt.Sprintf("toolserver: two tools are named %q", t.Name))
		case t.InputSchema != nil && !isObject(t.InputSchema):
			panic(fmt.Sprintf("toolserver: tool %q: InputSchema is not a JSON object", t.Name))
		}
		s.byName[t.Name] = t
		s.list.Tools = append(s.list.Tools, &toolv1.Tool{
			Name: t.Name, Description: t.Description,
			InputSchemaJson: string(t.InputSchema), SideEffects: t.SideEffects,
		})
	}
	return s
}

// Register adds the server to gs as curfew.tool.v1.ToolService.
func (s *Server) Register(gs *grpc.Server) { toolv1.RegisterToolServiceServer(gs, s) }

// ListTools returns the server's tools.
func (s *Server) ListTools(context.Context, *toolv1.ListToolsRequest) (*toolv1.ListToolsResponse, error) {
	return s.list, nil
}

// CallTool runs one tool: its progress events, then its result.
func (s *Server) CallTool(req *toolv1.CallToolRequest, stream grpc.ServerStreamingServer[toolv1.CallToolResponse]) error {
	t := s.byName[req.GetName()]
	if t == nil {
		return status.Errorf(codes.NotFound, "tool %q: no such tool on this server", req.GetName())
	}
	args := json.RawMessage(req.GetArgumentsJson())
	if len(bytes.TrimSpace(args)) == 0 {
		args = json.RawMessage("{}")
	}
	if !isObject(args) {
		return status.Errorf(codes.InvalidArgument, "arguments_json of tool %q: not a JSON object", t.Name)
	}

	ctx, done := handlerContext(stream.Context())
	defer done()
	var mu sync.Mutex // guards stream.Send and returned
	returned := false
	progress := func(d, total float64, msg string) {
		mu.Lock()
		defer mu.Unlock()
		if returned || ctx.Err() != nil {
			return
		}
		// A failed send means the stream is gone; ctx says so to the handler.
		_ = stream.Send(&toolv1.CallToolResponse{Event: &toolv1.CallToolResponse_Progress{
			Progress: &meshv1.Progress{Progress: d, Total: total, Message: msg}}})
	}
	out, err := t.Handler(ctx, callOf(stream.Context(), t.Name, args), progress)
	mu.Lock()
	returned = true
	mu.Unlock()

	res := &toolv1.CallToolResult{}
	var te *toolError
	switch {
	case errors.As(err, &te):
		res.IsError, res.ErrorText = true, te.text
	case err != nil:
		if _, ok := status.FromError(err); ok {
			return err
		}
		if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
			return status.FromContextError(err).Err()
		}
		return err
	case len(out) > 0:
		if !json.Valid(out) {
			return status.Errorf(codes.Internal, "tool %q returned output that is not JSON", t.Name)
		}
		res.OutputJson = string(out)
	}
	return stream.Send(&toolv1.CallToolResponse{Event: &toolv1.CallToolResponse_Result{Result: res}})
}

// handlerContext returns the handler's context: the stream's values and deadline, ended
// with ErrCancelled (wrapping the stream's own cause when it has one) or ErrDeadline when
// the stream's context ends. done releases it.
func handlerContext(sctx context.Context) (context.Context, func()) {
	ctx, cancel := context.WithCancelCause(context.WithoutCancel(sctx))
	dl, hasDL := sctx.Deadline()
	if hasDL {
		var cancelDL context.CancelFunc
		ctx, cancelDL = context.WithDeadlineCause(ctx, dl, ErrDeadline)
		prev := cancel
		cancel = func(err error) { prev(err); cancelDL() } // the cause first: it reaches ctx
	}
	stop := context.AfterFunc(sctx, func() {
		switch cause := context.Cause(sctx); {
		// A caller whose own deadline passed resets the stream, which can arrive before
		// this server's timer fires: an end that close to the deadline is the deadline.
		case errors.Is(sctx.Err(), context.DeadlineExceeded), hasDL && time.Until(dl) <= meshcancel.DeadlineSlop:
			cancel(ErrDeadline)
		case cause != nil && cause != context.Canceled: //nolint:errorlint // the bare sentinel means no cause was given
			// A cause the server's chain gave (mesh's retry-id layer: a newer attempt
			// superseded this one) stays visible beside ErrCancelled.
			cancel(fmt.Errorf("%w: %w", ErrCancelled, cause))
		default:
			cancel(ErrCancelled)
		}
	})
	return ctx, func() { stop(); cancel(context.Canceled) }
}

// callOf reads curfew's facts from the call's incoming metadata.
func callOf(ctx context.Context, tool string, args json.RawMessage) Call {
	id := md.FromIncoming(ctx)
	c := Call{Tool: tool, Args: args, RunID: id.RunID, NodeID: id.NodeID, RetryID: id.RetryID,
		Attempt: id.Attempt, IdempotencyKey: md.IdempotencyKeyFrom(ctx), Hedge: md.HedgeFrom(ctx)}
	if dl, ok := md.IncomingDeadline(ctx); ok {
		c.Deadline = dl
	}
	return c
}

// isObject reports whether b is a JSON object.
func isObject(b json.RawMessage) bool {
	b = bytes.TrimSpace(b)
	return len(b) > 0 && b[0] == '{' && json.Valid(b)
}
