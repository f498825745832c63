package modelproxy

import (
	"context"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel/trace"

	"github.com/curfew-mesh/curfew/mesh/tracing"
)

// callTokens puts the tokens of one model call on its span (package tracing): the tokens
// the ledger recorded for the node while the call ran, and those recorded after the
// instant the call's context was cancelled here.
type callTokens struct {
	s         *Server
	span      trace.Span
	run, node string
	before    int64
	cancelled atomic.Int64 // unix nanos of the cancel; 0 while not cancelled
	stop      func() bool
}

// traceTokens starts counting the tokens of a call whose node context is ctx; nil (a
// no-op) when the call's span does not record.
func (s *Server) traceTokens(ctx context.Context, run, node string) *callTokens {
	span := trace.SpanFromContext(ctx)
	if !span.IsRecording() {
		return nil
	}
	t := &callTokens{s: s, span: span, run: run, node: node}
	t.before, _, _ = s.Ledger.Figures(run, node, time.Time{})
	t.stop = context.AfterFunc(ctx, func() { t.cancelled.Store(s.now().UnixNano()) })
	return t
}

// end records the figures on the span; the span itself is ended by its call.
func (t *callTokens) end() {
	if t == nil {
		return
	}
	t.stop()
	var at time.Time
	if ns := t.cancelled.Load(); ns != 0 {
		at = time.Unix(0, ns)
	}
	total, _, after := t.s.Ledger.Figures(t.run, t.node, at)
	t.span.SetAttributes(tracing.Tokens.Int64(total - t.before))
	if !at.IsZero() {
		t.span.SetAttributes(tracing.TokensAfterCancel.Int64(after))
	}
}
