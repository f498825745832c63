package retryid_test

import (
	"context"
	"errors"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	toolrunnerv1 "github.com/curfew-mesh/curfew/gen/curfew/toolrunner/v1"
	"github.com/curfew-mesh/curfew/mesh"
	"github.com/curfew-mesh/curfew/mesh/cancel"
	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/mesh/meshtest"
	"github.com/curfew-mesh/curfew/mesh/retryid"
)

// started is one handler's start: its attempt number and, later, its context's cause.
type started struct {
	attempt string
	cause   chan error
}

// overlap counts the handlers running at once per tenant and retry-id, and the most ever.
type overlap struct {
	mu      sync.Mutex
	running map[string]int
	peak    int
}

// enter records a handler of id's start; the func it returns records its end.
func (o *overlap) enter(ctx context.Context) func() {
	id := md.IdentityFrom(ctx)
	k := id.Tenant + "/" + id.RetryID
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.running == nil {
		o.running = map[string]int{}
	}
	o.running[k]++
	o.peak = max(o.peak, o.running[k])
	return func() {
		o.mu.Lock()
		defer o.mu.Unlock()
		o.running[k]--
	}
}

func (o *overlap) max() int {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.peak
}

// blocker is a ToolRunnerService whose Execute sends one node, then blocks until its
// context is done; it tracks how many handlers of one retry-id run at once.
type blocker struct {
	toolrunnerv1.UnimplementedToolRunnerServiceServer
	started  chan started
	overlap  overlap
	handlers atomic.Int32
}

func (b *blocker) Execute(_ *toolrunnerv1.ExecuteRequest, ss grpc.ServerStreamingServer[toolrunnerv1.ExecuteResponse]) error {
	ctx := ss.Context()
	defer b.overlap.enter(ctx)()
	b.handlers.Add(1)
	s := started{attempt: md.IdentityFrom(ctx).RetryID + "#" + strconv.Itoa(md.IdentityFrom(ctx).Attempt), cause: make(chan error, 1)}
	b.started <- s
	if err := ss.Send(&toolrunnerv1.ExecuteResponse{Event: &toolrunnerv1.ExecuteResponse_Node{Node: &meshv1.Node{Id: s.attempt}}}); err != nil {
		s.cause <- context.Cause(ctx)
		return err
	}
	<-ctx.Done()
	s.cause <- context.Cause(ctx)
	time.Sleep(teardown) // a teardown a newer attempt must not overlap
	return ctx.Err()
}

// teardown is how long a blocker's handler takes to stop after its context is done.
const teardown = 30 * time.Millisecond

func waitStarted(t *testing.T, b *blocker) started {
	t.Helper()
	select {
	case s := <-b.started:
		return s
	case <-time.After(long):
		t.Fatal("no handler started")
		return started{}
	}
}

func waitCause(t *testing.T, s started) error {
	t.Helper()
	select {
	case err := <-s.cause:
		return err
	case <-time.After(long):
		t.Fatalf("handler of %s did not end", s.attempt)
		return nil
	}
}

func openExecute(ctx context.Context, t *testing.T, cc *grpc.ClientConn) toolrunnerv1.ToolRunnerService_ExecuteClient {
	t.Helper()
	st, err := toolrunnerv1.NewToolRunnerServiceClient(cc).Execute(ctx, &toolrunnerv1.ExecuteRequest{Name: "sleep"})
	if err != nil {
		t.Fatalf("Execute: %v", err)
	}
	return st
}

