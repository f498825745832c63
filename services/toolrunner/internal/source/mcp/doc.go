// Package mcp is the tool source for MCP (Model Context Protocol) servers, over stdio (a
// process the source starts and restarts) or streamable HTTP, on the official Go SDK
// (github.com/modelcontextprotocol/go-sdk).
//
// A Source keeps one MCP session to its server. Opening does not wait for a server that
// is down: List and Call then fail UNAVAILABLE, naming the source and the reason, while
// the source reconnects (for stdio, starts the process again) with exponential backoff;
// Changed is closed each time it has reconnected and when the server says its tools
// changed. What cannot work at all (a command that does not exist, a malformed URL) is
// an error from Open.
//
// Call sends curfew's facts in the request's _meta (source.Meta.MCPMeta) with a progress
// token of its own: the server's progress for that token reaches the call's progress
// callback while Call runs and is dropped and counted (Options.Late) after it returned.
// Call returns ctx's error as soon as ctx ends; the SDK then tells the server with
// notifications/cancelled, but Call does not wait for the server to stop. The SDK drops
// a response that arrives for a call already returned without telling its client, so
// such responses are not counted as late.
//
// The SDK reads messages of up to 16 MiB (stdio lines, SSE events) and whole JSON
// response bodies without a limit, so the source bounds what it reads itself: a message
// larger than Options.MaxMessageBytes fails the call with an error wrapping
// source.ErrTooLarge (code RESOURCE_EXHAUSTED); on stdio it also ends the session, and
// the process is restarted.
package mcp
