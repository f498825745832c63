package breaker_test

import (
	"context"
	"errors"
	"io"
	"log/slog"
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
	"google.golang.org/grpc/status"

	toolrunnerv1 "github.com/curfew-mesh/curfew/gen/curfew/toolrunner/v1"
	"github.com/curfew-mesh/curfew/mesh"
	"github.com/curfew-mesh/curfew/mesh/breaker"
	"github.com/curfew-mesh/curfew/mesh/meshtest"
	"github.com/curfew-mesh/curfew/mesh/retry"
)

const checkMethod = "/grpc.health.v1.Health/Check"

// health is a Health service whose unary Check runs fn for the n-th call it receives
// (from 1); Watch is left unimplemented.
type health struct {
	healthpb.UnimplementedHealthServer
	calls atomic.Int64
	fn    func(ctx context.Context, n int64) error
}

func (h *health) Check(ctx context.Context, _ *healthpb.HealthCheckRequest) (*healthpb.HealthCheckResponse, error) {
	n := h.calls.Add(1)
	if err := h.fn(ctx, n); err != nil {
		return nil, err
	}
	return &healthpb.HealthCheckResponse{Status: healthpb.HealthCheckResponse_SERVING}, nil
}

func quiet() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

// serve starts a real gRPC server with the mesh server chain on loopback, serving h
// and tools (either may be nil), and returns its address.
func serve(t testing.TB, cfg mesh.ServerConfig, h *health, tools *meshtest.Tools) string {
	t.Helper()
	cfg.Logger = quiet()
	conn := meshtest.Serve(t, cfg, func(s *grpc.Server) {
		if h != nil {
			healthpb.RegisterHealthServer(s, h)
		}
		if tools != nil {
			tools.Register(s)
		}
	})
	return conn.Target()
}

// serveBare starts a plain grpc-go server, without curfew's server chain, on loopback:
// a target whose handlers' UNAVAILABLE is its own failure. (curfew's server chain marks a
// handler's UNAVAILABLE as a dependency's, relayed, which breakers ignore.)
func serveBare(t testing.TB, h *health, tools *meshtest.Tools) string {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := grpc.NewServer()
	if h != nil {
		healthpb.RegisterHealthServer(s, h)
	}
	if tools != nil {
		tools.Register(s)
	}
	go func() { _ = s.Serve(lis) }()
	t.Cleanup(s.Stop)
	return lis.Addr().String()
}

// dial connects to addr with the mesh client chain: rc's retries (Target "svc") and the
// set's breaker for "svc".
func dial(t testing.TB, addr string, set *breaker.Set, rc retry.Config) *grpc.ClientConn {
	t.Helper()
	rc.Target, rc.Logger = "svc", quiet()
	opts := append(mesh.DialOptions(mesh.ClientConfig{Retry: rc, Breakers: set}), grpc.WithTransportCredentials(insecure.NewCredentials()))
	cc, err := grpc.NewClient(addr, opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cc.Close() })
	return cc
}

var noRetries = retry.Config{Default: retry.Policy{Disabled: true}}

func check(ctx context.Context, cc *grpc.ClientConn) error {
	_, err := healthpb.NewHealthClient(cc).Check(ctx, &healthpb.HealthCheckRequest{})
	return err
}

func timeout(t *testing.T, d time.Duration) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), d)
	t.Cleanup(cancel)
	return ctx
}

func TestOpenFailsFastAndSendsNothing(t *testing.T) {
	h := &health{fn: func(context.Context, int64) error { return status.Error(codes.Unavailable, "down") }}
	reg := prometheus.NewRegistry()
	set := breaker.NewSet(breaker.Config{ConsecutiveFailures: 3, OpenTimeout: time.Hour}, reg)
	cc := dial(t, serveBare(t, h, nil), set, noRetries)
	for i := range 3 {
		err := check(timeout(t, 10*time.Second), cc)
		if breaker.IsOpen(err) || status.Code(err) != codes.Unavailable {
			t.Fatalf("call %d: %v, want the server's UNAVAILABLE", i+1, err)
		}
	}
	for range 20 {
		start := time.Now()
		err := check(timeout(t, 10*time.Second), cc)
		if el := time.Since(start); el > 2*time.Second {
			t.Errorf("refusal took %v", el)
		}
		wantOpen(t, err, "svc", "open", 40*time.Minute, 72*time.Minute)
		if !retry.IsExhausted(err) {
			t.Errorf("refusal %v not marked as retried to exhaustion", err)
		}
	}
	if n := h.calls.Load(); n != 3 {
		t.Errorf("server saw %d calls, want 3: an open breaker sends nothing", n)
	}
	if v := metric(t, reg, "curfew_circuit_breaker_calls_total", map[string]string{"target": "svc", "outcome": "rejected"}); v != 20 {
		t.Errorf("rejected = %v, want 20", v)
	}
}

