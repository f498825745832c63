package budget_test

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/curfew-mesh/curfew/mesh/budget"
	"github.com/curfew-mesh/curfew/mesh/store"
	_ "github.com/curfew-mesh/curfew/mesh/store/postgres"
	"github.com/curfew-mesh/curfew/mesh/store/storetest"
)

// openStore opens a store on dsn, closed when t ends.
func openStore(t *testing.T, dsn string, opts ...store.Option) store.Store {
	t.Helper()
	st, err := store.Open(context.Background(), dsn, opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = st.Close() })
	return st
}

func newShared(t *testing.T, cfg budget.SharedConfig) *budget.Shared {
	t.Helper()
	s, err := budget.NewShared(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	return s
}

// Two replicas, each with a store handle of its own (on PostgreSQL: separate
// connections), race for one tenant's budget: the store's spend never passes it.
func TestSharedReplicasNeverOverrun(t *testing.T) {
	for _, backend := range []string{"memory", "postgres"} {
		t.Run(backend, func(t *testing.T) {
			dsn := storetest.MemoryDSN(t)
			if backend == "postgres" {
				dsn = storetest.PostgresDSN(t)
			}
			const budgetTokens = 1000
			lim := limits(budgetTokens, time.Hour)
			reg := prometheus.NewRegistry()
			replicas := []*budget.Shared{
				newShared(t, budget.SharedConfig{Store: openStore(t, dsn), Limits: lim, Registry: reg}),
				newShared(t, budget.SharedConfig{Store: openStore(t, dsn), Limits: lim}),
			}
			var (
				wg               sync.WaitGroup
				granted, refused atomic.Int64
			)
			for g := range 16 {
				wg.Add(1)
				go func() {
					defer wg.Done()
					b := replicas[g%2]
					for i := range 40 {
						n := int64(1 + (g+i)%13)
						h, err := b.Reserve(context.Background(), "acme", n)
						if err != nil {
							if !budget.Refused(err) {
								t.Error(err)
								return
							}
							refused.Add(1)
							continue
						}
						granted.Add(1)
						h.Settle(n) // each spends all it reserved
					}
				}()
			}
			wg.Wait()
			u, err := replicas[1].Usage(context.Background(), "acme")
			if err != nil {
				t.Fatal(err)
			}
			if u.Spent > budgetTokens || u.Reserved != 0 {
				t.Fatalf("usage %+v: over the budget %d, or a reservation left", u, budgetTokens)
			}
			if granted.Load() == 0 || refused.Load() == 0 || u.Spent < budgetTokens-13 {
				t.Fatalf("granted %d, refused %d, spent %d: want both, the budget used up", granted.Load(), refused.Load(), u.Spent)
			}
			if replicas[0].Degraded() || replicas[1].Degraded() {
				t.Fatal("degraded with the store up")
			}
			t.Logf("granted %d, refused %d, spent %d of %d", granted.Load(), refused.Load(), u.Spent, budgetTokens)
		})
	}
}

func TestSharedRefusalAndNoBudget(t *testing.T) {
	ctx := context.Background()
	st := openStore(t, storetest.MemoryDSN(t))
	b := newShared(t, budget.SharedConfig{Store: st, Limits: limits(10, time.Hour)})
	h, err := b.Reserve(ctx, "acme", 4)
	if err != nil {
		t.Fatal(err)
	}
	_, err = b.Reserve(ctx, "acme", 7)
	var rf *budget.Refusal
	if !errors.As(err, &rf) || !budget.Refused(err) || rf.Reserved != 4 || rf.Budget != 10 || rf.Need != 7 ||
		!rf.WindowEnd.Equal(time.Now().Truncate(time.Hour).Add(time.Hour)) {
		t.Fatalf("err = %v (%+v), want a refusal with 4 reserved of 10", err, rf)
	}
	h.Settle(3)
	h.Settle(30) // a second settle is a no-op
	if u, err := b.Usage(ctx, "acme"); err != nil || u.Spent != 3 || u.Reserved != 0 {
		t.Fatalf("usage %+v, %v; want spent 3", u, err)
	}
	nh, err := b.Reserve(ctx, "free", 1<<40)
	if err != nil || nh != budget.NoHold {
		t.Fatalf("Reserve for a tenant without a budget = %v, %v; want NoHold", nh, err)
	}
}

// A replica that dies holding a reservation (no settle, no renewal) stops counting TTL
// after its last renewal; a live replica's reservation is renewed and keeps counting.
func TestSharedDeadReplicaHoldsExpire(t *testing.T) {
	ctx := context.Background()
	dsn := storetest.MemoryDSN(t)
	const ttl = 600 * time.Millisecond
	lim := limits(100, time.Hour)
	live := newShared(t, budget.SharedConfig{Store: openStore(t, dsn), Limits: lim, TTL: ttl})
	dead, err := budget.NewShared(budget.SharedConfig{Store: openStore(t, dsn), Limits: lim, TTL: ttl})
	if err != nil {
		t.Fatal(err)
	}
	lh, err := live.Reserve(ctx, "acme", 40)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := dead.Reserve(ctx, "acme", 60); err != nil {
		t.Fatal(err)
	}
	_ = dead.Close() // its renewals stop; its hold is never settled
	died := time.Now()
	if _, err := live.Reserve(ctx, "acme", 1); !budget.Refused(err) {
		t.Fatalf("reserve with 100 of 100 held: %v, want a refusal", err)
	}
	var got budget.Hold
	for got == nil && time.Since(died) < 10*time.Second {
		time.Sleep(50 * time.Millisecond)
		if got, err = live.Reserve(ctx, "acme", 60); err != nil && !budget.Refused(err) {
			t.Fatal(err)
		}
	}
	took := time.Since(died)
	if got == nil || took < ttl/2 || took > ttl+2*time.Second {
		t.Fatalf("the dead replica's 60 came back after %v (granted %v), want within TTL %v + margin", took, got != nil, ttl)
	}
	// The live replica's 40, renewed all along, still counts.
	if _, err := live.Reserve(ctx, "acme", 1); !budget.Refused(err) {
		t.Fatalf("reserve with 40 + 60 held: %v, want a refusal", err)
	}
	lh.Settle(40)
	got.Settle(60)
	t.Logf("a dead replica's reservation came back after %v (TTL %v)", took.Round(time.Millisecond), ttl)
}

// A replica that dies mid-call leaves its reservation unsettled, but its call's spend is
// in the token ledger (the parts its decoder persisted): when the hold lapses, the
// tenant's window is charged those tokens, neither nothing nor the whole reservation.
func TestSharedDeadReplicaChargedFromLedger(t *testing.T) {
	ctx := context.Background()
	dsn := storetest.MemoryDSN(t)
	const (
		ttl = 600 * time.Millisecond
		key = "modelproxy/run-1/root/m0/rid-1/1/nonce.1"
	)
	lim := limits(1000, time.Hour)
	st := openStore(t, dsn)
	live := newShared(t, budget.SharedConfig{Store: openStore(t, dsn), Limits: lim, TTL: ttl})
	dead, err := budget.NewShared(budget.SharedConfig{Store: openStore(t, dsn), Limits: lim, TTL: ttl})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := dead.Reserve(budget.WithLedger(ctx, "run-1", key), "acme", 300); err != nil {
		t.Fatal(err)
	}
	// Its decoder persisted two parts before the crash: 20 output + 4 prompt, then 9.
	if _, err := st.AddTokens(ctx,
		store.LedgerEntry{Tenant: "acme", RunID: "run-1", Tokens: 20, Kind: "output", Key: key + "/1"},
		store.LedgerEntry{Tenant: "acme", RunID: "run-1", Tokens: 4, Kind: store.KindPrompt, Key: key + "/1/prompt"},
		store.LedgerEntry{Tenant: "acme", RunID: "run-1", Tokens: 9, Kind: "output", Key: key + "/2"}); err != nil {
		t.Fatal(err)
	}
	_ = dead.Close() // its renewals stop; its hold is never settled
	died := time.Now()
	var u budget.Usage
	for time.Since(died) < 10*time.Second {
		if u, err = live.Usage(ctx, "acme"); err != nil {
			t.Fatal(err)
		}
		if u.Reserved == 0 {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	if u.Reserved != 0 || u.Spent != 33 {
		t.Fatalf("usage %v after the dead replica's hold expired (%v after its death), want spent 33 (its ledger), reserved 0",
			u, time.Since(died).Round(time.Millisecond))
	}
	// The reservation that lapses it charges it once, and the budget holds it: 1000 - 33.
	if _, err := live.Reserve(ctx, "acme", 968); !budget.Refused(err) {
		t.Fatalf("968 with 33 charged of 1000: %v, want a refusal", err)
	}
	h, err := live.Reserve(ctx, "acme", 967)
	if err != nil {
		t.Fatal(err)
	}
	h.Settle(7)
	if u, err = live.Usage(ctx, "acme"); err != nil || u.Spent != 40 || u.Reserved != 0 {
		t.Fatalf("usage %v, %v after a call of 7; want spent 40", u, err)
	}
}

// flaky is a store whose budget calls fail while down is set.
type flaky struct {
	store.Budgets
	down  atomic.Bool
	calls atomic.Int64
}

var errDown = errors.New("connection refused")

func (f *flaky) ReserveTokens(ctx context.Context, r store.TokenReservation) (store.TokenBudgetState, error) {
	f.calls.Add(1)
	if f.down.Load() {
		return store.TokenBudgetState{}, errDown
	}
	return f.Budgets.ReserveTokens(ctx, r)
}

func (f *flaky) SettleTokens(ctx context.Context, c store.TokenSettlement) error {
	f.calls.Add(1)
	if f.down.Load() {
		return errDown
	}
	return f.Budgets.SettleTokens(ctx, c)
}

func (f *flaky) RenewTokenHolds(ctx context.Context, holder string, ttl time.Duration) ([]string, error) {
	f.calls.Add(1)
	if f.down.Load() {
		return nil, errDown
	}
	return f.Budgets.RenewTokenHolds(ctx, holder, ttl)
}

// While the store is unreachable a replica reserves against its share of what the
// tenant had left (here 2 replicas, 60 of 100 left: 30), says so in
// curfew_budget_coordination_degraded, and charges what it spent to the store when it
// is back; coordination then resumes.
func TestSharedDegradedShareAndResume(t *testing.T) {
	ctx := context.Background()
	st := &flaky{Budgets: openStore(t, storetest.MemoryDSN(t))}
	reg := prometheus.NewRegistry()
	b := newShared(t, budget.SharedConfig{Store: st, Limits: limits(100, time.Hour), Registry: reg, TTL: 3 * time.Second,
		Replicas: func(context.Context) (int, error) { return 2, nil }})
	h, err := b.Reserve(ctx, "acme", 40)
	if err != nil {
		t.Fatal(err)
	}
	h.Settle(40) // the store knows: 40 of 100 used
	st.down.Store(true)
	// The first reservation finds the store down; it and the next are judged locally.
	var holds []budget.Hold
	for range 3 {
		h, err := b.Reserve(ctx, "acme", 10)
		if err != nil {
			t.Fatalf("reserve within the share: %v", err)
		}
		holds = append(holds, h)
	}
	if !b.Degraded() || gauge(t, reg, "curfew_budget_coordination_degraded") != 1 {
		t.Fatal("not degraded with the store down")
	}
	if s := b.Status(); !s.Degraded || s.Replicas != 2 || s.DegradedSince.IsZero() || time.Since(s.DegradedSince) > time.Minute {
		t.Fatalf("status %+v, want degraded since just now, on a share of 2 replicas", s)
	}
	if _, err := b.Reserve(ctx, "acme", 1); !budget.Refused(err) {
		t.Fatalf("reserve past the share of 30: %v, want a refusal", err)
	}
	for _, h := range holds {
		h.Settle(8)
	}
	calls := st.calls.Load()
	time.Sleep(1500 * time.Millisecond)
	if n := st.calls.Load() - calls; n < 1 || n > 4 {
		t.Errorf("%d store calls in 1.5 s while down, want a probe about every second", n)
	}
	st.down.Store(false)
	waitUntil(t, "coordination resumed", 5*time.Second, func() bool { return !b.Degraded() })
	if s := b.Status(); s.Degraded || !s.DegradedSince.IsZero() {
		t.Fatalf("status %+v after the store came back, want coordinated", s)
	}
	if got := gauge(t, reg, "curfew_budget_coordination_degraded"); got != 0 {
		t.Fatalf("degraded gauge %v after the store came back", got)
	}
	u, err := b.Usage(ctx, "acme")
	if err != nil || u.Spent != 40+3*8 || u.Reserved != 0 {
		t.Fatalf("usage %+v, %v; want the degraded spend charged: spent 64", u, err)
	}
	// Coordinated again: the store's 36 left, not the local share, decides.
	if _, err := b.Reserve(ctx, "acme", 37); !budget.Refused(err) {
		t.Fatalf("reserve 37 with 36 left: %v", err)
	}
	if h, err := b.Reserve(ctx, "acme", 36); err != nil {
		t.Fatalf("reserve 36 with 36 left: %v", err)
	} else {
		h.Settle(36)
	}
}

// A settlement that fails is kept and charged when the store is back; meanwhile its
// reservation is renewed, so it keeps counting.
func TestSharedSettleDuringOutage(t *testing.T) {
	ctx := context.Background()
	st := &flaky{Budgets: openStore(t, storetest.MemoryDSN(t))}
	b := newShared(t, budget.SharedConfig{Store: st, Limits: limits(100, time.Hour), TTL: 3 * time.Second})
	h, err := b.Reserve(ctx, "acme", 50)
	if err != nil {
		t.Fatal(err)
	}
	st.down.Store(true)
	h.Settle(20)
	if !b.Degraded() {
		t.Fatal("a failed settlement did not degrade")
	}
	st.down.Store(false)
	waitUntil(t, "coordination resumed", 5*time.Second, func() bool { return !b.Degraded() })
	waitUntil(t, "the settlement charged", 5*time.Second, func() bool {
		u, err := b.Usage(ctx, "acme")
		return err == nil && u.Spent == 20 && u.Reserved == 0
	})
}

// gauge is the value of the unlabelled gauge name in reg.
func gauge(t *testing.T, reg *prometheus.Registry, name string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == name {
			return mf.GetMetric()[0].GetGauge().GetValue()
		}
	}
	t.Fatalf("%s not registered", name)
	return 0
}

func waitUntil(t *testing.T, what string, d time.Duration, ok func() bool) {
	t.Helper()
	for end := time.Now().Add(d); !ok(); time.Sleep(20 * time.Millisecond) {
		if time.Now().After(end) {
			t.Fatalf("%s: not within %v", what, d)
		}
	}
}
