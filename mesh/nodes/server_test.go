package nodes_test

import (
	"context"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	"github.com/curfew-mesh/curfew/mesh"
	"github.com/curfew-mesh/curfew/mesh/meshtest"
	"github.com/curfew-mesh/curfew/mesh/nodes"
)

func serveTable(t *testing.T, srv *nodes.Server) meshv1.NodeReportServiceClient {
	t.Helper()
	cc := meshtest.Serve(t, mesh.ServerConfig{}, func(s *grpc.Server) { meshv1.RegisterNodeReportServiceServer(s, srv) })
	return meshv1.NewNodeReportServiceClient(cc)
}

func TestServerValidation(t *testing.T) {
	c := serveTable(t, &nodes.Server{Table: nodes.New(0)})
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	cases := []struct {
		name string
		req  *meshv1.ListNodesRequest
		code codes.Code
	}{
		{"no run id", &meshv1.ListNodesRequest{}, codes.InvalidArgument},
		{"negative settle", &meshv1.ListNodesRequest{RunId: "r", SettleTimeout: durationpb.New(-time.Second)}, codes.InvalidArgument},
		{"settle above 60s", &meshv1.ListNodesRequest{RunId: "r", SettleTimeout: durationpb.New(61 * time.Second)}, codes.InvalidArgument},
		{"settle 60s", &meshv1.ListNodesRequest{RunId: "r", SettleTimeout: durationpb.New(60 * time.Second)}, codes.OK},
		{"no settle", &meshv1.ListNodesRequest{RunId: "r"}, codes.OK},
	}
	for _, tc := range cases {
		_, err := c.ListNodes(ctx, tc.req)
		if got := status.Code(err); got != tc.code {
			t.Errorf("%s: code %v (%v), want %v", tc.name, got, err, tc.code)
		}
	}
}

func TestServerListsAndSettles(t *testing.T) {
	tb := nodes.New(0)
	var decorated atomic.Int32
	c := serveTable(t, &nodes.Server{Table: tb, Decorate: func(run string, req *meshv1.ListNodesRequest, n *meshv1.Node) {
		decorated.Add(1)
		n.TokensAtCancel = 42
	}})
	start(tb, "r", "root/s0.t0", "root/s0.t1", "root/s0.t10")
	tb.End("r", "root/s0.t10", succeeded, noCause, "", "", nil)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()

	// Not settled within a short settle timeout.
	resp, err := c.ListNodes(ctx, &meshv1.ListNodesRequest{RunId: "r", NodePrefixes: []string{"root/s0.t1"}, SettleTimeout: durationpb.New(50 * time.Millisecond)})
	if err != nil {
		t.Fatal(err)
	}
	if resp.Settled || !slices.Equal(ids(resp.Nodes), []string{"root/s0.t1"}) {
		t.Fatalf("resp = %v; want root/s0.t1 only (not t10), unsettled", resp)
	}
	if resp.Nodes[0].TokensAtCancel != 42 || decorated.Load() != 1 {
		t.Errorf("Decorate not applied to each listed node (%d calls)", decorated.Load())
	}

	// Settles once the node ends while the call waits.
	time.AfterFunc(100*time.Millisecond, func() { tb.End("r", "root/s0.t1", cancelled, noCause, "CANCELLED", "cancelled", nil) })
	resp, err = c.ListNodes(ctx, &meshv1.ListNodesRequest{RunId: "r", NodePrefixes: []string{"root/s0.t1"}, SettleTimeout: durationpb.New(2 * time.Second)})
	if err != nil {
		t.Fatal(err)
	}
	if !resp.Settled || resp.Nodes[0].Status != cancelled {
		t.Fatalf("resp = %v; want settled with the node cancelled", resp)
	}

	// The caller's deadline ends a long settle wait. The handler's copy of the deadline
	// fires no later than the caller's, so the caller sees either its DEADLINE_EXCEEDED or
	// the handler's unsettled answer, and either way without waiting for the settle.
	start(tb, "r", "root/s0.t2")
	short, cancelShort := context.WithTimeout(ctx, 200*time.Millisecond)
	defer cancelShort()
	begin := time.Now()
	resp, err = c.ListNodes(short, &meshv1.ListNodesRequest{RunId: "r", SettleTimeout: durationpb.New(30 * time.Second)})
	if elapsed := time.Since(begin); elapsed > 2*time.Second {
		t.Fatalf("settle beyond the caller's deadline returned after %v", elapsed)
	}
	if status.Code(err) != codes.DeadlineExceeded && (err != nil || resp.GetSettled()) {
		t.Fatalf("settle beyond the caller's deadline: %v, %v; want DEADLINE_EXCEEDED or unsettled", resp, err)
	}
}
