package toolserver_test

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"net"
	"strconv"
	"testing"
	"time"

	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	toolv1 "github.com/curfew-mesh/curfew/gen/curfew/tool/v1"
	"github.com/curfew-mesh/curfew/mesh"
	meshcancel "github.com/curfew-mesh/curfew/mesh/cancel"
	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/mesh/toolserver"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// serve runs srv on a loopback port with opts and returns a client of it.
func serve(t *testing.T, srv *toolserver.Server, opts ...grpc.ServerOption) toolv1.ToolServiceClient {
	t.Helper()
	gs := grpc.NewServer(opts...)
	srv.Register(gs)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go func() { _ = gs.Serve(lis) }()
	t.Cleanup(gs.Stop)
	conn, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	return toolv1.NewToolServiceClient(conn)
}

// call runs one CallTool to its end: the progress messages and the result or error.
func call(ctx context.Context, c toolv1.ToolServiceClient, name, args string) ([]string, *toolv1.CallToolResult, error) {
	stream, err := c.CallTool(ctx, &toolv1.CallToolRequest{Name: name, ArgumentsJson: args})
	if err != nil {
		return nil, nil, err
	}
	var progress []string
	for {
		ev, err := stream.Recv()
		if err != nil {
			return progress, nil, err
		}
		if p := ev.GetProgress(); p != nil {
			progress = append(progress, p.GetMessage())
			continue
		}
		if _, err := stream.Recv(); !errors.Is(err, io.EOF) {
			return progress, nil, errors.New("an event after the result")
		}
		return progress, ev.GetResult(), nil
	}
}

func echo(name string, effects toolv1.SideEffects) toolserver.Tool {
	return toolserver.Tool{Name: name, Description: name + " echoes", SideEffects: effects,
		Handler: func(_ context.Context, c toolserver.Call, _ func(float64, float64, string)) (json.RawMessage, error) {
			return json.Marshal(c)
		}}
}

func TestListTools(t *testing.T) {
	schema := json.RawMessage(`{"type":"object"}`)
	a := echo("a", toolv1.SideEffects_SIDE_EFFECTS_NONE)
	a.InputSchema = schema
	c := serve(t, toolserver.New(a, echo("b", toolv1.SideEffects_SIDE_EFFECTS_IDEMPOTENT)))
	res, err := c.ListTools(context.Background(), &toolv1.ListToolsRequest{})
	if err != nil {
		t.Fatal(err)
	}
	got := res.GetTools()
	if len(got) != 2 || got[0].GetName() != "a" || got[1].GetName() != "b" {
		t.Fatalf("tools = %v, want a then b", got)
	}
	if got[0].GetInputSchemaJson() != string(schema) || got[0].GetSideEffects() != toolv1.SideEffects_SIDE_EFFECTS_NONE ||
		got[1].GetInputSchemaJson() != "" || got[1].GetSideEffects() != toolv1.SideEffects_SIDE_EFFECTS_IDEMPOTENT ||
		got[0].GetDescription() != "a echoes" {
		t.Fatalf("tools = %v", got)
	}
}

// The handler reads curfew's metadata as the mesh's client chain sends it.
func TestCallCarriesCurfewMetadata(t *testing.T) {
	c := serve(t, toolserver.New(echo("echo", 0)))
	deadline := time.Now().Add(time.Minute).Truncate(time.Millisecond)
	ctx, cancel := context.WithDeadline(context.Background(), deadline)
	defer cancel()
	ctx = metadata.AppendToOutgoingContext(ctx, md.RunID, "run-1", md.NodeID, "root/s0.t1", md.RetryID, "r-9",
		md.Attempt, "2", md.IdempotencyKey, "k-1", md.Hedge, md.HedgeBackup, md.Deadline, strconv.FormatInt(deadline.UnixMilli(), 10))
	_, res, err := call(ctx, c, "echo", `{"x":1}`)
	if err != nil {
		t.Fatal(err)
	}
	var got toolserver.Call
	if err := json.Unmarshal([]byte(res.GetOutputJson()), &got); err != nil {
		t.Fatal(err)
	}
	want := toolserver.Call{Tool: "echo", Args: json.RawMessage(`{"x":1}`), RunID: "run-1", NodeID: "root/s0.t1",
		RetryID: "r-9", Attempt: 2, IdempotencyKey: "k-1", Hedge: true, Deadline: deadline}
	if got.Tool != want.Tool || string(got.Args) != string(want.Args) || got.RunID != want.RunID || got.NodeID != want.NodeID ||
		got.RetryID != want.RetryID || got.Attempt != want.Attempt || got.IdempotencyKey != want.IdempotencyKey ||
		got.Hedge != want.Hedge || !got.Deadline.Equal(want.Deadline) {
		t.Fatalf("call = %+v, want %+v", got, want)
	}
}

