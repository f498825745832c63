// Package service is the process runtime every curfew service shares: its common flags
// (each also settable as a CURFEW_* environment variable), the gRPC server with curfew's
// interceptor chain, gRPC health and server reflection, the admin HTTP port
// (/healthz, /readyz, /metrics) and a graceful shutdown with a bound.
//
// Configuration precedence: a flag given on the command line wins over its environment
// variable, which wins over the default. The variable of flag --foo-bar is
// CURFEW_FOO_BAR; a bad value in either fails start-up with a message naming both.
package service
