// Package clusterslots holds cluster-wide admission slots (store.Slots) for the callers
// of one process: a pool cap or a tenant's concurrency that holds across every replica
// sharing the store (docs/cluster.md, issue 24).
//
// A process has one [Holder], named uniquely (a restarted process never inherits a dead
// one's slots). [Holder.Acquire] claims a slot of a scope for one caller, waiting in a
// local FIFO queue while every slot is held; [Slot.Release] gives it back. The Holder
// renews every slot it holds every TTL/3 with ONE store statement per tick, whatever
// their number, so a process that dies stops renewing and its slots are claimable
// again TTL after its last renewal: a waiter elsewhere gets one within TTL + the poll
// period (DefaultTTL 10 s + DefaultPoll 250 ms by default).
//
// How a waiter learns that a slot freed on another replica: a queue with waiters tries
// one claim per scope every poll period (the backstop, which also catches slots freed by
// expiry), and at once when a slot of the scope is released, here (locally) or, when the
// store implements store.SlotReleases (PostgreSQL: a trigger NOTIFYs curfew_slots on
// every release and the Holder LISTENs on a connection of its own), on any replica. The
// SQLite and memory backends have no cross-process notification; SQLite's replicas rely
// on the poll. Notifications are hints: lost or spurious ones cost a poll period or a
// wasted claim, never correctness, which rests on the store's conditional claim alone.
//
// A caller with a queue of its own (admission orders its waiters by criticality, not by
// arrival) uses [Holder.TryAcquire] from its own dispatch instead of Acquire, and
// Config.OnRelease as its wake-up: it is called on the same releases.
//
// Fairness: queues are local. Within one process a scope's waiters are served in
// arrival order; across replicas a freed slot goes to whichever replica's claim reaches
// the store first (after a release every replica with waiters is woken and races), so
// there is no global FIFO: a replica with waiters gets slots roughly in proportion to
// how often it claims, not to how long its runs have waited. A released slot is always
// given back to the store, never handed to a local waiter directly, so a busy replica
// cannot keep a slot to itself.
//
// A lost slot: when a renewal returns without one of the Holder's slots (it expired and
// another holder claimed it), or renewals have failed (store down) until its TTL has
// passed by this process's clock, the slot is lost: [Slot.Lost] is closed and [Slot.Err]
// says which. The cap may then be exceeded by this caller's work; docs/cluster.md says
// what a caller should do (admission: let the admitted run finish, count it, do not
// re-admit it). A renewal failure before that is reported by [Holder.Status] and the
// Config.OnRenewError hook, and the Holder keeps trying every tick.
//
// Costs in store round trips: a claim that succeeds at once 1 (also for several scopes
// at once, all or none: [Holder.TryAcquireAll]); a release 1 ([Holder.ReleaseAll] for
// several); renewals 1
// per TTL/3 per process (not per slot); a waiting queue 1 per poll period per scope and
// 1 per wake-up; sizing a scope 1 transaction.
package clusterslots