func TestErrors(t *testing.T) {
	failing := func(name string, err error) toolserver.Tool {
		return toolserver.Tool{Name: name, Handler: func(context.Context, toolserver.Call, func(float64, float64, string)) (json.RawMessage, error) {
			return nil, err
		}}
	}
	badOutput := toolserver.Tool{Name: "bad_output", Handler: func(context.Context, toolserver.Call, func(float64, float64, string)) (json.RawMessage, error) {
		return json.RawMessage(`{"unterminated`), nil
	}}
	c := serve(t, toolserver.New(echo("echo", 0), badOutput,
		failing("tool_error", toolserver.ToolError("no such order")),
		failing("status", status.Error(codes.FailedPrecondition, "not yet")),
		failing("plain", errors.New("disk on fire"))))
	ctx := context.Background()

	for _, tc := range []struct {
		tool, args string
		code       codes.Code
	}{
		{"missing", `{}`, codes.NotFound},
		{"echo", `[1]`, codes.InvalidArgument},
		{"echo", `{"x":`, codes.InvalidArgument},
		{"echo", `"s"`, codes.InvalidArgument},
		{"bad_output", `{}`, codes.Internal},
		{"status", `{}`, codes.FailedPrecondition},
		{"plain", `{}`, codes.Unknown}, // grpc-go's code for a plain error; mesh's chain makes it INTERNAL
	} {
		if _, _, err := call(ctx, c, tc.tool, tc.args); status.Code(err) != tc.code {
			t.Errorf("%s(%s): %v, want %v", tc.tool, tc.args, err, tc.code)
		}
	}
	_, res, err := call(ctx, c, "tool_error", `{}`)
	if err != nil || !res.GetIsError() || res.GetErrorText() != "no such order" || res.GetOutputJson() != "" {
		t.Fatalf("tool_error: %v, %v; want is_error with its text", res, err)
	}
	_, res, err = call(ctx, c, "echo", "")
	if err != nil || res.GetIsError() {
		t.Fatalf("echo with empty arguments: %v, %v; want them taken as {}", res, err)
	}
}

// blocker is a tool that reports progress and waits for its context to end, then tells
// ended what context.Cause said.
func blocker(ended chan<- error) toolserver.Tool {
	return toolserver.Tool{Name: "block", Handler: func(ctx context.Context, _ toolserver.Call, progress func(float64, float64, string)) (json.RawMessage, error) {
		progress(1, 0, "started")
		<-ctx.Done()
		ended <- context.Cause(ctx)
		progress(2, 0, "after the end") // ignored
		return nil, ctx.Err()
	}}
}

