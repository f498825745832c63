package meshtest_test

import (
	"context"
	"fmt"
	"runtime"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	modelproxyv1 "github.com/curfew-mesh/curfew/gen/curfew/modelproxy/v1"
	"github.com/curfew-mesh/curfew/mesh"
	"github.com/curfew-mesh/curfew/mesh/meshtest"
	"github.com/curfew-mesh/curfew/mesh/nodes"
)

// fakeTB records the failure of a helper instead of failing the test.
type fakeTB struct {
	testing.TB
	failure string
}

func (f *fakeTB) Helper() {}

func (f *fakeTB) Fatal(args ...any) { f.Fatalf("%s", fmt.Sprint(args...)) }

func (f *fakeTB) Fatalf(format string, args ...any) {
	f.failure = fmt.Sprintf(format, args...)
	runtime.Goexit()
}

// failure runs fn with a fakeTB and returns the message it failed with, "" if it passed.
func failure(t *testing.T, fn func(tb testing.TB)) string {
	t.Helper()
	f := &fakeTB{TB: t}
	done := make(chan struct{})
	go func() {
		defer close(done)
		fn(f)
	}()
	<-done
	return f.failure
}

func TestWantCode(t *testing.T) {
	err := status.Error(codes.NotFound, `tool "x" not found`)
	for _, tc := range []struct {
		name     string
		err      error
		code     codes.Code
		contains []string
		fails    string // "" when WantCode passes
	}{
		{"code", err, codes.NotFound, nil, ""},
		{"code and text", err, codes.NotFound, []string{`"x"`, "not found"}, ""},
		{"nil is OK", nil, codes.OK, nil, ""},
		{"wrong code", err, codes.InvalidArgument, nil, "want code InvalidArgument"},
		{"nil is not an error", nil, codes.NotFound, nil, "want code NotFound"},
		{"missing text", err, codes.NotFound, []string{"not found", "y"}, `does not mention "y"`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := failure(t, func(tb testing.TB) { meshtest.WantCode(tb, tc.err, tc.code, tc.contains...) })
			if (tc.fails == "") != (got == "") || !strings.Contains(got, tc.fails) {
				t.Fatalf("WantCode failed with %q, want %q", got, tc.fails)
			}
		})
	}
}

func TestWaitNode(t *testing.T) {
	const run = "r"
	tbl := nodes.New(0)
	tbl.Start(run, &meshv1.Node{Id: "root/a"})
	tbl.Start(run, &meshv1.Node{Id: "root/a/b"})
	tbl.Start(run, &meshv1.Node{Id: "root/c"})
	tbl.End(run, "root/a", meshv1.NodeStatus_NODE_STATUS_SUCCEEDED, meshv1.CancelCause_CANCEL_CAUSE_UNSPECIFIED, "", "", nil)
	ended := make(chan struct{})
	go func() {
		defer close(ended)
		time.Sleep(50 * time.Millisecond)
		tbl.End(run, "root/a/b", meshv1.NodeStatus_NODE_STATUS_FAILED, meshv1.CancelCause_CANCEL_CAUSE_UNSPECIFIED, "ABORTED", "x", nil)
	}()

	// WaitNode waits for the nodes beneath the node too, and returns the node's record.
	n := meshtest.WaitNode(t, tbl, run, "root/a")
	if n.GetId() != "root/a" || n.GetStatus() != meshv1.NodeStatus_NODE_STATUS_SUCCEEDED {
		t.Fatalf("WaitNode = %v, want root/a SUCCEEDED", n)
	}
	// The table, not the goroutine, says whether root/a/b had ended: the goroutine closes
	// ended only after End returns, which may be after WaitNode saw the end.
	if _, settled := tbl.List(context.Background(), run, []string{"root/a"}, 0); !settled {
		t.Fatal("WaitNode returned before root/a/b ended")
	}
	<-ended

	if got := failure(t, func(tb testing.TB) { meshtest.WaitNode(tb, tbl, run, "root/x") }); !strings.Contains(got, "not recorded") {
		t.Fatalf("WaitNode of an unknown node failed with %q, want not recorded", got)
	}
	start := time.Now()
	got := failure(t, func(tb testing.TB) { meshtest.WaitNode(tb, tbl, run, "root/c") })
	if !strings.Contains(got, "did not end within 3s") || time.Since(start) < 3*time.Second {
		t.Fatalf("WaitNode of a running node failed with %q after %v, want after 3s", got, time.Since(start))
	}
}

// failingWatch is a Health service whose Watch sends SERVING, then fails with ABORTED.
type failingWatch struct {
	healthpb.UnimplementedHealthServer
}

func (failingWatch) Watch(_ *healthpb.HealthCheckRequest, ss grpc.ServerStreamingServer[healthpb.HealthCheckResponse]) error {
	if err := ss.Send(&healthpb.HealthCheckResponse{Status: healthpb.HealthCheckResponse_SERVING}); err != nil {
		return err
	}
	return status.Error(codes.Aborted, "watch failed")
}

func TestDrain(t *testing.T) {
	m := meshtest.NewModel(meshtest.ModelStep{Text: "a b c"})
	c := modelproxyv1.NewModelProxyServiceClient(meshtest.Serve(t, mesh.ServerConfig{}, m.Register))
	req := &modelproxyv1.GenerateRequest{Messages: []*modelproxyv1.Message{{Role: modelproxyv1.Role_ROLE_USER}}}
	st, err := c.Generate(ctxFor(t, "root/m0"), req)
	if err != nil {
		t.Fatal(err)
	}
	msgs, err := meshtest.Drain(st)
	if err != nil || len(msgs) != 4 || msgs[0].GetDelta() != "a" || msgs[3].GetFinishReason() != "stop" {
		t.Fatalf("Drain = %v, %v; want 3 tokens and the final chunk", msgs, err)
	}

	// A stream that fails after a message: Drain returns the message and the error.
	hc := healthpb.NewHealthClient(meshtest.Serve(t, mesh.ServerConfig{}, func(s *grpc.Server) {
		healthpb.RegisterHealthServer(s, failingWatch{})
	}))
	ws, err := hc.Watch(ctxFor(t, ""), &healthpb.HealthCheckRequest{})
	if err != nil {
		t.Fatal(err)
	}
	got, err := meshtest.Drain(ws)
	if status.Code(err) != codes.Aborted || len(got) != 1 || got[0].GetStatus() != healthpb.HealthCheckResponse_SERVING {
		t.Fatalf("Drain of a Watch that fails after one update = %v, %v; want the SERVING update and ABORTED", got, err)
	}
}
