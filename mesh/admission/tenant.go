package admission

import (
	"fmt"
	"time"
)

// tenantSweepEvery is how often arrivals look for idle tenants whose budget window has
// ended, to forget them.
const tenantSweepEvery = time.Minute

// tenant is one tenant's counts. It exists while the tenant has runs admitted or queued,
// or spend in the current budget window.
type tenant struct {
	name string
	// outstanding counts the tenant's runs admitted or queued, for MaxInFlight.
	outstanding int
	// running counts the tenant's runs admitted here, for its share of MaxInFlight while
	// the cluster's store is down.
	running int
	// used is the tokens settled in the current window; reserved the expected tokens of
	// the outstanding runs.
	used, reserved int64
	// window and windowStart are the current fixed budget window.
	window      time.Duration
	windowStart time.Time
	// The token buckets of the run rate and of the request rate.
	runs, requests bucket
}

// bucket is a token bucket: tokens at tokensAt, full again at fullAt (its tenant is not
// forgotten before, or forgetting would refill it).
type bucket struct {
	tokens           float64
	tokensAt, fullAt time.Time
}

// take takes one token of the bucket refilled at rate up to burst, or says how long until
// one is there.
func (b *bucket) take(now time.Time, rate, burst float64) (bool, time.Duration) {
	if b.tokensAt.IsZero() {
		b.tokens = burst
	} else {
		b.tokens = min(burst, b.tokens+now.Sub(b.tokensAt).Seconds()*rate)
	}
	b.tokensAt = now
	if b.tokens < 1 {
		return false, time.Duration((1 - b.tokens) / rate * float64(time.Second))
	}
	b.tokens--
	b.fullAt = now.Add(time.Duration((burst - b.tokens) / rate * float64(time.Second)))
	return true, 0
}

// windowStart is the start of the fixed window of length w containing now, aligned to
// the Unix epoch.
func windowStart(now time.Time, w time.Duration) time.Time {
	ns := now.UnixNano()
	return time.Unix(0, ns-ns%int64(w))
}

// roll moves t to the window containing now, forgetting the spend of a past window.
// Reservations carry over: their runs are still outstanding, and their spend is charged
// to the window in which they are settled.
func (t *tenant) roll(now time.Time, w time.Duration) {
	start := windowStart(now, w)
	if w != t.window || !start.Equal(t.windowStart) {
		t.window, t.windowStart, t.used = w, start, 0
	}
}

// tenantFor returns the state of the tenant name, creating it.
func (c *Controller) tenantFor(name string) *tenant {
	t := c.tenants[name]
	if t == nil {
		t = &tenant{name: name}
		c.tenants[name] = t
	}
	return t
}

// tenantLimits asks the limit source for name's limits, with the window defaulted.
func (c *Controller) tenantLimits(name string) TenantLimits {
	l := c.limits.TenantLimits(name)
	if l.Window <= 0 {
		l.Window = DefaultBudgetWindow
	}
	return l
}

// budgetShed refuses a run whose expected tokens do not fit in its tenant's budget
// window: used + reserved + expected > budget. A run expecting no tokens counts as 1, so
// that a tenant with its budget used up starts nothing.
func (c *Controller) budgetShed(p *pool, ten *tenant, lim TenantLimits, req Request, now time.Time) *ShedError {
	ten.roll(now, lim.Window)
	if lim.TokenBudget <= 0 {
		return nil
	}
	need := max(req.ExpectedTokens, 1)
	if ten.used+ten.reserved+need <= lim.TokenBudget {
		return nil
	}
	return &ShedError{Reason: ReasonBudget, RetryAfter: ten.windowStart.Add(lim.Window).Sub(now), Pool: p.cfg.Name, Tenant: req.Tenant,
		Detail: fmt.Sprintf("tenant has spent %d and reserved %d of its %d tokens per %v; the run expects %d",
			ten.used, ten.reserved, lim.TokenBudget, lim.Window, req.ExpectedTokens)}
}

// settle replaces a run's reservation with its actual spend in its tenant's window.
func (c *Controller) settle(ten *tenant, reserved, spent int64, now time.Time) {
	ten.roll(now, c.tenantLimits(ten.name).Window)
	ten.reserved -= reserved
	ten.used += max(spent, 0)
}

// forget deletes ten when nothing refers to it any more and it holds no spend of the
// current window.
func (c *Controller) forget(ten *tenant, now time.Time) {
	if ten.outstanding != 0 || ten.reserved != 0 || now.Before(ten.runs.fullAt) || now.Before(ten.requests.fullAt) {
		return
	}
	if ten.used != 0 && now.Before(ten.windowStart.Add(ten.window)) {
		return
	}
	if c.tenants[ten.name] == ten {
		delete(c.tenants, ten.name)
	}
}

// sweepTenants forgets every idle tenant whose window has ended.
func (c *Controller) sweepTenants(now time.Time) {
	for _, t := range c.tenants {
		c.forget(t, now)
	}
	c.nextSweep = now.Add(tenantSweepEvery)
}

// TenantUsage is a snapshot of a tenant's counts.
type TenantUsage struct {
	// Outstanding is the tenant's runs admitted or queued.
	Outstanding int
	// Used is the tokens settled in the current window.
	Used int64
	// Reserved is the expected tokens of the outstanding runs.
	Reserved int64
	// Budget is the tenant's budget per window (0: unlimited).
	Budget int64
	// WindowEnd is when the current budget window ends.
	WindowEnd time.Time
}

// TenantUsage returns a snapshot of tenant's counts and budget.
func (c *Controller) TenantUsage(tenant string) TenantUsage {
	c.mu.Lock()
	defer c.mu.Unlock()
	now := c.now()
	lim := c.tenantLimits(tenant)
	u := TenantUsage{Budget: lim.TokenBudget, WindowEnd: windowStart(now, lim.Window).Add(lim.Window)}
	if t := c.tenants[tenant]; t != nil {
		t.roll(now, lim.Window)
		u.Outstanding, u.Used, u.Reserved = t.outstanding, t.used, t.reserved
	}
	return u
}