// sleeper records the retry layer's waits and returns at once.
type sleeper struct {
	mu sync.Mutex
	d  []time.Duration
}

func (s *sleeper) Sleep(ctx context.Context, d time.Duration) error {
	s.mu.Lock()
	s.d = append(s.d, d)
	s.mu.Unlock()
	return ctx.Err()
}

func (s *sleeper) waits() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.d)
}

func TestRetryLayerDoesNotRetryARefusal(t *testing.T) {
	h := &health{fn: func(context.Context, int64) error { return status.Error(codes.Unavailable, "down") }}
	set := breaker.NewSet(breaker.Config{ConsecutiveFailures: 2, OpenTimeout: time.Hour}, nil)
	sl := &sleeper{}
	cc := dial(t, serveBare(t, h, nil), set, retry.Config{Default: retry.Policy{MaxAttempts: 3}, Sleep: sl.Sleep})

	// Attempt 1 fails, the retry layer waits, attempt 2 fails and trips the breaker, the
	// retry layer waits its backoff once more (it judges the server's UNAVAILABLE), and
	// attempt 3 is refused: the call ends there, with no wait after the refusal.
	err := check(timeout(t, 10*time.Second), cc)
	wantOpen(t, err, "svc", "open", 40*time.Minute, 72*time.Minute)
	if n := h.calls.Load(); n != 2 {
		t.Errorf("server saw %d attempts, want 2", n)
	}
	if n := sl.waits(); n != 2 {
		t.Errorf("retry layer waited %d times, want 2 (before attempts 2 and 3)", n)
	}
	// Later calls end at their first attempt, with the refusal's own code: not
	// DEADLINE_EXCEEDED for a pushback that outlasts the deadline, and no wait.
	for range 5 {
		err := check(timeout(t, 3*time.Second), cc)
		wantOpen(t, err, "svc", "open", 40*time.Minute, 72*time.Minute)
	}
	if n, w := h.calls.Load(), sl.waits(); n != 2 || w != 2 {
		t.Errorf("after 5 refused calls: server saw %d attempts, retry layer waited %d times; want 2 and 2", n, w)
	}
}

