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
// orchestrator's detached runs) ends there, so that its spans are exported too. The
// functions run in registration order and must return by StopDeadline.
func (rt *Runtime) OnStop(fn func()) { rt.onStop = append(rt.onStop, fn) }

// stopped runs the OnStop functions.
func (rt *Runtime) stopped() {
	for _, fn := range rt.onStop {
		fn()
	}
}

// flushTraces exports the spans left and stops the exporter, within ctx.
func (rt *Runtime) flushTraces(ctx context.Context) {
	if err := rt.tracing.Shutdown(ctx); err != nil {
		rt.Log.Warn("flushing traces", "error", err.Error())
	}
}
