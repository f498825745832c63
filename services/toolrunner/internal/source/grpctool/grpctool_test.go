package grpctool_test

import (
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	toolv1 "github.com/curfew-mesh/curfew/gen/curfew/tool/v1"
	"github.com/curfew-mesh/curfew/mesh"
	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/mesh/retry"
	"github.com/curfew-mesh/curfew/mesh/toolserver"
	"github.com/curfew-mesh/curfew/services/toolrunner/internal/source"
	"github.com/curfew-mesh/curfew/services/toolrunner/internal/source/grpctool"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// serveOn serves svc on addr ("127.0.0.1:0" for any port) and returns the address and
// a stop function (also run at cleanup).
func serveOn(t *testing.T, addr string, svc toolv1.ToolServiceServer) (string, func()) {
	t.Helper()
	lis, err := net.Listen("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	gs := grpc.NewServer()
	toolv1.RegisterToolServiceServer(gs, svc)
	go func() { _ = gs.Serve(lis) }()
	t.Cleanup(gs.Stop)
	return lis.Addr().String(), gs.Stop
}

// open opens a source of addr dialled with mesh's client chain, as toolrunner does.
func open(t *testing.T, addr string, opts grpctool.Options, extra ...grpc.DialOption) *grpctool.Source {
	t.Helper()
	dial := append(mesh.DialOptions(mesh.ClientConfig{Retry: retry.Config{Target: "team", Logger: slog.New(slog.DiscardHandler)}}), extra...)
	src, err := grpctool.Open(context.Background(), grpctool.Config{Name: "team", Address: addr, DialOptions: dial}, opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = src.Close() })
	return src
}

func noProgress(*meshv1.Progress) {}

// echo returns the Call it was given.
var echo = toolserver.Tool{Name: "echo", SideEffects: toolv1.SideEffects_SIDE_EFFECTS_NONE,
	InputSchema: json.RawMessage(`{"type":"object"}`),
	Handler: func(ctx context.Context, c toolserver.Call, _ func(float64, float64, string)) (json.RawMessage, error) {
		dl, _ := ctx.Deadline()
		return json.Marshal(map[string]any{"call": c, "left_ms": time.Until(dl).Milliseconds()})
	}}

func TestList(t *testing.T) {
	write := toolserver.Tool{Name: "write", Description: "writes", SideEffects: toolv1.SideEffects_SIDE_EFFECTS_IRREVERSIBLE, Handler: echo.Handler}
	put := toolserver.Tool{Name: "put", SideEffects: toolv1.SideEffects_SIDE_EFFECTS_IDEMPOTENT, Handler: echo.Handler}
	unsaid := toolserver.Tool{Name: "unsaid", Handler: echo.Handler}
	addr, _ := serveOn(t, "127.0.0.1:0", toolserver.New(echo, write, put, unsaid))
	src := open(t, addr, grpctool.Options{})
	tools, err := src.List(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if len(tools) != 4 {
		t.Fatalf("tools = %+v", tools)
	}
	b := func(p *bool) string {
		if p == nil {
			return "-"
		}
		if *p {
			return "y"
		}
		return "n"
	}
	hints := func(h source.Hints) string {
		return b(h.ReadOnly) + b(h.Destructive) + b(h.Idempotent) + b(h.OpenWorld)
	}
	for i, want := range []struct{ name, hints, schema string }{
		{"echo", "yny-", `{"type":"object"}`},
		{"write", "n-n-", ""},
		{"put", "n-y-", ""},
		{"unsaid", "----", ""},
	} {
		got := tools[i]
		if got.Name != want.name || hints(got.Hints) != want.hints || string(got.InputSchema) != want.schema {
			t.Errorf("tool %d = %s %s %s, want %+v", i, got.Name, hints(got.Hints), got.InputSchema, want)
		}
	}
	if tools[1].Description != "writes" {
		t.Errorf("description = %q", tools[1].Description)
	}
}

// malformed is a ToolService whose list has tools the source must leave out.
type malformed struct {
	toolv1.UnimplementedToolServiceServer
}

func (malformed) ListTools(context.Context, *toolv1.ListToolsRequest) (*toolv1.ListToolsResponse, error) {
	return &toolv1.ListToolsResponse{Tools: []*toolv1.Tool{
		{Name: ""}, {Name: "array_schema", InputSchemaJson: `[]`}, {Name: "broken", InputSchemaJson: `{"a":`}, {Name: "fine"},
	}}, nil
}

func TestListLeavesOutMalformedTools(t *testing.T) {
	addr, _ := serveOn(t, "127.0.0.1:0", malformed{})
	src := open(t, addr, grpctool.Options{Logger: slog.New(slog.DiscardHandler)})
	tools, err := src.List(context.Background())
	if err != nil || len(tools) != 1 || tools[0].Name != "fine" {
		t.Fatalf("tools = %+v, %v; want only fine", tools, err)
	}
}

func TestOpen(t *testing.T) {
	for _, addr := range []string{"", "localhost", "127.0.0.1:x", ":7800", "127.0.0.1:70000"} {
		if _, err := grpctool.Open(context.Background(), grpctool.Config{Name: "team", Address: addr}, grpctool.Options{}); status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), `"team"`) {
			t.Errorf("Open(%q) = %v, want INVALID_ARGUMENT naming the source", addr, err)
		}
	}
	if _, err := grpctool.Open(context.Background(), grpctool.Config{Address: "127.0.0.1:1"}, grpctool.Options{}); status.Code(err) != codes.InvalidArgument {
		t.Errorf("Open without a name = %v", err)
	}

	// A server that is down: Open succeeds, List and Call fail UNAVAILABLE naming the source.
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	down := lis.Addr().String()
	_ = lis.Close()
	src := open(t, down, grpctool.Options{})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := src.List(ctx); status.Code(err) != codes.Unavailable || !strings.Contains(err.Error(), `"team"`) {
		t.Fatalf("List of a down server = %v, want UNAVAILABLE naming the source", err)
	}
	if _, err := src.Call(ctx, source.Call{Tool: "echo"}, noProgress); status.Code(err) != codes.Unavailable || !strings.Contains(err.Error(), `"team"`) {
		t.Fatalf("Call of a down server = %v, want UNAVAILABLE naming the source", err)
	}
}

