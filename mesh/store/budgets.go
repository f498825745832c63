package store

import (
	"context"
	"time"
)

// Budgets reserves tenants' tokens against their budgets across every process sharing
// the store (docs/cluster.md, "Budgets across replicas"; mesh/budget.Shared is its
// caller). A tenant has one current window (fixed, Window long, aligned to the Unix
// epoch, as mesh/budget defines it) with the tokens settled in it, and its live
// reservations, each a row of its own with a holder (one per process) and an expiry
// that the holder renews: a crashed holder's reservations stop counting once their TTL
// has passed.
//
// A reservation of n is granted when spent in the current window + reserved by live
// holds + n <= budget, judged in one conditional statement on the tenant's row under
// its lock (the latest committed version on PostgreSQL under READ COMMITTED), never
// counted and then inserted, so concurrent reservations on any number of replicas never
// grant more than the budget. Reservations carry over a window boundary; spend is
// charged to the window in which a call settles. Time is the store's clock
// (store.WithClock), so replicas' clocks must agree within a fraction of the TTL.
//
// A hold whose TTL passes lapses: it stops counting as reserved, and the tokens the
// token ledger holds for its call (the sum of the parts of TokenReservation.LedgerKey)
// are charged to the tenant's current window, so a crashed holder's spend is neither
// hidden nor charged in full. The lapsed hold stays behind as a tombstone for
// LapsedHoldKeep (renewed by its holder while it lives), so that a late settlement of it
// charges only what the lapse did not: a call is charged once whether it settles first,
// lapses first, or both race.
type Budgets interface {
	// ReserveTokens reserves r.Tokens of r.Tenant's r.Budget for r.Holder under r.ID
	// until now+r.TTL, or refuses (Granted false, nothing held), in one round trip on
	// PostgreSQL. It also lapses the tenant's expired holds (charging their ledger
	// spend) and drops their expired tombstones, whatever the outcome. The answer's
	// Spent and Reserved are the tenant's after the decision (Reserved includes this
	// hold when granted).
	ReserveTokens(ctx context.Context, r TokenReservation) (TokenBudgetState, error)
	// SettleTokens removes the hold s.ID, if it is still there (it may have lapsed;
	// "" names none), and charges s.Actual to the tenant's window containing s.At
	// (zero: now), in one round trip on PostgreSQL; of a lapsed hold, only what s.Actual
	// adds to the ledger spend its lapse charged. A charge to a window older than the
	// tenant's current one is not added (that window is over); one to a newer window
	// starts it.
	SettleTokens(ctx context.Context, s TokenSettlement) error
	// RenewTokenHolds extends every live hold of holder to now+ttl (and its lapsed
	// holds' tombstones to now+LapsedHoldKeep), in one statement, and returns the live
	// holds' IDs; a hold missing from the answer was lost (it lapsed).
	RenewTokenHolds(ctx context.Context, holder string, ttl time.Duration) ([]string, error)
	// TokenBudgetUsage returns the tenant's state in its current window of length
	// window (spent is 0 when the stored window is older, or of another length), its
	// Reserved counting live holds only, and its Spent including the ledger spend of the
	// holds expired but not lapsed yet (what the next reservation will charge). Granted
	// is false.
	TokenBudgetUsage(ctx context.Context, tenant string, window time.Duration) (TokenBudgetState, error)
}

// LapsedHoldKeep is how long a lapsed hold's tombstone outlives its lapse, or its
// holder's last renewal: a holder that comes back within it (its renewals failed for
// longer than the TTL, its call went on) settles the hold for what the lapse did not
// charge; one that comes back later is charged its call's whole spend again.
const LapsedHoldKeep = time.Hour

// TokenReservation is one reservation request (Budgets.ReserveTokens). Every field is
// required: Tokens, Budget, Window and TTL positive.
type TokenReservation struct {
	Tenant, Holder string
	// ID names the hold, unique across holders (the holder's name and a sequence).
	ID string
	// RunID and LedgerKey name the call's decoder in the token ledger (optional): its
	// parts are the ledger entries of RunID keyed LedgerKey/<k>… (modelproxy's
	// ledgerEntryKey). A hold that lapses is charged their sum; without them, nothing.
	RunID, LedgerKey string
	Tokens           int64
	// Budget is the tenant's budget per Window, as this replica's configuration says.
	Budget int64
	Window time.Duration
	TTL    time.Duration
}

// TokenSettlement ends a hold (Budgets.SettleTokens).
type TokenSettlement struct {
	Tenant string
	// ID is the hold's, "" to charge without one (spend counted while the store was
	// unreachable).
	ID string
	// Actual is what the call spent (>= 0).
	Actual int64
	// Window is the tenant's window length (positive).
	Window time.Duration
	// At is when the call ended; zero is the store's now.
	At time.Time
}

// TokenBudgetState is a tenant's budget state in its current window.
type TokenBudgetState struct {
	Granted         bool
	Spent, Reserved int64
	// WindowStart is the current window's start.
	WindowStart time.Time
}
