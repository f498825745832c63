// Package chaos parses the drill's fault switches, carried per request in the
// curfew-chaos header (md.Chaos).
//
// The switches are explicit chaos settings, off by default, for `curfew drill` (seed 003's
// cancel-and-shed drill, docs/drill.md): a service honours them only when it was started
// with --chaos (CURFEW_CHAOS); without it, the server chain clears the header, logging a
// warning once. They break the cancel path on purpose, one hop at a time, so that the
// drill can show which defence catches each break:
//
//	orphan              propagation off: the orchestrator neither cancels nor broadcasts on a
//	                    client cancel; modelproxy's decoders ignore their call's cancel and
//	                    their lease, and decode until the run's deadline
//	drop-cancel         modelproxy's decoders of overflow (sheddable) runs ignore their call's
//	                    cancel; their lease still applies
//	slow-heartbeat=DUR  the caller renews this run's decoder leases only every DUR, bypassing
//	                    the remaining/3 rule
//	no-retry-id         a retry sent without its retry-id (the drill sends it; no service
//	                    reads the switch)
//	worker-ledger       modelproxy keys the decoder's tokens by worker (host, pid), not task
//	no-dedupe           a failed attempt's decoder is left running and is not superseded by
//	                    the retry of the same retry-id
//
// Settings are read from the identity on a context (From), which the server chain fills
// from the header and clears when chaos is off.
package chaos
