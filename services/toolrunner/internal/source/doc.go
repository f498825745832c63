// Package source defines what toolrunner needs of a place tools come from: the built-in
// tools, an MCP server (stdio or streamable HTTP) or a gRPC curfew.tool.v1.ToolService.
// The registry (package registry) names, validates and guards the tools; a Source only
// lists and calls them, under the call's context, which carries the run's deadline and
// is cancelled with the node.
package source