func TestHalfOpenProbeOverGRPC(t *testing.T) {
	for _, probeFails := range []bool{false, true} {
		release := make(chan struct{})
		entered := make(chan struct{}, 1)
		h := &health{fn: func(ctx context.Context, n int64) error {
			switch n {
			case 1:
				return status.Error(codes.Unavailable, "down")
			case 2: // the probe: held until the test releases it
				entered <- struct{}{}
				select {
				case <-release:
				case <-ctx.Done():
					return ctx.Err()
				}
				if probeFails {
					return status.Error(codes.Internal, "still broken")
				}
			}
			return nil
		}}
		reg := prometheus.NewRegistry()
		set := breaker.NewSet(breaker.Config{ConsecutiveFailures: 1, OpenTimeout: 100 * time.Millisecond, Jitter: -1}, reg)
		cc := dial(t, serveBare(t, h, nil), set, noRetries)
		b := set.Get("svc")
		if err := check(timeout(t, 10*time.Second), cc); status.Code(err) != codes.Unavailable || breaker.IsOpen(err) {
			t.Fatalf("first call: %v", err)
		}
		if s := b.State(); s != breaker.StateOpen {
			t.Fatalf("state %s, want open", s)
		}
		waitState(t, b, breaker.StateHalfOpen, 5*time.Second)

		probe := make(chan error, 1)
		go func() { probe <- check(timeout(t, 10*time.Second), cc) }()
		<-entered // the probe is at the server
		var wg sync.WaitGroup
		errs := make(chan error, 8)
		for range 8 {
			wg.Go(func() { errs <- check(timeout(t, 10*time.Second), cc) })
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			wantOpen(t, err, "svc", "half-open", breaker.MinRetryDelay, breaker.MinRetryDelay)
		}
		if n := h.calls.Load(); n != 2 {
			t.Fatalf("server saw %d calls, want 2 (the trip and the single probe)", n)
		}
		close(release)
		err := <-probe
		if !probeFails {
			if err != nil {
				t.Fatalf("probe: %v", err)
			}
			if s := b.State(); s != breaker.StateClosed {
				t.Fatalf("state %s after the probe succeeded, want closed", s)
			}
			for range 5 {
				if err := check(timeout(t, 10*time.Second), cc); err != nil {
					t.Fatalf("call after close: %v", err)
				}
			}
			if n := h.calls.Load(); n != 7 {
				t.Errorf("server saw %d calls, want 7", n)
			}
			if g := stateGauges(t, reg, "svc"); g != [3]float64{1, 0, 0} {
				t.Errorf("gauges %v, want [1 0 0]", g)
			}
			continue
		}
		if status.Code(err) != codes.Internal {
			t.Fatalf("probe: %v, want the server's INTERNAL", err)
		}
		if s := b.State(); s != breaker.StateOpen {
			t.Fatalf("state %s after the probe failed, want open", s)
		}
		wantOpen(t, check(timeout(t, 10*time.Second), cc), "svc", "open", 0, 120*time.Millisecond)
		if n := h.calls.Load(); n != 2 {
			t.Errorf("server saw %d calls, want 2", n)
		}
		if v := metric(t, reg, "curfew_circuit_breaker_transitions_total", map[string]string{"from": "half-open", "to": "open"}); v != 1 {
			t.Errorf("half-open→open = %v, want 1", v)
		}
	}
}

