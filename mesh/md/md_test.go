package md_test

import (
	"context"
	"net"
	"strconv"
	"testing"
	"time"

	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	"github.com/curfew-mesh/curfew/mesh/md"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// seen is what the server read from one call.
type seen struct {
	id       md.Identity
	raw      metadata.MD
	deadline time.Time
	hasDL    bool
}

// echo is a plain gRPC server (no curfew chain: this package is what the chain is built
// from) whose handler reads the incoming metadata with md.
type echo struct {
	meshv1.UnimplementedNodeReportServiceServer
	got chan seen
}

func (e *echo) ListNodes(ctx context.Context, _ *meshv1.ListNodesRequest) (*meshv1.ListNodesResponse, error) {
	raw, _ := metadata.FromIncomingContext(ctx)
	dl, ok := md.IncomingDeadline(ctx)
	e.got <- seen{id: md.FromIncoming(ctx), raw: raw.Copy(), deadline: dl, hasDL: ok}
	return &meshv1.ListNodesResponse{}, nil
}

func startEcho(t *testing.T) (meshv1.NodeReportServiceClient, chan seen) {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	e := &echo{got: make(chan seen, 1)}
	srv := grpc.NewServer()
	meshv1.RegisterNodeReportServiceServer(srv, e)
	done := make(chan struct{})
	go func() { defer close(done); _ = srv.Serve(lis) }()
	cc, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cc.Close(); srv.Stop(); <-done })
	return meshv1.NewNodeReportServiceClient(cc), e.got
}

func roundTrip(ctx context.Context, t *testing.T) seen {
	t.Helper()
	c, got := startEcho(t)
	cctx, cancel := context.WithTimeout(md.AppendOutgoing(ctx), 5*time.Second)
	defer cancel()
	if _, err := c.ListNodes(cctx, &meshv1.ListNodesRequest{}); err != nil {
		t.Fatal(err)
	}
	return <-got
}

func TestRoundTripIdentityAndDeadline(t *testing.T) {
	want := md.Identity{Tenant: "acme", RunID: "run-1", NodeID: "root/s0.t1", Pool: "overflow"}
	ctx, cancel := context.WithTimeout(md.WithIdentity(context.Background(), want), 3*time.Second)
	defer cancel()
	dl, _ := ctx.Deadline()

	s := roundTrip(ctx, t)
	if s.id != want {
		t.Errorf("FromIncoming = %+v, want %+v", s.id, want)
	}
	if got := s.raw.Get(md.Deadline); len(got) != 1 || got[0] != strconv.FormatInt(dl.UnixMilli(), 10) {
		t.Errorf("%s = %v, want [%d] (the ctx deadline in Unix ms)", md.Deadline, got, dl.UnixMilli())
	}
	if !s.hasDL || s.deadline.UnixMilli() != dl.UnixMilli() {
		t.Errorf("IncomingDeadline = %v, %v; want %v", s.deadline, s.hasDL, dl.Truncate(time.Millisecond))
	}
	for _, k := range []string{md.Tenant, md.RunID, md.NodeID, md.Pool} {
		if n := len(s.raw.Get(k)); n != 1 {
			t.Errorf("header %s sent %d times, want once", k, n)
		}
	}
}

func TestExplicitOutgoingValuesWin(t *testing.T) {
	ctx := md.WithIdentity(context.Background(), md.Identity{Tenant: "from-ctx", RunID: "run-ctx", NodeID: "root"})
	ctx = metadata.AppendToOutgoingContext(ctx, md.Tenant, "explicit", md.Attempt, "3", md.Deadline, "12345")
	ctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()

	s := roundTrip(ctx, t)
	if got := s.raw.Get(md.Tenant); len(got) != 1 || got[0] != "explicit" {
		t.Errorf("tenant header = %v, want only the explicit value", got)
	}
	if got := s.raw.Get(md.Deadline); len(got) != 1 || got[0] != "12345" {
		t.Errorf("deadline header = %v, want only the explicit value", got)
	}
	if s.id.Tenant != "explicit" || s.id.RunID != "run-ctx" || s.id.NodeID != "root" || s.id.Attempt != 3 {
		t.Errorf("identity = %+v, want explicit tenant and attempt, the rest from ctx", s.id)
	}
}

func TestDefaultTenantAndNoDeadline(t *testing.T) {
	c, got := startEcho(t)
	// No identity and no deadline on the context: nothing to stamp.
	if _, err := c.ListNodes(md.AppendOutgoing(context.Background()), &meshv1.ListNodesRequest{}); err != nil {
		t.Fatal(err)
	}
	s := <-got
	if s.id != (md.Identity{Tenant: md.DefaultTenant}) {
		t.Errorf("identity = %+v, want only the default tenant", s.id)
	}
	if s.hasDL || len(s.raw.Get(md.Deadline)) != 0 {
		t.Errorf("deadline header present without a ctx deadline: %v", s.raw.Get(md.Deadline))
	}
}

func TestAppendOutgoingWithoutIdentityKeepsContext(t *testing.T) {
	ctx := context.Background()
	if got := md.AppendOutgoing(ctx); got != ctx {
		t.Error("AppendOutgoing with nothing to add must return ctx itself")
	}
}

func TestWithNodeKeepsTenantAndRun(t *testing.T) {
	ctx := md.WithIdentity(context.Background(), md.Identity{Tenant: "t", RunID: "r", NodeID: "root", Attempt: 2})
	got := md.IdentityFrom(md.WithNode(ctx, "root/m0"))
	if got != (md.Identity{Tenant: "t", RunID: "r", NodeID: "root/m0", Attempt: 2}) {
		t.Errorf("WithNode identity = %+v", got)
	}
	if md.IdentityFrom(ctx).NodeID != "root" {
		t.Error("WithNode changed the parent context's identity")
	}
	if got := md.IdentityFrom(context.Background()); got != (md.Identity{}) {
		t.Errorf("IdentityFrom(empty) = %+v, want zero", got)
	}
}

func TestFromIncomingParsing(t *testing.T) {
	cases := []struct {
		name    string
		kv      []string
		attempt int
		dl      bool
	}{
		{"good", []string{md.Attempt, "4", md.Deadline, "1700000000000"}, 4, true},
		{"junk", []string{md.Attempt, "x", md.Deadline, "soon"}, 0, false},
		{"non-positive", []string{md.Attempt, "-1", md.Deadline, "0"}, 0, false},
		{"padded", []string{md.Tenant, "  acme ", md.Attempt, " 2 "}, 2, false},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			ctx := metadata.NewIncomingContext(context.Background(), metadata.Pairs(tc.kv...))
			id := md.FromIncoming(ctx)
			if id.Attempt != tc.attempt {
				t.Errorf("Attempt = %d, want %d", id.Attempt, tc.attempt)
			}
			if tc.name == "padded" && id.Tenant != "acme" {
				t.Errorf("Tenant = %q, want trimmed %q", id.Tenant, "acme")
			}
			dl, ok := md.IncomingDeadline(ctx)
			if ok != tc.dl {
				t.Errorf("IncomingDeadline ok = %v, want %v", ok, tc.dl)
			}
			if ok && dl.UnixMilli() != 1700000000000 {
				t.Errorf("IncomingDeadline = %v", dl)
			}
		})
	}
}
