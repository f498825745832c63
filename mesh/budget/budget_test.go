package budget_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/goleak"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/curfew-mesh/curfew/mesh/admission"
	"github.com/curfew-mesh/curfew/mesh/budget"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// clock is a settable clock.
type clock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *clock) now() time.Time      { c.mu.Lock(); defer c.mu.Unlock(); return c.t }
func (c *clock) add(d time.Duration) { c.mu.Lock(); defer c.mu.Unlock(); c.t = c.t.Add(d) }
func newClock(t time.Time) *clock    { return &clock{t: t} }
func limits(b int64, w time.Duration) admission.Config {
	return admission.Config{
		DefaultTenant: admission.TenantLimits{TokenBudget: b, Window: w},
		Tenants:       map[string]admission.TenantLimits{"free": {}},
	}
}

func TestReserveSettle(t *testing.T) {
	ctx := context.Background()
	clk := newClock(time.Unix(3600*100, 0))
	b := budget.NewMemory(limits(100, time.Hour), budget.Options{Now: clk.now})
	h1, err := b.Reserve(ctx, "acme", 60)
	if err != nil {
		t.Fatal(err)
	}
	// 60 reserved: a call needing 41 does not fit, one needing 40 does.
	if _, err := b.Reserve(ctx, "acme", 41); !budget.Refused(err) {
		t.Fatalf("Reserve(41) with 60 of 100 reserved = %v, want a refusal", err)
	}
	h2, err := b.Reserve(ctx, "acme", 40)
	if err != nil {
		t.Fatal(err)
	}
	if u := b.Usage("acme"); u.Reserved != 100 || u.Spent != 0 {
		t.Fatalf("usage = %+v, want 100 reserved", u)
	}
	h1.Settle(25) // spent less than reserved: the rest comes back
	h1.Settle(25) // a second settle is a no-op
	if u := b.Usage("acme"); u.Reserved != 40 || u.Spent != 25 {
		t.Fatalf("usage after settle = %+v, want spent 25 reserved 40", u)
	}
	h2.Settle(0) // a call cut off before any token
	if u := b.Usage("acme"); u.Reserved != 0 || u.Spent != 25 {
		t.Fatalf("usage = %+v, want spent 25 reserved 0", u)
	}
	if _, err := b.Reserve(ctx, "acme", 76); !budget.Refused(err) {
		t.Fatalf("Reserve(76) with 25 spent = %v, want a refusal", err)
	}
	h3, err := b.Reserve(ctx, "acme", 75)
	if err != nil {
		t.Fatal(err)
	}
	h3.Settle(80) // the estimate was wrong: charged what it spent
	if u := b.Usage("acme"); u.Spent != 105 {
		t.Fatalf("usage = %+v, want spent 105", u)
	}
	// Other tenants have budgets of their own; a tenant without one reserves nothing.
	if _, err := b.Reserve(ctx, "other", 100); err != nil {
		t.Fatal(err)
	}
	h, err := b.Reserve(ctx, "free", 1<<40)
	if err != nil || h != budget.NoHold {
		t.Fatalf("Reserve for a tenant without a budget = %v, %v; want NoHold", h, err)
	}
}

func TestRefusalStatus(t *testing.T) {
	clk := newClock(time.Date(2030, 1, 1, 10, 30, 0, 0, time.UTC))
	b := budget.NewMemory(limits(10, time.Hour), budget.Options{Now: clk.now})
	h, _ := b.Reserve(context.Background(), "acme", 4)
	defer h.Settle(4)
	_, err := b.Reserve(context.Background(), "acme", 7)
	var rf *budget.Refusal
	if !errors.As(err, &rf) {
		t.Fatalf("err = %v, want a *Refusal", err)
	}
	rf.Detail = "prompt 2 + max_tokens 5"
	st := status.Convert(err)
	want := `token budget exhausted: tenant "acme" has spent 0 and reserved 4 of its 10 tokens per 1h0m0s; the model call needs 7 (prompt 2 + max_tokens 5)`
	if st.Code() != codes.ResourceExhausted || st.Message() != want {
		t.Fatalf("status = %v %q, want RESOURCE_EXHAUSTED %q", st.Code(), st.Message(), want)
	}
	if !rf.WindowEnd.Equal(time.Date(2030, 1, 1, 11, 0, 0, 0, time.UTC)) {
		t.Errorf("window end = %v, want 11:00", rf.WindowEnd)
	}
	// Recognised after crossing the wire, and wrapped; other statuses are not refusals.
	if !budget.Refused(st.Err()) || !budget.Refused(fmt.Errorf("step: %w", err)) {
		t.Error("Refused does not recognise the refusal's status")
	}
	for _, e := range []error{nil, errors.New("x"), status.Error(codes.ResourceExhausted, "step limit 8 reached")} {
		if budget.Refused(e) {
			t.Errorf("Refused(%v) = true", e)
		}
	}
}

