package budget

import (
	"context"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/curfew-mesh/curfew/mesh/admission"
)

// Budgets reserves tokens against tenants' budgets. [Memory] is the in-process
// implementation, [Shared] the one every replica sharing a store enforces together.
// Implementations are safe for concurrent use.
type Budgets interface {
	// Reserve reserves n tokens of tenant's budget for one call, or refuses with a
	// *Refusal when the budget cannot cover them. The Hold must be settled exactly once,
	// when the call ends.
	Reserve(ctx context.Context, tenant string, n int64) (Hold, error)
}

// Hold is a granted reservation.
type Hold interface {
	// Settle replaces the reservation with actual, the tokens the call spent (prompt and
	// output). Calls after the first are no-ops.
	Settle(actual int64)
}

// noHold is the Hold of a tenant without a budget.
type noHold struct{}

func (noHold) Settle(int64) {}

// NoHold is the Hold of a reservation that reserved nothing (a tenant without a budget).
var NoHold Hold = noHold{}

// Options tune a Memory.
type Options struct {
	// Registry receives curfew_model_budget_refusals_total and
	// curfew_model_budget_reserved_tokens; nil registers nothing.
	Registry prometheus.Registerer
	// Now is the clock; nil is time.Now.
	Now func() time.Time
}

// sweepEvery is how many reservations pass between sweeps of idle tenants.
const sweepEvery = 1024

// Memory is Budgets counted in this process's memory (one modelproxy replica's). The
// zero value is not usable; call NewMemory.
type Memory struct {
	limits admission.LimitSource
	now    func() time.Time

	mu      sync.Mutex
	tenants map[string]*tenant
	calls   int // reservations since the last sweep

	refusals prometheus.Counter
	reserved prometheus.Gauge
}

// tenant is one tenant's current window.
type tenant struct {
	window      time.Duration
	windowStart time.Time
	spent       int64 // settled in the current window
	reserved    int64 // held by calls in flight
}

// NewMemory returns budgets with the limits of src (an admission.Config is one: its
// DefaultTenant and Tenants). Each tenant's TokenBudget and Window are asked for at
// every reservation.
func NewMemory(src admission.LimitSource, o Options) *Memory {
	m := &Memory{limits: src, now: o.Now, tenants: map[string]*tenant{},
		refusals: prometheus.NewCounter(prometheus.CounterOpts{Name: "curfew_model_budget_refusals_total",
			Help: "Model calls refused before they started because their tenant's token budget could not cover their reservation (prompt + max_tokens)."}),
		reserved: prometheus.NewGauge(prometheus.GaugeOpts{Name: "curfew_model_budget_reserved_tokens",
			Help: "Tokens reserved against tenants' budgets by model calls in flight."}),
	}
	if m.now == nil {
		m.now = time.Now
	}
	if o.Registry != nil {
		o.Registry.MustRegister(m.refusals, m.reserved)
	}
	return m
}

// limitsOf is tenant's budget and window, the window defaulted as admission does.
func (m *Memory) limitsOf(name string) (budget int64, window time.Duration) {
	l := m.limits.TenantLimits(name)
	if l.Window <= 0 {
		l.Window = admission.DefaultBudgetWindow
	}
	return l.TokenBudget, l.Window
}

// windowStart is the start of the fixed window of length w containing now, aligned to
// the Unix epoch (as admission's).
func windowStart(now time.Time, w time.Duration) time.Time {
	ns := now.UnixNano()
	return time.Unix(0, ns-ns%int64(w))
}

// roll moves t to the window containing now: a past window's spend is forgotten;
// reservations carry over.
func (t *tenant) roll(now time.Time, w time.Duration) {
	if start := windowStart(now, w); w != t.window || !start.Equal(t.windowStart) {
		t.window, t.windowStart, t.spent = w, start, 0
	}
}

// Reserve implements Budgets.
func (m *Memory) Reserve(_ context.Context, name string, n int64) (Hold, error) {
	budget, window := m.limitsOf(name)
	if budget <= 0 {
		return NoHold, nil
	}
	n = max(n, 1)
	now := m.now()
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.calls++; m.calls >= sweepEvery {
		m.calls = 0
		m.sweepLocked(now)
	}
	t := m.tenants[name]
	if t == nil {
		t = &tenant{}
		m.tenants[name] = t
	}
	t.roll(now, window)
	if t.spent+t.reserved+n > budget {
		m.refusals.Inc()
		return nil, &Refusal{Tenant: name, Spent: t.spent, Reserved: t.reserved, Budget: budget, Window: window,
			Need: n, WindowEnd: t.windowStart.Add(window)}
	}
	t.reserved += n
	m.reserved.Add(float64(n))
	return &hold{m: m, name: name, t: t, n: n}, nil
}

// sweepLocked forgets tenants with nothing reserved whose window has ended.
func (m *Memory) sweepLocked(now time.Time) {
	for name, t := range m.tenants {
		if t.reserved == 0 && !now.Before(t.windowStart.Add(t.window)) {
			delete(m.tenants, name)
		}
	}
}

// Usage is a tenant's state in its current window.
type Usage struct {
	// Spent is the tokens settled in the current window; Reserved those held by calls in
	// flight; Budget the tenant's budget per window (0: unlimited).
	Spent, Reserved, Budget int64
	// WindowEnd is when the current window ends.
	WindowEnd time.Time
}

// Usage returns tenant's spent and reserved tokens in its current window.
func (m *Memory) Usage(name string) Usage {
	budget, window := m.limitsOf(name)
	now := m.now()
	m.mu.Lock()
	defer m.mu.Unlock()
	u := Usage{Budget: budget, WindowEnd: windowStart(now, window).Add(window)}
	if t := m.tenants[name]; t != nil {
		t.roll(now, window)
		u.Spent, u.Reserved = t.spent, t.reserved
	}
	return u
}

// hold is a Memory reservation.
type hold struct {
	m    *Memory
	name string
	t    *tenant // never swept while reserved > 0
	n    int64
	once sync.Once
}

func (h *hold) Settle(actual int64) {
	h.once.Do(func() {
		_, window := h.m.limitsOf(h.name)
		now := h.m.now()
		h.m.mu.Lock()
		defer h.m.mu.Unlock()
		h.t.roll(now, window)
		h.t.reserved -= h.n
		h.t.spent += max(actual, 0)
		h.m.reserved.Sub(float64(h.n))
	})
}
