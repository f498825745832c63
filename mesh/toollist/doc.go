// Package toollist is the caller's side of toolrunner's ListTools: which tools a tenant's
// model is told of (name, description, the JSON Schema of the arguments) and what a
// caller needs to know of them to decide whether it may call one again (its side
// effects).
//
// A [Lister] asks toolrunner once per tenant and keeps the answer for its TTL
// (DefaultTTL, 5 s), so that a model step does not pay an extra hop each time. That is
// the staleness bound: a tool a source adds, drops or opens to another tenant reaches
// the models at most TTL (plus one listing) after toolrunner learned of it. A failed
// listing keeps nothing: the next step asks again. A caller that finds a listed tool
// gone (toolrunner answers NOT_FOUND) drops the tenant's list ([Lister.Invalidate]).
//
// When toolrunner does not answer (down, an older toolrunner without ListTools), the
// answer is the built-in tools ([Builtins]) and the run goes on: the Lister logs that
// once per outage, not once per step.
//
// [Tools.NeedsKey] decides whether a call of a tool may run a second time only with an
// idempotency key: a built-in by the catalogue (package catalog); a listed tool by its
// listed side effects (none and idempotent are retried freely, irreversible only with
// a key); any other name, whose effects are unknown here, conservatively only with a key.
package toollist
