// Package toolrunner executes tools for the agent loop. The built-ins are:
//
//   - sleep: waits args.ms, cancellable at once; with args.progress_ms it reports its
//     progress every that many milliseconds, as node events.
//   - fail: fails the first args.times attempts with args.code (default UNAVAILABLE),
//     after args.after_ms; for tests of failure handling.
//   - deploy: starts a job that takes args.duration_ms and polls it every args.poll_ms.
//     Cancelled mid-poll, it aborts the job on a cleanup budget of its own
//     (args.cleanup_ms, default 5 s), detached from the cancelled context, since the
//     deadline that triggered the teardown has by definition no time left; then it
//     re-raises the cancellation.
//   - spawn_subagent: runs args.task (or a sim plan, args.plan) in the subagent service, with
//     the model, tools, max_tokens and reserve given, under the same deadline and
//     node path, streaming the nested nodes and node events back. Limited in depth and
//     per-run fan-out.
//
// Each tool call is a node recorded here, by the process that executes it; the node ends
// only after its teardown (a deploy's abort, a subagent's settle) has finished. A tool
// streams node events (mesh.v1.NodeEvent) while its node runs, never after it ended (see
// events.go); its first one makes the call no longer retryable.
//
// A call that needs a human's approval (the registry says so, or the call asks:
// ExecuteRequest.require_approval) waits for it in its node before its effect, on a
// request in the store, capped by the run's deadline less the tool's minimum time (see
// approval.go).
package toolrunner
