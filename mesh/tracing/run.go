package tracing

import (
	"context"

	"go.opentelemetry.io/otel/trace"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	"github.com/curfew-mesh/curfew/mesh/md"
)

// StartRun starts the span of a run, named "run", and returns runCtx carrying it. The
// span's parent is the span of ctx (the call that started the run: the orchestrator's
// Run server span, itself the trace's root or a child of the caller's span), and it is
// made by the same tracer provider; runCtx is the run's own context (detached from the
// call), which every call the run makes derives from, so they all join the run's trace.
func StartRun(ctx, runCtx context.Context, id md.Identity) (context.Context, trace.Span) {
	parent := trace.SpanFromContext(ctx)
	if !parent.IsRecording() && !parent.SpanContext().IsValid() {
		// Tracing off, and no caller's context to pass on.
		return runCtx, parent
	}
	tr := parent.TracerProvider().Tracer(instrumentationScope)
	runCtx = trace.ContextWithSpan(runCtx, parent)
	return tr.Start(runCtx, "run", trace.WithSpanKind(trace.SpanKindInternal), trace.WithAttributes(IdentityAttrs(id)...))
}

// EndRun records a run's outcome and token figures on its span and ends it.
func EndRun(span trace.Span, st meshv1.NodeStatus, cause meshv1.CancelCause, errCode, errMsg string, tokens, tokensAfterCancel int64) {
	if span.IsRecording() {
		EndNode(span, st, cause, errCode, errMsg)
		span.SetAttributes(Tokens.Int64(tokens), TokensAfterCancel.Int64(tokensAfterCancel))
	}
	span.End()
}
