// Package bench holds curfew's benchmarks, recorded in docs/benchmarks.md:
//
//   - BenchmarkCancelPropagation: across the real processes (internal/meshproc), the
//     time from a client's cancel of a Run call to the last leaf decoder in modelproxy
//     stopping, for trees of 1, 8 and 64 leaves at subagent depths 0 to 3.
//   - BenchmarkChain and BenchmarkChainLatency: a unary call through curfew's full
//     interceptor chain (mesh.ServerOptions, mesh.DialOptions) against bare grpc-go, on
//     loopback TCP, same handler (grpc health Check).
//   - BenchmarkRunMemory: resident memory per in-flight run, summed over the four
//     service processes, with 10,000 runs each waiting on a sleep tool.
//   - BenchmarkToolCancel, BenchmarkToolCall and BenchmarkToolMemory: MCP tools through a
//     real toolrunner (--tools-config, the test server internal/mcptest over stdio and
//     streamable HTTP) beside a bare go-sdk client of the same server: cancel to the
//     handler's ctx done, one echo call, and memory per idle session and per call.
//   - BenchmarkFirstDelta and BenchmarkFrontDoorDisconnect: a real model server (the
//     openaitest process) behind the mesh: time to the first streamed delta through the
//     OpenAI-compatible front door and through Run, and a disconnect of 64 front-door
//     streams to the model server seeing each upstream stream close, each beside the same
//     server called directly.
//   - BenchmarkThroughput: CPU per run, summed over the four service processes, for a
//     small plan on the real mesh against the same plan on the bare tree (the same four
//     processes and protos on bare grpc-go with no policies, baretree_test.go),
//     alternating blocks of runs.
//   - BenchmarkCancelFloor: the 64-leaf cancel of BenchmarkCancelPropagation beside the
//     same cancel on the bare tree (grpc-go's own context cancellation), alternating.
//   - BenchmarkTracingRun: CPU per run (the demo plan, and a 64-leaf cancel) and the
//     cancel's latency with tracing off, on (every span exported to a real OpenTelemetry
//     Collector) and sampled by a parent-based ratio, three meshes alternating.
//
// Every benchmark runs only under `go test -bench`; a plain `go test ./bench/...` runs
// the fast unit tests of the helpers and nothing else. scripts/bench.sh runs them all with
// the settings docs/benchmarks.md reports.
package bench