func TestEndToEndSupersedeOverGRPC(t *testing.T) {
	reg := prometheus.NewRegistry()
	b := &blocker{started: make(chan started, 8)}
	cc := meshtest.Serve(t, mesh.ServerConfig{RetryIDs: retryid.New(long, reg)}, func(s *grpc.Server) {
		toolrunnerv1.RegisterToolRunnerServiceServer(s, b)
	})
	base := metadata.AppendToOutgoingContext(t.Context(), md.Tenant, "acme", md.RetryID, "rid-e2e")

	// Attempt 1 runs and blocks.
	ctx1, stop1 := context.WithCancel(base)
	defer stop1()
	st1 := openExecute(ctx1, t, cc)
	h1 := waitStarted(t, b)
	if h1.attempt != "rid-e2e#1" {
		t.Fatalf("first handler is %s, want rid-e2e#1", h1.attempt)
	}
	if r, err := st1.Recv(); err != nil || r.GetNode().GetId() != "rid-e2e#1" {
		t.Fatalf("attempt 1's first message: %v, %v", r, err)
	}

	// Attempt 2 of the same logical call supersedes it.
	ctx2, stop2 := context.WithCancel(metadata.AppendToOutgoingContext(base, md.Attempt, "2"))
	defer stop2()
	st2 := openExecute(ctx2, t, cc)
	if cause := waitCause(t, h1); !errors.Is(cause, cancel.ErrSuperseded) {
		t.Fatalf("attempt 1's handler ended with cause %v, want ErrSuperseded", cause)
	}
	h2 := waitStarted(t, b)
	if h2.attempt != "rid-e2e#2" {
		t.Fatalf("second handler is %s, want rid-e2e#2", h2.attempt)
	}
	if r, err := st2.Recv(); err != nil || r.GetNode().GetId() != "rid-e2e#2" {
		t.Fatalf("attempt 2's first message: %v, %v", r, err)
	}
	if _, err := st1.Recv(); status.Code(err) != codes.Canceled {
		t.Fatalf("attempt 1's stream ended with %v, want CANCELED", err)
	}

	// A late attempt 1 of the same call is refused while attempt 2 runs.
	ctxLate, stopLate := context.WithCancel(metadata.AppendToOutgoingContext(base, md.Attempt, "1"))
	defer stopLate()
	late := openExecute(ctxLate, t, cc)
	if _, err := late.Recv(); status.Code(err) != codes.Aborted {
		t.Fatalf("late duplicate: %v, want ABORTED", err)
	}

	// Another tenant's call with the same retry-id runs beside it.
	ctxOther, stopOther := context.WithCancel(metadata.AppendToOutgoingContext(t.Context(), md.Tenant, "globex", md.RetryID, "rid-e2e"))
	other := openExecute(ctxOther, t, cc)
	h3 := waitStarted(t, b)
	if _, err := other.Recv(); err != nil {
		t.Fatalf("other tenant: %v", err)
	}
	stopOther()
	if cause := waitCause(t, h3); errors.Is(cause, cancel.ErrSuperseded) {
		t.Fatalf("other tenant's handler superseded")
	}

	// The client goes away: attempt 2's handler ends, not superseded.
	stop2()
	if cause := waitCause(t, h2); errors.Is(cause, cancel.ErrSuperseded) || cause == nil {
		t.Fatalf("attempt 2's handler ended with cause %v, want a client cancel", cause)
	}

	// Handlers ran one at a time per (tenant, method, retry-id).
	if p := b.overlap.max(); p != 1 {
		t.Fatalf("peak of %d handlers of one retry-id at once, want 1", p)
	}
	if n := b.handlers.Load(); n != 3 {
		t.Fatalf("%d handlers ran, want 3 (the late duplicate never starts)", n)
	}
	if v := value(t, reg, "curfew_superseded_total", execMethod); v != 1 {
		t.Errorf("superseded %v, want 1", v)
	}
	if v := value(t, reg, "curfew_inflight_by_retry_id_max", execMethod); v != 1 {
		t.Errorf("inflight max %v, want 1", v)
	}
	deadline := time.Now().Add(long)
	for value(t, reg, "curfew_inflight_by_retry_id", execMethod) != 0 {
		if time.Now().After(deadline) {
			t.Fatalf("inflight %v after every handler ended, want 0", value(t, reg, "curfew_inflight_by_retry_id", execMethod))
		}
		time.Sleep(5 * time.Millisecond)
	}
}

const execMethod = "/curfew.toolrunner.v1.ToolRunnerService/Execute"