// The server sees the call's facts as curfew's metadata, and the run's deadline as its
// gRPC deadline, through mesh's client chain.
func TestCallSendsCurfewMetadata(t *testing.T) {
	addr, _ := serveOn(t, "127.0.0.1:0", toolserver.New(echo))
	src := open(t, addr, grpctool.Options{})

	deadline := time.Now().Add(3 * time.Second).Truncate(time.Millisecond)
	meta := source.Meta{Deadline: deadline, RunID: "run-1", NodeID: "root/s0.t1", RetryID: "r-1", Attempt: 2, IdempotencyKey: "k-1"}
	// The caller's context: the mesh identity of the toolrunner call, a later deadline.
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	ctx = md.WithIdentity(ctx, md.Identity{Tenant: "acme", RunID: "run-1", NodeID: "root/s0"})
	res, err := src.Call(ctx, source.Call{Tool: "echo", Args: json.RawMessage(`{"q":1}`), Meta: meta}, noProgress)
	if err != nil || res.IsError {
		t.Fatalf("Call = %+v, %v", res, err)
	}
	var got struct {
		Call   toolserver.Call `json:"call"`
		LeftMS int64           `json:"left_ms"`
	}
	if err := json.Unmarshal(res.Output, &got); err != nil {
		t.Fatal(err)
	}
	c := got.Call
	if c.Tool != "echo" || string(c.Args) != `{"q":1}` || c.RunID != "run-1" || c.NodeID != "root/s0.t1" || c.RetryID != "r-1" ||
		c.Attempt != 2 || c.IdempotencyKey != "k-1" || !c.Deadline.Equal(deadline) {
		t.Fatalf("the server saw %+v, want %+v", c, meta)
	}
	// The earlier Meta.Deadline is the gRPC deadline: about 3 s left, not a minute.
	if got.LeftMS <= 0 || got.LeftMS > 3000 {
		t.Fatalf("the server had %d ms left, want at most 3000", got.LeftMS)
	}
}

func TestCallProgressAndResults(t *testing.T) {
	steps := toolserver.Tool{Name: "steps", Handler: func(_ context.Context, _ toolserver.Call, progress func(float64, float64, string)) (json.RawMessage, error) {
		for i := 1; i <= 3; i++ {
			progress(float64(i), 3, "step")
		}
		return json.RawMessage(`{"steps":3}`), nil
	}}
	fails := toolserver.Tool{Name: "fails", Handler: func(context.Context, toolserver.Call, func(float64, float64, string)) (json.RawMessage, error) {
		return nil, toolserver.ToolError("no such order")
	}}
	big := toolserver.Tool{Name: "big", Handler: func(context.Context, toolserver.Call, func(float64, float64, string)) (json.RawMessage, error) {
		return json.Marshal(strings.Repeat("x", 4096))
	}}
	addr, _ := serveOn(t, "127.0.0.1:0", toolserver.New(steps, fails, big))
	src := open(t, addr, grpctool.Options{}, grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(1024)))
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	var seen []float64
	res, err := src.Call(ctx, source.Call{Tool: "steps"}, func(p *meshv1.Progress) { seen = append(seen, p.GetProgress()) })
	if err != nil || string(res.Output) != `{"steps":3}` || res.IsError {
		t.Fatalf("steps = %+v, %v", res, err)
	}
	if len(seen) != 3 || seen[0] != 1 || seen[2] != 3 {
		t.Fatalf("progress = %v, want 1, 2, 3 before the result", seen)
	}

	res, err = src.Call(ctx, source.Call{Tool: "fails"}, noProgress)
	if err != nil || !res.IsError || res.Text != "no such order" {
		t.Fatalf("fails = %+v, %v; want a Result with IsError", res, err)
	}
	if _, err := src.Call(ctx, source.Call{Tool: "missing"}, noProgress); status.Code(err) != codes.NotFound || !strings.Contains(err.Error(), `"team"`) {
		t.Fatalf("missing = %v, want NOT_FOUND naming the source", err)
	}
	if _, err := src.Call(ctx, source.Call{Tool: "big"}, noProgress); status.Code(err) != codes.ResourceExhausted || !errors.Is(err, source.ErrTooLarge) {
		t.Fatalf("big = %v, want RESOURCE_EXHAUSTED wrapping ErrTooLarge", err)
	}
}

