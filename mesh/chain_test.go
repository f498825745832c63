package mesh_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
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
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/resolver"
	"google.golang.org/grpc/resolver/manual"
	"google.golang.org/grpc/status"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	"github.com/curfew-mesh/curfew/mesh"
	"github.com/curfew-mesh/curfew/mesh/deadline"
	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/mesh/meshtest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// probe serves a unary method (NodeReportService.ListNodes) and a server-streaming one
// (Health.Watch); both run fn on the handler's context and return its error.
type probe struct {
	meshv1.UnimplementedNodeReportServiceServer
	healthpb.UnimplementedHealthServer
	fn    func(ctx context.Context) error
	calls atomic.Int32
}

func (p *probe) ListNodes(ctx context.Context, _ *meshv1.ListNodesRequest) (*meshv1.ListNodesResponse, error) {
	p.calls.Add(1)
	if err := p.fn(ctx); err != nil {
		return nil, err
	}
	return &meshv1.ListNodesResponse{Settled: true}, nil
}

func (p *probe) Watch(_ *healthpb.HealthCheckRequest, ss grpc.ServerStreamingServer[healthpb.HealthCheckResponse]) error {
	p.calls.Add(1)
	if err := p.fn(ss.Context()); err != nil {
		return err
	}
	return ss.Send(&healthpb.HealthCheckResponse{Status: healthpb.HealthCheckResponse_SERVING})
}

// path is one way of calling a probe: unary or server-streaming.
type path struct {
	name   string
	method string
	call   func(ctx context.Context, cc *grpc.ClientConn) error
}

var paths = []path{
	{"unary", "/curfew.mesh.v1.NodeReportService/ListNodes", func(ctx context.Context, cc *grpc.ClientConn) error {
		_, err := meshv1.NewNodeReportServiceClient(cc).ListNodes(ctx, &meshv1.ListNodesRequest{RunId: "r"})
		return err
	}},
	{"stream", "/grpc.health.v1.Health/Watch", func(ctx context.Context, cc *grpc.ClientConn) error {
		st, err := healthpb.NewHealthClient(cc).Watch(ctx, &healthpb.HealthCheckRequest{})
		if err != nil {
			return err
		}
		if _, err := st.Recv(); err != nil {
			return err
		}
		if _, err := st.Recv(); !errors.Is(err, io.EOF) {
			return fmt.Errorf("second Recv: want EOF, got %w", err)
		}
		return nil
	}},
}

func serveProbe(t *testing.T, cfg mesh.ServerConfig, fn func(context.Context) error) (*probe, *grpc.ClientConn) {
	t.Helper()
	p := &probe{fn: fn}
	cc := meshtest.Serve(t, cfg, func(s *grpc.Server) {
		meshv1.RegisterNodeReportServiceServer(s, p)
		healthpb.RegisterHealthServer(s, p)
	})
	return p, cc
}

// deadlineProbe records the deadline the handler sees.
type deadlineProbe struct {
	mu  sync.Mutex
	dl  time.Time
	ok  bool
	hdr time.Time // curfew-deadline as received
}

func (d *deadlineProbe) fn(ctx context.Context) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.dl, d.ok = ctx.Deadline()
	d.hdr, _ = md.IncomingDeadline(ctx)
	return nil
}

func (d *deadlineProbe) get() (time.Time, bool) {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.dl, d.ok
}

var testPolicy = deadline.Policy{Default: 2 * time.Second, Max: 5 * time.Second}

