// Package agent is the agent loop shared by the orchestrator and the subagent service:
// model step (streamed) → the step's tool calls in parallel → next model step → … →
// answer.
//
// The loop applies seed 000's disciplines: one absolute deadline carried unchanged on the
// context; a fast-fail check of the time left before every model call and tool call; when
// one parallel tool fails, its siblings are cancelled with cause sibling_failed and the
// loop waits for their teardown before it returns the error; cancellation is caught only
// to wait for that teardown, and then returned.
//
// A gRPC cancel is not acknowledged, so "wait for teardown" across a process boundary
// means asking the executor: after a call is cancelled the loop calls the executor's
// NodeReportService.ListNodes with a settle timeout for that node's subtree, which returns
// once the executor has recorded the node's end (and, recursively, its children's).
//
// What happens in the tree goes to the loop's owner through Config.Emit (nodes: started,
// progressed, ended) and Config.EmitEvent (node events of whatever kind, each between its
// tool node's start and end), for the orchestrator and the subagent service to forward.
package agent
