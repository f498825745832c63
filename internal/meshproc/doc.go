// Package meshproc starts the real mesh for end-to-end tests and benchmarks: it builds
// the curfew CLI and the four service binaries once per test binary, and either runs
// `curfew up` as a child process on free loopback ports (Start, a Mesh), or starts the
// services one by one for tests that kill and restart them (NewCluster, a Cluster, on
// package launch). Nothing is faked: every hop is a real process talking real gRPC.
package meshproc