// Cancelling the call's context resets the stream: the handler's context ends with
// ErrCancelled, and Call returns at once, even when the handler ignores the cancel.
func TestCallCancel(t *testing.T) {
	handlerSaw := make(chan error, 1)
	release := make(chan struct{})
	block := toolserver.Tool{Name: "block", Handler: func(ctx context.Context, _ toolserver.Call, progress func(float64, float64, string)) (json.RawMessage, error) {
		progress(1, 0, "waiting")
		<-ctx.Done()
		handlerSaw <- context.Cause(ctx)
		return nil, ctx.Err()
	}}
	stubborn := toolserver.Tool{Name: "stubborn", Handler: func(_ context.Context, _ toolserver.Call, progress func(float64, float64, string)) (json.RawMessage, error) {
		progress(1, 0, "ignoring cancels")
		<-release
		return json.RawMessage(`{}`), nil
	}}
	addr, _ := serveOn(t, "127.0.0.1:0", toolserver.New(block, stubborn))
	src := open(t, addr, grpctool.Options{})
	defer close(release)

	for _, tool := range []string{"block", "stubborn"} {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		var once sync.Once
		var cancelled time.Time
		done := make(chan error, 1)
		go func() {
			_, err := src.Call(ctx, source.Call{Tool: tool}, func(*meshv1.Progress) {
				once.Do(func() { cancelled = time.Now(); cancel() })
			})
			done <- err
		}()
		select {
		case err := <-done:
			if status.Code(err) != codes.Canceled || !strings.Contains(err.Error(), `"team"`) {
				t.Fatalf("%s: Call = %v, want CANCELLED naming the source", tool, err)
			}
			if d := time.Since(cancelled); d > 2*time.Second {
				t.Fatalf("%s: Call returned %v after the cancel", tool, d)
			}
		case <-time.After(20 * time.Second):
			t.Fatalf("%s: Call did not return after the cancel", tool)
		}
		cancel()
	}
	select {
	case cause := <-handlerSaw:
		if !errors.Is(cause, toolserver.ErrCancelled) {
			t.Fatalf("the handler's cause = %v, want ErrCancelled", cause)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the handler did not see the cancel")
	}
}

// Changed is closed when the server comes up, and again when it restarts.
func TestChangedOnReconnect(t *testing.T) {
	addr, stop := serveOn(t, "127.0.0.1:0", toolserver.New(echo))
	src := open(t, addr, grpctool.Options{})
	waitChanged := func(what string) {
		t.Helper()
		select {
		case <-src.Changed():
		case <-time.After(20 * time.Second):
			t.Fatalf("Changed not closed %s", what)
		}
	}
	waitChanged("when the server was first reached")
	stop()
	next := src.Changed()
	select {
	case <-next:
		t.Fatal("Changed closed while the server is down")
	case <-time.After(200 * time.Millisecond):
	}
	serveOn(t, addr, toolserver.New(echo))
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	for { // a call makes the idle connection reconnect
		if _, err := src.List(ctx); err == nil || ctx.Err() != nil {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	select {
	case <-next:
	case <-time.After(20 * time.Second):
		t.Fatal("Changed not closed after the server restarted")
	}
}

// After the call's context ends, no progress reaches the callback: events already on the
// way are dropped and counted as late.
func TestNoProgressAfterCancel(t *testing.T) {
	release := make(chan struct{})
	burst := toolserver.Tool{Name: "burst", Handler: func(ctx context.Context, _ toolserver.Call, progress func(float64, float64, string)) (json.RawMessage, error) {
		for i := 1; i <= 200; i++ {
			progress(float64(i), 200, "")
		}
		select {
		case <-ctx.Done():
		case <-release:
		}
		return json.RawMessage(`{}`), nil
	}}
	addr, _ := serveOn(t, "127.0.0.1:0", toolserver.New(burst))
	defer close(release)
	var lateHook atomic.Int64
	src := open(t, addr, grpctool.Options{Late: func() { lateHook.Add(1) }})

	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var delivered, afterCancel int
	_, err := src.Call(ctx, source.Call{Tool: "burst"}, func(*meshv1.Progress) {
		delivered++
		if ctx.Err() != nil {
			afterCancel++
		}
		cancel()
	})
	if status.Code(err) != codes.Canceled {
		t.Fatalf("Call = %v, want CANCELLED", err)
	}
	if delivered != 1 || afterCancel != 0 {
		t.Fatalf("%d events delivered, %d after the cancel; want 1 and none", delivered, afterCancel)
	}
	if src.LateEvents() != lateHook.Load() {
		t.Fatalf("LateEvents = %d, the Late hook counted %d", src.LateEvents(), lateHook.Load())
	}
	t.Logf("%d late events dropped", src.LateEvents())
}
