// Package subagent runs nested agent loops for spawn_subagent. A nested loop runs under
// the parent's deadline (the gRPC deadline of the Spawn call, never extended) and node
// path: the subagent node is <tool node>/sub, and its model steps and tools hang beneath
// it. Depth is bounded here as well as in toolrunner, so a misbehaving caller cannot nest
// without limit.
package subagent