func TestChainDeadlineDefaultAndCap(t *testing.T) {
	for _, p := range paths {
		t.Run(p.name, func(t *testing.T) {
			var d deadlineProbe
			_, cc := serveProbe(t, mesh.ServerConfig{Deadline: testPolicy}, d.fn)

			// No deadline: the server assigns Default from the instant it received the call.
			before := time.Now()
			if err := p.call(context.Background(), cc); err != nil {
				t.Fatalf("call without deadline: %v", err)
			}
			after := time.Now()
			dl, ok := d.get()
			if !ok {
				t.Fatal("handler saw no deadline; want the default")
			}
			if dl.Before(before.Add(testPolicy.Default)) || dl.After(after.Add(testPolicy.Default)) {
				t.Errorf("default deadline %v away from call start; want %v", dl.Sub(before), testPolicy.Default)
			}

			// 10h asked for: capped to Max from arrival.
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Hour)
			defer cancel()
			before = time.Now()
			if err := p.call(ctx, cc); err != nil {
				t.Fatalf("call with 10h deadline: %v", err)
			}
			after = time.Now()
			dl, _ = d.get()
			if dl.Before(before.Add(testPolicy.Max)) || dl.After(after.Add(testPolicy.Max)) {
				t.Errorf("capped deadline %v away from call start; want %v", dl.Sub(before), testPolicy.Max)
			}
		})
	}
}

func TestChainNeverExtendsClientDeadline(t *testing.T) {
	for _, p := range paths {
		t.Run(p.name, func(t *testing.T) {
			var d deadlineProbe
			_, cc := serveProbe(t, mesh.ServerConfig{Deadline: testPolicy}, d.fn)
			ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
			defer cancel()
			want, _ := ctx.Deadline()
			if err := p.call(ctx, cc); err != nil {
				t.Fatal(err)
			}
			dl, ok := d.get()
			if !ok {
				t.Fatal("handler saw no deadline")
			}
			// grpc-timeout alone would put it a transit delay later; the chain
			// reconciles it with curfew-deadline, so it is never later at all.
			if dl.After(want) {
				t.Errorf("handler deadline %v is after the client's %v (by %v)", dl, want, dl.Sub(want))
			}
			if dl.Before(want.Add(-time.Second)) {
				t.Errorf("handler deadline %v far earlier than the client's %v: the client's deadline was not used", dl, want)
			}
			d.mu.Lock()
			hdr := d.hdr
			d.mu.Unlock()
			if hdr.UnixMilli() != want.UnixMilli() {
				t.Errorf("curfew-deadline = %d, want the client's deadline %d (Unix ms)", hdr.UnixMilli(), want.UnixMilli())
			}
		})
	}
}

type identityProbe struct {
	mu  sync.Mutex
	ids []md.Identity
	dls []time.Time
}

func (r *identityProbe) record(ctx context.Context) {
	r.mu.Lock()
	defer r.mu.Unlock()
	dl, _ := ctx.Deadline()
	r.ids = append(r.ids, md.IdentityFrom(ctx))
	r.dls = append(r.dls, dl)
}

func (r *identityProbe) last(t *testing.T) (md.Identity, time.Time) {
	t.Helper()
	r.mu.Lock()
	defer r.mu.Unlock()
	if len(r.ids) == 0 {
		t.Fatal("handler not called")
	}
	return r.ids[len(r.ids)-1], r.dls[len(r.dls)-1]
}

func TestChainIdentityPropagatesOverTwoHops(t *testing.T) {
	for _, p := range paths {
		t.Run(p.name, func(t *testing.T) {
			var leaf, mid identityProbe
			_, leafCC := serveProbe(t, mesh.ServerConfig{}, func(ctx context.Context) error {
				leaf.record(ctx)
				return nil
			})
			_, midCC := serveProbe(t, mesh.ServerConfig{}, func(ctx context.Context) error {
				mid.record(ctx)
				// The handler does nothing for propagation but name the child node.
				return p.call(md.WithNode(ctx, md.IdentityFrom(ctx).NodeID+"/child"), leafCC)
			})

			ctx := md.WithIdentity(context.Background(), md.Identity{Tenant: "acme", RunID: "run-7", NodeID: "root"})
			ctx = metadata.AppendToOutgoingContext(ctx, md.RetryID, "rid-1")
			ctx, cancel := context.WithTimeout(ctx, 3*time.Second)
			defer cancel()
			clientDL, _ := ctx.Deadline()
			if err := p.call(ctx, midCC); err != nil {
				t.Fatal(err)
			}

			midID, midDL := mid.last(t)
			// The retry layer keeps the caller's retry-id and numbers the attempt.
			if want := (md.Identity{Tenant: "acme", RunID: "run-7", NodeID: "root", RetryID: "rid-1", Attempt: 1}); midID != want {
				t.Errorf("first hop identity = %+v, want %+v", midID, want)
			}
			leafID, leafDL := leaf.last(t)
			if leafID.Tenant != "acme" || leafID.RunID != "run-7" || leafID.NodeID != "root/child" {
				t.Errorf("second hop identity = %+v, want tenant acme, run run-7, node root/child", leafID)
			}
			if midDL.After(clientDL) || leafDL.After(midDL) {
				t.Errorf("deadline grew along the chain: client %v, mid %v, leaf %v", clientDL, midDL, leafDL)
			}

			// Without an identity the tenant is the default one.
			if err := p.call(context.Background(), leafCC); err != nil {
				t.Fatal(err)
			}
			if id, _ := leaf.last(t); id.Tenant != md.DefaultTenant || id.RunID != "" || id.NodeID != "" {
				t.Errorf("identity without metadata = %+v, want only tenant %q", id, md.DefaultTenant)
			}
		})
	}
}

