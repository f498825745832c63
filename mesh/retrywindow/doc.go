// Package retrywindow coordinates retries across the replicas that share a store
// (issue 24, item 3; seed 001's "only the leader may issue retries during its window"):
// per target, at most N replicas (retry.WindowConfig.Replicas, default 1) may retry
// during a window (Length, default 10 s). The others fail a call at its first retryable
// error, marked RETRIES_EXHAUSTED so that no layer above retries it, and ask again only
// when the window moves.
//
// A process has one [Holder]; it is the retry.Window of every connection that
// mesh/service dials (retry.Config.Window). A window is a slot of the store scope
// "retry/<target>", sized N (store.Slots), claimed on demand by the first retry that
// needs it, under a TTL of Length, with the slot's epoch as its fencing token. The first
// attempt of a call never asks: coordination costs nothing while nothing fails.
//
// What "until the window moves" means: a window is never renewed. It ends, by this
// process's clock, a guard (Length/20, at most 250 ms) before its TTL runs out in the
// store, so that attempts begun in it have arrived before another replica's window can
// start; it ends at once when it is lost (a verification, every Length/3 while it is in
// use, finds the slot's epoch or holder changed, or cannot reach the store). A replica
// refused a window learns from the store (one ListSlots) when the earliest held window
// expires and does not ask again before then. A replica whose window ended does not claim
// again before its window's expiry plus the guard, so that under a lasting failure the
// replicas that were refused, who ask at the expiry, take the next windows first: windows
// rotate instead of one replica keeping them.
//
// When the store cannot be asked (a claim or a verification fails), retries that need a
// window are refused (fail fast) for StoreRetry (1 s) before the store is asked again,
// logged once per outage and counted as refusals with reason store_down; coordination
// resumes with the first claim that succeeds.
//
// Costs in store round trips, per target and replica: none while no call needs a retry;
// 1 claim per window (plus 1 sizing of the scope the first time), 1 verification per
// Length/3 of a window in use, 1 release at Close; a refused replica 2 (claim and list)
// per window it is refused.
//
// The Holder's name must differ from every other holder's in the store, this process's
// clusterslots.Holder included: RenewSlots renews every slot of a name, and would keep
// the windows forever. The default adds "/retry" to hostname-pid-random.
package retrywindow
