package breaker_test

import (
	"context"
	"errors"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/resolver"
	"google.golang.org/grpc/resolver/manual"
	"google.golang.org/grpc/status"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	toolrunnerv1 "github.com/curfew-mesh/curfew/gen/curfew/toolrunner/v1"
	"github.com/curfew-mesh/curfew/mesh"
	"github.com/curfew-mesh/curfew/mesh/breaker"
	"github.com/curfew-mesh/curfew/mesh/meshtest"
	"github.com/curfew-mesh/curfew/mesh/retry"
)

// replica is one replica of a service: a bare gRPC server whose Check answers at once,
// or, while hold is set, waits until its call ends (as a long call does).
type endpoint struct {
	srv    *grpc.Server
	addr   string
	hold   atomic.Bool
	held   atomic.Int64 // calls waiting now
	served atomic.Int64 // calls answered at once
}

// bothAnswer makes calls until each replica has answered one, so that the breaker has
// seen both up: round_robin picks only the replicas it has connected to, and at first
// that may be one of them alone.
func bothAnswer(ctx context.Context, t *testing.T, cc *grpc.ClientConn, a, b *endpoint) {
	t.Helper()
	for a.served.Load() == 0 || b.served.Load() == 0 {
		if err := check(ctx, cc); err != nil {
			t.Fatal(err)
		}
	}
}

func startEndpoint(t *testing.T) *endpoint {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	r := &endpoint{srv: grpc.NewServer(), addr: lis.Addr().String()}
	crashed := make(chan struct{})
	healthpb.RegisterHealthServer(r.srv, &health{fn: func(context.Context, int64) error {
		if r.hold.Load() {
			r.held.Add(1)
			defer r.held.Add(-1)
			<-crashed // a crashed process answers nothing, not even its cancellation
			return errors.New("crashed")
		}
		r.served.Add(1)
		return nil
	}})
	go func() { _ = r.srv.Serve(lis) }()
	t.Cleanup(r.srv.Stop)
	t.Cleanup(func() { close(crashed) }) // (runs first)
	return r
}

// crashWithCallsInFlight makes every call r receives wait, sends calls until at least n
// wait on r, then stops r: the calls in flight on it fail as a crash fails them. It
// returns once every call sent has returned.
func crashWithCallsInFlight(t *testing.T, cc *grpc.ClientConn, r *endpoint, n int64) {
	t.Helper()
	r.hold.Store(true)
	var wg sync.WaitGroup
	ctx := timeout(t, 10*time.Second)
	for r.held.Load() < n {
		wg.Go(func() { _ = check(ctx, cc) })
		time.Sleep(time.Millisecond)
		if ctx.Err() != nil {
			t.Fatalf("only %d calls wait on the replica", r.held.Load())
		}
	}
	r.srv.Stop()
	wg.Wait()
}

// One replica of two crashing with calls in flight does not open the service's breaker:
// its calls' UNAVAILABLE is counted as the replica's (endpoint_failure), the service is
// still served by the other. When the other crashes too, the breaker opens.
func TestOneReplicaDownDoesNotOpenTheServicesBreaker(t *testing.T) {
	a, b := startEndpoint(t), startEndpoint(t)
	reg := prometheus.NewRegistry()
	set := breaker.NewSet(breaker.Config{ConsecutiveFailures: 3, OpenTimeout: time.Hour}, reg)
	cc := dialReplicas(t, set, noRetries, []resolver.Address{{Addr: a.addr}, {Addr: b.addr}})
	ctx := timeout(t, 10*time.Second)
	bothAnswer(ctx, t, cc, a, b)

	crashWithCallsInFlight(t, cc, b, 6)
	if st := set.Get("svc").State(); st != breaker.StateClosed {
		t.Fatalf("the breaker is %s after one replica of two crashed, want closed", st)
	}
	if n := metric(t, reg, "curfew_circuit_breaker_calls_total", map[string]string{"target": "svc", "outcome": "endpoint_failure"}); n < 6 {
		t.Errorf("%v endpoint failures counted, want at least the 6 calls cut", n)
	}
	if n := metric(t, reg, "curfew_circuit_breaker_calls_total", map[string]string{"target": "svc", "outcome": "failure"}); n != 0 {
		t.Errorf("%v failures counted against the service, want 0", n)
	}
	for range 10 { // the survivor serves every call
		if err := check(ctx, cc); err != nil {
			t.Fatalf("a call after the crash: %v", err)
		}
	}

	crashWithCallsInFlight(t, cc, a, 3)
	waitState(t, set.Get("svc"), breaker.StateOpen, 5*time.Second)
	if err := check(ctx, cc); status.Code(err) != codes.Unavailable {
		t.Fatalf("a call with both replicas down: %v, want UNAVAILABLE", err)
	}
}

