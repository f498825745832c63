package admission

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/curfew-mesh/curfew/mesh/clusterslots"
)

// Defaults of ClusterConfig.
const (
	// DefaultClaimTimeout bounds one claim's (or release's) store round trips.
	DefaultClaimTimeout = time.Second
	// DefaultClusterPoll is how often a pool whose cluster-wide slots were all held
	// claims again without a wake-up (clusterslots.DefaultPoll).
	DefaultClusterPoll = clusterslots.DefaultPoll
	// DefaultDegradedFor is how long, after a claim failed on a store error, decisions
	// use this replica's share of each cap before the store is tried again.
	DefaultDegradedFor = time.Second
)

// ClusterConfig makes pool caps and tenant concurrency hold across every replica that
// shares a store (docs/cluster.md). Its zero value is off: every limit is this
// replica's own.
type ClusterConfig struct {
	// Slots holds this process's cluster-wide slots; nil turns coordination off. Its
	// Config.OnRelease should call [Controller.Kick], so that a slot freed on another
	// replica admits a waiter here at once rather than at the next Poll.
	Slots *clusterslots.Holder
	// Replicas is the number of live replicas sharing the caps, read when the store
	// fails, for the local share of each cap (ceil(cap / replicas)); nil or < 1 is 1.
	Replicas func() int
	// ClaimTimeout bounds one claim's store round trips; 0 is DefaultClaimTimeout.
	ClaimTimeout time.Duration
	// Poll is how often a pool whose slots were all held claims again without a
	// wake-up; 0 is DefaultClusterPoll.
	Poll time.Duration
	// DegradedFor is how long decisions use the local share after a store error before
	// the store is tried again; 0 is DefaultDegradedFor.
	DegradedFor time.Duration
}

func (cc ClusterConfig) withDefaults() ClusterConfig {
	if cc.ClaimTimeout == 0 {
		cc.ClaimTimeout = DefaultClaimTimeout
	}
	if cc.Poll == 0 {
		cc.Poll = DefaultClusterPoll
	}
	if cc.DegradedFor == 0 {
		cc.DegradedFor = DefaultDegradedFor
	}
	return cc
}

func (cc ClusterConfig) validate() error {
	if cc.ClaimTimeout < 0 || cc.Poll < 0 || cc.DegradedFor < 0 {
		return &ConfigError{"cluster", fmt.Sprintf("%+v", cc), "durations must not be negative"}
	}
	return nil
}

// PoolScope names the cluster-wide slot scope of a pool's cap.
func PoolScope(pool string) string { return "pool/" + pool }

// TenantScope names the cluster-wide slot scope of a tenant's concurrency.
func TenantScope(tenant string) string { return "tenant/" + tenant }

// claimResult is what a cluster claim found.
type claimResult uint8

const (
	claimGranted    claimResult = iota
	claimPoolFull               // every slot of the pool is held
	claimTenantFull             // the pool had a slot, the tenant's concurrency had none
	claimFailed                 // the store failed: decide on the local share
)

var claimResultNames = [...]string{"granted", "pool_full", "tenant_full", "error"}

// ClusterStatus is the state of a controller's cluster-wide coordination.
type ClusterStatus struct {
	// Enabled: caps are claimed in the store.
	Enabled bool
	// Degraded: the last claim failed on a store error, and decisions use this replica's
	// share of each cap until DegradedUntil; DegradedSince is when it began.
	Degraded                     bool
	DegradedSince, DegradedUntil time.Time
	// LastError is the last store error of a claim or release, "" when none yet.
	LastError string
	// Replicas is the replica count the local share is computed from.
	Replicas int
	// LocalAdmits counts the runs admitted on the local share, holding no slot (the
	// cluster may run over a cap until they end); SlotsLost the slots that another
	// holder claimed while their run went on.
	LocalAdmits, SlotsLost int64
	// Holder is the slot holder's own view: held and waiting per scope, renewals.
	Holder clusterslots.Status
}

// clusterState is the controller's coordination state, guarded by Controller.mu except
// where noted.
type clusterState struct {
	degradedSince, degradedUntil time.Time
	lastErr                      error
	localAdmits, lost            int64
	// sized is the size each scope was last given in the store; only claim goroutines
	// use it, under sizeMu.
	sized map[string]int
}

// clustered reports whether caps are claimed in the store.
func (c *Controller) clustered() bool { return c.cluster.Slots != nil }

// share is this replica's share of cap while the store is down: ceil(cap / replicas),
// at least 1.
func (c *Controller) share(limit int) int {
	n := 1
	if f := c.cluster.Replicas; f != nil {
		n = max(f(), 1)
	}
	return max((limit+n-1)/n, 1)
}

// scopesFor lists the scopes a waiter must hold a slot of, and their sizes: its pool's,
// and its tenant's when the tenant has a concurrency limit.
func (c *Controller) scopesFor(p *pool, w *waiter) ([]string, []int) {
	scopes, sizes := []string{PoolScope(p.name)}, []int{p.cfg.MaxInFlight}
	if lim := c.tenantLimits(w.req.Tenant); lim.MaxInFlight > 0 {
		scopes, sizes = append(scopes, TenantScope(w.req.Tenant)), append(sizes, lim.MaxInFlight)
	}
	return scopes, sizes
}

