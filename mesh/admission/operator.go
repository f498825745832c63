package admission

import (
	"sort"
	"time"
)

// ConditionOperator is the Condition of a pool_closed shed from a pool an operator
// closed (OperatorControls.Closed): not evidence about the cancel path but a decision.
const ConditionOperator Condition = "operator"

// OperatorControls are the operators' decisions on pools, as every replica reads them
// from the store (the orchestrator polls them and hands them to SetOperatorControls).
type OperatorControls struct {
	// Closed maps a pool to the reason an operator closed it: the pool sheds every new
	// run with pool_closed, condition operator, and its queue is shed. Runs admitted
	// keep running.
	Closed map[string]string
	// ForcedOpen maps a pool to the instant until which it admits although its
	// automatic fail-closed window holds (an operator's open with force).
	ForcedOpen map[string]time.Time
}

// SetOperatorControls replaces the operators' decisions the controller obeys. A pool
// newly closed sheds its queue at once; names of pools not configured are kept (a
// reload may add the pool later) but act on nothing.
func (c *Controller) SetOperatorControls(oc OperatorControls) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.operator = oc
	now := c.now()
	for _, p := range c.pools {
		if e := c.operatorShed(p, "", now); e != nil {
			c.dropAll(p, func(w *waiter) *ShedError {
				we := *e
				we.Tenant = w.req.Tenant
				return &we
			}, now)
		}
	}
}

// operatorShed refuses a run for p while an operator has it closed.
func (c *Controller) operatorShed(p *pool, tenantName string, _ time.Time) *ShedError {
	reason, closed := c.operator.Closed[p.name]
	if !closed {
		return nil
	}
	detail := "an operator has closed the pool"
	if reason != "" {
		detail += ": " + reason
	}
	return &ShedError{Reason: ReasonPoolClosed, RetryAfter: c.cfg.RetryAfter, Pool: p.name, Tenant: tenantName,
		Condition: string(ConditionOperator), Detail: detail}
}

// forcedOpen reports whether an operator has forced p open over its automatic window.
func (c *Controller) forcedOpen(p *pool, now time.Time) bool {
	until, ok := c.operator.ForcedOpen[p.name]
	return ok && now.Before(until)
}

// PoolState is a pool's admission state on this replica, for operators.
type PoolState struct {
	Name        string
	Overflow    bool
	MaxInFlight int
	MaxQueue    int
	InFlight    int
	Queued      int
	// OldestQueued is how long the head of the queue has waited (0: empty queue).
	OldestQueued time.Duration
	// OperatorClosed and OperatorReason: an operator's close in force.
	OperatorClosed bool
	OperatorReason string
	// AutoConditions are the fail-closed conditions within their window (the overflow
	// pool only), and AutoUntil when the last of them ends. They are reported even while
	// ForcedOpenUntil lifts them.
	AutoConditions  []string
	AutoUntil       time.Time
	ForcedOpenUntil time.Time
}

// PoolStates returns every configured pool's state, in their configured order.
func (c *Controller) PoolStates() []PoolState {
	c.mu.Lock()
	defer c.mu.Unlock()
	now := c.now()
	out := make([]PoolState, 0, len(c.pools))
	for _, p := range c.pools {
		s := PoolState{Name: p.name, Overflow: p.cfg.Overflow, MaxInFlight: p.cfg.MaxInFlight, MaxQueue: p.cfg.MaxQueue,
			InFlight: p.inFlight, Queued: p.queued()}
		for _, q := range p.queues {
			if q.head != nil {
				s.OldestQueued = max(s.OldestQueued, now.Sub(q.head.enqueued))
			}
		}
		s.OperatorReason, s.OperatorClosed = c.operator.Closed[p.name]
		if p == c.overflow {
			conds, until := c.failedClosed(now)
			if conds != "" {
				s.AutoConditions, s.AutoUntil = splitConditions(conds), until
			}
		}
		if c.forcedOpen(p, now) {
			s.ForcedOpenUntil = c.operator.ForcedOpen[p.name]
		}
		out = append(out, s)
	}
	return out
}

// FailClosedWindow is how long a fail-closed condition keeps the overflow pool closed.
func (c *Controller) FailClosedWindow() time.Duration {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.cfg.FailClosedWindow
}

func splitConditions(conds string) []string {
	var out []string
	start := 0
	for i := 0; i <= len(conds); i++ {
		if i == len(conds) || conds[i] == ',' {
			out = append(out, conds[start:i])
			start = i + 1
		}
	}
	sort.Strings(out)
	return out
}
