package retry

import (
	"context"
	"sync/atomic"
)

// A target may run as several replicas (endpoints) behind one connection. When one of
// them dies, its calls in flight fail UNAVAILABLE at once, while another replica serves.
// The breaker below this layer (mesh/breaker, innermost in the chain) tells such an
// endpoint failure apart and notes it on the attempt's context; a retry of that attempt
// needs no retry window (Config.Window): the window keeps a failing target from a retry
// storm, and this target is not failing, one replica of it is, and the retry goes to
// another (gRPC's balancer stops picking the dead one). The retry budget, the policy's
// attempts and its backoff still apply.

// endpointNote is one attempt's note, made only when a Window is configured.
type endpointNote struct{ failed atomic.Bool }

type endpointNoteKey struct{}

// NoteEndpointFailure records, on an attempt's context, that the attempt failed at one
// endpoint of its target while another endpoint is up. It does nothing on a context this
// layer did not make.
func NoteEndpointFailure(ctx context.Context) {
	if n, ok := ctx.Value(endpointNoteKey{}).(*endpointNote); ok {
		n.failed.Store(true)
	}
}

// noted returns the attempt's ctx with a fresh note, remembered as the call's last, when
// the call may need a retry window; ctx as it is otherwise.
func (cl *call) noted(ctx context.Context) context.Context {
	if cl.c.cfg.Window == nil || cl.p.Naive {
		return ctx
	}
	cl.note = &endpointNote{}
	return context.WithValue(ctx, endpointNoteKey{}, cl.note)
}

// endpointFailed reports whether the call's last attempt failed at one endpoint while
// another was up.
func (cl *call) endpointFailed() bool {
	return cl.note != nil && cl.note.failed.Load()
}