func TestChainFastFail(t *testing.T) {
	for _, p := range paths {
		t.Run(p.name, func(t *testing.T) {
			cfg := mesh.ServerConfig{
				Deadline: deadline.Policy{Default: time.Second, Max: time.Minute},
				MinTime:  map[string]time.Duration{p.method: 2 * time.Second},
			}
			pr, cc := serveProbe(t, cfg, func(context.Context) error { return nil })

			ctx, cancel := context.WithTimeout(context.Background(), time.Second)
			defer cancel()
			err := p.call(ctx, cc)
			if status.Code(err) != codes.DeadlineExceeded || !strings.Contains(status.Convert(err).Message(), "no time left to start "+p.method) {
				t.Fatalf("call with 1s left and a 2s minimum: got %v, want DEADLINE_EXCEEDED \"no time left to start %s\"", err, p.method)
			}
			// Without a deadline the default (1s) is assigned first, and fast-fail sees it.
			err = p.call(context.Background(), cc)
			if status.Code(err) != codes.DeadlineExceeded || !strings.Contains(status.Convert(err).Message(), "no time left to start") {
				t.Fatalf("call without deadline, default below the minimum: got %v, want DEADLINE_EXCEEDED", err)
			}
			if n := pr.calls.Load(); n != 0 {
				t.Fatalf("handler ran %d times; a refused call must not reach it", n)
			}

			ctx, cancel = context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			if err := p.call(ctx, cc); err != nil {
				t.Fatalf("call with enough time left: %v", err)
			}
			if n := pr.calls.Load(); n != 1 {
				t.Fatalf("handler ran %d times, want 1", n)
			}
		})
	}
}

// syncBuffer is a bytes.Buffer safe for the server's goroutines to write to.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

func TestChainErrorMapping(t *testing.T) {
	const secret = "password=hunter2"
	cases := []struct {
		name    string
		err     func() error
		code    codes.Code
		msg     string // exact message on the wire
		logged  string // must appear in the server log ("" = nothing required)
		private string // must not appear on the wire
	}{
		{"plain error", func() error { return errors.New("db down: " + secret) }, codes.Internal, "internal error", secret, secret},
		{"panic", func() error { panic("boom: " + secret) }, codes.Internal, "internal error", secret, secret},
		{"canceled", func() error { return context.Canceled }, codes.Canceled, "cancelled", "", ""},
		{"wrapped deadline", func() error { return fmt.Errorf("step 3: %w", context.DeadlineExceeded) }, codes.DeadlineExceeded, "deadline exceeded", "", ""},
		{"status passes", func() error { return status.Error(codes.NotFound, "no such run") }, codes.NotFound, "no such run", "", ""},
	}
	for _, p := range paths {
		for _, tc := range cases {
			t.Run(p.name+"/"+tc.name, func(t *testing.T) {
				var logs syncBuffer
				var fail atomic.Bool
				fail.Store(true)
				cfg := mesh.ServerConfig{Logger: slog.New(slog.NewTextHandler(&logs, nil))}
				_, cc := serveProbe(t, cfg, func(context.Context) error {
					if fail.Load() {
						return tc.err()
					}
					return nil
				})
				ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
				defer cancel()
				err := p.call(ctx, cc)
				st := status.Convert(err)
				if st.Code() != tc.code || st.Message() != tc.msg {
					t.Fatalf("got %v %q, want %v %q", st.Code(), st.Message(), tc.code, tc.msg)
				}
				if tc.private != "" && strings.Contains(err.Error(), tc.private) {
					t.Errorf("internal text leaked to the caller: %v", err)
				}
				if tc.logged != "" && !strings.Contains(logs.String(), tc.logged) {
					t.Errorf("server log lacks %q; log:\n%s", tc.logged, logs.String())
				}
				// The server survives and serves the next call.
				fail.Store(false)
				if err := p.call(ctx, cc); err != nil {
					t.Fatalf("next call after %s: %v", tc.name, err)
				}
			})
		}
	}
}

