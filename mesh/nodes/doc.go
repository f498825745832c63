// Package nodes is a process's own record of the run-tree nodes it executes.
//
// The rule is that a node is recorded by the process that executes it: the orchestrator
// records the run, modelproxy its decoders, toolrunner its tools, subagent its nested
// loops. A caller that cancels a child for a reason the child cannot see on the wire (a
// failed sibling) records a note with that cause ([Table.Note]). The orchestrator
// assembles a run's summary by merging what every process reports ([Merge]).
//
// [Table.List] can wait until every selected node has ended: that is how a caller waits
// for a remote child's teardown after cancelling it, since a gRPC cancel is not
// acknowledged. A [Server] serves a Table as curfew.mesh.v1.NodeReportService.
package nodes
