// Package chaos wires the drill's faults (package mesh/chaos, docs/drill.md) into a
// modelproxy started with --chaos; without the flag nothing of it runs, and package
// modelproxy does not depend on it. The faults apply to the sim model only, and each
// breaks one defence on purpose:
//
//   - orphan: the decoder ignores its call's cancel and its lease, and decodes on a context
//     detached from the call but bounded by the call's deadline.
//   - drop-cancel: the decoder ignores its call's cancel (the RST_STREAM and the cancel
//     broadcast); its lease still stops it when it lapses.
//   - worker-ledger: the decoder's tokens go to the ledger under this worker (host, pid),
//     not under the task (run, node).
//   - no-dedupe: an attempt failed by the plan's model_error leaves its decoder running,
//     as a node of its own (NODE~aN), which the retry of the same retry-id does not
//     supersede; nothing renews its lease, so the lease lapse stops it.
//
// Wire puts them in: a provider wrapper around the sim model (Provider: the decoders that
// outlive their call, and the one left running), and a ledger-keying hook (LedgerKey).
package chaos
