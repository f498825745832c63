// Package mesh is curfew's shared library: the interceptor chain every service installs,
// defined once here in order, and the status mapping every boundary uses.
//
// One policy lives in each subpackage (md, deadline, cancel, nodes, plan, agent, ...);
// this package only composes them. Services call [ServerOptions] for their gRPC server
// and [DialOptions] for every client connection, and nothing else, so the order below
// holds everywhere. Each chain is declared as a table of named layers (serverChain in
// chain.go, clientChain in chain_client.go); the lists here are the same layers in the
// same order, and a test fails if the two disagree or if a call runs them in another
// order. A layer whose setting is off is left out.
//
// Server chain, outermost first: everything a call passes through.
//
//  1. credentials (ServerConfig.Credentials; mTLS from package meshtls in the services):
//     the TLS handshake, once per connection, authenticates the peer before any call.
//  2. header-limit (ServerConfig.MaxHeaderListSize): the transport refuses a request
//     whose metadata is larger, before the call begins.
//  3. tracing (ServerConfig.Tracing, package tracing): otelgrpc's stats handler opens the
//     call's span when its headers arrive, before every interceptor, and closes it after.
//  4. message-limit (ServerConfig.MaxRecvMsgSize): a larger request message is refused
//     with RESOURCE_EXHAUSTED; grpc-go reads a unary request, and so refuses it, before
//     the interceptors run (a stream's messages when the handler receives them).
//  5. metrics (ServerConfig.Metrics): the standard gRPC server metrics of
//     go-grpc-middleware's Prometheus provider. The outermost interceptor, so it counts
//     every call with the code the caller receives.
//  6. call-log: one line per call when it ends ("call finished": method, run_id,
//     node_id, retry_id, attempt, error_type, error, elapsed_ms; its level by
//     [FinishLevel]). Outside recovery and status, so it logs what the caller receives.
//  7. recovery (go-grpc-middleware's): a panic anywhere below becomes INTERNAL
//     "internal error", logged with its stack, instead of killing the process and every
//     in-flight run with it.
//  8. status: every error leaving a handler becomes a gRPC status with the documented
//     code; internal error text is logged, never sent. Outside the layers that refuse
//     calls, so the statuses they make pass through unchanged; a handler's UNAVAILABLE
//     or RESOURCE_EXHAUSTED is marked relayed for callers' breakers (breaker.Relay).
//  9. authorize (ServerConfig.Authorize, with mTLS: a meshtls.Policy): a caller the
//     call graph does not allow is refused with PERMISSION_DENIED (UNAUTHENTICATED
//     without a mesh identity) before anything else runs. Inside metrics, call-log and
//     status, so refusals are counted and logged; before the deadline, so a refused
//     call takes no deadline, identity or retry-id.
//  10. contract (md.Check): every curfew-* header is checked against its rule (docs/api.md,
//     "What each header may hold"); one sent twice or malformed is refused with
//     INVALID_ARGUMENT naming the header and the rule. After authorize, so a caller the
//     call graph forbids learns nothing about its headers; before every layer that reads
//     one, so a malformed deadline, retry-id or tenant never takes effect.
//  11. deadline: a request without a deadline gets the service default, one beyond the
//     maximum is capped; then the relative gRPC deadline is reconciled with the caller's
//     absolute curfew-deadline, so that a child never sees a later deadline than its
//     parent (a gap over a second is logged as clock skew and the gRPC deadline kept). It
//     only ever shortens. Before anything that measures time left. With metrics, the
//     final deadline's time left is observed here (curfew_deadline_slack_seconds).
//  12. identity: curfew-tenant, curfew-run-id, curfew-node-id, curfew-attempt and the
//     other curfew headers become the context's md.Identity, so handlers and their
//     outgoing calls carry them.
//  13. chaos (left out with ServerConfig.Chaos): the curfew-chaos header is cleared from
//     the identity, so nothing acts on it or sends it on, and a warning is logged the
//     first time. Right after identity, before anything reads it.
//  14. authenticate (ServerConfig.Authenticate; the orchestrator: an apikey.Guard): the
//     claimed curfew-tenant is replaced by the tenant of the caller's verified API key,
//     or kept only from a trusted mesh peer, and a caller with neither is refused with
//     UNAUTHENTICATED; then the tenant's request rate (apikey.Guard.Limit, admission's
//     per-tenant rate in the orchestrator) may refuse it with RESOURCE_EXHAUSTED. After
//     the deadline, so its lookup is bounded by it.
//  15. fast-fail (ServerConfig.MinTime): a method with a configured minimum is refused
//     with DEADLINE_EXCEEDED ("no time left to start X") when less than that remains.
//     After the deadline layer, so it sees the final deadline; before retry-id, so a
//     doomed attempt does not supersede one that is still running.
//  16. retry-id: at most one attempt per (tenant, method, retry-id) runs; a newer attempt
//     supersedes (cancels with cause superseded) the earlier one and starts only after its
//     teardown, or is refused with ABORTED past the grace (package retryid). Last, so the
//     handler's context is the one the supersede cancels.
//
// Admission of runs (package admission) is not a layer of this chain: the orchestrator
// admits each new run in its handlers, inside the whole chain, once the call has its
// authenticated tenant and final deadline, and sheds with RESOURCE_EXHAUSTED and
// RetryInfo.
//
// Client chain (see [DialOptions]), outermost first:
//
//  1. metrics (ClientConfig.Metrics): the standard gRPC client metrics, one logical call
//     each, with its final code and whole duration, retries included.
//  2. retry (package retry): one logical call, its attempts (same retry-id,
//     curfew-attempt numbered), backoff, pushback, budget. It stamps every attempt with
//     the identity, curfew-deadline (the context's deadline in Unix ms; gRPC itself sends
//     grpc-timeout from the same deadline), retry-id and attempt, in one metadata append.
//     Outside everything that is per attempt, so each attempt passes the breaker and is
//     counted by it, and the one retrying layer sees every attempt's outcome, the
//     breaker's refusals included.
//  3. breaker (package breaker, when ClientConfig.Breakers is set): the target's circuit
//     breaker, innermost, next to the transport, so that it counts what the target did
//     to each attempt and an open breaker refuses an attempt before anything is sent.
//     Its refusal is marked as retried to exhaustion, so the retry layer returns it at
//     once instead of sleeping out the open period, and no retry layer further up
//     retries it either. Were the breaker outside the retry layer, it would count one
//     outcome per logical call, hiding the failed attempts that a retry rescued, and a
//     trip in the middle of a call would not stop that call's remaining attempts.
//
// Status mapping (see [Status]): context cancellation → CANCELED, deadline →
// DEADLINE_EXCEEDED, anything that is not already a status → INTERNAL "internal error".
// A late or stuck duplicate attempt → ABORTED (package retryid); an error retried to
// exhaustion keeps its code and gains a RETRIES_EXHAUSTED ErrorInfo detail (package retry).
// Breaker open → UNAVAILABLE with RetryInfo (until the breaker half-opens) and a
// BREAKER_OPEN ErrorInfo (package breaker). Admission shed or an exhausted tenant budget
// (the orchestrator's handlers, package admission) → RESOURCE_EXHAUSTED with RetryInfo.
package mesh
