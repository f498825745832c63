package tracing_test

import (
	"context"
	"net"
	"sync/atomic"
	"testing"
	"time"

	"go.opentelemetry.io/otel/attribute"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	"github.com/curfew-mesh/curfew/mesh"
	"github.com/curfew-mesh/curfew/mesh/cancel"
	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/mesh/retry"
	"github.com/curfew-mesh/curfew/mesh/tracing"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func env(kv map[string]string) func(string) string { return func(k string) string { return kv[k] } }

func TestEnabled(t *testing.T) {
	for _, c := range []struct {
		env  map[string]string
		want bool
	}{
		{nil, false},
		{map[string]string{"OTEL_SERVICE_NAME": "x", "OTEL_TRACES_SAMPLER": "always_on"}, false},
		{map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317"}, true},
		{map[string]string{"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:4318/v1/traces"}, true},
		{map[string]string{"OTEL_TRACES_EXPORTER": "otlp"}, true},
		{map[string]string{"OTEL_TRACES_EXPORTER": "console"}, true},
		{map[string]string{"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4317"}, false},
		{map[string]string{"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "otlp"}, false},
	} {
		if got := tracing.Enabled(env(c.env)); got != c.want {
			t.Errorf("Enabled(%v) = %v, want %v", c.env, got, c.want)
		}
	}
}

func TestFromEnv(t *testing.T) {
	ctx := t.Context()
	p, err := tracing.FromEnv(ctx, "svc", env(nil))
	if err != nil || p.Enabled() {
		t.Fatalf("no environment: %v, enabled %v", err, p.Enabled())
	}
	for _, bad := range []map[string]string{
		{"OTEL_TRACES_EXPORTER": "zipkin"},
		{"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"},
	} {
		if _, err := tracing.FromEnv(ctx, "svc", env(bad)); err == nil {
			t.Errorf("%v: no error", bad)
		}
	}
	// Both OTLP protocols build; the exporters connect lazily, so nothing listens here.
	for _, proto := range []string{"grpc", "http/protobuf"} {
		p, err := tracing.FromEnv(ctx, "svc", env(map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1", "OTEL_EXPORTER_OTLP_PROTOCOL": proto}))
		if err != nil || !p.Enabled() {
			t.Fatalf("%s: %v", proto, err)
		}
		sctx, stop := context.WithTimeout(ctx, 5*time.Second)
		_ = p.Shutdown(sctx)
		stop()
	}
}

// flaky fails each call's first attempt with UNAVAILABLE, or blocks until the call is
// cancelled when block is set.
type flaky struct {
	healthpb.UnimplementedHealthServer
	calls atomic.Int32
	block bool
}

func (f *flaky) Check(ctx context.Context, _ *healthpb.HealthCheckRequest) (*healthpb.HealthCheckResponse, error) {
	if f.block {
		<-ctx.Done()
		return nil, status.FromContextError(ctx.Err()).Err()
	}
	if f.calls.Add(1)%2 == 1 {
		return nil, status.Error(codes.Unavailable, "first attempt fails")
	}
	return &healthpb.HealthCheckResponse{Status: healthpb.HealthCheckResponse_SERVING}, nil
}

// serve starts a server and a client connection with the mesh chains and the tracing
// handlers of p.
func serve(t *testing.T, p *tracing.Provider, h healthpb.HealthServer) healthpb.HealthClient {
	t.Helper()
	var lc net.ListenConfig
	lis, err := lc.Listen(t.Context(), "tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer(append(mesh.ServerOptions(mesh.ServerConfig{}), grpc.StatsHandler(tracing.ServerHandler(p)))...)
	healthpb.RegisterHealthServer(srv, h)
	done := make(chan struct{})
	go func() { defer close(done); _ = srv.Serve(lis) }()
	rc := retry.Config{Target: "test", Default: retry.Policy{MaxAttempts: 3}, Sleep: func(context.Context, time.Duration) error { return nil }}
	conn, err := grpc.NewClient(lis.Addr().String(), append(mesh.DialOptions(mesh.ClientConfig{Retry: rc}),
		grpc.WithTransportCredentials(insecure.NewCredentials()), grpc.WithStatsHandler(tracing.ClientHandler(p)))...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close(); srv.Stop(); <-done })
	return healthpb.NewHealthClient(conn)
}

func attrs(s sdktrace.ReadOnlySpan) map[attribute.Key]attribute.Value {
	m := map[attribute.Key]attribute.Value{}
	for _, kv := range s.Attributes() {
		m[kv.Key] = kv.Value
	}
	return m
}

// Each attempt of a retried call is a client span and a server span of its own, carrying
// the attempt number, the one retry-id, and the work's identity; the server span is the
// client span's child.
func TestSpanPerAttempt(t *testing.T) {
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	p := tracing.WithSDK(tp)
	defer func() { _ = p.Shutdown(context.Background()) }()
	c := serve(t, p, &flaky{})

	ctx, parent := tp.Tracer("test").Start(t.Context(), "parent")
	ctx = md.WithIdentity(ctx, md.Identity{Tenant: "acme", RunID: "run-1", NodeID: "root/s0.t0"})
	if _, err := c.Check(ctx, &healthpb.HealthCheckRequest{}); err != nil {
		t.Fatalf("Check: %v", err)
	}
	parent.End()

	// A server span ends after its response was sent: the client may have it first.
	var clients, servers []sdktrace.ReadOnlySpan
	for wait := time.Now().Add(10 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		clients, servers = nil, nil
		for _, s := range rec.Ended() {
			switch s.SpanKind() {
			case trace.SpanKindClient:
				clients = append(clients, s)
			case trace.SpanKindServer:
				servers = append(servers, s)
			}
		}
		if len(servers) >= 2 || time.Now().After(wait) {
			break
		}
	}
	if len(clients) != 2 || len(servers) != 2 {
		t.Fatalf("%d client and %d server spans, want 2 and 2", len(clients), len(servers))
	}
	retryID := attrs(clients[0])[tracing.RetryID].AsString()
	if retryID == "" {
		t.Fatal("no retry-id on the first attempt's span")
	}
	for i, pair := range [][2]sdktrace.ReadOnlySpan{{clients[0], servers[0]}, {clients[1], servers[1]}} {
		for _, s := range pair {
			a := attrs(s)
			if a[tracing.Attempt].AsInt64() != int64(i+1) || a[tracing.RetryID].AsString() != retryID ||
				a[tracing.RunID].AsString() != "run-1" || a[tracing.NodeID].AsString() != "root/s0.t0" || a[tracing.Tenant].AsString() != "acme" {
				t.Errorf("attempt %d, %s span: %v", i+1, s.SpanKind(), a)
			}
			if s.SpanContext().TraceID() != parent.SpanContext().TraceID() {
				t.Errorf("attempt %d, %s span: not in the caller's trace", i+1, s.SpanKind())
			}
		}
		if pair[0].Parent().SpanID() != parent.SpanContext().SpanID() {
			t.Errorf("attempt %d: client span's parent is not the caller's span", i+1)
		}
		if pair[1].Parent().SpanID() != pair[0].SpanContext().SpanID() || !pair[1].Parent().IsRemote() {
			t.Errorf("attempt %d: server span's parent is not the attempt's client span", i+1)
		}
	}
}

// A call that ends because its caller was cancelled with a cause carries the cause.
func TestClientSpanCancelCause(t *testing.T) {
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	p := tracing.WithSDK(tp)
	defer func() { _ = p.Shutdown(context.Background()) }()
	c := serve(t, p, &flaky{block: true})
	ctx, stop := context.WithCancelCause(t.Context())
	time.AfterFunc(50*time.Millisecond, func() { stop(cancel.ErrOperator) })
	if _, err := c.Check(ctx, &healthpb.HealthCheckRequest{}); status.Code(err) != codes.Canceled {
		t.Fatalf("Check: %v", err)
	}
	for _, s := range rec.Ended() {
		if s.SpanKind() == trace.SpanKindClient {
			if got := attrs(s)[tracing.CancelCause].AsString(); got != "operator" {
				t.Errorf("client span's cause: %q", got)
			}
			return
		}
	}
	t.Fatal("no client span")
}

// With tracing off no handler is installed at all.
func TestOffInstallsNothing(t *testing.T) {
	p := tracing.Off()
	if _, ok := p.ServerOption().(grpc.EmptyServerOption); !ok {
		t.Error("off: a server option that is not empty")
	}
	if _, ok := p.DialOption().(grpc.EmptyDialOption); !ok {
		t.Error("off: a dial option that is not empty")
	}
	var nilP *tracing.Provider
	if _, ok := nilP.DialOption().(grpc.EmptyDialOption); !ok {
		t.Error("nil provider: a dial option that is not empty")
	}
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	defer func() { _ = tp.Shutdown(context.Background()) }()
	if _, ok := tracing.WithSDK(tp).ServerOption().(grpc.EmptyServerOption); ok {
		t.Error("on: an empty server option")
	}
}

func TestStartRun(t *testing.T) {
	// Off, and no caller's span: the run's context is left as it is.
	rctx := context.Background()
	got, span := tracing.StartRun(context.Background(), rctx, md.Identity{RunID: "r"})
	if got != rctx || span.IsRecording() {
		t.Fatal("StartRun changed the context with tracing off")
	}
	span.End()

	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	defer func() { _ = tp.Shutdown(context.Background()) }()
	ctx, call := tp.Tracer("test").Start(context.Background(), "Run")
	got, span = tracing.StartRun(ctx, context.Background(), md.Identity{RunID: "r", NodeID: "root", Tenant: "default"})
	if trace.SpanFromContext(got) != span || !span.IsRecording() {
		t.Fatal("the run's context does not carry its span")
	}
	tracing.EndRun(span, meshv1.NodeStatus_NODE_STATUS_CANCELLED, meshv1.CancelCause_CANCEL_CAUSE_CLIENT_DISCONNECT, "CANCELLED", "cancelled", 12, 1)
	call.End()
	s := rec.Ended()[0]
	a := attrs(s)
	if s.Name() != "run" || s.Parent().SpanID() != call.SpanContext().SpanID() || a[tracing.RunID].AsString() != "r" ||
		a[tracing.CancelCause].AsString() != "client_disconnect" || a[tracing.NodeStatus].AsString() != "cancelled" ||
		a[tracing.Tokens].AsInt64() != 12 || a[tracing.TokensAfterCancel].AsInt64() != 1 {
		t.Fatalf("run span %s: %v", s.Name(), a)
	}
}
