// Package orchestrator is curfew's public entry point. It admits runs, fixes each run's
// absolute deadline once (the call's gRPC deadline, the service default when there is
// none, capped at the maximum), runs the shared agent loop, streams events to the client,
// and cancels the whole tree on client disconnect (unless the request asked to continue),
// deadline, or CancelRun.
//
// A run's summary is assembled from what every process recorded about the nodes it
// executed (NodeReportService on modelproxy, toolrunner and subagent), after waiting for
// their teardown: the token figures come from the decoders' own ledger, not from what the
// orchestrator happened to receive, because after a cancel the orchestrator has stopped
// listening and only the decoder knows what it went on spending.
//
// Every run is recorded in the store (Config.Store) and leased to the orchestrator that
// advances it; the most recent MaxRuns are also kept in memory (a process-private store
// forgets the older ended ones with them). Where the store makes a
// difference, the server asks whether other orchestrators share it (store.Sharing): on a shared
// store (a SQLite file, PostgreSQL) runs are checkpointed step by step, and a dead or
// draining orchestrator's runs are resumed by another; on a process-private one
// (memory://) they are not, and a drain cancels them.
//
// The files, by responsibility:
//
//   - server.go: Config, Server and its construction.
//   - api.go: the OrchestratorService methods (Run, StartRun, WatchRun, GetRun,
//     ListRuns, CancelRun) and Replay, the DeadLetterService's replayer.
//   - run.go: the run type (its record, events, lease state) and this process's table
//     of runs.
//   - start.go: the one path by which a run starts (validate, drain, minimum time,
//     admission, create, launch), shared by Run, StartRun and Replay.
//   - execute.go: running a run's agent loop (parked on an open breaker when it has a
//     journal) and assembling its summary.
//   - leases.go: heartbeats, takeover and resume, the journal of checkpoints, and the
//     fenced commit of a run's result.
//   - storewait.go: a run waiting, within its deadline, for an unavailable store to
//     take its checkpoint.
//   - stored.go: reading runs from the store.
//   - cancel.go: a run's cancel, decoders first; cancelfwd.go: cancelling a run that
//     another orchestrator owns; watchfwd.go: relaying the WatchRun of such a run from
//     its owner.
//   - drain.go: the drain and shutdown.
//   - admission.go: admitting new runs; deadletters.go: recording failed runs and the
//     DeadLetterService.
//   - leasemetrics.go, logging.go: the run-lease metrics (the waits for the store
//     among them) and the run log lines.
package orchestrator