func TestStatus(t *testing.T) {
	if out := mesh.Status(nil); out != nil {
		t.Errorf("Status(nil) = %v", out)
	}
	se := status.Error(codes.Unavailable, "breaker open")
	if out := mesh.Status(se); out != se { //nolint:errorlint // the very same error value must pass through
		t.Errorf("a status error must pass unchanged, got %v", out)
	}
	cases := []struct {
		err  error
		code codes.Code
	}{
		{context.Canceled, codes.Canceled},
		{fmt.Errorf("x: %w", context.Canceled), codes.Canceled},
		{context.DeadlineExceeded, codes.DeadlineExceeded},
		{fmt.Errorf("x: %w", context.DeadlineExceeded), codes.DeadlineExceeded},
		{errors.New("disk full"), codes.Internal},
	}
	for _, tc := range cases {
		out := mesh.Status(tc.err)
		if status.Code(out) != tc.code {
			t.Errorf("Status(%v) = %v, want %v", tc.err, out, tc.code)
		}
		if tc.code == codes.Internal && strings.Contains(out.Error(), tc.err.Error()) {
			t.Errorf("Status(%v) leaks the error text: %v", tc.err, out)
		}
		if got := mesh.Code(tc.err); got != tc.code {
			t.Errorf("Code(%v) = %v, want %v", tc.err, got, tc.code)
		}
	}
}

func TestChainReconcilesCurfewDeadline(t *testing.T) {
	for _, p := range paths {
		t.Run(p.name, func(t *testing.T) {
			var d deadlineProbe
			var logs syncBuffer
			cfg := mesh.ServerConfig{Deadline: testPolicy, Logger: slog.New(slog.NewTextHandler(&logs, nil))}
			_, cc := serveProbe(t, cfg, d.fn)
			ctx, cancel := context.WithTimeout(context.Background(), 4*time.Second)
			defer cancel()
			grpcDL, _ := ctx.Deadline()

			// An absolute deadline a little before the relative one: the same deadline seen
			// through transit delay; the handler gets the earlier, absolute one.
			abs := grpcDL.Add(-300 * time.Millisecond)
			near := metadata.AppendToOutgoingContext(ctx, md.Deadline, fmt.Sprint(abs.UnixMilli()))
			if err := p.call(near, cc); err != nil {
				t.Fatal(err)
			}
			if dl, _ := d.get(); dl.UnixMilli() != abs.UnixMilli() || dl.After(abs) {
				t.Errorf("handler deadline %v, want curfew-deadline %v", dl, abs.Truncate(time.Millisecond))
			}
			if strings.Contains(logs.String(), "skew") {
				t.Errorf("a transit-sized difference was logged as skew:\n%s", logs.String())
			}

			// Far earlier: a skewed clock; grpc-timeout stays authoritative and it is logged.
			skewed := metadata.AppendToOutgoingContext(ctx, md.Deadline, fmt.Sprint(grpcDL.Add(-3*time.Second).UnixMilli()))
			if err := p.call(skewed, cc); err != nil {
				t.Fatal(err)
			}
			if dl, _ := d.get(); dl.Before(grpcDL.Add(-time.Second)) {
				t.Errorf("handler deadline %v before the grpc deadline %v: a skewed curfew-deadline was trusted", dl, grpcDL)
			}
			if !strings.Contains(logs.String(), "clocks may be skewed") {
				t.Errorf("skew not logged:\n%s", logs.String())
			}
		})
	}
}

