// Package meshproc starts the real mesh for end-to-end tests and benchmarks: it builds
// the curfew CLI and the four service binaries once per test binary, runs `curfew up` as
// a child process on free loopback ports, and hands back the endpoints and a client of
// the orchestrator. Nothing is faked: every hop is a real process talking real gRPC.
package meshproc
