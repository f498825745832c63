package service

import (
	"context"
	"os"

	"google.golang.org/grpc"

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

// serverTracing is the server option installing the tracing stats handler.
func (rt *Runtime) serverTracing() grpc.ServerOption {
	return rt.tracing.ServerOption()
}

// clientTracing is the dial option installing the tracing stats handler.
func (rt *Runtime) clientTracing() grpc.DialOption {
	return rt.tracing.DialOption()
}

// Tracing returns the runtime's tracer provider (no-op when the environment asks for no
// traces).
func (rt *Runtime) Tracing() *tracing.Provider { return rt.tracing }

// OnStop registers fn to run when Serve stops, after the gRPC server has stopped and
// before the spans are flushed: work that outlives the server's calls (the
// orchestrator's detached runs) ends there, so that its spans are exported too.
func (rt *Runtime) OnStop(fn func()) { rt.onStop = append(rt.onStop, fn) }

// stopped runs the OnStop functions, then flushes the spans and stops the exporter,
// within the shutdown grace.
func (rt *Runtime) stopped(ctx context.Context) {
	for _, fn := range rt.onStop {
		fn()
	}
	fctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), rt.Opts.ShutdownGrace)
	defer cancel()
	if err := rt.tracing.Shutdown(fctx); err != nil {
		rt.Log.Warn("flushing traces", "error", err.Error())
	}
}
