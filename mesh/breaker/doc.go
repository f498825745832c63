// Package breaker is curfew's circuit breaker per downstream target (a service, or a
// model provider in modelproxy): sony/gobreaker v2's two-step breaker wrapped with
// curfew's outcome classification, open-period jitter, a gRPC refusal status, metrics,
// and client interceptors.
//
// # States
//
// Closed: every call goes through, and outcomes are counted over a rolling window
// (Config.Window, in WindowBuckets gobreaker buckets). The breaker trips to open after
// Config.ConsecutiveFailures failures in a row, or when failures are at least
// Config.FailureRatio of the judged calls (successes plus failures) in the window once it
// holds Config.MinRequests of them.
//
// Open: every call is refused at once, before anything is sent, with UNAVAILABLE, a
// google.rpc.RetryInfo (the time until the breaker half-opens, at least MinRetryDelay)
// and a google.rpc.ErrorInfo {Reason: "BREAKER_OPEN", Domain: "curfew.dev", Metadata:
// target, state}. The open period is Config.OpenTimeout spread uniformly by ±
// Config.Jitter, drawn anew each time the breaker opens. gobreaker's Settings have no
// jitter and a Timeout fixed for the breaker's life, so gobreaker's Timeout is set to the
// shortest period, OpenTimeout·(1−Jitter), and the breaker keeps refusing on its own until
// the drawn period has passed, before gobreaker is even asked; gobreaker turns half-open
// only when asked after that. A timer asks at the end of the period, so the state gauge
// flips to half-open on time without traffic.
//
// Half-open: exactly one probe goes through (gobreaker MaxRequests 1); other calls are
// refused as when open (RetryInfo MinRetryDelay, ErrorInfo state "half-open"). The probe's
// success closes the breaker, its failure opens it again for a new period; a probe whose
// outcome is ignored (the caller cancelled it) frees the slot for the next call.
//
// # One probe per target across replicas
//
// [Set.Coordinate] makes the half-open probe cluster-wide: a breaker that half-opens
// claims its target's lease in a shared store (store.Slots, scope "probe/<target>" of
// size 1) before its probe goes out, and a replica that finds it held sends nothing and
// stays open until the lease ends. The prober writes the outcome into the lease: a
// success releases it, and every replica's breaker for the target closes when it next
// reads it (every Coordination.Poll while not closed); a failure keeps it for the
// prober's new open period, which every replica waits out, so the next probe is again
// one cluster-wide. gobreaker cannot close an open breaker early, so a breaker still open
// when another replica's probe succeeds is replaced by a new, closed one. A closed
// breaker never asks the store. While the store cannot be reached a breaker probes on
// its own, as without coordination ([Breaker.CoordinationDegraded]). Without
// Coordinate (the default) nothing changes. docs/cluster.md has the details and costs.
//
// # What counts
//
// [Classify] decides, per gRPC code and the caller's context, whether an outcome is a
// success, a failure, or ignored. In short: a call cancelled by its caller, or whose
// caller's deadline passed, is ignored, as are CANCELED, a DEADLINE_EXCEEDED of the
// caller's own short budget, a RESOURCE_EXHAUSTED pushback with RetryInfo, and failures
// relayed from below the target (marked BREAKER_OPEN, RETRIES_EXHAUSTED, or by [Relay]);
// client errors (INVALID_ARGUMENT, NOT_FOUND, ..., ABORTED) are successes, since the
// target answered; UNAVAILABLE, INTERNAL, UNKNOWN, DATA_LOSS, RESOURCE_EXHAUSTED without
// RetryInfo, and a DEADLINE_EXCEEDED the target gave while its caller still had time are
// failures.
//
// # Use
//
// A [Set] holds one breaker per target, created on first use. Code that calls a target
// by other means than gRPC (modelproxy's HTTP providers) uses [Breaker.Allow] and its
// done callback; gRPC clients install [Set.UnaryClientInterceptor] and
// [Set.StreamClientInterceptor] (package mesh's client chain does, inside the retry
// layer). [IsOpen] and [Open] recognize a refusal.
//
// # Retries
//
// The retry layer sits outside the breaker, so each attempt asks the breaker. A refused
// attempt must not be retried: waiting out the open period would hold the caller for
// seconds instead of failing fast, and when the breaker half-opens only one of the
// waiting callers gets the probe. The interceptors therefore mark a refusal with the
// retry package's RETRIES_EXHAUSTED ErrorInfo (attempts "0": nothing reached the target),
// which the retry layer returns at once without sleeping, and which no retry layer
// further up the call tree retries either. The RetryInfo stays on the error for callers
// that schedule work or fall back (modelproxy's fallback chain).
//
// # Metrics
//
//   - curfew_circuit_breaker_state{target,state}: 1 for the current state, 0 for the
//     other two.
//   - curfew_circuit_breaker_transitions_total{target,from,to}: state changes.
//   - curfew_circuit_breaker_calls_total{target,outcome}: success, failure, ignored,
//     rejected (refused while open or half-open).
//
// A coordinated Set adds:
//
//   - curfew_circuit_breaker_probes_total{target,outcome}: half-open probes sent
//     (success, failure, ignored).
//   - curfew_circuit_breaker_probe_leases_refused_total{target}: claims of the probe
//     lease lost to another replica.
//   - curfew_circuit_breaker_shared_outcomes_total{target,outcome}: another replica's
//     probe applied here: closed, reopened.
//   - curfew_circuit_breaker_coordination_degraded{target}: 1 while the breaker is not
//     closed and cannot reach the store, so it probes on its own.
//   - curfew_circuit_breaker_transitions_total{from="open",to="closed"}: closed by
//     another replica's probe while still open.
//
// Every series of a target exists from its breaker's creation (or its Set's
// coordination), at 0 where nothing happened yet.
//
// docs/breakers.md is the operator's view: states, what counts, the chain order, flags.
package breaker
