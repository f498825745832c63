// Package tracing is curfew's OpenTelemetry tracing: the tracer provider of a process,
// configured only by the standard OTEL_* environment variables, and the gRPC stats
// handlers (otelgrpc's, plus curfew's attributes) that every server and client of the mesh
// installs.
//
// Tracing is off unless the environment asks for it (see [Enabled]): then nothing is
// recorded or exported, and [Provider.ServerOption] and [Provider.DialOption] install no
// handler at all, so that off costs nothing. When on, spans go to an OTLP exporter
// (gRPC or HTTP, by OTEL_EXPORTER_OTLP_PROTOCOL) through a batch processor, with
// service.name set to the process's own name.
//
// Every RPC attempt is one span (otelgrpc makes one per attempt, and curfew's retry layer
// makes one attempt per RPC). The handlers add the work's identity from the call's curfew-*
// metadata to each span ([RunID], [NodeID], [Tenant], [RetryID], [Attempt]) and, on a
// client call that ended because its caller was cancelled, the cancel's cause
// ([CancelCause]). Package nodes adds a node's outcome to the span of the call that
// executed it ([EndNode]); modelproxy adds the tokens of a model call ([Tokens],
// [TokensAfterCancel]); the orchestrator opens one span per run ([StartRun]).
//
// docs/tracing.md is the operator's guide.
package tracing
