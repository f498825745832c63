// Package rpcmetrics records the standard gRPC server and client metrics in Prometheus:
// the grpc_server_* and grpc_client_* families of go-grpc-middleware's Prometheus
// provider (github.com/grpc-ecosystem/go-grpc-middleware/providers/prometheus), with the
// same names, help text, labels, buckets and counting rules, so every gRPC dashboard and
// alert written for the provider reads them unchanged.
//
// Streaming calls are observed by go-grpc-middleware's own reporting interceptors
// (package interceptors), unary calls by this package's, which count the same events and
// read the clock twice instead of four times; what this package replaces is the
// provider's reporter. WrapUnary puts the unary metrics around an interceptor of the
// caller's as one interceptor (package mesh does, on both sides), which spares grpc-go
// chaining one more per call. The provider
// resolves every series by its label values on every event (five label-hashing lookups
// per unary call on each side, and two allocations); here each method's series are
// resolved once, on its first call, and a call only increments them, with no
// allocation (BenchmarkUnary; docs/benchmarks.md, "Chain as the services run it").
//
// Defaults, as the services run them: the handling-time histograms are on
// (grpc_server_handling_seconds, grpc_client_handling_seconds, buckets
// prometheus.DefBuckets); the per-message client histograms of the provider are not
// offered; series appear on a method's first call, not before (the provider's
// InitializeMetrics is not offered either).
package rpcmetrics
