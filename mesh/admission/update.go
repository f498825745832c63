package admission

import (
	"errors"
	"fmt"
	"sync/atomic"

	"github.com/prometheus/client_golang/prometheus"
)

// Update swaps cfg (validated first, defaults applied) into the running controller,
// keeping every admitted run and every queued one. It is the configuration reload of
// --admission-config (docs/admission.md, "Reloading the configuration"):
//
//   - A pool that stays (by name) takes its new limits at once. A raised MaxInFlight
//     admits queued runs now; a lowered one admits nothing new until enough admitted runs
//     have ended, and never stops one. A lowered MaxQueue sheds no queued run: arrivals
//     find the queue full until it drains below the limit. A shorter MaxQueueAge sheds
//     the queued runs already past it (queue_age), the others at their next check.
//   - A new pool starts empty.
//   - A removed pool admits nothing more, and a request naming it is INVALID_ARGUMENT
//     (unknown pool). Its queued runs are shed with pool_closed; its admitted runs keep
//     their tickets, and their Release still frees the (removed) slot and settles their
//     tenant's budget.
//   - Tenant limits and budgets apply to the next decision: a tenant's outstanding runs,
//     spend and reservations in the current window carry over; a lowered MaxInFlight or
//     budget refuses new runs only. A changed budget window starts the tenant's spend
//     afresh at its next decision, as it does when a window rolls over.
//   - CancelGrace, FailClosedWindow and RetryAfter apply to the next decision; the
//     overflow pool's fail-closed conditions are kept (with the new window).
//
// The service label (Config.Service), the clock (Config.Now), a LimitSource and the
// cluster wiring (Config.Cluster) given to New are kept: they are wiring, not configuration. A cfg whose Service differs is an
// error. On any error nothing changes.
func (c *Controller) Update(cfg Config) error {
	if err := cfg.Validate(); err != nil {
		return err
	}
	cfg = cfg.WithDefaults()
	c.mu.Lock()
	defer c.mu.Unlock()
	if cfg.Service != c.cfg.Service {
		return &ConfigError{"service", fmt.Sprintf("%q", cfg.Service), fmt.Sprintf("cannot change on a reload (running as %q)", c.cfg.Service)}
	}
	if c.closed {
		return errors.New("admission: the controller is shut down")
	}
	cfg.Now, cfg.Limits, cfg.Cluster = c.cfg.Now, c.cfg.Limits, c.cfg.Cluster
	now := c.now()
	pools := make([]*pool, 0, len(cfg.Pools))
	byName := make(map[string]*pool, len(cfg.Pools))
	var overflow *pool
	for _, pc := range cfg.Pools {
		p := c.byName[pc.Name]
		if p == nil {
			p = c.newPool(pc)
		}
		p.cfg = pc
		pools = append(pools, p)
		byName[pc.Name] = p
		if pc.Overflow {
			overflow = p
		}
	}
	for _, p := range c.pools {
		if byName[p.name] != nil {
			continue
		}
		c.dropAll(p, func(w *waiter) *ShedError {
			return &ShedError{Reason: ReasonPoolClosed, RetryAfter: cfg.RetryAfter, Pool: p.name, Tenant: w.req.Tenant,
				Detail: "the pool was removed by a configuration reload"}
		}, now)
		// Its admitted runs still hold slots; their gauges go with the pool.
		c.m.depth.DeleteLabelValues(p.name)
		c.m.inFlight.DeleteLabelValues(p.name)
		c.m.age.DeleteLabelValues(p.name)
		c.m.claims.DeletePartialMatch(prometheus.Labels{"pool": p.name})
	}
	c.cfg, c.pools, c.byName, c.overflow = cfg, pools, byName, overflow
	if c.cfg.Limits == nil {
		c.limits = cfg
	}
	for _, p := range c.pools {
		c.expireHeads(p, now)
		c.dispatch(p, now)
	}
	return nil
}

// LiveLimits is a LimitSource whose Config a reload replaces: modelproxy's per-call
// budgets (package budget) read the tenants of --admission-config through it. Make it
// with NewLiveLimits; it is safe for concurrent use.
type LiveLimits struct{ cfg atomic.Pointer[Config] }

// NewLiveLimits returns the limits of cfg.
func NewLiveLimits(cfg Config) *LiveLimits {
	l := &LiveLimits{}
	l.cfg.Store(&cfg)
	return l
}

// TenantLimits implements LimitSource with the current Config.
func (l *LiveLimits) TenantLimits(tenant string) TenantLimits {
	return l.cfg.Load().TenantLimits(tenant)
}

// Update replaces the Config after validating it; on error nothing changes. A tenant's
// reservations and spend, kept by the budget, carry over.
func (l *LiveLimits) Update(cfg Config) error {
	if err := cfg.Validate(); err != nil {
		return err
	}
	cfg = cfg.WithDefaults()
	l.cfg.Store(&cfg)
	return nil
}
