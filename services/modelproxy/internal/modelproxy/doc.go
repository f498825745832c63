// Package modelproxy is the model proxy service: one front for model providers. This
// package holds the built-in `sim` provider (a decoder scripted by a JSON plan, see
// package plan) and the token ledger that records every token a decoder emits, keyed by
// task (run and node) with its wall-clock instant, so that tokens spent after a cancel are
// measurable from the decoder's own record. With a durable store (Server.Store) each
// decoder's tokens also go to the store's ledger when it ends (persist.go: queued, and
// appended in batches a moment later), so a run's spend survives restarts.
//
// A decoder stops at the next token boundary once its context is cancelled: the wait for
// each token selects on the context, so a cancel costs at most the token being emitted.
//
// Every decoder also holds a lease (lease.go, docs/leases.md) that its caller renews with
// RenewLeases; a decoder whose lease lapses is cancelled with cause lease_expired, so it
// stops by itself when its caller's cancel was lost.
package modelproxy
