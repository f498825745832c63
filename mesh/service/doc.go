// Package service is the process runtime every curfew service shares: its common flags
// (each also settable as a CURFEW_* environment variable), the gRPC server with curfew's
// interceptor chain, gRPC health and server reflection, the admin HTTP port
// (/healthz, /readyz, /metrics) and a graceful shutdown with a bound.
//
// Configuration precedence: a flag given on the command line wins over its environment
// variable, which wins over the default. The variable of flag --foo-bar is
// CURFEW_FOO_BAR; a bad value in either fails start-up with a message naming both.
//
// Files by responsibility: options.go (the common flags and their validation; the retry
// and breaker flags are retry.Flags and breaker.Flags), env.go (the environment),
// listeners.go, runtime.go (assembling the server: mesh.ServerOptions with this
// service's credentials, limits and tracing), dial.go (client connections), serve.go
// (serving, the admin port, the three-phase stop), tls.go, tracing.go and metrics.go.
package service
