// Package decoderlease is the caller's side of modelproxy's decoder leases: a Keeper
// heartbeats the lease of every decoder this process is streaming from, so that a decoder
// whose caller is gone stops by itself even when the cancel (RST_STREAM) never reached it.
// See docs/leases.md for the whole picture; modelproxy holds the other side.
//
// Every model step registers its lease with [Keeper.Hold] when its stream opens and
// releases it ([Lease.Release]) when the stream ends. The keeper renews the leases it
// holds with ONE RenewLeases call per tenant per wake-up, carrying every lease due then,
// from a single goroutine per keeper: nothing per decoder but a small record in a map. The
// goroutine runs only while the keeper holds leases, so an idle process has none.
//
// Renewal period. A lease is renewed at least every min(Period, remaining / 3), where
// remaining is the time left before the model call's deadline (seed 003: a heartbeat
// slower than a third of the deadline is a fail-closed condition), and never more often
// than MinTick. When the keeper wakes for a lease that is due, it also renews every lease
// of the same tenant that has used up half its period, so leases that started at about
// the same time are renewed in the same call and stay in step: the number of calls grows
// with the number of distinct periods, not with the number of decoders.
//
// The leases' TTL (Options.TTL, 3 × Period by default: two renewals may be lost before a
// lease lapses) is sent with Generate (GenerateRequest.lease_ttl) and with every renewal.
//
// The keepers of a process are shared per client connection ([Shared]): the orchestrator
// and the subagent service create one agent loop per run, and all of them renew through
// the keeper of their model client.
package decoderlease
