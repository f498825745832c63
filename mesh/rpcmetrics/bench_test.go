package rpcmetrics_test

import (
	"context"
	"testing"

	grpcprom "github.com/grpc-ecosystem/go-grpc-middleware/providers/prometheus"
	"google.golang.org/grpc"

	"github.com/curfew-mesh/curfew/mesh/rpcmetrics"
)

// BenchmarkUnary is what recording one unary call costs each side, this package against
// go-grpc-middleware's Prometheus provider, the interceptor called directly around a
// handler (or invoker) that does nothing:
//
//	go test -run '^$' -bench '^BenchmarkUnary$' -count 5 ./rpcmetrics/   (in mesh/)
func BenchmarkUnary(b *testing.B) {
	const method = "/grpc.health.v1.Health/Check"
	info := &grpc.UnaryServerInfo{FullMethod: method}
	handler := func(context.Context, any) (any, error) { return struct{}{}, nil }
	invoker := func(context.Context, string, any, any, *grpc.ClientConn, ...grpc.CallOption) error { return nil }
	servers := map[string]grpc.UnaryServerInterceptor{
		"provider":   grpcprom.NewServerMetrics(grpcprom.WithServerHandlingTimeHistogram()).UnaryServerInterceptor(),
		"rpcmetrics": rpcmetrics.NewServer().UnaryServerInterceptor(),
	}
	clients := map[string]grpc.UnaryClientInterceptor{
		"provider":   grpcprom.NewClientMetrics(grpcprom.WithClientHandlingTimeHistogram()).UnaryClientInterceptor(),
		"rpcmetrics": rpcmetrics.NewClient().UnaryClientInterceptor(),
	}
	ctx := b.Context()
	for _, name := range []string{"provider", "rpcmetrics"} {
		b.Run("server/"+name, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				_, _ = servers[name](ctx, nil, info, handler)
			}
		})
		b.Run("client/"+name, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				_ = clients[name](ctx, method, nil, nil, nil, invoker)
			}
		})
	}
}
