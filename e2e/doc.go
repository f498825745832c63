// Package e2e holds curfew's end-to-end tests: the four real service binaries as
// separate processes under `curfew up`, driven over real gRPC the way users drive them.
package e2e
