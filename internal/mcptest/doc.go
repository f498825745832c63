// Package mcptest is an MCP server for tests and benchmarks: a handful of tools with
// controllable timing, progress, cancellation behaviour, effects and result size, built
// on the official Go SDK (github.com/modelcontextprotocol/go-sdk). The binary
// internal/mcptest/cmd/curfew-mcptest serves it over stdio or streamable HTTP.
//
// Tools (arguments in parentheses):
//
//   - echo (text): returns text as a text block.
//   - wait (ms, progress_ms): waits ms milliseconds or until its context ends, sending
//     progress every progress_ms when set; fails with the context's error when it ended.
//   - stubborn (ms, progress_ms): ignores cancellation: sends progress every progress_ms
//     for ms milliseconds, then returns.
//   - effect: does its effect at most once per idempotency key (from _meta) and returns
//     {"key", "calls", "effects"}: how often the key was seen and how many effects it
//     caused (always 1) as structured content.
//   - big (bytes): returns a text block of that many bytes.
//   - add_tool (name): adds a tool of that name that works like echo, so that the server
//     sends notifications/tools/list_changed.
//
// Every call's _meta is checked for curfew's keys (source.MetaPrefix): deadline and
// timeout_ms integers, the ids strings. A malformed _meta fails the call (isError) and
// is recorded. With a Recorder, each call appends one JSON line (Record) when its handler
// returns: the tool, the curfew _meta it received, when it started, when its context
// ended and when it returned (Unix nanoseconds).
package mcptest
