// Package cancel names why work was stopped and runs cleanup on a budget of its own.
//
// Cancellation is the stop signal at every hop: a context cancelled with
// context.WithCancelCause carries one of the Err* causes here, and [CauseOf] turns it into
// the wire enum recorded per node. When a cancel arrives over gRPC (RST_STREAM) the cause
// is not on the wire; the node records UNSPECIFIED and the run summary resolves it from
// the nearest ancestor that knows ([Resolve]).
//
// [Cleanup] is the seed's rule for teardown: the deadline that triggered it has no time
// left, so cleanup gets its own small budget, detached from the cancelled context but
// keeping its values, and the caller re-raises the cancellation afterwards.
//
// A caller whose child call failed follows three rules, here so that the agent loop and
// toolrunner apply them alike: [Await] a child's CANCELLED for a moment, since it may be
// the caller's own cancel on its way; [Settle] a cancelled child, asking its executor to
// report the end of its subtree (a gRPC cancel is not acknowledged); and return [Status],
// the cancelled caller's own status. [DeadlineSlop] is how close to a deadline an end
// counts as that deadline.
package cancel
