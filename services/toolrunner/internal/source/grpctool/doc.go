// Package grpctool is the tool source of a gRPC curfew.tool.v1.ToolService: a team's
// tool server in any language (package mesh/toolserver in Go, examples/node-tool in
// Node). List asks the server's ListTools; Call runs CallTool with the call's context,
// so the run's deadline travels as the gRPC deadline and a cancelled node resets the
// stream (RST_STREAM), and with curfew's metadata (curfew-run-id, curfew-node-id,
// curfew-retry-id, curfew-attempt, curfew-idempotency-key, curfew-deadline) from the
// call's source.Meta.
//
// The connection is made lazily and kept: Open fails only for a configuration gRPC
// cannot dial (an empty or malformed address), never for a server that is down; List
// and Call then fail UNAVAILABLE, naming the source, until it answers. Each time the
// connection becomes ready (the first time, and again after the server restarted),
// Changed is closed, so the registry lists the tools again.
//
// Config.DialOptions carry the connection's policy: toolrunner dials with mesh's
// client chain (mesh.DialOptions: retries, breaker, metrics) and its transport
// credentials. Without credentials among them the connection is plaintext.
package grpctool
