// Package launch starts curfew's four services as child processes and waits until they
// serve. `curfew up`, `curfew drill` and the end-to-end tests all start services through
// it: one way to pick the addresses, wire each service to its peers, start the process,
// wait for its gRPC health to report SERVING, and stop it with SIGTERM and a grace.
package launch
