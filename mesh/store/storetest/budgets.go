package storetest

import (
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/curfew-mesh/curfew/mesh/store"
)

// ledgerPart numbers the ledger parts the tests append.
var ledgerPart atomic.Int64

const (
	budgetTTL    = 10 * time.Second
	budgetWindow = time.Hour
)

// reserve reserves n of budget for holder under id and returns the store's answer.
func (e *env) reserve(s store.Store, tenant, holder, id string, n, budget int64) store.TokenBudgetState {
	e.t.Helper()
	st, err := s.ReserveTokens(e.ctx, store.TokenReservation{Tenant: tenant, Holder: holder, ID: id, Tokens: n,
		Budget: budget, Window: budgetWindow, TTL: budgetTTL})
	if err != nil {
		e.t.Fatalf("reserve %d for %s/%s: %v", n, tenant, id, err)
	}
	return st
}

func (e *env) settle(s store.Store, tenant, id string, actual int64) {
	e.t.Helper()
	if err := s.SettleTokens(e.ctx, store.TokenSettlement{Tenant: tenant, ID: id, Actual: actual, Window: budgetWindow}); err != nil {
		e.t.Fatalf("settle %s/%s: %v", tenant, id, err)
	}
}

// reserveCall reserves n of budget for holder under id, naming its call's decoder in the
// ledger (run, key), and fails unless granted.
func (e *env) reserveCall(s store.Store, tenant, holder, id, run, key string, n, budget int64) {
	e.t.Helper()
	st, err := s.ReserveTokens(e.ctx, store.TokenReservation{Tenant: tenant, Holder: holder, ID: id, RunID: run, LedgerKey: key,
		Tokens: n, Budget: budget, Window: budgetWindow, TTL: budgetTTL})
	if err != nil || !st.Granted {
		e.t.Fatalf("reserve %d for %s/%s: %+v, %v; want granted", n, tenant, id, st, err)
	}
}

// ledgerParts appends a decoder's parts as modelproxy does (persist.go): part k is
// key/k (output), key/k/orphan and key/k/prompt.
func (e *env) ledgerParts(tenant, run, key string, output, orphan, prompt int64) {
	e.t.Helper()
	k := fmt.Sprintf("%s/%d", key, ledgerPart.Add(1)) // the part's number: any, unique
	es := []store.LedgerEntry{{Tenant: tenant, RunID: run, Tokens: output, Kind: "output", Key: k}}
	if orphan > 0 {
		es = append(es, store.LedgerEntry{Tenant: tenant, RunID: run, Tokens: orphan, Kind: "orphan", Key: k + "/orphan"})
	}
	if prompt > 0 {
		es = append(es, store.LedgerEntry{Tenant: tenant, RunID: run, Tokens: prompt, Kind: store.KindPrompt, Key: k + "/prompt"})
	}
	if _, err := e.s.AddTokens(e.ctx, es...); err != nil {
		e.t.Fatalf("ledger parts of %s: %v", key, err)
	}
}

// budgetUsage checks the tenant's spent and reserved tokens.
func (e *env) budgetUsage(tenant string, spent, reserved int64) {
	e.t.Helper()
	u, err := e.open().TokenBudgetUsage(e.ctx, tenant, budgetWindow)
	if err != nil || u.Spent != spent || u.Reserved != reserved {
		e.t.Fatalf("usage of %s = %+v, %v; want spent %d reserved %d", tenant, u, err, spent, reserved)
	}
}

