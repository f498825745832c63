// Package soak drives a curfew mesh the way production does: many runs at once, for
// minutes, of a mix of plans (tool calls, an MCP server's tool with a side effect,
// subagents, model steps; some failing, some cancelled by their client, some past their
// deadline), and reports what users and operators feel: throughput, latency
// percentiles (start, cancel to the last decoder stopped, deadline overshoot), outcomes
// by code, tokens decoded after a cancel, duplicate side effects, runs lost, and every
// process's goroutines, heap and resident memory over time, as a JSON report and PNG
// plots.
//
// [Drive] runs the load against orchestrators a caller already has; the command
// bench/soak/cmd/curfew-soak starts a mesh under `curfew up` (or targets one) and writes
// the report (docs/soak.md).
//
// The mix is stated by [Mix]: each kind's share, tokens per model step, decode rate and
// tool durations; the offered load is the number of runs kept in flight
// ([Config].Concurrency), a closed loop: each worker starts its next run when its last
// one ended.
package soak