// A half-open probe that is a long stream closes the breaker at its first message, not
// at its end: while a probe is out every other call is refused, and a stream may last
// as long as its caller's deadline.
func TestLongStreamProbeClosesAtItsFirstMessage(t *testing.T) {
	var failing atomic.Bool
	failing.Store(true)
	tools := meshtest.NewTools(map[string]meshtest.ToolFunc{
		"long": func(ctx context.Context, _ string) (string, error) {
			if failing.Load() {
				return "", status.Error(codes.Unavailable, "down")
			}
			if err := meshtest.SendEvent(ctx, &meshv1.NodeEvent{}); err != nil {
				return "", err
			}
			<-ctx.Done() // runs until its caller ends it
			return "", ctx.Err()
		},
	})
	reg := prometheus.NewRegistry()
	set := breaker.NewSet(breaker.Config{ConsecutiveFailures: 1, OpenTimeout: 50 * time.Millisecond, Jitter: -1}, reg)
	cc := dial(t, serveBare(t, nil, tools), set, noRetries)
	tr := toolrunnerv1.NewToolRunnerServiceClient(cc)
	open := func(ctx context.Context) (grpc.ServerStreamingClient[toolrunnerv1.ExecuteResponse], error) {
		return tr.Execute(ctx, &toolrunnerv1.ExecuteRequest{Name: "long"})
	}
	st, err := open(timeout(t, 10*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := st.Recv(); status.Code(err) != codes.Unavailable {
		t.Fatalf("first stream: %v, want UNAVAILABLE", err)
	}
	b := set.Get("svc")
	waitState(t, b, breaker.StateHalfOpen, 5*time.Second)
	failing.Store(false)

	ctx, cancel := context.WithCancel(timeout(t, 10*time.Second))
	defer cancel()
	probe, err := open(ctx)
	if err != nil {
		t.Fatalf("the probe: %v", err)
	}
	if _, err := probe.Recv(); err != nil {
		t.Fatalf("the probe's first message: %v", err)
	}
	if st := b.State(); st != breaker.StateClosed {
		t.Fatalf("the breaker is %s after the probe's first message, want closed", st)
	}
	other, err := open(ctx) // not refused while the probe still runs
	if err != nil {
		t.Fatalf("a call while the probe stream still runs: %v", err)
	}
	if _, err := other.Recv(); err != nil {
		t.Fatalf("a call while the probe stream still runs: %v", err)
	}
	cancel()
	if _, err := probe.Recv(); status.Code(err) != codes.Canceled {
		t.Fatalf("the probe after its cancel: %v", err)
	}
	if n := metric(t, reg, "curfew_circuit_breaker_calls_total", map[string]string{"target": "svc", "outcome": "success"}); n != 1 {
		t.Errorf("%v successes, want 1: the probe, counted once", n)
	}
}

// watcher is a Health service whose Watch sends one answer and then runs until its
// caller cancels it, or, with crashes, until crashed is closed: a crashed process answers
// nothing, not even a cancellation.
type watcher struct {
	healthpb.UnimplementedHealthServer
	crashes bool
	crashed chan struct{}
	open    atomic.Int64 // streams it has received
}

func (w *watcher) Watch(_ *healthpb.HealthCheckRequest, ss grpc.ServerStreamingServer[healthpb.HealthCheckResponse]) error {
	w.open.Add(1)
	if err := ss.Send(&healthpb.HealthCheckResponse{Status: healthpb.HealthCheckResponse_SERVING}); err != nil {
		return err
	}
	if w.crashes {
		<-w.crashed
		return errors.New("crashed")
	}
	<-ss.Context().Done()
	return ss.Context().Err()
}

// A client whose only calls to the surviving replica are streams still open knows that
// replica is up: a stream opened on it is enough. So the other replica's crash, cutting
// its streams, does not open the breaker, even before any call to the survivor ended.
func TestOpenStreamsShowTheSurvivorIsUp(t *testing.T) {
	crashed := make(chan struct{})
	var addrs []resolver.Address
	var servers []*grpc.Server
	var watchers []*watcher
	for i := range 2 {
		lis, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		s, w := grpc.NewServer(), &watcher{crashes: i == 0, crashed: crashed}
		watchers = append(watchers, w)
		healthpb.RegisterHealthServer(s, w)
		go func() { _ = s.Serve(lis) }()
		t.Cleanup(s.Stop)
		servers = append(servers, s)
		addrs = append(addrs, resolver.Address{Addr: lis.Addr().String()})
	}
	t.Cleanup(func() { close(crashed) }) // (before the servers' Stop)
	reg := prometheus.NewRegistry()
	set := breaker.NewSet(breaker.Config{ConsecutiveFailures: 2, OpenTimeout: time.Hour}, reg)
	cc := dialReplicas(t, set, noRetries, addrs)
	hc := healthpb.NewHealthClient(cc)
	ctx, cancel := context.WithCancel(timeout(t, 10*time.Second))
	defer cancel()
	// Streams until each replica has at least three (round robin, once both are
	// connected).
	var streams []grpc.ServerStreamingClient[healthpb.HealthCheckResponse]
	for watchers[0].open.Load() < 3 || watchers[1].open.Load() < 3 {
		if len(streams) == 100 {
			t.Fatalf("100 streams, and the replicas have %d and %d", watchers[0].open.Load(), watchers[1].open.Load())
		}
		st, err := hc.Watch(ctx, &healthpb.HealthCheckRequest{})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := st.Recv(); err != nil {
			t.Fatal(err)
		}
		streams = append(streams, st)
	}
	onCrashing := int(watchers[0].open.Load())
	ends := make(chan error, len(streams))
	for _, st := range streams {
		go func() { _, err := st.Recv(); ends <- err }()
	}
	servers[0].Stop()
	for range onCrashing { // the crash cuts its streams
		select {
		case err := <-ends:
			if status.Code(err) != codes.Unavailable {
				t.Fatalf("a stream cut by the crash: %v, want UNAVAILABLE", err)
			}
		case <-time.After(5 * time.Second):
			t.Fatal("the crash did not end its streams")
		}
	}
	if n := metric(t, reg, "curfew_circuit_breaker_calls_total", map[string]string{"target": "svc", "outcome": "endpoint_failure"}); int(n) != onCrashing {
		t.Errorf("%v endpoint failures, want the %d streams the crash cut", n, onCrashing)
	}
	if st := set.Get("svc").State(); st != breaker.StateClosed {
		t.Fatalf("the breaker is %s, want closed: the survivor's streams are open", st)
	}
	cancel()
	for range len(streams) - onCrashing {
		if err := <-ends; status.Code(err) != codes.Canceled {
			t.Errorf("a stream on the survivor, cancelled: %v, want CANCELED", err)
		}
	}
}

// dialReplicas connects to addrs as one service "svc", round robin, with the mesh client
// chain: rc's retries (Target "svc") and the set's breaker.
func dialReplicas(t *testing.T, set *breaker.Set, rc retry.Config, addrs []resolver.Address) *grpc.ClientConn {
	t.Helper()
	res := manual.NewBuilderWithScheme("replicas")
	res.InitialState(resolver.State{Addresses: addrs})
	rc.Target, rc.Logger = "svc", quiet()
	opts := append(mesh.DialOptions(mesh.ClientConfig{Retry: rc, Breakers: set}),
		grpc.WithTransportCredentials(insecure.NewCredentials()), grpc.WithResolvers(res),
		grpc.WithDefaultServiceConfig(`{"loadBalancingConfig": [{"round_robin": {}}]}`))
	cc, err := grpc.NewClient(res.Scheme()+":///svc", opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cc.Close() })
	return cc
}

// refusingWindow is a retry window held by another replica for good.
type refusingWindow struct{ asked atomic.Int64 }

func (w *refusingWindow) AllowRetry(context.Context, string) error {
	w.asked.Add(1)
	return errors.New("other replicas hold the target's retry windows")
}

// Calls cut by one replica's crash are retried on the other without a retry window: the
// breaker notes the endpoint failure on the attempt, and the retry layer above needs no
// window for it. A failure of the whole target still does.
func TestAReplicasCrashIsRetriedWithoutAWindow(t *testing.T) {
	a, b := startEndpoint(t), startEndpoint(t)
	set := breaker.NewSet(breaker.Config{ConsecutiveFailures: 100, OpenTimeout: time.Hour}, nil)
	w := &refusingWindow{}
	rc := retry.Config{Window: w, Default: retry.Policy{MaxAttempts: 3, Base: time.Millisecond, Cap: time.Millisecond}}
	cc := dialReplicas(t, set, rc, []resolver.Address{{Addr: a.addr}, {Addr: b.addr}})
	ctx := timeout(t, 10*time.Second)
	bothAnswer(ctx, t, cc, a, b)

	// Calls held on b, then b crashes: each is retried, on a, and succeeds.
	b.hold.Store(true)
	errs := make(chan error, 64)
	var wg sync.WaitGroup
	sent := 0
	for b.held.Load() < 4 {
		wg.Go(func() { errs <- check(ctx, cc) })
		sent++
		time.Sleep(time.Millisecond)
		if ctx.Err() != nil || sent == 64 {
			t.Fatalf("only %d calls wait on b", b.held.Load())
		}
	}
	b.srv.Stop()
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Errorf("a call cut by b's crash: %v, want it retried on a", err)
		}
	}
	if n := w.asked.Load(); n != 0 {
		t.Errorf("the retry window was asked %d times for endpoint failures, want 0", n)
	}

	// Both down: a failure of the target needs the window, which refuses.
	a.srv.Stop()
	if err := check(ctx, cc); status.Code(err) != codes.Unavailable {
		t.Fatalf("a call with both replicas down: %v, want UNAVAILABLE", err)
	}
	if w.asked.Load() == 0 {
		t.Error("the retry window was not asked when the whole target failed")
	}
}
