package service

import (
	"context"
	"os"

	"google.golang.org/grpc"
	"google.golang.org/grpc/stats"

	"github.com/curfew-mesh/curfew/mesh/tracing"
)

// Tracing (package tracing, docs/tracing.md): every server New builds and every
// connection Runtime.Dial makes carries otelgrpc's stats handler with curfew's attributes.
// The tracer provider comes from the standard OTEL_* environment variables; with none set
// tracing is off and no handler is installed (it would cost even when recording nothing).

// startTracing sets up the runtime's tracer provider from the environment.
func (rt *Runtime) startTracing(ctx context.Context) error {
	p, err := tracing.FromEnv(ctx, rt.Opts.Name, os.Getenv)
	if err != nil {
		return err
	}
	rt.tracing = p
	return nil
}

// serverTracing is the tracing stats handler of the server, nil when tracing is off:
// any stats handler, even one that records nothing, costs grpc-go per-call work.
func (rt *Runtime) serverTracing() stats.Handler {
	if !rt.tracing.Enabled() {
		return nil
	}
	return tracing.ServerHandler(rt.tracing)
}

// clientTracing is the dial option installing the tracing stats handler.
func (rt *Runtime) clientTracing() grpc.DialOption {
	return rt.tracing.DialOption()
}

// Tracing returns the runtime's tracer provider (no-op when the environment asks for no
// traces).
func (rt *Runtime) Tracing() *tracing.Provider { return rt.tracing }

// flushTraces exports the spans left and stops the exporter, within ctx.
func (rt *Runtime) flushTraces(ctx context.Context) {
	if err := rt.tracing.Shutdown(ctx); err != nil {
		rt.Log.Warn("flushing traces", "error", err.Error())
	}
}
