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
// Runs are kept in memory (the most recent MaxRuns); the durable store comes later.
package orchestrator