// TestEndToEndNeverTwoAtOnce sends a burst of attempts of one retry-id, each superseding
// the one before, and checks that no two of their handlers ever overlap.
func TestEndToEndNeverTwoAtOnce(t *testing.T) {
	reg := prometheus.NewRegistry()
	b := &blocker{started: make(chan started, 64)}
	cc := meshtest.Serve(t, mesh.ServerConfig{RetryIDs: retryid.New(long, reg)}, func(s *grpc.Server) {
		toolrunnerv1.RegisterToolRunnerServiceServer(s, b)
	})
	base := metadata.AppendToOutgoingContext(t.Context(), md.RetryID, "rid-burst")
	const attempts = 5
	var streams []toolrunnerv1.ToolRunnerService_ExecuteClient
	var stops []context.CancelFunc
	defer func() {
		for _, s := range stops {
			s()
		}
	}()
	for a := 1; a <= attempts; a++ {
		ctx, stop := context.WithCancel(metadata.AppendToOutgoingContext(base, md.Attempt, strconv.Itoa(a)))
		stops = append(stops, stop)
		streams = append(streams, openExecute(ctx, t, cc))
		h := waitStarted(t, b)
		if h.attempt != "rid-burst#"+strconv.Itoa(a) {
			t.Fatalf("handler %s started, want attempt %d", h.attempt, a)
		}
		if a > 1 {
			if _, err := streams[a-2].Recv(); err != nil {
				t.Fatalf("attempt %d: first message: %v", a-1, err)
			}
			if _, err := streams[a-2].Recv(); status.Code(err) != codes.Canceled {
				t.Fatalf("attempt %d: %v, want CANCELED when superseded", a-1, err)
			}
		}
	}
	if p := b.overlap.max(); p != 1 {
		t.Fatalf("peak of %d handlers of one retry-id at once, want 1", p)
	}
	if v := value(t, reg, "curfew_superseded_total", execMethod); v != attempts-1 {
		t.Fatalf("superseded %v, want %d", v, attempts-1)
	}
	if v := value(t, reg, "curfew_inflight_by_retry_id", execMethod); v != 1 {
		t.Fatalf("inflight %v, want 1", v)
	}
}

// TestEndToEndUnary checks the unary interceptor: a unary handler of attempt 1 is
// superseded by attempt 2 of the same call.
func TestEndToEndUnary(t *testing.T) {
	svc := &unaryBlocker{started: make(chan context.Context, 4)}
	cc := meshtest.Serve(t, mesh.ServerConfig{RetryIDs: retryid.New(long, nil)}, func(s *grpc.Server) {
		meshv1.RegisterNodeReportServiceServer(s, svc)
	})
	base := metadata.AppendToOutgoingContext(t.Context(), md.RetryID, "rid-unary")
	client := meshv1.NewNodeReportServiceClient(cc)
	first := make(chan error, 1)
	go func() {
		_, err := client.ListNodes(base, &meshv1.ListNodesRequest{RunId: "r"})
		first <- err
	}()
	var h1 context.Context
	select {
	case h1 = <-svc.started:
	case <-time.After(long):
		t.Fatal("attempt 1 did not start")
	}
	ctx2, stop2 := context.WithTimeout(metadata.AppendToOutgoingContext(base, md.Attempt, "2"), long)
	defer stop2()
	resp, err := client.ListNodes(ctx2, &meshv1.ListNodesRequest{RunId: "r"})
	if err != nil || !resp.GetSettled() {
		t.Fatalf("attempt 2: %v, %v", resp, err)
	}
	if !errors.Is(context.Cause(h1), cancel.ErrSuperseded) {
		t.Fatalf("attempt 1's cause = %v", context.Cause(h1))
	}
	select {
	case err := <-first:
		if status.Code(err) != codes.Canceled {
			t.Fatalf("attempt 1: %v, want CANCELED", err)
		}
	case <-time.After(long):
		t.Fatal("attempt 1 did not return")
	}
	if p := svc.overlap.max(); p != 1 {
		t.Fatalf("peak %d, want 1", p)
	}
}

// unaryBlocker's first ListNodes blocks until its context is done; later ones answer.
type unaryBlocker struct {
	meshv1.UnimplementedNodeReportServiceServer
	started chan context.Context
	calls   atomic.Int32
	overlap overlap
}

func (u *unaryBlocker) ListNodes(ctx context.Context, _ *meshv1.ListNodesRequest) (*meshv1.ListNodesResponse, error) {
	defer u.overlap.enter(ctx)()
	if u.calls.Add(1) == 1 {
		u.started <- ctx
		<-ctx.Done()
		return nil, ctx.Err()
	}
	return &meshv1.ListNodesResponse{Settled: true}, nil
}
