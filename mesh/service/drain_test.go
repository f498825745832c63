package service_test

import (
	"context"
	"net"
	"net/http"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	toolrunnerv1 "github.com/curfew-mesh/curfew/gen/curfew/toolrunner/v1"
	"github.com/curfew-mesh/curfew/mesh"
	"github.com/curfew-mesh/curfew/mesh/service"
)

// quick is a ToolRunnerService whose Execute answers at once.
type quick struct {
	toolrunnerv1.UnimplementedToolRunnerServiceServer
}

func (quick) Execute(req *toolrunnerv1.ExecuteRequest, ss grpc.ServerStreamingServer[toolrunnerv1.ExecuteResponse]) error {
	return ss.Send(&toolrunnerv1.ExecuteResponse{Event: &toolrunnerv1.ExecuteResponse_Result{Result: &toolrunnerv1.ExecuteResult{OutputJson: `"` + req.GetName() + `"`}}})
}

// startHooked is start with a setup step between New and Serve (hooks).
func startHooked(t *testing.T, o service.Options, register func(*grpc.Server), setup func(*service.Runtime)) *running {
	t.Helper()
	rt, err := service.New(context.Background(), o, nil)
	if err != nil {
		t.Fatal(err)
	}
	if register != nil {
		register(rt.Server)
	}
	if setup != nil {
		setup(rt)
	}
	cc, err := service.Dial(rt.Addr(), nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx, stop := context.WithCancel(context.Background())
	r := &running{rt: rt, cc: cc, stop: stop, done: make(chan error, 1), admin: "http://" + rt.AdminAddr()}
	go func() { r.done <- rt.Serve(ctx) }()
	t.Cleanup(func() {
		stop()
		select {
		case err := <-r.done:
			if err != nil {
				t.Errorf("Serve = %v", err)
			}
		case <-time.After(o.StopBound() + 5*time.Second): // its bound, with margin for a loaded machine
			t.Error("Serve did not return within its stop bound")
		}
		_ = cc.Close()
	})
	return r
}

func healthOf(ctx context.Context, cc *grpc.ClientConn) (healthpb.HealthCheckResponse_ServingStatus, error) {
	cctx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	resp, err := healthpb.NewHealthClient(cc).Check(cctx, &healthpb.HealthCheckRequest{})
	return resp.GetStatus(), err
}

func executeOnce(ctx context.Context, cc *grpc.ClientConn, name string) (string, error) {
	cctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	st, err := toolrunnerv1.NewToolRunnerServiceClient(cc).Execute(cctx, &toolrunnerv1.ExecuteRequest{Name: name})
	if err != nil {
		return "", err
	}
	resp, err := st.Recv()
	return resp.GetResult().GetOutputJson(), err
}

// During the drain delay health answers NOT_SERVING (on a connection made before the stop
// and on one made during it) while calls that still arrive are served; the OnDrain
// functions ran first, in order, with health already NOT_SERVING and StopDeadline set.
func TestDrainDelayServesWhileNotServing(t *testing.T) {
	o := validOptions()
	o.DrainDelay, o.ShutdownGrace = 1500*time.Millisecond, time.Second
	var (
		mu      sync.Mutex
		order   []int
		inHook  healthpb.HealthCheckResponse_ServingStatus
		stopBy  time.Time
		stopped time.Time
	)
	r := startHooked(t, o, func(s *grpc.Server) { toolrunnerv1.RegisterToolRunnerServiceServer(s, quick{}) }, func(rt *service.Runtime) {
		rt.OnDrain(func() {
			resp, _ := rt.Health.Check(context.Background(), &healthpb.HealthCheckRequest{})
			mu.Lock()
			defer mu.Unlock()
			order, inHook, stopBy = append(order, 1), resp.GetStatus(), rt.StopDeadline()
		})
		rt.OnDrain(func() {
			mu.Lock()
			defer mu.Unlock()
			order = append(order, 2)
		})
		rt.OnStop(func() {
			mu.Lock()
			defer mu.Unlock()
			stopped = time.Now()
		})
	})
	ctx := context.Background()
	// A plain client (one that Kubernetes endpoints route), connected before the stop.
	plain, err := grpc.NewClient(r.rt.Addr(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer plain.Close()
	if st, err := healthOf(ctx, plain); err != nil || st != healthpb.HealthCheckResponse_SERVING {
		t.Fatalf("health before the stop = %v, %v", st, err)
	}
	if !r.rt.StopDeadline().IsZero() {
		t.Fatal("StopDeadline set before the stop began")
	}

	begin := time.Now()
	r.stop()
	for {
		st, err := healthOf(ctx, plain)
		if err == nil && st == healthpb.HealthCheckResponse_NOT_SERVING {
			break
		}
		if err != nil || time.Since(begin) > 500*time.Millisecond {
			t.Fatalf("health %v after the stop began = %v, %v; want NOT_SERVING at once", time.Since(begin), st, err)
		}
		time.Sleep(5 * time.Millisecond)
	}
	if code, _ := get(t, r.admin+"/readyz"); code != http.StatusServiceUnavailable {
		t.Errorf("/readyz during the drain = %d, want 503", code)
	}
	// Calls still arriving during the delay are served, on the old connection and on a
	// new one: the listener is open.
	if out, err := executeOnce(ctx, plain, "old"); err != nil || out != `"old"` {
		t.Errorf("call during the drain on an open connection = %q, %v; want served", out, err)
	}
	fresh, err := grpc.NewClient(r.rt.Addr(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer fresh.Close()
	if st, err := healthOf(ctx, fresh); err != nil || st != healthpb.HealthCheckResponse_NOT_SERVING {
		t.Errorf("health on a connection made during the drain = %v, %v; want NOT_SERVING", st, err)
	}
	if out, err := executeOnce(ctx, fresh, "new"); err != nil || out != `"new"` {
		t.Errorf("call during the drain on a new connection = %q, %v; want served", out, err)
	}
	if d := time.Since(begin); d >= o.DrainDelay {
		t.Fatalf("the checks took %v, beyond the drain delay %v: the machine is too slow for this test", d, o.DrainDelay)
	}

	select {
	case err := <-r.done:
		elapsed := time.Since(begin)
		if err != nil {
			t.Errorf("Serve = %v", err)
		}
		// No call in flight: the stop ends right after the drain delay.
		if elapsed < o.DrainDelay || elapsed > o.DrainDelay+o.ShutdownGrace+service.StopFlush {
			t.Errorf("Serve returned %v after the stop began, want between the drain delay %v and the bound %v",
				elapsed, o.DrainDelay, o.StopBound())
		}
		r.done <- nil
	case <-time.After(o.StopBound() + 3*time.Second):
		t.Fatal("Serve did not return within its bound")
	}
	mu.Lock()
	defer mu.Unlock()
	if len(order) != 2 || order[0] != 1 || order[1] != 2 {
		t.Errorf("OnDrain functions ran as %v, want [1 2]", order)
	}
	if inHook != healthpb.HealthCheckResponse_NOT_SERVING {
		t.Errorf("health in the OnDrain function = %v, want NOT_SERVING already", inHook)
	}
	want := begin.Add(o.DrainDelay + o.ShutdownGrace)
	if d := stopBy.Sub(want); d < -100*time.Millisecond || d > time.Second {
		t.Errorf("StopDeadline in the OnDrain function = %v, want about %v", stopBy, want)
	}
	if stopped.IsZero() || stopped.Sub(begin) < o.DrainDelay {
		t.Errorf("OnStop ran %v after the stop began, want after the drain delay", stopped.Sub(begin))
	}
	// After the stop the listener is closed.
	if _, err := executeOnce(ctx, fresh, "late"); status.Code(err) != codes.Unavailable {
		t.Errorf("call after the stop = %v, want UNAVAILABLE", err)
	}
}

// A call that never ends does not stretch the stop beyond DrainDelay + ShutdownGrace +
// StopFlush: it is cancelled at StopDeadline, and the OnStop functions run after it.
func TestStopBoundHoldsWithACallThatNeverEnds(t *testing.T) {
	o := validOptions()
	o.DrainDelay, o.ShutdownGrace = 400*time.Millisecond, 600*time.Millisecond
	h := &hang{started: make(chan struct{})}
	var hookAt, hookDeadline time.Time
	r := startHooked(t, o, func(s *grpc.Server) { toolrunnerv1.RegisterToolRunnerServiceServer(s, h) }, func(rt *service.Runtime) {
		rt.OnStop(func() { hookAt, hookDeadline = time.Now(), rt.StopDeadline() })
	})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	st, err := toolrunnerv1.NewToolRunnerServiceClient(r.cc).Execute(ctx, &toolrunnerv1.ExecuteRequest{Name: "hang"})
	if err != nil {
		t.Fatal(err)
	}
	select {
	case <-h.started:
	case <-time.After(5 * time.Second):
		t.Fatal("handler did not start")
	}
	begin := time.Now()
	r.stop()
	select {
	case err := <-r.done:
		elapsed := time.Since(begin)
		if err != nil {
			t.Errorf("Serve = %v", err)
		}
		if elapsed < o.DrainDelay+o.ShutdownGrace {
			t.Errorf("Serve returned after %v, before drain delay + grace %v with a call in flight", elapsed, o.DrainDelay+o.ShutdownGrace)
		}
		// The bound, plus a generous margin for a loaded machine.
		if limit := o.StopBound() + time.Second; elapsed > limit {
			t.Errorf("Serve returned after %v, beyond the bound %v (+1s)", elapsed, o.StopBound())
		}
		r.done <- nil
	case <-time.After(o.StopBound() + 5*time.Second):
		t.Fatal("Serve did not return with a handler that never ends")
	}
	if !h.cancelled.Load() {
		t.Error("the call was not cancelled at the stop deadline")
	}
	if hookAt.IsZero() || hookAt.Before(hookDeadline.Add(-50*time.Millisecond)) {
		t.Errorf("OnStop ran at %v, want after the server stopped at its deadline %v", hookAt, hookDeadline)
	}
	_, err = st.Recv()
	if c := status.Code(err); c != codes.Unavailable && c != codes.Canceled {
		t.Errorf("client saw %v, want UNAVAILABLE or CANCELED", err)
	}
}

// --max-connection-age closes each connection gracefully after about the age, with no call
// failing: the client connects again (re-resolving its target, a headless Service's new
// replicas) and its calls go on. The client dials through a counting dialer, since with
// round_robin (mesh.DialOptions) it reconnects at once and its channel need not pass
// through IDLE where a test could see it.
func TestMaxConnectionAgeCyclesConnectionsWithoutFailingCalls(t *testing.T) {
	o := validOptions()
	o.MaxConnectionAge = time.Second
	r := startHooked(t, o, func(s *grpc.Server) { toolrunnerv1.RegisterToolRunnerServiceServer(s, quick{}) }, nil)
	var dials atomic.Int32
	var d net.Dialer
	cc, err := grpc.NewClient(r.rt.Addr(), append(mesh.DialOptions(mesh.ClientConfig{}),
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithContextDialer(func(ctx context.Context, addr string) (net.Conn, error) {
			dials.Add(1)
			return d.DialContext(ctx, "tcp", addr)
		}))...)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = cc.Close() }()
	ctx := t.Context()
	// Calls every 50 ms until the client has connected three times (two ages of 1 s
	// ± 10 %), for at most 15 s; every one must succeed.
	until := time.Now().Add(15 * time.Second)
	calls := 0
	for dials.Load() < 3 {
		if time.Now().After(until) {
			t.Fatalf("%d connections after 15 s with a 1 s max age (%d calls)", dials.Load(), calls)
		}
		name := "call-" + strconv.Itoa(calls)
		if out, err := executeOnce(ctx, cc, name); err != nil || out != `"`+name+`"` {
			t.Fatalf("call %d while connections cycle: %q, %v", calls, out, err)
		}
		calls++
		time.Sleep(50 * time.Millisecond)
	}
	t.Logf("%d calls over %d connections", calls, dials.Load())
}
