// Package hedge sends hedged calls (Finagle's backup requests; grpc-go does not implement
// gRFC A6 hedging): when a call has not answered after the latency that a fraction
// MaxExtraLoad of its recent calls exceeded (0.05: the p95), one backup is sent beside
// it, the first success wins, and the other is cancelled with cause superseded
// (cancel.ErrSuperseded).
//
// It serves the agent loop's tool calls only (mesh/agent), and only for tools whose
// side effects are none or idempotent and which run no model calls
// (toollist.Tools.Hedgeable): model calls have no path through it, so a hedge never runs
// a second decoder.
//
// The policy, per tool:
//   - the latencies of the last Window (DefaultWindow, 200) successful calls are kept in
//     a ring; a backup is considered only once MinSamples (DefaultMinSamples, 50) have
//     been seen, and then after the (1 − MaxExtraLoad) quantile of the ring;
//   - a call whose backup won is recorded at the delay (it is known only to be slower
//     than that): winning backups neither drag the quantile down (more backups than
//     MaxExtraLoad) nor, as its elapsed time would, push it up call after call until
//     hedging stops;
//   - no backup is sent with less time left than the caller's minimum for the call;
//   - the backup draws on the target's retry budget: the caller sends it with
//     retry.Hedge, and a refusal (retry.ErrHedgeRefused) leaves the first call alone;
//   - the backup carries curfew-hedge: 1 and its twin's retry-id (the caller mints one
//     for both), so that the retry-id table and toolrunner's idempotency records let it
//     run beside its twin.
//
// Metrics, by tool: curfew_hedges_sent_total, curfew_hedges_won_total (the backup
// answered first), curfew_hedges_refused_total (the retry budget refused the backup).
package hedge
