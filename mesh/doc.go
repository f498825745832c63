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
//  0. metrics (ServerConfig.Metrics, when set): the standard gRPC server metrics of
//     go-grpc-middleware's Prometheus provider, recorded by package rpcmetrics. Outside
//     recovery and status so it counts every call with the code the caller receives.
//  1. recovery: a panic anywhere below becomes INTERNAL instead of killing the process
//     and every in-flight run with it. Outermost so it also guards the other interceptors.
//  2. status: every error leaving a handler becomes a gRPC status with the documented
//     code; internal error text is logged, never sent. Outside the deadline layer so the
//     fast-fail statuses it makes pass through unchanged.
//  3. authorization (ServerConfig.Authorize, with mTLS: a meshtls.Policy): a caller the
//     call graph does not allow is refused with PERMISSION_DENIED (UNAUTHENTICATED
//     without a mesh identity) before anything else runs. Inside metrics, recovery and
//     status, so refusals are counted and logged; before the deadline, so a refused
//     call takes no deadline, identity or retry-id.
//  4. deadline: a request without a deadline gets the service default, one beyond the
//     maximum is capped; then the relative gRPC deadline is reconciled with the caller's
//     absolute curfew-deadline, so that a child never sees a later deadline than its
//     parent (a gap over a second is logged as clock skew and the gRPC deadline kept). It
//     only ever shortens. Before anything that measures time left. With metrics, the
//     final deadline's time left is observed here (curfew_deadline_slack_seconds).
//  5. identity: curfew-tenant, curfew-run-id, curfew-node-id and curfew-attempt become
//     the context's md.Identity, so handlers and their outgoing calls carry them. The
//     tenant is authenticated here when ServerConfig.Authenticate is set (the
//     orchestrator: an apikey.Guard): the claimed curfew-tenant is replaced by the
//     tenant of the caller's verified API key, or kept only from a trusted mesh peer,
//     and a caller with neither is refused with UNAUTHENTICATED.
//  6. fast-fail: a method with a configured minimum is refused with DEADLINE_EXCEEDED
//     ("no time left to start X") when less than that remains. After the deadline layer,
//     so it sees the final deadline; before retry-id, so a doomed attempt does not
//     supersede one that is still running.
//  7. retry-id: at most one attempt per (tenant, method, retry-id) runs; a newer attempt
//     supersedes (cancels with cause superseded) the earlier one and starts only after its
//     teardown, or is refused with ABORTED past the grace (package retryid). Last, so the
//     handler's context is the one the supersede cancels.
//
// Client chain (see [DialOptions]), outermost first: the standard gRPC client metrics
// when ClientConfig.Metrics is set (one logical call each), then identity and deadline are stamped on
// every outgoing call (curfew-deadline is the context's deadline in Unix ms; gRPC itself
// sends grpc-timeout from the same deadline), then the retry layer (package retry) runs
// the logical call's attempts, then the target's circuit breaker (package breaker) admits
// or refuses each attempt and counts its outcome. Retry sits outside the breaker so that
// every attempt is counted and an open breaker refuses each attempt before it is sent;
// the refusal is marked as retried to exhaustion, so neither this retry layer nor any
// above it waits out the open period.
//
// Status mapping (see [Status]): context cancellation → CANCELED, deadline →
// DEADLINE_EXCEEDED, anything that is not already a status → INTERNAL "internal error".
// A late or stuck duplicate attempt → ABORTED (package retryid); an error retried to
// exhaustion keeps its code and gains a RETRIES_EXHAUSTED ErrorInfo detail (package retry).
// Breaker open → UNAVAILABLE with RetryInfo (until the breaker half-opens) and a
// BREAKER_OPEN ErrorInfo (package breaker). Later layers add: shed or budget →
// RESOURCE_EXHAUSTED with RetryInfo.
package mesh
