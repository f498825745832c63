// Package modelproxy is the model proxy service: one front for model providers. Generate
// resolves the model asked for to a route (route.go: the built-in sim model, package sim,
// served directly; any other through the Router's fallback chains, router.go), records the
// decoder's node and lease, lets the route stream the answer, and records every token the
// decoder emits in the token ledger, keyed by task (run and node) with its wall-clock
// instant, so that tokens spent after a cancel are measurable from the decoder's own
// record. Each decoder's tokens also go to the store's ledger (Server.Store) when it ends
// (persist.go: queued, and appended in batches a moment later): with a durable store
// (--store) a run's spend survives restarts; without one the store is this process's
// own, in memory.
//
// A decoder stops once its context is cancelled: the sim model at the next token
// boundary, a provider's stream when it closes its upstream.
//
// Every decoder also holds a lease (lease.go, docs/leases.md) that its caller renews with
// RenewLeases; a decoder whose lease lapses is cancelled with cause lease_expired, so it
// stops by itself when its caller's cancel was lost.
package modelproxy