// A budget of zero tokens left starts nothing, not even a call that asks for 0.
func TestZeroNeedCountsAsOne(t *testing.T) {
	b := budget.NewMemory(limits(1, time.Hour), budget.Options{})
	h, err := b.Reserve(context.Background(), "acme", 0)
	if err != nil {
		t.Fatal(err)
	}
	h.Settle(1)
	if _, err := b.Reserve(context.Background(), "acme", 0); !budget.Refused(err) {
		t.Fatalf("Reserve(0) with the budget used up = %v, want a refusal", err)
	}
}

// The window rolls at its epoch-aligned end: the past window's spend is forgotten, a
// reservation made before the boundary carries over and is charged to the window in which
// it settles.
func TestWindowRoll(t *testing.T) {
	ctx := context.Background()
	clk := newClock(time.Unix(3600*100+3590, 0)) // 10 s before a window boundary
	b := budget.NewMemory(limits(100, time.Hour), budget.Options{Now: clk.now})
	h, _ := b.Reserve(ctx, "acme", 50)
	h.Settle(50)
	carried, _ := b.Reserve(ctx, "acme", 40)
	if _, err := b.Reserve(ctx, "acme", 11); !budget.Refused(err) {
		t.Fatalf("over budget before the roll: %v", err)
	}
	clk.add(10 * time.Second) // the boundary
	if u := b.Usage("acme"); u.Spent != 0 || u.Reserved != 40 {
		t.Fatalf("usage after the roll = %+v, want spent 0, 40 reserved carried over", u)
	}
	if _, err := b.Reserve(ctx, "acme", 61); !budget.Refused(err) {
		t.Fatalf("the carried reservation counts in the new window: %v", err)
	}
	carried.Settle(30)
	if u := b.Usage("acme"); u.Spent != 30 || u.Reserved != 0 {
		t.Fatalf("usage = %+v, want the carried call's 30 in the new window", u)
	}
}

// Concurrent calls never reserve more than the budget together, and what they settle
// never exceeds it when each spends at most what it reserved. Run with -race.
func TestConcurrentReservationsNeverOverrun(t *testing.T) {
	const budgetTokens = 1000
	reg := prometheus.NewRegistry()
	b := budget.NewMemory(limits(budgetTokens, time.Hour), budget.Options{Registry: reg})
	var (
		wg                sync.WaitGroup
		inFlight, maxSeen atomic.Int64
		granted, refused  atomic.Int64
	)
	for g := range 16 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 200 {
				n := int64(1 + (g+i)%13)
				h, err := b.Reserve(context.Background(), "acme", n)
				if err != nil {
					if !budget.Refused(err) {
						t.Error(err)
					}
					refused.Add(1)
					continue
				}
				granted.Add(1)
				cur := inFlight.Add(n)
				for m := maxSeen.Load(); cur > m && !maxSeen.CompareAndSwap(m, cur); m = maxSeen.Load() {
				}
				inFlight.Add(-n)
				h.Settle(n / 2) // every path settles: here half of what it reserved
			}
		}()
	}
	wg.Wait()
	u := b.Usage("acme")
	if u.Reserved != 0 {
		t.Errorf("reserved after every call settled = %d, want 0", u.Reserved)
	}
	if u.Spent > budgetTokens || maxSeen.Load() > budgetTokens {
		t.Errorf("spent %d, most in flight %d: over the budget %d", u.Spent, maxSeen.Load(), budgetTokens)
	}
	if granted.Load() == 0 || refused.Load() == 0 {
		t.Errorf("granted %d, refused %d: want both (the budget ran out)", granted.Load(), refused.Load())
	}
	if got := counter(t, reg, "curfew_model_budget_refusals_total"); got != float64(refused.Load()) {
		t.Errorf("curfew_model_budget_refusals_total = %v, want %d", got, refused.Load())
	}
}

// counter is the value of the unlabelled counter name in reg.
func counter(t *testing.T, reg *prometheus.Registry, name string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == name {
			return mf.GetMetric()[0].GetCounter().GetValue()
		}
	}
	t.Fatalf("%s not registered", name)
	return 0
}
