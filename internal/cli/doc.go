// Package cli implements the curfew command: up starts the mesh (package launch); run,
// get, ls, cancel, trace and dlq talk to its orchestrator; drill runs package drill;
// tenant and tls manage API keys and certificates. cmd/curfew only calls Main. Every
// command writes its own output on stdout and stderr, and library logs on stderr only at
// --log-level (warn by default).
package cli
