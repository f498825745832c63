package store

import (
	"context"
	"time"
)

// Slots are cluster-wide admission slots (docs/cluster.md): a scope ("pool/paid",
// "tenant/acme") has a size, and that many pre-numbered slots, 0..size-1, that holders
// (one per process, see mesh/clusterslots) claim one at a time, each under a TTL that the
// holder renews. A cap holds across every replica sharing the store because a slot row
// is held by one holder at a time and taken with one conditional statement, never
// counted and then inserted (which READ COMMITTED would let overshoot).
//
// Every claim increments the slot's epoch, the fencing token: ReleaseSlot frees a slot
// only while the epoch still matches, so a holder whose slot expired and was re-claimed
// cannot free the new holder's slot. Expiry is judged by the store's clock (the clock
// of the process calling the store, store.WithClock; replicas' clocks should agree
// within a fraction of the TTL, as for run leases).
type Slots interface {
	// SizeSlots sets the scope's size to n (>= 0), creating the slots below n that do
	// not exist yet. Shrinking never cuts a holder off: a held slot at or above n stays
	// held until its holder releases it or its TTL passes, and until then it also keeps
	// the active slot n mod size from being claimed, so the number held converges to n
	// without exceeding the larger of n and what was held at the shrink. Slots at or
	// above n are never claimed again until the scope grows back; their epochs are kept.
	// Idempotent; the last writer wins when replicas disagree (a rolling reload).
	SizeSlots(ctx context.Context, scope string, n int) error
	// ClaimSlot takes one free or expired slot of the scope for holder until now+ttl,
	// incrementing its epoch, in one statement (one round trip). ok is false, with a
	// nil error, when every slot is held (or the scope was never sized); concurrent
	// claims never take one slot twice.
	ClaimSlot(ctx context.Context, scope, holder string, ttl time.Duration) (slot Slot, ok bool, err error)
	// RenewSlots extends every slot that holder holds, in every scope, to now+ttl, in
	// one statement, and returns them. A slot that expired but that nobody claimed is
	// still the holder's and is renewed; a slot missing from the result is lost (it was
	// claimed by someone else after it expired).
	RenewSlots(ctx context.Context, holder string, ttl time.Duration) ([]Slot, error)
	// ReleaseSlot frees the slot if holder and epoch still match, in one statement;
	// ErrStaleEpoch if they do not (the slot had expired and was claimed by someone
	// else: nothing was changed).
	ReleaseSlot(ctx context.Context, s Slot) error
	// ListSlots returns the scope's slots by number, for status: the active ones
	// (below its size) and the held ones above it.
	ListSlots(ctx context.Context, scope string) ([]Slot, error)
	SlotsMulti
}

// Slot is one numbered slot of a scope and who holds it.
type Slot struct {
	Scope  string
	N      int
	Holder string    // "" when free
	Epoch  int64     // incremented by every claim
	Expiry time.Time // the holder's TTL; zero when free
	// Active is false for a slot at or above the scope's size (after a shrink): it is
	// never claimed, and is listed only while held.
	Active bool
}

// Held reports whether the slot is held at now: it has a holder whose TTL has not
// passed.
func (s Slot) Held(now time.Time) bool { return s.Holder != "" && now.Before(s.Expiry) }

// SlotReleases is implemented by a store that can tell a process when a slot was
// released by any process sharing it (PostgreSQL: LISTEN/NOTIFY), so that a caller
// waiting for a slot claims at once instead of at its next poll. It is optional: assert
// for it. Notifications are hints, never needed for correctness: one may be lost (a
// dropped connection) or spurious, and a slot that frees by expiry sends none.
type SlotReleases interface {
	// WatchSlotReleases calls fn with the scope of every slot released from now on,
	// until ctx ends or the watch fails; it returns once it listens, and reports a
	// failure of the watch afterwards through done, which is then closed.
	WatchSlotReleases(ctx context.Context, fn func(scope string)) (done <-chan error, err error)
}

// SlotsMulti claims and releases the slots of several scopes at once (a run needs a slot
// of its pool and one of its tenant): one statement each way, so coordination costs a
// run two round trips instead of four.
type SlotsMulti interface {
	// ClaimSlots takes one slot of each of the distinct scopes for holder, all or none,
	// in one statement: ok is false, and nothing is claimed, while any of them has no
	// slot free. The slots are returned in the order of scopes.
	ClaimSlots(ctx context.Context, scopes []string, holder string, ttl time.Duration) (slots []Slot, ok bool, err error)
	// ReleaseSlots frees, in one statement, each of the slots whose holder and epoch
	// still match, and returns how many it freed (the others had been lost).
	ReleaseSlots(ctx context.Context, slots []Slot) (freed int, err error)
}
