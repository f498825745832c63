package admission

import (
	"time"
)

// Condition is a fail-closed condition of the overflow pool: evidence that the cancel
// path is not proven (seed 003's "reject overflow admission when any line below is
// true").
type Condition string

// Conditions.
const (
	// ConditionOrphanTokens: a finished run spent tokens after it was cancelled.
	ConditionOrphanTokens Condition = "orphan_tokens"
	// ConditionSlowCancel: a cancel took longer to propagate than the slack it had.
	ConditionSlowCancel Condition = "slow_cancel_propagation"
	// ConditionRetryWithoutID: a retry arrived without its retry-id.
	ConditionRetryWithoutID Condition = "retry_without_id"
	// ConditionSlowHeartbeat: a run's decoder-lease heartbeat period is larger than one
	// third of its deadline.
	ConditionSlowHeartbeat Condition = "slow_heartbeat"
)

// conditions indexes Controller.lastFailure.
var conditions = [...]Condition{orphanIdx: ConditionOrphanTokens, slowCancelIdx: ConditionSlowCancel, noRetryIDIdx: ConditionRetryWithoutID,
	slowHeartbeatIdx: ConditionSlowHeartbeat}

// Indexes of conditions.
const (
	orphanIdx = iota
	slowCancelIdx
	noRetryIDIdx
	slowHeartbeatIdx
)

// ObserveOrphanTokens reports a finished run's orphan tokens (spent after it was
// cancelled). Any n > 0 closes the overflow pool for Config.FailClosedWindow.
func (c *Controller) ObserveOrphanTokens(n int64) {
	if n > 0 {
		c.fail(orphanIdx)
	}
}

// ObserveCancelPropagation reports that a cancel took d to reach the leaves of a run
// whose deadline slack was slack when it was cancelled. Propagation slower than the slack
// closes the overflow pool for Config.FailClosedWindow. A slack ≤ 0 (the cancel was the
// deadline itself) is judged against Config.CancelGrace instead: tokens must freeze
// within one cancel grace.
func (c *Controller) ObserveCancelPropagation(d, slack time.Duration) {
	bound := slack
	if bound <= 0 {
		c.mu.Lock()
		bound = c.cfg.CancelGrace
		c.mu.Unlock()
	}
	if d > bound {
		c.fail(slowCancelIdx)
	}
}

// ObserveRetryWithoutID reports a retry that arrived without its retry-id. It closes the
// overflow pool for Config.FailClosedWindow.
func (c *Controller) ObserveRetryWithoutID() { c.fail(noRetryIDIdx) }

// ObserveHeartbeat reports the decoder-lease heartbeat period of a run with deadline
// slack: a period larger than one third of the slack (seed 003: "heartbeat period is
// larger than one third of the deadline") closes the overflow pool for
// Config.FailClosedWindow, since a lost cancel would then not be caught by a lease lapse
// before the deadline. A slack ≤ 0 is not judged.
func (c *Controller) ObserveHeartbeat(period, slack time.Duration) {
	if slack > 0 && period > slack/3 {
		c.fail(slowHeartbeatIdx)
	}
}

// fail records an occurrence of conditions[i] and sheds the overflow pool's queue.
func (c *Controller) fail(i int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	now := c.now()
	if now.After(c.lastFailure[i]) {
		c.lastFailure[i] = now
	}
	if c.overflow == nil || c.closed || c.forcedOpen(c.overflow, now) {
		return
	}
	e := c.closedShed(c.overflow, "", now)
	if e == nil { // a zero FailClosedWindow cannot happen (defaulted); be safe
		return
	}
	c.dropAll(c.overflow, func(w *waiter) *ShedError {
		we := *e
		we.Tenant = w.req.Tenant
		return &we
	}, now)
}

// failedClosed lists the conditions active at now (comma-separated, "" when none) and
// when the last of them expires.
func (c *Controller) failedClosed(now time.Time) (conds string, until time.Time) {
	for i, last := range c.lastFailure {
		if last.IsZero() {
			continue
		}
		end := last.Add(c.cfg.FailClosedWindow)
		if !now.Before(end) {
			continue
		}
		if conds != "" {
			conds += ","
		}
		conds += string(conditions[i])
		if end.After(until) {
			until = end
		}
	}
	return conds, until
}

// closedShed refuses a run for p while p is the overflow pool and has failed closed,
// unless an operator has forced it open.
func (c *Controller) closedShed(p *pool, tenantName string, now time.Time) *ShedError {
	if p != c.overflow || c.forcedOpen(p, now) {
		return nil
	}
	conds, until := c.failedClosed(now)
	if conds == "" {
		return nil
	}
	return &ShedError{Reason: ReasonPoolClosed, RetryAfter: until.Sub(now), Pool: p.cfg.Name, Tenant: tenantName,
		Condition: conds, Detail: "the overflow pool has failed closed, the cancel path is not proven: " + conds}
}

// Closed reports whether the named pool refuses every run, and why: any pool after
// Close (reason "shutdown"), a pool an operator closed (reason "operator"), the
// overflow pool while a fail-closed condition is within its window and no operator
// forced it open (reason: the conditions, comma-separated). An unknown pool is open.
func (c *Controller) Closed(pool string) (closed bool, reason string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	p := c.byName[pool]
	switch {
	case p == nil:
		return false, ""
	case c.closed:
		return true, string(ReasonShutdown)
	}
	if _, ok := c.operator.Closed[pool]; ok {
		return true, string(ConditionOperator)
	}
	if p != c.overflow || c.forcedOpen(p, c.now()) {
		return false, ""
	}
	conds, _ := c.failedClosed(c.now())
	return conds != "", conds
}