// startClaim takes w (out of its queue) to the store, in a goroutine of its own, since
// the store is never called with the lock held. Claims start in queue order, as many at
// once as the pool has room for locally (a slow round trip does not hold up the next
// waiter); a claim that finds the pool full puts its waiter back at the head. While the
// store is known to be down (degraded), the decision is made at once on the local share
// instead.
func (c *Controller) startClaim(p *pool, w *waiter, now time.Time) {
	if now.Before(c.cl.degradedUntil) {
		c.finishClaim(p, w, nil, claimFailed, nil, now)
		return
	}
	p.claims++
	w.claiming = true
	scopes, sizes := c.scopesFor(p, w)
	c.claims.Add(1)
	go func() {
		defer c.claims.Done()
		ctx, cancel := context.WithTimeout(context.Background(), c.cluster.ClaimTimeout)
		defer cancel()
		start := time.Now()
		slots, res, err := c.claim(ctx, scopes, sizes)
		c.m.claimSeconds.Observe(time.Since(start).Seconds())
		c.m.claims.WithLabelValues(p.name, claimResultNames[res]).Inc()
		c.mu.Lock()
		p.claims--
		w.claiming = false
		now := c.now()
		giveBack := c.finishClaim(p, w, slots, res, err, now)
		c.dispatch(p, now)
		c.mu.Unlock()
		c.releaseSlots(ctx, giveBack)
	}()
}

// claim takes a slot of every scope in the store: both in one statement; when that
// finds one full, the pool's alone tells which (a tenant at its cluster-wide concurrency
// is shed, a full pool waits).
func (c *Controller) claim(ctx context.Context, scopes []string, sizes []int) ([]*clusterslots.Slot, claimResult, error) {
	h := c.cluster.Slots
	if err := c.size(ctx, scopes, sizes); err != nil {
		return nil, claimFailed, err
	}
	slots, ok, err := h.TryAcquireAll(ctx, scopes...)
	switch {
	case err != nil:
		return nil, claimFailed, err
	case ok:
		return slots, claimGranted, nil
	case len(scopes) == 1:
		return nil, claimPoolFull, nil
	}
	ps, ok, err := h.TryAcquire(ctx, scopes[0])
	if err != nil {
		return nil, claimFailed, err
	}
	if !ok {
		return nil, claimPoolFull, nil
	}
	ts, ok, err := h.TryAcquire(ctx, scopes[1])
	if err != nil || !ok {
		c.releaseSlots(ctx, []*clusterslots.Slot{ps})
	}
	switch {
	case err != nil:
		return nil, claimFailed, err
	case !ok:
		return nil, claimTenantFull, nil
	}
	return []*clusterslots.Slot{ps, ts}, claimGranted, nil
}

// size gives each scope its size in the store, once per size and process: at the first
// claim, and after a reload changed it.
func (c *Controller) size(ctx context.Context, scopes []string, sizes []int) error {
	c.sizeMu.Lock()
	defer c.sizeMu.Unlock()
	for i, scope := range scopes {
		if c.cl.sized[scope] == sizes[i] {
			continue
		}
		if err := c.cluster.Slots.Size(ctx, scope, sizes[i]); err != nil {
			return err
		}
		c.cl.sized[scope] = sizes[i]
	}
	return nil
}

// finishClaim decides a waiter once its claim came back (or at once, while degraded),
// with the lock held, and returns the slots to give back to the store once the lock is
// released. Its caller dispatches the pool's next waiter.
func (c *Controller) finishClaim(p *pool, w *waiter, slots []*clusterslots.Slot, res claimResult, err error, now time.Time) (giveBack []*clusterslots.Slot) {
	if res == claimFailed && err != nil {
		c.degrade(err, now)
	}
	if res == claimGranted && !now.Before(c.cl.degradedUntil) {
		c.cl.degradedSince = time.Time{}
	}
	ten := w.tenant
	lim := c.tenantLimits(w.req.Tenant)
	switch {
	case w.cancelErr != nil: // its caller left during the claim
		c.undo(w, ReasonCancelled, w.cancelErr, now)
		return slots
	case c.closed || c.byName[p.name] != p:
		c.undo(w, ReasonShutdown, c.refuseShed(p, w), now)
		return slots
	case res == claimGranted:
		w.ch <- result{t: c.grant(p, ten, w.req, now.Sub(w.enqueued), slots)}
	case res == claimTenantFull, res == claimFailed && lim.MaxInFlight > 0 && ten.running >= c.share(lim.MaxInFlight):
		e := &ShedError{Reason: ReasonTenantConcurrency, RetryAfter: c.cfg.RetryAfter, Pool: p.name, Tenant: w.req.Tenant,
			Detail: fmt.Sprintf("tenant has %d runs admitted across the cluster, its limit", lim.MaxInFlight)}
		if res == claimFailed {
			e.Detail = fmt.Sprintf("the store is down: tenant has %d runs admitted here, this replica's share of its limit %d", ten.running, lim.MaxInFlight)
		}
		e.RetryAfter = max(e.RetryAfter, MinRetryAfter)
		c.undo(w, e.Reason, e, now)
	case res == claimFailed && p.inFlight < c.share(p.cfg.MaxInFlight):
		c.cl.localAdmits++
		c.m.localAdmits.Inc()
		w.ch <- result{t: c.grant(p, ten, w.req, now.Sub(w.enqueued), nil)}
	default: // the pool is full across the cluster, or this replica's share of it
		p.queues[queueOf(w.req)].pushFront(w)
		p.depth.Set(float64(p.queued()))
		c.waitCluster(p)
	}
	return nil
}

