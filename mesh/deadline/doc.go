// Package deadline holds curfew's deadline policy: one absolute deadline per run,
// assigned once, carried unchanged to every leaf, and never extended.
//
// The gRPC deadline (grpc-timeout) is authoritative at every hop because it is relative
// and so immune to clock skew. [Policy.Apply] gives a request without a deadline the
// service default, and caps one beyond the maximum; it can only ever shorten. [Check] is
// the fast-fail before expensive work: it returns DEADLINE_EXCEEDED "no time left to
// start X" when less than the work's minimum remains.
package deadline
