package breaker_test

import (
	"context"
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

	"github.com/curfew-mesh/curfew/mesh"
	"github.com/curfew-mesh/curfew/mesh/breaker"
)

// replica is one replica of a service: a bare gRPC server whose Check answers at once,
// or, while hold is set, waits until its call ends (as a long call does).
type endpoint struct {
	srv  *grpc.Server
	addr string
	hold atomic.Bool
	held atomic.Int64 // calls waiting now
}

func startEndpoint(t *testing.T) *endpoint {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	r := &endpoint{srv: grpc.NewServer(), addr: lis.Addr().String()}
	healthpb.RegisterHealthServer(r.srv, &health{fn: func(ctx context.Context, _ int64) error {
		if r.hold.Load() {
			r.held.Add(1)
			defer r.held.Add(-1)
			<-ctx.Done()
			return ctx.Err()
		}
		return nil
	}})
	go func() { _ = r.srv.Serve(lis) }()
	t.Cleanup(r.srv.Stop)
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
	res := manual.NewBuilderWithScheme("replicas")
	res.InitialState(resolver.State{Addresses: []resolver.Address{{Addr: a.addr}, {Addr: b.addr}}})
	reg := prometheus.NewRegistry()
	set := breaker.NewSet(breaker.Config{ConsecutiveFailures: 3, OpenTimeout: time.Hour}, reg)
	rc := noRetries
	rc.Target, rc.Logger = "svc", quiet()
	opts := append(mesh.DialOptions(mesh.ClientConfig{Retry: rc, Breakers: set}),
		grpc.WithTransportCredentials(insecure.NewCredentials()), grpc.WithResolvers(res),
		grpc.WithDefaultServiceConfig(`{"loadBalancingConfig": [{"round_robin": {}}]}`))
	cc, err := grpc.NewClient(res.Scheme()+":///svc", opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cc.Close() })
	ctx := timeout(t, 10*time.Second)
	for range 10 { // both replicas answer
		if err := check(ctx, cc); err != nil {
			t.Fatal(err)
		}
	}

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
