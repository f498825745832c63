// Package cli implements the curfew command: up, run, get, ls and cancel. cmd/curfew only
// calls Main.
package cli