func TestCancellationIsNotAFailure(t *testing.T) {
	// The server: "hang" waits for the caller to go away; "bad-*" are client errors;
	// anything else fails with INTERNAL once the test flips broken (a curfew server's own
	// failure; its handlers' UNAVAILABLE would be relayed, see mesh.ServerInterceptors).
	var broken atomic.Bool
	h := &health{fn: func(ctx context.Context, _ int64) error {
		if broken.Load() {
			return status.Error(codes.Internal, "broken")
		}
		<-ctx.Done()
		return ctx.Err()
	}}
	clientErrs := []codes.Code{codes.InvalidArgument, codes.NotFound, codes.AlreadyExists, codes.PermissionDenied,
		codes.Unauthenticated, codes.FailedPrecondition, codes.OutOfRange, codes.Aborted}
	tools := meshtest.NewTools(map[string]meshtest.ToolFunc{
		"hang": func(ctx context.Context, _ string) (string, error) { <-ctx.Done(); return "", ctx.Err() },
		"bad": func(_ context.Context, args string) (string, error) {
			return "", status.Error(clientErrs[len(args)%len(clientErrs)], "your fault")
		},
	})
	reg := prometheus.NewRegistry()
	set := breaker.NewSet(breaker.Config{ConsecutiveFailures: 3, FailureRatio: 0.1, MinRequests: 5}, reg)
	// The server refuses Execute for lack of time when less than 2s are left.
	addr := serve(t, mesh.ServerConfig{MinTime: map[string]time.Duration{"/curfew.toolrunner.v1.ToolRunnerService/Execute": 2 * time.Second}}, h, tools)
	cc := dial(t, addr, set, retry.Config{Default: retry.Policy{MaxAttempts: 3}})
	tr := toolrunnerv1.NewToolRunnerServiceClient(cc)

	var wg sync.WaitGroup
	for i := range 20 {
		// A unary call the caller cancels while the server works on it.
		wg.Go(func() {
			ctx, cancel := context.WithCancel(timeout(t, 20*time.Second))
			time.AfterFunc(time.Duration(5+i%10)*time.Millisecond, cancel)
			if err := check(ctx, cc); status.Code(err) != codes.Canceled {
				t.Errorf("cancelled call: %v", err)
			}
		})
		// A unary call whose caller's deadline passes.
		wg.Go(func() {
			if err := check(timeout(t, time.Duration(5+i%10)*time.Millisecond), cc); status.Code(err) != codes.DeadlineExceeded {
				t.Errorf("short deadline: %v", err)
			}
		})
		// A stream the caller abandons by cancelling.
		wg.Go(func() {
			ctx, cancel := context.WithCancel(timeout(t, 20*time.Second))
			defer cancel()
			st, err := tr.Execute(ctx, &toolrunnerv1.ExecuteRequest{Name: "hang"})
			if err != nil {
				t.Errorf("hang: %v", err)
				return
			}
			time.AfterFunc(time.Duration(5+i%10)*time.Millisecond, cancel)
			if _, err := meshtest.Drain(st); status.Code(err) != codes.Canceled {
				t.Errorf("abandoned stream: %v", err)
			}
		})
		// A stream refused by the server for lack of time ("no time left to start").
		wg.Go(func() {
			st, err := tr.Execute(timeout(t, time.Second), &toolrunnerv1.ExecuteRequest{Name: "hang"})
			if err == nil {
				_, err = meshtest.Drain(st)
			}
			if status.Code(err) != codes.DeadlineExceeded {
				t.Errorf("no time left: %v", err)
			}
		})
		// Client errors.
		wg.Go(func() {
			st, err := tr.Execute(timeout(t, 20*time.Second), &toolrunnerv1.ExecuteRequest{Name: "bad", ArgsJson: string(make([]byte, i))})
			if err == nil {
				_, err = meshtest.Drain(st)
			}
			if c := status.Code(err); c != clientErrs[i%len(clientErrs)] {
				t.Errorf("client error: %v", err)
			}
		})
	}
	wg.Wait()
	if s := set.Get("svc").State(); s != breaker.StateClosed {
		t.Fatalf("state %s after calls the callers gave up on or were at fault for, want closed", s)
	}
	calls := func(o string) float64 {
		return metric(t, reg, "curfew_circuit_breaker_calls_total", map[string]string{"target": "svc", "outcome": o})
	}
	if calls("failure") != 0 || calls("rejected") != 0 {
		t.Errorf("failures %v rejected %v, want 0 0", calls("failure"), calls("rejected"))
	}
	// Every attempt was judged exactly once: 60 ignored (cancelled, expired, abandoned)
	// plus 20 refused for lack of time, 20 client errors counted as successes.
	if calls("ignored") != 80 || calls("success") != 20 {
		t.Errorf("ignored %v success %v, want 80 20", calls("ignored"), calls("success"))
	}
	// The breaker is live: three real failures trip it.
	broken.Store(true)
	for range 3 {
		_ = check(timeout(t, 10*time.Second), cc)
	}
	if s := set.Get("svc").State(); s != breaker.StateOpen {
		t.Errorf("state %s after real failures, want open", s)
	}
}

