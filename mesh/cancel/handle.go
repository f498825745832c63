package cancel

import (
	"context"
	"sync/atomic"
)

// WithHandle is context.WithCancelCause whose cancel func one piece of work further down
// the same call may take over ([Take]) instead of deriving a cancellable context of its
// own. Each cancellable layer costs a context, a done channel and a child map in its
// parent for as long as the call runs; the server chain's retry-id layer and the node
// table's Begin would otherwise both add one to every call.
func WithHandle(parent context.Context) (context.Context, context.CancelCauseFunc) {
	c, cancel := context.WithCancelCause(parent)
	return &handleCtx{Context: c, cancel: cancel}, cancel
}

// handleCtx is the context of WithHandle. Its children register with the embedded
// cancelCtx as usual (Value passes through), and context.Cause sees its cause.
type handleCtx struct {
	context.Context
	cancel context.CancelCauseFunc
	taken  atomic.Bool
}

// Take returns the cancel func of ctx when ctx is itself a context made by WithHandle (not
// one derived from it, which may have cancellable layers of its own) and the func has not
// been taken before. Cancelling it cancels ctx with the cause given; ctx is still its
// maker's to release.
func Take(ctx context.Context) (context.CancelCauseFunc, bool) {
	h, ok := ctx.(*handleCtx)
	if !ok || !h.taken.CompareAndSwap(false, true) {
		return nil, false
	}
	return h.cancel, true
}
