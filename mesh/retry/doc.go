// Package retry is curfew's client-side retry discipline: exponential backoff with full
// jitter, deadline-aware attempts, server pushback, a retry budget per target, optional
// client-side adaptive throttling, and the "one retrying layer" rule.
//
// Defaults come from the anchors: at most 3 attempts per request (SRE book; grpc-go caps
// retries at 5, so MaxAttempts may not exceed 5), full-jitter backoff with base 25 ms and
// cap 250 ms (Envoy), a budget of 20 % of requests plus 10 retries per second over a 10 s
// window (Linkerd/Finagle), and throttling by max(0, (requests − 2·accepts)/(requests+1))
// (SRE book).
//
// Only UNAVAILABLE is retried by default; RESOURCE_EXHAUSTED only when the server pushed
// back with a delay. A server's pushback (the grpc-retry-pushback-ms trailer or a
// google.rpc.RetryInfo detail) replaces the backoff; a negative or malformed pushback means
// "don't retry". An attempt is never started with less than MinAttemptTime left, and a
// backoff that would end past the deadline is not slept: the call fails with
// DEADLINE_EXCEEDED.
//
// One retrying layer: an error this layer retried to exhaustion leaves it marked (a
// google.rpc.ErrorInfo detail with reason RETRIES_EXHAUSTED), and no layer above retries
// a marked error, so failures at orchestrator → subagent → modelproxy do not multiply.
//
// Coordinated retries (issue 24): Config.Window, when set, is asked before every retry
// (never before a first attempt) whether this replica holds the target's cluster-wide
// retry window. A refusal that says when the window moves (WindowRefusal) is waited out,
// up to MaxWindowWaits times while the deadline leaves room for an attempt ("others
// wait", seed 001); a refusal not waited out ends the call with its error marked
// RETRIES_EXHAUSTED, as if its retries were spent. mesh/retrywindow implements it on the
// store's slots; the retry file's "window" section (WindowConfig, default 1 replica per
// 10 s window) sets it. A nil Window leaves every replica retrying on its own.
//
// Restartable streams: a server-streaming call is retried only before its first message,
// unless the caller passes Restartable, saying it can take the stream again from its
// start (the agent loop's tool calls and model steps, whose callee may die mid-call).
//
// Policy logic takes an injected clock and random source and imports no transport code;
// the interceptors in interceptor.go apply it to gRPC calls.
package retry