func TestStreamOutcomes(t *testing.T) {
	tools := meshtest.NewTools(map[string]meshtest.ToolFunc{
		"ok":   func(context.Context, string) (string, error) { return `{}`, nil },
		"fail": func(context.Context, string) (string, error) { return "", status.Error(codes.Unavailable, "down") },
		"hang": func(ctx context.Context, _ string) (string, error) { <-ctx.Done(); return "", ctx.Err() },
	})
	reg := prometheus.NewRegistry()
	set := breaker.NewSet(breaker.Config{ConsecutiveFailures: 2, OpenTimeout: time.Hour}, reg)
	cc := dial(t, serveBare(t, nil, tools), set, noRetries)
	tr := toolrunnerv1.NewToolRunnerServiceClient(cc)
	calls := func(o string) float64 {
		return metric(t, reg, "curfew_circuit_breaker_calls_total", map[string]string{"target": "svc", "outcome": o})
	}
	run := func(name string) error {
		st, err := tr.Execute(timeout(t, 10*time.Second), &toolrunnerv1.ExecuteRequest{Name: name})
		if err != nil {
			return err
		}
		_, err = meshtest.Drain(st)
		return err
	}
	for range 3 {
		if err := run("ok"); err != nil {
			t.Fatal(err)
		}
	}
	if calls("success") != 3 {
		t.Errorf("success = %v after 3 streams that ended with io.EOF, want 3", calls("success"))
	}

	// Read the first message, then abandon the stream: CANCELED with the caller's
	// context done, ignored, and reported once.
	ctx, cancel := context.WithCancel(t.Context())
	st, err := tr.Execute(ctx, &toolrunnerv1.ExecuteRequest{Name: "ok"})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := st.Recv(); err != nil {
		t.Fatal(err)
	}
	cancel()
	// The outcome is reported by gRPC's finish, from its own goroutine: wait for it.
	end := time.Now().Add(5 * time.Second)
	for calls("ignored") != 1 && time.Now().Before(end) {
		time.Sleep(2 * time.Millisecond)
	}
	if calls("ignored") != 1 || calls("success") != 3 {
		t.Errorf("abandoned stream: ignored %v success %v, want 1 3", calls("ignored"), calls("success"))
	}

	// Two streams that end with UNAVAILABLE trip it; the third is refused before it
	// opens.
	for range 2 {
		if err := run("fail"); status.Code(err) != codes.Unavailable || breaker.IsOpen(err) {
			t.Fatalf("fail: %v", err)
		}
	}
	before := len(tools.Calls())
	err = run("ok")
	wantOpen(t, err, "svc", "open", 40*time.Minute, 72*time.Minute)
	if n := len(tools.Calls()); n != before {
		t.Errorf("server saw %d more streams while open, want 0", n-before)
	}
	if calls("failure") != 2 || calls("rejected") != 1 {
		t.Errorf("failure %v rejected %v, want 2 1", calls("failure"), calls("rejected"))
	}
}

func TestStreamAbandonedByCancelIsReportedOnce(t *testing.T) {
	tools := meshtest.NewTools(map[string]meshtest.ToolFunc{
		"hang": func(ctx context.Context, _ string) (string, error) { <-ctx.Done(); return "", ctx.Err() },
	})
	reg := prometheus.NewRegistry()
	set := breaker.NewSet(breaker.Config{ConsecutiveFailures: 1, OpenTimeout: time.Hour}, reg)
	cc := dial(t, serveBare(t, nil, tools), set, noRetries)
	tr := toolrunnerv1.NewToolRunnerServiceClient(cc)
	const n = 30
	for range n {
		ctx, cancel := context.WithCancel(t.Context())
		if _, err := tr.Execute(ctx, &toolrunnerv1.ExecuteRequest{Name: "hang"}); err != nil {
			t.Fatal(err)
		}
		cancel() // never read: the caller walks away
	}
	end := time.Now().Add(5 * time.Second)
	for metric(t, reg, "curfew_circuit_breaker_calls_total", map[string]string{"outcome": "ignored"}) != n && time.Now().Before(end) {
		time.Sleep(2 * time.Millisecond)
	}
	if v := metric(t, reg, "curfew_circuit_breaker_calls_total", nil); v != n {
		t.Errorf("outcomes reported %v, want %d (one per stream)", v, n)
	}
	if s := set.Get("svc").State(); s != breaker.StateClosed {
		t.Errorf("state %s, want closed (ConsecutiveFailures 1 and no failure)", s)
	}
}

func TestPanickingInvokerIsAFailure(t *testing.T) {
	set := breaker.NewSet(breaker.Config{ConsecutiveFailures: 1, OpenTimeout: time.Hour}, nil)
	ui := set.UnaryClientInterceptor("svc")
	func() {
		defer func() { _ = recover() }()
		_ = ui(t.Context(), checkMethod, nil, nil, nil, func(context.Context, string, any, any, *grpc.ClientConn, ...grpc.CallOption) error {
			panic("boom")
		})
	}()
	if s := set.Get("svc").State(); s != breaker.StateOpen {
		t.Errorf("state %s after a panicking call, want open", s)
	}
	err := ui(t.Context(), checkMethod, nil, nil, nil, func(context.Context, string, any, any, *grpc.ClientConn, ...grpc.CallOption) error {
		return errors.New("must not be called")
	})
	wantOpen(t, err, "svc", "open", 40*time.Minute, 72*time.Minute)
}