// A caller's cancel (RST_STREAM) ends the handler's context with ErrCancelled, its
// deadline with ErrDeadline.
func TestHandlerContextEnds(t *testing.T) {
	ended := make(chan error, 1)
	c := serve(t, toolserver.New(blocker(ended)))

	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	stream, err := c.CallTool(ctx, &toolv1.CallToolRequest{Name: "block"})
	if err != nil {
		t.Fatal(err)
	}
	if ev, err := stream.Recv(); err != nil || ev.GetProgress().GetMessage() != "started" {
		t.Fatalf("first event: %v, %v", ev, err)
	}
	cancelled := time.Now()
	cancel()
	select {
	case cause := <-ended:
		if !errors.Is(cause, toolserver.ErrCancelled) || !errors.Is(cause, context.Canceled) {
			t.Fatalf("cause = %v, want ErrCancelled", cause)
		}
		if d := time.Since(cancelled); d > 2*time.Second {
			t.Fatalf("the handler saw the cancel after %v", d)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the handler did not see the cancel")
	}

	ctx, cancel = context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	_, _, err = call(ctx, c, "block", `{}`)
	if status.Code(err) != codes.DeadlineExceeded {
		t.Fatalf("call past its deadline: %v", err)
	}
	select {
	case cause := <-ended:
		if !errors.Is(cause, toolserver.ErrDeadline) || !errors.Is(cause, context.DeadlineExceeded) {
			t.Fatalf("cause = %v, want ErrDeadline", cause)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the handler did not see the deadline")
	}
}

// Under mesh's server chain the handler sees the same facts and errors keep their codes.
func TestUnderMeshChain(t *testing.T) {
	c := serve(t, toolserver.New(echo("echo", 0)), mesh.ServerOptions(mesh.ServerConfig{Logger: slog.New(slog.DiscardHandler)})...)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	ctx = md.AppendOutgoing(md.WithIdentity(ctx, md.Identity{RunID: "run-7", NodeID: "root/t"}))
	_, res, err := call(ctx, c, "echo", `{}`)
	if err != nil {
		t.Fatal(err)
	}
	var got toolserver.Call
	if err := json.Unmarshal([]byte(res.GetOutputJson()), &got); err != nil || got.RunID != "run-7" || got.NodeID != "root/t" || got.Deadline.IsZero() {
		t.Fatalf("call = %+v, %v", got, err)
	}
	if _, _, err := call(ctx, c, "missing", `{}`); status.Code(err) != codes.NotFound {
		t.Fatalf("missing tool under the chain: %v", err)
	}
}

func TestNewPanicsOnMistakes(t *testing.T) {
	ok := echo("a", 0)
	noSchema := echo("s", 0)
	noSchema.InputSchema = json.RawMessage(`[]`)
	for name, tools := range map[string][]toolserver.Tool{
		"no name":    {{Handler: ok.Handler}},
		"no handler": {{Name: "x"}},
		"duplicate":  {ok, ok},
		"schema":     {noSchema},
	} {
		func() {
			defer func() {
				if recover() == nil {
					t.Errorf("%s: New did not panic", name)
				}
			}()
			toolserver.New(tools...)
		}()
	}
}

// Under mesh's server chain, a newer attempt of the same retry-id supersedes the running
// one: its handler's cause is ErrCancelled wrapping cancel.ErrSuperseded.
func TestSupersededUnderMeshChain(t *testing.T) {
	ended := make(chan error, 2)
	c := serve(t, toolserver.New(blocker(ended)), mesh.ServerOptions(mesh.ServerConfig{Logger: slog.New(slog.DiscardHandler)})...)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	attempt := func(n string) grpc.ServerStreamingClient[toolv1.CallToolResponse] {
		actx := metadata.AppendToOutgoingContext(ctx, md.RetryID, "r-1", md.Attempt, n)
		stream, err := c.CallTool(actx, &toolv1.CallToolRequest{Name: "block"})
		if err != nil {
			t.Fatal(err)
		}
		if ev, err := stream.Recv(); err != nil || ev.GetProgress() == nil {
			t.Fatalf("attempt %s: first event %v, %v", n, ev, err)
		}
		return stream
	}
	attempt("1")
	attempt("2")
	select {
	case cause := <-ended:
		if !errors.Is(cause, toolserver.ErrCancelled) || !errors.Is(cause, meshcancel.ErrSuperseded) {
			t.Fatalf("cause = %v, want ErrCancelled wrapping ErrSuperseded", cause)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the first attempt was not superseded")
	}
}