// The handler's context ends at the deadline it reports, the curfew-deadline, and not
// at the later gRPC deadline: with DeadlineExceeded when the curfew-deadline lies well
// before the caller's own deadline; when the two are the same deadline (differing by the
// millisecond truncation and transit only) the caller's RST_STREAM can win the race
// against the handler's timer on a loaded machine, so there it may end Canceled, but
// never before its deadline.
func TestChainDeadlineEndsCall(t *testing.T) {
	for _, p := range paths {
		t.Run(p.name, func(t *testing.T) {
			type seen struct {
				dl    time.Time
				ended time.Time
				err   error
			}
			got := make(chan seen, 1)
			_, cc := serveProbe(t, mesh.ServerConfig{Deadline: testPolicy, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))}, func(ctx context.Context) error {
				dl, _ := ctx.Deadline()
				<-ctx.Done()
				got <- seen{dl, time.Now(), ctx.Err()}
				return ctx.Err()
			})
			for _, c := range []struct {
				name  string
				early time.Duration // curfew-deadline before the client's deadline
			}{{"well before", 300 * time.Millisecond}, {"same deadline", 0}} {
				ctx, cancel := context.WithTimeout(context.Background(), 600*time.Millisecond)
				grpcDL, _ := ctx.Deadline()
				abs := grpcDL.Add(-c.early)
				_ = p.call(metadata.AppendToOutgoingContext(ctx, md.Deadline, fmt.Sprint(abs.UnixMilli())), cc)
				cancel()
				s := <-got
				abs = abs.Truncate(time.Millisecond)
				if !s.dl.Equal(abs) {
					t.Errorf("%s: handler deadline %v, want curfew-deadline %v", c.name, s.dl, abs)
				}
				switch {
				case errors.Is(s.err, context.DeadlineExceeded):
				case c.early == 0 && errors.Is(s.err, context.Canceled) && !s.ended.Before(abs):
					// the caller's cancel at the same deadline arrived first
				default:
					t.Errorf("%s: handler context ended with %v at %v after its deadline, want deadline exceeded", c.name, s.err, s.ended.Sub(abs))
				}
				// Never before the deadline it reports, after it by a loaded machine's delay.
				if s.ended.Before(abs) {
					t.Errorf("%s: ended %v before its deadline %v", c.name, abs.Sub(s.ended), abs)
				}
				if late := s.ended.Sub(abs); late > 100*time.Millisecond {
					t.Errorf("%s: ended %v after its deadline (the gRPC deadline is %v after it)", c.name, late, grpcDL.Sub(abs))
				}
			}
		})
	}
}

// ServerConfig.Authorize refuses a call before the deadline layer and the handler, with
// the status it returns, on both paths; it sees each call's method.
func TestChainAuthorize(t *testing.T) {
	for _, p := range paths {
		t.Run(p.name, func(t *testing.T) {
			var seen atomic.Value
			cfg := mesh.ServerConfig{
				// A minimum no call meets: were the deadline layers first, they would refuse.
				MinTime: map[string]time.Duration{p.method: time.Hour},
				Authorize: func(_ context.Context, method string) error {
					seen.Store(method)
					return status.Errorf(codes.PermissionDenied, "x may not call %s", method)
				},
			}
			pr, cc := serveProbe(t, cfg, func(context.Context) error { return nil })
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			err := p.call(ctx, cc)
			if status.Code(err) != codes.PermissionDenied || !strings.Contains(status.Convert(err).Message(), p.method) {
				t.Fatalf("call: %v, want PERMISSION_DENIED naming %s", err, p.method)
			}
			if got, _ := seen.Load().(string); got != p.method {
				t.Errorf("Authorize saw method %q, want %q", got, p.method)
			}
			if n := pr.calls.Load(); n != 0 {
				t.Errorf("handler ran %d times; a refused call must not reach it", n)
			}
		})
	}
}

