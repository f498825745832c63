package tracing

import (
	"context"

	"go.opentelemetry.io/contrib/instrumentation/google.golang.org/grpc/otelgrpc"
	"go.opentelemetry.io/otel/attribute"
	metricnoop "go.opentelemetry.io/otel/metric/noop"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/stats"

	"github.com/curfew-mesh/curfew/mesh/cancel"
)

// ServerHandler returns the stats handler of a gRPC server: otelgrpc's server handler
// (one span per call, a child of the caller's span when it sent a traceparent) that also
// puts the call's curfew identity (run, node, tenant, retry-id, attempt, read from the
// incoming metadata) on the span.
//
// otelgrpc's own metrics are off (a no-op meter provider): the gRPC metrics are on each
// service's /metrics, go-grpc-middleware's Prometheus provider (package mesh).
func ServerHandler(p *Provider) stats.Handler {
	return &handler{Handler: otelgrpc.NewServerHandler(options(p)...), client: false}
}

// ClientHandler returns the stats handler of a gRPC client connection: otelgrpc's client
// handler (one span per RPC, so one per retry attempt, with the traceparent injected into
// the outgoing metadata) that also puts the attempt's curfew identity (run, node, tenant,
// retry-id, attempt, read from the outgoing metadata the retry layer stamped) on the span
// and, when the call ended because its caller's context was cancelled with a known cause,
// that cause.
func ClientHandler(p *Provider) stats.Handler {
	return &handler{Handler: otelgrpc.NewClientHandler(options(p)...), client: true}
}

// ServerOption is the server option of p: the tracing stats handler (ServerHandler) when
// p records, and nothing at all when tracing is off. Off is free this way: any stats
// handler, even one that records nothing, makes grpc-go do per-call work (payload and
// header events, a copy of the incoming metadata) that cost a third of a loopback call's
// latency through the curfew chain (docs/benchmarks.md, "Tracing overhead"). The price is
// that a process with tracing off does not pass a caller's traceparent on.
func (p *Provider) ServerOption() grpc.ServerOption {
	if !p.Enabled() {
		return grpc.EmptyServerOption{}
	}
	return grpc.StatsHandler(ServerHandler(p))
}

// DialOption is the dial option of p: the tracing stats handler (ClientHandler) when p
// records, and nothing when tracing is off (see ServerOption).
func (p *Provider) DialOption() grpc.DialOption {
	if !p.Enabled() {
		return grpc.EmptyDialOption{}
	}
	return grpc.WithStatsHandler(ClientHandler(p))
}

func options(p *Provider) []otelgrpc.Option {
	return []otelgrpc.Option{
		otelgrpc.WithTracerProvider(p.TracerProvider()),
		otelgrpc.WithPropagators(Propagator()),
		otelgrpc.WithMeterProvider(metricnoop.NewMeterProvider()),
	}
}

// handler wraps otelgrpc's handler with curfew's attributes.
type handler struct {
	stats.Handler
	client bool
}

// TagRPC starts the call's span (otelgrpc) and adds the curfew identity to it. A span
// that does not record (tracing off, or not sampled) costs no metadata lookup.
func (h *handler) TagRPC(ctx context.Context, info *stats.RPCTagInfo) context.Context {
	ctx = h.Handler.TagRPC(ctx, info)
	span := trace.SpanFromContext(ctx)
	if !span.IsRecording() {
		return ctx
	}
	get := metadata.ValueFromIncomingContext
	if h.client {
		get = metadata.ValueFromOutgoingContext
	}
	var buf [5]attribute.KeyValue
	if kv := identityAttrs(buf[:0], ctx, get); len(kv) > 0 {
		span.SetAttributes(kv...)
	}
	return ctx
}

// HandleRPC adds a client call's cancel cause before otelgrpc ends the span.
func (h *handler) HandleRPC(ctx context.Context, rs stats.RPCStats) {
	if _, end := rs.(*stats.End); end && h.client && ctx.Err() != nil {
		if span := trace.SpanFromContext(ctx); span.IsRecording() {
			if c := cancel.Name(cancel.CauseOf(ctx)); c != "" {
				span.SetAttributes(CancelCause.String(c))
			}
		}
	}
	h.Handler.HandleRPC(ctx, rs)
}
