// Package mesh is curfew's shared library: the interceptor chain every service installs,
// defined once here in order, and the status mapping every boundary uses.
//
// One policy lives in each subpackage (md, deadline, cancel, nodes, plan, agent, ...);
// this package only composes them. Services call [ServerOptions] for their gRPC server
// and [DialOptions] for every client connection, and nothing else, so the order below
// holds everywhere.
//
// Server chain, outermost first:
//
//  1. recovery: a panic anywhere below becomes INTERNAL instead of killing the process
//     and every in-flight run with it. Outermost so it also guards the other interceptors.
//  2. status: every error leaving a handler becomes a gRPC status with the documented
//     code; internal error text is logged, never sent. Outside the deadline layer so the
//     fast-fail statuses it makes pass through unchanged.
//  3. deadline: a request without a deadline gets the service default, one beyond the
//     maximum is capped; then the relative gRPC deadline is reconciled with the caller's
//     absolute curfew-deadline, so that a child never sees a later deadline than its
//     parent (a gap over a second is logged as clock skew and the gRPC deadline kept). It
//     only ever shortens. Before anything that measures time left.
//  4. identity: curfew-tenant, curfew-run-id, curfew-node-id and curfew-attempt become
//     the context's md.Identity, so handlers and their outgoing calls carry them.
//  5. fast-fail: a method with a configured minimum is refused with DEADLINE_EXCEEDED
//     ("no time left to start X") when less than that remains. Last, so it sees the final
//     deadline and costs nothing when it refuses.
//
// Client chain: identity and deadline are stamped on every outgoing call (curfew-deadline
// is the context's deadline in Unix ms; gRPC itself sends grpc-timeout from the same
// deadline, so a child can never see a later deadline than its parent).
//
// Status mapping (see [Status]): context cancellation → CANCELED, deadline →
// DEADLINE_EXCEEDED, anything that is not already a status → INTERNAL "internal error".
// Later layers add: breaker open → UNAVAILABLE, shed or budget → RESOURCE_EXHAUSTED with
// RetryInfo, duplicate in flight → ABORTED.
package mesh