// ServerConfig.Authenticate replaces the claimed tenant by the one it returns, which the
// handler sees, and refuses the call with its status before the handler; it is given the
// claim (md.DefaultTenant when the call names none).
func TestChainAuthenticate(t *testing.T) {
	for _, p := range paths {
		t.Run(p.name, func(t *testing.T) {
			var claims, seen atomic.Value
			cfg := mesh.ServerConfig{
				Authenticate: func(ctx context.Context, method, claimed string) (string, error) {
					claims.Store(claimed)
					if len(metadata.ValueFromIncomingContext(ctx, "authorization")) == 0 {
						return "", status.Error(codes.Unauthenticated, "missing API key")
					}
					return "from-key", nil
				},
			}
			pr, cc := serveProbe(t, cfg, func(ctx context.Context) error {
				seen.Store(md.IdentityFrom(ctx).Tenant)
				return nil
			})
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			if err := p.call(ctx, cc); status.Code(err) != codes.Unauthenticated {
				t.Fatalf("call without a key: %v, want UNAUTHENTICATED", err)
			}
			if got, _ := claims.Load().(string); got != md.DefaultTenant {
				t.Errorf("claim without a header = %q, want %q", got, md.DefaultTenant)
			}
			if n := pr.calls.Load(); n != 0 {
				t.Fatalf("handler ran %d times; a refused call must not reach it", n)
			}
			forged := metadata.AppendToOutgoingContext(ctx, md.Tenant, "victim", "authorization", "Bearer k")
			if err := p.call(forged, cc); err != nil {
				t.Fatal(err)
			}
			if got, _ := claims.Load().(string); got != "victim" {
				t.Errorf("claim = %q, want the header's victim", got)
			}
			if got, _ := seen.Load().(string); got != "from-key" {
				t.Errorf("handler's tenant = %q, want from-key: the claim must not reach it", got)
			}
		})
	}
}

// DialOptions' connections balance calls over every address the target resolves to (a
// headless Service's pods), not, as gRPC's default pick_first would, all to the first.
func TestDialOptionsBalanceOverEveryAddress(t *testing.T) {
	var hits [2]atomic.Int32
	var addrs []resolver.Address
	for i := range hits {
		var lc net.ListenConfig
		lis, err := lc.Listen(t.Context(), "tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		srv := grpc.NewServer()
		healthpb.RegisterHealthServer(srv, &countingHealth{n: &hits[i]})
		go func() { _ = srv.Serve(lis) }()
		t.Cleanup(srv.Stop)
		addrs = append(addrs, resolver.Address{Addr: lis.Addr().String()})
	}
	r := manual.NewBuilderWithScheme("replicas")
	r.InitialState(resolver.State{Addresses: addrs})
	cc, err := grpc.NewClient(r.Scheme()+":///svc", append(mesh.DialOptions(mesh.ClientConfig{}),
		grpc.WithTransportCredentials(insecure.NewCredentials()), grpc.WithResolvers(r))...)
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	call := func() {
		if _, err := healthpb.NewHealthClient(cc).Check(ctx, &healthpb.HealthCheckRequest{}); err != nil {
			t.Fatal(err)
		}
	}
	// round_robin picks only among connected addresses: on a loaded machine the second may
	// connect after the first has taken a few calls. pick_first would never reach it.
	for hits[0].Load() == 0 || hits[1].Load() == 0 {
		call()
	}
	hits[0].Store(0)
	hits[1].Store(0)
	for range 40 {
		call()
	}
	if a, b := hits[0].Load(), hits[1].Load(); a+b != 40 || a < 10 || b < 10 {
		t.Fatalf("calls per replica %d and %d, want both well used (round_robin)", a, b)
	}
}

type countingHealth struct {
	healthpb.UnimplementedHealthServer
	n *atomic.Int32
}

func (h *countingHealth) Check(context.Context, *healthpb.HealthCheckRequest) (*healthpb.HealthCheckResponse, error) {
	h.n.Add(1)
	return &healthpb.HealthCheckResponse{Status: healthpb.HealthCheckResponse_SERVING}, nil
}
