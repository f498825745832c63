package cli

import (
	"context"
	"os"

	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc"
	"google.golang.org/grpc/stats"

	"github.com/curfew-mesh/curfew/mesh/tracing"
)

// withTracing is the dial option of the CLI's connection to the orchestrator: otelgrpc's
// client handler (package tracing) on a no-op provider, so the CLI records nothing itself
// but passes a trace context on in W3C traceparent. The context is the one in the
// TRACEPARENT and TRACESTATE environment variables (OpenTelemetry's environment carrier),
// so that a script or CI job that runs `curfew run` inside its own span makes the run's
// trace a child of that span.
func withTracing() grpc.DialOption {
	h := tracing.ClientHandler(nil)
	carrier := propagation.MapCarrier{"traceparent": os.Getenv("TRACEPARENT"), "tracestate": os.Getenv("TRACESTATE")}
	if carrier["traceparent"] == "" {
		return grpc.WithStatsHandler(h)
	}
	return grpc.WithStatsHandler(&envParent{Handler: h, carrier: carrier})
}

// envParent makes the environment's trace context the parent of calls that have none.
type envParent struct {
	stats.Handler
	carrier propagation.MapCarrier
}

func (h *envParent) TagRPC(ctx context.Context, info *stats.RPCTagInfo) context.Context {
	if !trace.SpanContextFromContext(ctx).IsValid() {
		ctx = propagation.TraceContext{}.Extract(ctx, h.carrier)
	}
	return h.Handler.TagRPC(ctx, info)
}