var budgetTests = map[string]func(*env){
	"ReserveSettle": func(e *env) {
		e.budgetUsage("acme", 0, 0)
		a := e.reserve(e.s, "acme", "p1", "p1/1", 60, 100)
		if !a.Granted || a.Spent != 0 || a.Reserved != 60 || !a.WindowStart.Equal(e.clock.Now().Truncate(budgetWindow)) {
			e.t.Fatalf("first reservation: %+v", a)
		}
		// Another replica sees it: 41 does not fit, 40 does.
		other := e.open()
		if r := e.reserve(other, "acme", "p2", "p2/1", 41, 100); r.Granted || r.Spent != 0 || r.Reserved != 60 {
			e.t.Fatalf("41 with 60 of 100 reserved: %+v, want refused", r)
		}
		if r := e.reserve(other, "acme", "p2", "p2/2", 40, 100); !r.Granted || r.Reserved != 100 {
			e.t.Fatalf("40 with 60 of 100 reserved: %+v, want granted", r)
		}
		e.settle(e.s, "acme", "p1/1", 25) // the rest comes back
		e.budgetUsage("acme", 25, 40)
		e.settle(e.s, "acme", "p1/1", 25) // a hold is removed once; the spend is charged again
		e.budgetUsage("acme", 50, 40)
		e.settle(other, "acme", "p2/2", 80) // overspend is charged
		e.budgetUsage("acme", 130, 0)
		if r := e.reserve(e.s, "acme", "p1", "p1/2", 1, 100); r.Granted || r.Spent != 130 {
			e.t.Fatalf("reservation over a spent budget: %+v", r)
		}
		// A need above the whole budget is refused, for a new tenant too; other tenants
		// are independent.
		if r := e.reserve(e.s, "new", "p1", "p1/3", 101, 100); r.Granted || r.Reserved != 0 {
			e.t.Fatalf("101 of 100: %+v", r)
		}
		if r := e.reserve(e.s, "new", "p1", "p1/4", 100, 100); !r.Granted {
			e.t.Fatalf("100 of 100: %+v", r)
		}
		// A charge without a hold (spend counted while the store was unreachable).
		e.settle(e.s, "third", "", 7)
		e.budgetUsage("third", 7, 0)
	},
	"Invalid": func(e *env) {
		bad := []store.TokenReservation{
			{Holder: "h", ID: "1", Tokens: 1, Budget: 1, Window: time.Hour, TTL: time.Second},
			{Tenant: "t", ID: "1", Tokens: 1, Budget: 1, Window: time.Hour, TTL: time.Second},
			{Tenant: "t", Holder: "h", Tokens: 1, Budget: 1, Window: time.Hour, TTL: time.Second},
			{Tenant: "t", Holder: "h", ID: "1", Budget: 1, Window: time.Hour, TTL: time.Second},
			{Tenant: "t", Holder: "h", ID: "1", Tokens: 1, Window: time.Hour, TTL: time.Second},
			{Tenant: "t", Holder: "h", ID: "1", Tokens: 1, Budget: 1, TTL: time.Second},
			{Tenant: "t", Holder: "h", ID: "1", Tokens: 1, Budget: 1, Window: time.Hour},
		}
		for _, r := range bad {
			if _, err := e.s.ReserveTokens(e.ctx, r); !errors.Is(err, store.ErrInvalidArgument) {
				e.t.Errorf("reserve %+v: %v, want ErrInvalidArgument", r, err)
			}
		}
		if err := e.s.SettleTokens(e.ctx, store.TokenSettlement{Tenant: "t", Actual: -1, Window: time.Hour}); !errors.Is(err, store.ErrInvalidArgument) {
			e.t.Errorf("settle -1: %v", err)
		}
		if _, err := e.s.RenewTokenHolds(e.ctx, "", time.Second); !errors.Is(err, store.ErrInvalidArgument) {
			e.t.Errorf("renew without holder: %v", err)
		}
	},
	// The window rolls at its epoch-aligned end: the past window's spend is forgotten,
	// a reservation carries over and its spend is charged to the window it settles in; a
	// late charge to a past window is not added to the current one.
	"WindowRoll": func(e *env) {
		e.clock.Advance(budgetWindow - 2*time.Second) // 2 s before a boundary
		e.reserve(e.s, "acme", "p1", "p1/1", 50, 100)
		e.settle(e.s, "acme", "p1/1", 50)
		e.reserve(e.s, "acme", "p1", "p1/2", 40, 100) // carried over
		before := e.clock.Now()
		e.clock.Advance(2 * time.Second)
		e.budgetUsage("acme", 0, 40)
		if r := e.reserve(e.s, "acme", "p1", "p1/3", 61, 100); r.Granted || r.Spent != 0 || r.Reserved != 40 {
			e.t.Fatalf("61 with 40 carried over: %+v, want refused", r)
		}
		e.settle(e.s, "acme", "p1/2", 30)
		e.budgetUsage("acme", 30, 0)
		if err := e.s.SettleTokens(e.ctx, store.TokenSettlement{Tenant: "acme", Actual: 9, Window: budgetWindow, At: before}); err != nil {
			e.t.Fatal(err)
		}
		e.budgetUsage("acme", 30, 0)
		// Another window length is another window (a reload): the spend starts over.
		if u, err := e.s.TokenBudgetUsage(e.ctx, "acme", 2*budgetWindow); err != nil || u.Spent != 0 {
			e.t.Fatalf("usage in a 2h window: %+v, %v", u, err)
		}
	},
	// A holder that stops renewing (a crashed replica) stops counting once its holds'
	// TTL has passed; a live holder's renewed holds keep counting, and a renewal tells
	// a holder which of its holds it lost.
	"ExpiredHoldsStopCounting": func(e *env) {
		dead, live := e.open(), e.open()
		e.reserve(dead, "acme", "dead", "dead/1", 70, 100)
		e.reserve(live, "acme", "live", "live/1", 20, 100)
		if r := e.reserve(e.s, "acme", "x", "x/1", 11, 100); r.Granted {
			e.t.Fatalf("11 with 90 of 100 held: %+v", r)
		}
		e.clock.Advance(budgetTTL / 2)
		if ids, err := live.RenewTokenHolds(e.ctx, "live", budgetTTL); err != nil || len(ids) != 1 || ids[0] != "live/1" {
			e.t.Fatalf("renew: %v, %v", ids, err)
		}
		e.clock.Advance(budgetTTL / 2)
		e.budgetUsage("acme", 0, 20) // dead/1 expired; live/1 was renewed
		if r := e.reserve(e.s, "acme", "x", "x/2", 80, 100); !r.Granted || r.Reserved != 100 {
			e.t.Fatalf("80 once the dead holder's 70 expired: %+v", r)
		}
		if ids, err := dead.RenewTokenHolds(e.ctx, "dead", budgetTTL); err != nil || len(ids) != 0 {
			e.t.Fatalf("the dead holder's renewal after its hold was dropped: %v, %v; want none", ids, err)
		}
		// Its late settle still charges what the call spent, and takes nothing else back.
		e.settle(dead, "acme", "dead/1", 5)
		e.budgetUsage("acme", 5, 100)
	},
	// A hold that lapses (its holder crashed) is charged exactly what the ledger has of
	// its call: the sum of its decoder's parts, not 0 and not the reservation. Parts of
	// other decoders (a key that merely starts alike, another run, another tenant) are
	// not its. The spend counts from the moment the hold expires (usage reads it), and the
	// reservation that lapses it charges it once.
	"LapsedHoldChargesLedger": func(e *env) {
		const key = "modelproxy/run-1/root/m0/rid-1/1/nonce.1"
		e.reserveCall(e.s, "acme", "dead", "dead/1", "run-1", key, 300, 1000)
		e.ledgerParts("acme", "run-1", key, 30, 0, 6)
		e.ledgerParts("acme", "run-1", key, 20, 5, 0)                                         // N = 61
		e.ledgerParts("acme", "run-1", key+"0", 100, 0, 0)                                    // nonce.10: another decoder
		e.ledgerParts("acme", "run-1", "modelproxy/run-1/root/m0/rid-1/2/nonce.2", 100, 0, 0) // the retry's
		e.ledgerParts("acme", "run-2", key, 100, 0, 0)
		e.ledgerParts("other", "run-1", key, 100, 0, 0)
		// A hold that names no decoder (a call without a run id) lapses for nothing.
		e.reserveCall(e.s, "acme", "dead", "dead/2", "", "", 50, 1000)
		e.budgetUsage("acme", 0, 350)
		e.clock.Advance(budgetTTL)
		e.budgetUsage("acme", 61, 0) // expired: read as the next reservation will charge it
		if r := e.reserve(e.open(), "acme", "live", "live/1", 10, 1000); !r.Granted || r.Spent != 61 || r.Reserved != 10 {
			e.t.Fatalf("the reservation that lapses the holds: %+v, want spent 61 (the ledger's), reserved 10", r)
		}
		e.budgetUsage("acme", 61, 10)
		// Charged once: later reservations find only the tombstones.
		if r := e.reserve(e.s, "acme", "live", "live/2", 10, 1000); r.Spent != 61 || r.Reserved != 20 {
			e.t.Fatalf("the next reservation: %+v, want spent 61, reserved 20", r)
		}
		// The lapse counts against the budget: 1000 - 61 - 20 = 919 fit, 920 do not.
		if r := e.reserve(e.s, "acme", "live", "live/3", 920, 1000); r.Granted {
			e.t.Fatalf("920 with 61 charged and 20 held of 1000: %+v, want refused", r)
		}
		if r := e.reserve(e.s, "acme", "live", "live/4", 919, 1000); !r.Granted {
			e.t.Fatalf("919 with 61 charged and 20 held of 1000: %+v, want granted", r)
		}
	},
	// A hold settled normally is charged its spend once: the ledger's copy of the same
	// tokens is never charged again, however long after its TTL a reservation comes.
	"SettledThenExpiredChargedOnce": func(e *env) {
		const key = "modelproxy/run-1/root/m0/rid-1/1/nonce.1"
		e.reserveCall(e.s, "acme", "p1", "p1/1", "run-1", key, 300, 1000)
		e.ledgerParts("acme", "run-1", key, 40, 0, 5)
		e.settle(e.s, "acme", "p1/1", 45)
		e.budgetUsage("acme", 45, 0)
		e.clock.Advance(2 * budgetTTL)
		e.budgetUsage("acme", 45, 0)
		if r := e.reserve(e.open(), "acme", "p2", "p2/1", 10, 1000); !r.Granted || r.Spent != 45 {
			e.t.Fatalf("a reservation after the settled hold's TTL: %+v, want spent 45", r)
		}
	},
	// A holder whose renewals failed for longer than the TTL lost its hold (it lapsed,
	// charged what the ledger had), but its call went on: its settlement charges only the
	// rest. Its renewals keep the tombstone while it lives; a dead holder's goes after
	// store.LapsedHoldKeep.
	"LapsedThenSettledChargedOnce": func(e *env) {
		const key = "modelproxy/run-1/root/m0/rid-1/1/nonce.1"
		late := e.open()
		e.reserveCall(late, "acme", "late", "late/1", "run-1", key, 300, 1000)
		e.ledgerParts("acme", "run-1", key, 40, 0, 0)
		e.clock.Advance(budgetTTL)
		if r := e.reserve(e.s, "acme", "x", "x/1", 1, 1000); r.Spent != 40 || r.Reserved != 1 {
			e.t.Fatalf("the lapsing reservation: %+v, want spent 40, reserved 1", r)
		}
		e.settle(e.s, "acme", "x/1", 0)
		if ids, err := late.RenewTokenHolds(e.ctx, "late", budgetTTL); err != nil || len(ids) != 0 {
			e.t.Fatalf("the holder's renewal after its hold lapsed: %v, %v; want none (lost)", ids, err)
		}
		// Renewed, the tombstone outlives LapsedHoldKeep after the lapse.
		e.clock.Advance(store.LapsedHoldKeep - time.Minute)
		if _, err := late.RenewTokenHolds(e.ctx, "late", budgetTTL); err != nil {
			e.t.Fatal(err)
		}
		e.clock.Advance(2 * time.Minute)
		before, err := e.s.TokenBudgetUsage(e.ctx, "acme", budgetWindow)
		if err != nil {
			e.t.Fatal(err)
		}
		e.reserve(e.s, "acme", "x", "x/2", 1, 1000) // sweeps the expired tombstones: not this one
		e.settle(e.s, "acme", "x/2", 0)
		e.settle(late, "acme", "late/1", 55) // 40 charged by the lapse, 15 now
		e.budgetUsage("acme", before.Spent+15, 0)

		// A dead holder's tombstone goes once LapsedHoldKeep has passed: a settlement after
		// that (a holder cut off from the store for an hour) is charged in full.
		e.reserveCall(e.s, "acme", "dead", "dead/1", "run-2", key, 300, 1000)
		e.ledgerParts("acme", "run-2", key, 30, 0, 0)
		e.clock.Advance(budgetTTL)
		e.reserve(e.s, "acme", "x", "x/3", 1, 1000)
		e.settle(e.s, "acme", "x/3", 0)
		e.clock.Advance(store.LapsedHoldKeep)
		e.reserve(e.s, "acme", "x", "x/4", 1, 1000)
		e.settle(e.s, "acme", "x/4", 0)
		e.budgetUsage("acme", 0, 0) // a new window (1 h)
		e.settle(e.s, "acme", "dead/1", 35)
		e.budgetUsage("acme", 35, 0)
	},
	// Settlements race reservations that lapse the same expired holds, on 4 handles
	// (separate connections): whichever comes first, each call is charged what it spent
	// once (the lapse its ledger spend and the settlement the rest, or the settlement
	// all of it), no statement fails (no deadlock), and nothing stays reserved.
	"SettleLapseRace": func(e *env) {
		const (
			rounds  = 6
			holds   = 8
			ledger  = 10 // each call's parts in the ledger
			actual  = 12 // what each call spent
			budget_ = 1_000_000
		)
		stores := []store.Store{e.s, e.open(), e.open(), e.open()}
		var (
			mu   sync.Mutex
			errs []error
		)
		fail := func(err error) {
			mu.Lock()
			errs = append(errs, err)
			mu.Unlock()
		}
		for round := range rounds {
			for i := range holds {
				id, key := fmt.Sprintf("r%d/%d", round, i), fmt.Sprintf("modelproxy/run/node/rid/%d/n.%d", round, i)
				e.reserveCall(stores[i%len(stores)], "acme", fmt.Sprintf("r%d", round), id, "run", key, 100, budget_)
				e.ledgerParts("acme", "run", key, ledger-2, 0, 2)
			}
			e.clock.Advance(budgetTTL)
			// holds settlements and holds/2 lapsing reservations, released together.
			parallel(holds+holds/2, func(i int) {
				s := stores[i%len(stores)]
				if i < holds {
					err := s.SettleTokens(e.ctx, store.TokenSettlement{Tenant: "acme", ID: fmt.Sprintf("r%d/%d", round, i),
						Actual: actual, Window: budgetWindow})
					if err != nil {
						fail(err)
					}
					return
				}
				id := fmt.Sprintf("sweep-%d-%d", round, i)
				r, err := s.ReserveTokens(e.ctx, store.TokenReservation{Tenant: "acme", Holder: "sweeper", ID: id, Tokens: 1,
					Budget: budget_, Window: budgetWindow, TTL: budgetTTL})
				if err == nil && r.Granted {
					err = s.SettleTokens(e.ctx, store.TokenSettlement{Tenant: "acme", ID: id, Actual: 0, Window: budgetWindow})
				} else if err == nil {
					err = fmt.Errorf("1 of %d refused: %+v", budget_, r)
				}
				if err != nil {
					fail(err)
				}
			})
			if len(errs) > 0 {
				e.t.Fatalf("round %d: %d errors, first: %v", round, len(errs), errs[0])
			}
			e.budgetUsage("acme", int64((round+1)*holds*actual), 0)
		}
		// Whatever lapsed is charged once more by no later reservation.
		e.clock.Advance(budgetTTL)
		e.reserve(e.s, "acme", "x", "x/1", 1, budget_)
		e.budgetUsage("acme", rounds*holds*actual, 1)
	},
	// Reservations on 4 handles racing to drop the same expired holds each subtract
	// them once: no error (no deadlock), and the reserved sum ends at 0.
	"ConcurrentSweeps": func(e *env) {
		for i := range 8 {
			e.reserve(e.s, "acme", "dead", fmt.Sprintf("dead/%d", i), 10, 100)
		}
		e.clock.Advance(budgetTTL)
		stores := []store.Store{e.s, e.open(), e.open(), e.open()}
		var (
			mu   sync.Mutex
			errs []error
		)
		parallel(16, func(i int) {
			s := stores[i%len(stores)]
			id := fmt.Sprintf("live/%d", i)
			r, err := s.ReserveTokens(e.ctx, store.TokenReservation{Tenant: "acme", Holder: "live", ID: id, Tokens: 5,
				Budget: 100, Window: budgetWindow, TTL: budgetTTL})
			if err == nil && r.Granted {
				err = s.SettleTokens(e.ctx, store.TokenSettlement{Tenant: "acme", ID: id, Actual: 1, Window: budgetWindow})
			} else if err == nil {
				err = fmt.Errorf("5 of 100 refused: %+v", r)
			}
			if err != nil {
				mu.Lock()
				errs = append(errs, err)
				mu.Unlock()
			}
		})
		if len(errs) > 0 {
			e.t.Fatalf("%d errors, first: %v", len(errs), errs[0])
		}
		e.budgetUsage("acme", 16, 0)
		if r := e.reserve(e.s, "acme", "x", "x/1", 84, 100); !r.Granted || r.Reserved != 84 {
			e.t.Fatalf("84 with 16 spent and nothing held: %+v", r)
		}
	},
	// 64 callers on 4 store handles (separate connections) race for a budget of 1000
	// with needs of 1 to 13: at no moment do the granted holds exceed the budget, and
	// the spend they settle (at most what each reserved) never passes it.
	"ConcurrentReservationsNeverOvershoot": func(e *env) {
		const budget = 1000
		stores := []store.Store{e.s, e.open(), e.open(), e.open()}
		var (
			inFlight, peak, granted, refused atomic.Int64
			mu                               sync.Mutex
			errs                             []error
		)
		parallel(64, func(i int) {
			s := stores[i%len(stores)]
			holder := fmt.Sprintf("h%d", i)
			for k := range 12 {
				n := int64(1 + (i+k)%13)
				id := fmt.Sprintf("%s/%d", holder, k)
				r, err := s.ReserveTokens(e.ctx, store.TokenReservation{Tenant: "acme", Holder: holder, ID: id, Tokens: n,
					Budget: budget, Window: budgetWindow, TTL: budgetTTL})
				if err != nil {
					mu.Lock()
					errs = append(errs, err)
					mu.Unlock()
					return
				}
				if !r.Granted {
					refused.Add(1)
					continue
				}
				granted.Add(1)
				cur := inFlight.Add(n)
				for p := peak.Load(); cur > p && !peak.CompareAndSwap(p, cur); p = peak.Load() {
				}
				if r.Spent+r.Reserved > budget {
					mu.Lock()
					errs = append(errs, fmt.Errorf("granted with spent %d + reserved %d > %d", r.Spent, r.Reserved, budget))
					mu.Unlock()
				}
				time.Sleep(time.Millisecond) // hold it, so that callers overlap
				inFlight.Add(-n)
				if err := s.SettleTokens(e.ctx, store.TokenSettlement{Tenant: "acme", ID: id, Actual: n, Window: budgetWindow}); err != nil {
					mu.Lock()
					errs = append(errs, err)
					mu.Unlock()
					return
				}
			}
		})
		if len(errs) > 0 {
			e.t.Fatalf("%d errors, first: %v", len(errs), errs[0])
		}
		u, err := e.s.TokenBudgetUsage(e.ctx, "acme", budgetWindow)
		if err != nil {
			e.t.Fatal(err)
		}
		if u.Spent > budget || peak.Load() > budget || u.Reserved != 0 {
			e.t.Fatalf("spent %d, peak in flight %d, reserved left %d: over the budget %d or a hold left", u.Spent, peak.Load(), u.Reserved, budget)
		}
		// 64 × 12 calls of 7 tokens on average need about 5400: the budget ran out.
		if granted.Load() == 0 || refused.Load() == 0 || u.Spent < budget-13 {
			e.t.Fatalf("granted %d, refused %d, spent %d: want both, and the budget used up", granted.Load(), refused.Load(), u.Spent)
		}
		e.t.Logf("granted %d, refused %d, spent %d of %d, peak in flight %d", granted.Load(), refused.Load(), u.Spent, budget, peak.Load())
	},
}