// refuseShed is the shed of a waiter whose claim came back after Close or after a
// reload removed its pool.
func (c *Controller) refuseShed(p *pool, w *waiter) *ShedError {
	if c.closed {
		return &ShedError{Reason: ReasonShutdown, RetryAfter: c.cfg.RetryAfter, Pool: p.name, Tenant: w.req.Tenant, Detail: "admission is shut down"}
	}
	return &ShedError{Reason: ReasonPoolClosed, RetryAfter: c.cfg.RetryAfter, Pool: p.name, Tenant: w.req.Tenant,
		Detail: "the pool was removed by a configuration reload"}
}

// undo ends a waiter that is out of its queue (its claim came back) without admitting
// it, as dropWith does for a queued one.
func (c *Controller) undo(w *waiter, reason Reason, err error, now time.Time) {
	w.tenant.outstanding--
	w.tenant.reserved -= w.req.ExpectedTokens
	c.forget(w.tenant, now)
	c.sheds[reason].Inc()
	w.ch <- result{err: err}
}

// degrade records a store error: decisions use the local share for DegradedFor.
func (c *Controller) degrade(err error, now time.Time) {
	if c.cl.degradedSince.IsZero() {
		c.cl.degradedSince = now
	}
	c.cl.degradedUntil = now.Add(c.cluster.DegradedFor)
	c.cl.lastErr = err
}

// waitCluster parks p's dispatch until a slot is released (Kick) or Poll passes, or,
// while degraded, until the store is to be tried again.
func (c *Controller) waitCluster(p *pool) {
	if p.clusterWait {
		return
	}
	p.clusterWait = true
	d := c.cluster.Poll
	if until := time.Until(c.cl.degradedUntil); until > 0 {
		d = min(d, until)
	}
	p.poll = time.AfterFunc(d, func() { c.resume(p) })
}

// resume ends p's wait for the cluster and dispatches its queue.
func (c *Controller) resume(p *pool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !p.clusterWait {
		return
	}
	p.clusterWait = false
	p.poll.Stop()
	c.dispatch(p, c.now())
}

// Kick tells the controller that a slot of scope was released on some replica (the
// slot holder's OnRelease): a pool waiting for one claims again now.
func (c *Controller) Kick(scope string) {
	name, ok := strings.CutPrefix(scope, "pool/")
	if !ok {
		return
	}
	c.mu.Lock()
	p := c.byName[name]
	c.mu.Unlock()
	if p != nil {
		c.resume(p)
	}
}

// releaseSlots gives slots back to the store, counting those that were lost meanwhile.
// It is called without the lock. The release is bounded by ClaimTimeout and outlives
// ctx's cancellation: a slot must go back whoever stopped waiting.
func (c *Controller) releaseSlots(ctx context.Context, slots []*clusterslots.Slot) {
	if len(slots) == 0 {
		return
	}
	var lost int64
	for _, s := range slots {
		if s.Err() != nil {
			lost++
		}
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), c.cluster.ClaimTimeout)
	defer cancel()
	err := c.cluster.Slots.ReleaseAll(ctx, slots...)
	if err != nil && errors.Is(err, clusterslots.ErrClosed) {
		err = nil // the holder is closing and releases everything itself
	}
	if lost == 0 && err == nil {
		return
	}
	c.m.slotsLost.Add(float64(lost))
	c.mu.Lock()
	c.cl.lost += lost
	if err != nil {
		c.cl.lastErr = err
	}
	c.mu.Unlock()
}

// ClusterStatus returns the state of cluster-wide coordination.
func (c *Controller) ClusterStatus() ClusterStatus {
	c.mu.Lock()
	now := c.now()
	s := ClusterStatus{Enabled: c.clustered(), Degraded: now.Before(c.cl.degradedUntil),
		LocalAdmits: c.cl.localAdmits, SlotsLost: c.cl.lost}
	if s.Degraded {
		s.DegradedSince, s.DegradedUntil = c.cl.degradedSince, c.cl.degradedUntil
	}
	if c.cl.lastErr != nil {
		s.LastError = c.cl.lastErr.Error()
	}
	s.Replicas = 1
	if f := c.cluster.Replicas; f != nil {
		s.Replicas = max(f(), 1)
	}
	h := c.cluster.Slots
	c.mu.Unlock()
	if h != nil {
		s.Holder = h.Status()
	}
	return s
}
