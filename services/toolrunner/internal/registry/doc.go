// Package registry is toolrunner's registry of tools from outside curfew: the sources a
// configuration file names (MCP servers over stdio or streamable HTTP, gRPC
// curfew.tool.v1.ToolService servers), the tools they list, and the policy every call of
// them runs under.
//
// The file (Load, docs/tools.md) names each source, how to reach it, whether it is
// trusted, and the policy of its tools: side effects, least time to start, concurrency,
// retries, output cap, tenants. A Registry (New) opens and lists each source in the
// background, again whenever the source says its list changed, and with backoff while it
// is down; a down source never stops toolrunner, its tools fail UNAVAILABLE with the
// reason. Models and plans see a source's tool as source__tool (Name); the built-in tools
// keep their bare names and stay toolrunner's own (the registry only lists them).
//
// Prepare checks a call (the tool exists for the tenant, its source is up, its arguments
// satisfy the tool's input schema) before anything is sent; Prepared.Run runs it under
// the tool's policy, with retries that its side effects allow and one breaker per source.
package registry
