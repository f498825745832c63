package breaker_test

import (
	"context"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	"github.com/curfew-mesh/curfew/mesh"
	"github.com/curfew-mesh/curfew/mesh/breaker"
)

func nopInvoker(context.Context, string, any, any, *grpc.ClientConn, ...grpc.CallOption) error {
	return nil
}

// nopStream is a stream that ends at once; nopStreamer reports its end to the OnFinish
// call options the way gRPC does when a stream finishes.
type nopStream struct{ grpc.ClientStream }

func nopStreamer(_ context.Context, _ *grpc.StreamDesc, _ *grpc.ClientConn, _ string, opts ...grpc.CallOption) (grpc.ClientStream, error) {
	for _, o := range opts {
		if f, ok := o.(grpc.OnFinishCallOption); ok {
			f.OnFinish(nil)
		}
	}
	return nopStream{}, nil
}

// BenchmarkInterceptor is the breaker's cost on the call path with a no-op invoker (no
// transport): "without" calls the invoker directly, "closed" through a closed breaker,
// "open" is the refusal of an open breaker (the fail-fast path: the status with its
// RetryInfo and ErrorInfo built per call). The -parallel variants run on every P.
func BenchmarkInterceptor(b *testing.B) {
	ctx := context.Background()
	closed := breaker.NewSet(breaker.Config{}, nil).UnaryClientInterceptor("svc")
	openSet := breaker.NewSet(breaker.Config{ConsecutiveFailures: 1, OpenTimeout: time.Hour}, nil)
	open := openSet.UnaryClientInterceptor("svc")
	_ = open(ctx, checkMethod, nil, nil, nil, func(context.Context, string, any, any, *grpc.ClientConn, ...grpc.CallOption) error {
		return status.Error(codes.Unavailable, "down")
	})
	if openSet.Get("svc").State() != breaker.StateOpen {
		b.Fatal("breaker not open")
	}
	b.Run("unary/without", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			_ = nopInvoker(ctx, checkMethod, nil, nil, nil)
		}
	})
	b.Run("unary/closed", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if err := closed(ctx, checkMethod, nil, nil, nil, nopInvoker); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("unary/closed-parallel", func(b *testing.B) {
		b.ReportAllocs()
		b.RunParallel(func(pb *testing.PB) {
			for pb.Next() {
				_ = closed(ctx, checkMethod, nil, nil, nil, nopInvoker)
			}
		})
	})
	b.Run("unary/open", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if err := open(ctx, checkMethod, nil, nil, nil, nopInvoker); err == nil {
				b.Fatal("open breaker let a call through")
			}
		}
	})
	b.Run("unary/open-parallel", func(b *testing.B) {
		b.ReportAllocs()
		b.RunParallel(func(pb *testing.PB) {
			for pb.Next() {
				_ = open(ctx, checkMethod, nil, nil, nil, nopInvoker)
			}
		})
	})
	stream := breaker.NewSet(breaker.Config{}, nil).StreamClientInterceptor("svc")
	desc := &grpc.StreamDesc{ServerStreams: true}
	b.Run("stream/without", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			_, _ = nopStreamer(ctx, desc, nil, checkMethod)
		}
	})
	b.Run("stream/closed", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if _, err := stream(ctx, desc, nil, checkMethod, nopStreamer); err != nil {
				b.Fatal(err)
			}
		}
	})
}

// BenchmarkChainLoopback is one unary call through the whole mesh client chain (retry
// layer included) to a real gRPC server on loopback: "without" has no breaker in the
// chain, "closed" has one, and "open" is a call refused by an open breaker, which never
// leaves the process (the fail-fast latency a caller sees).
func BenchmarkChainLoopback(b *testing.B) {
	h := &health{fn: func(context.Context, int64) error { return nil }}
	addr := serve(b, mesh.ServerConfig{}, h, nil)
	ctx := context.Background()
	for _, bc := range []struct {
		name string
		set  *breaker.Set
		open bool
	}{
		{"without", nil, false},
		{"closed", breaker.NewSet(breaker.Config{}, nil), false},
		{"open", breaker.NewSet(breaker.Config{ConsecutiveFailures: 1, OpenTimeout: time.Hour}, nil), true},
	} {
		cc := dial(b, addr, bc.set, noRetries)
		if bc.open {
			done, err := bc.set.Get("svc").Allow(ctx)
			if err != nil {
				b.Fatal(err)
			}
			done(status.Error(codes.Unavailable, "down"))
		}
		hc := healthpb.NewHealthClient(cc)
		if _, err := hc.Check(ctx, &healthpb.HealthCheckRequest{}); (err != nil) != bc.open { // warm the connection
			b.Fatalf("%s: warm-up call: %v", bc.name, err)
		}
		b.Run(bc.name, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				_, err := hc.Check(ctx, &healthpb.HealthCheckRequest{})
				if (err != nil) != bc.open {
					b.Fatal(err)
				}
			}
		})
	}
}
