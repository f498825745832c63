package admission

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/curfew-mesh/curfew/mesh/clusterslots"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// Criticality is a run's criticality class, from the curfew-criticality header.
type Criticality string

// Criticalities. Critical work is admitted before sheddable work and may evict it from a
// full queue.
const (
	// Critical work goes to the first pool (paid). It is the default.
	Critical Criticality = "critical"
	// Sheddable work goes to the overflow pool when there is one, else the first pool.
	Sheddable Criticality = "sheddable"
)

// ParseCriticality parses a criticality header value: "" or "critical" is Critical,
// "sheddable" is Sheddable (case and surrounding spaces ignored); anything else is an
// error.
func ParseCriticality(s string) (Criticality, error) {
	switch strings.ToLower(strings.TrimSpace(s)) {
	case "", string(Critical):
		return Critical, nil
	case string(Sheddable):
		return Sheddable, nil
	}
	return "", fmt.Errorf("admission: unknown criticality %q (critical or sheddable)", s)
}

// Indexes of a pool's two queues.
const (
	critQ = 0
	shedQ = 1
)

// Request describes a run asking for admission. Its deadline is its context's.
type Request struct {
	// Tenant is the run's tenant (curfew-tenant); "" is a tenant like any other.
	Tenant string
	// Pool names the pool explicitly; "" picks it from Criticality.
	Pool string
	// Criticality orders the queue and picks the pool when Pool is ""; "" is Critical.
	Criticality Criticality
	// Class groups runs whose observed service times predict each other's (for example
	// the model name); the estimate for the deadline slack rule is kept per class.
	Class string
	// Expected is the run's declared expected service time; when 0 the controller's
	// estimate for Class is used (0 until a run of the class has completed).
	Expected time.Duration
	// ExpectedTokens is reserved against the tenant's token budget from admission until
	// Release settles it (from the plan, or max_tokens).
	ExpectedTokens int64
}

// End says how a run ended, in its Outcome.
type End uint8

// Ends. Only EndCompleted runs feed the expected service time of their class: the
// others ended early, so their durations say little about how long the work takes.
const (
	// EndUnknown: not said (the zero value).
	EndUnknown End = iota
	// EndCompleted: the run reached its answer.
	EndCompleted
	// EndFailed: the run failed with an error of its own.
	EndFailed
	// EndCancelled: the run was cancelled (client disconnect, operator).
	EndCancelled
	// EndDeadline: the run's deadline passed.
	EndDeadline
)

// Outcome is what Release is told about a finished run.
type Outcome struct {
	// Tokens is the run's actual token spend; it replaces the reservation in the tenant's
	// budget window.
	Tokens int64
	// Service is the run's service time, from admission to its end.
	Service time.Duration
	// Ended says how the run ended.
	Ended End
}

// Controller is the admission controller: named pools with their queues, tenant limits
// and budgets, the deadline slack rule, and the overflow pool's fail-closed state. It is
// safe for concurrent use. One mutex guards it all; every decision is O(1) in the queue
// length.
type Controller struct {
	cfg    Config
	now    func() time.Time
	limits LimitSource
	m      *metrics
	sheds  map[Reason]prometheus.Counter

	mu        sync.Mutex
	closed    bool
	pools     []*pool
	byName    map[string]*pool
	overflow  *pool // nil when no pool is marked overflow
	tenants   map[string]*tenant
	nextSweep time.Time
	classes   map[string]*samples
	// lastFailure is the last occurrence of each fail-closed condition (zero: never).
	lastFailure [len(conditions)]time.Time
	// operator holds the operators' decisions (SetOperatorControls).
	operator OperatorControls
	// cluster is Config.Cluster as given to New, defaults applied: wiring, never changed
	// by Update, so claim goroutines read it without the lock. cl is the coordination
	// state (cluster.go); claims counts the claims in flight, sizeMu guards cl.sized.
	cluster ClusterConfig
	cl      clusterState
	claims  sync.WaitGroup
	sizeMu  sync.Mutex
}

// pool is one pool's state.
type pool struct {
	name      string     // cfg.Name, which never changes: read without the lock by Ticket.Pool
	cfg       PoolConfig // guarded by Controller.mu (Update replaces it)
	inFlight  int
	queues    [2]waitList // critQ, shedQ
	depth     prometheus.Gauge
	inFlightG prometheus.Gauge
	age       prometheus.Observer
	// With cluster-wide slots (cluster.go): the waiters whose claims are at the store
	// (they count against MaxInFlight meanwhile), and whether dispatch waits for a slot
	// to be released somewhere (Kick) or for the poll timer.
	claims      int
	clusterWait bool
	poll        *time.Timer
}

func (p *pool) queued() int { return p.queues[critQ].n + p.queues[shedQ].n }

// waiter is a queued request; its caller waits in Admit for the result on ch.
type waiter struct {
	prev, next *waiter
	list       *waitList // nil once out of the queue
	pool       *pool
	req        Request
	tenant     *tenant
	enqueued   time.Time
	deadline   time.Time // zero: none
	giveUp     time.Time // when to check age and slack again; owned by the waiting caller
	ch         chan result
	// claiming is set while the waiter's claim is at the store; cancelErr when its
	// caller left meanwhile.
	claiming  bool
	cancelErr error
}

type result struct {
	t   *Ticket
	err error
}

// waitList is an intrusive FIFO of waiters: O(1) push, removal anywhere, both ends.
type waitList struct {
	head, tail *waiter
	n          int
}

func (l *waitList) pushBack(w *waiter) {
	w.list, w.prev, w.next = l, l.tail, nil
	if l.tail != nil {
		l.tail.next = w
	} else {
		l.head = w
	}
	l.tail = w
	l.n++
}

// pushFront puts w back at the head (its claim found no slot: it keeps its turn).
func (l *waitList) pushFront(w *waiter) {
	w.list, w.prev, w.next = l, nil, l.head
	if l.head != nil {
		l.head.prev = w
	} else {
		l.tail = w
	}
	l.head = w
	l.n++
}

// queueOf is the queue of a request's criticality.
func queueOf(req Request) int {
	if req.Criticality == Critical {
		return critQ
	}
	return shedQ
}

func (l *waitList) remove(w *waiter) {
	if w.prev != nil {
		w.prev.next = w.next
	} else {
		l.head = w.next
	}
	if w.next != nil {
		w.next.prev = w.prev
	} else {
		l.tail = w.prev
	}
	w.prev, w.next, w.list = nil, nil, nil
	l.n--
}

// New returns a controller configured by cfg (defaults applied), registering its metrics
// with reg when it is not nil. It fails when cfg does not validate or the metrics cannot
// be registered (one controller per registry).
func New(cfg Config, reg prometheus.Registerer) (*Controller, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg = cfg.WithDefaults()
	c := &Controller{
		cfg: cfg, now: cfg.Now, limits: cfg.Limits, m: newMetrics(cfg.Service),
		sheds:   map[Reason]prometheus.Counter{},
		byName:  map[string]*pool{},
		tenants: map[string]*tenant{},
		classes: map[string]*samples{},
		cl:      clusterState{sized: map[string]int{}},
		cluster: cfg.Cluster,
	}
	if c.now == nil {
		c.now = time.Now
	}
	if c.limits == nil {
		c.limits = cfg
	}
	c.m.closed = newClosedCollector(c)
	c.m.degraded = newDegradedGauge(c)
	for _, pc := range cfg.Pools {
		p := c.newPool(pc)
		c.pools = append(c.pools, p)
		c.byName[pc.Name] = p
		if pc.Overflow {
			c.overflow = p
		}
	}
	for _, r := range Reasons() {
		c.sheds[r] = c.m.shed.WithLabelValues(cfg.Service, string(r))
	}
	if reg != nil {
		if err := c.m.register(reg); err != nil {
			return nil, err
		}
	}
	return c, nil
}

// newPool makes the state of a pool configured by pc, with its metrics' series.
func (c *Controller) newPool(pc PoolConfig) *pool {
	if c.clustered() {
		for _, r := range claimResultNames {
			c.m.claims.WithLabelValues(pc.Name, r)
		}
	}
	return &pool{name: pc.Name, cfg: pc, depth: c.m.depth.WithLabelValues(pc.Name),
		inFlightG: c.m.inFlight.WithLabelValues(pc.Name), age: c.m.age.WithLabelValues(pc.Name)}
}

// Config returns the controller's configuration, defaults applied: the one given to New,
// or to the last Update that succeeded.
func (c *Controller) Config() Config {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.cfg
}

// TenantLimits returns tenant's limits from the controller's LimitSource.
func (c *Controller) TenantLimits(tenant string) TenantLimits {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.limits.TenantLimits(tenant)
}

// poolNames lists the pools, in their configured order.
func (c *Controller) poolNames() []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	names := make([]string, len(c.pools))
	for i, p := range c.pools {
		names[i] = p.name
	}
	return names
}

// Admit asks for a run's admission. It returns at once when the run is admitted or shed,
// and otherwise blocks while the run is queued, until it is admitted, shed from the queue
// (queue_age, deadline_slack, queue_full eviction, pool_closed, shutdown) or ctx ends.
// ctx's deadline is the run's deadline for the slack rule.
//
// On admission the caller owns a Ticket and must Release it exactly once when the run
// ends (more calls are no-ops). A refusal is a *ShedError (see AsShed); when ctx ends
// while queued, Admit returns ctx's status error (CANCELED or DEADLINE_EXCEEDED); an
// invalid request (unknown pool or criticality, negative expectations) is an
// INVALID_ARGUMENT status error.
func (c *Controller) Admit(ctx context.Context, req Request) (*Ticket, error) {
	if ctx.Err() != nil {
		return nil, ctxStatus(ctx)
	}
	deadline, _ := ctx.Deadline()
	t, w, err := c.arrive(req, deadline)
	if w == nil {
		return t, err
	}
	return c.wait(ctx, w)
}

// arrive is Admit's decision: a ticket (admitted at once), a queued waiter, or an error.
func (c *Controller) arrive(req Request, deadline time.Time) (*Ticket, *waiter, error) {
	crit, err := ParseCriticality(string(req.Criticality))
	if err != nil {
		return nil, nil, status.Error(codes.InvalidArgument, err.Error())
	}
	req.Criticality = crit
	if req.Expected < 0 || req.ExpectedTokens < 0 {
		return nil, nil, status.Errorf(codes.InvalidArgument, "admission: negative expected service time %v or tokens %d", req.Expected, req.ExpectedTokens)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	now := c.now()
	p, err := c.poolFor(req)
	if err != nil {
		return nil, nil, err
	}
	if c.closed {
		return nil, nil, c.refuse(&ShedError{Reason: ReasonShutdown, RetryAfter: c.cfg.RetryAfter, Pool: p.cfg.Name,
			Tenant: req.Tenant, Detail: "admission is shut down"})
	}
	if e := c.operatorShed(p, req.Tenant, now); e != nil {
		return nil, nil, c.refuse(e)
	}
	if e := c.closedShed(p, req.Tenant, now); e != nil {
		return nil, nil, c.refuse(e)
	}
	if e := c.slackShed(p, req, deadline, now); e != nil {
		return nil, nil, c.refuse(e)
	}
	if now.After(c.nextSweep) {
		c.sweepTenants(now)
	}
	ten := c.tenantFor(req.Tenant)
	lim := c.tenantLimits(req.Tenant)
	if lim.Rate > 0 {
		if ok, wait := ten.runs.take(now, lim.Rate, lim.burst()); !ok {
			c.forget(ten, now)
			return nil, nil, c.refuse(&ShedError{Reason: ReasonRateLimited, RetryAfter: max(wait, MinRetryAfter), Pool: p.cfg.Name,
				Tenant: req.Tenant, Detail: fmt.Sprintf("the tenant may start %g runs per second (burst %g)", lim.Rate, lim.burst())})
		}
	}
	if lim.MaxInFlight > 0 && ten.outstanding >= lim.MaxInFlight {
		c.forget(ten, now)
		return nil, nil, c.refuse(&ShedError{Reason: ReasonTenantConcurrency, RetryAfter: c.cfg.RetryAfter, Pool: p.cfg.Name,
			Tenant: req.Tenant, Detail: fmt.Sprintf("tenant has %d runs admitted or queued, its limit", ten.outstanding)})
	}
	if e := c.budgetShed(p, ten, lim, req, now); e != nil {
		c.forget(ten, now)
		return nil, nil, c.refuse(e)
	}
	// Count the run against its tenant now, so that shedding other waiters of the same
	// tenant below cannot make the tenant look idle and forgotten.
	ten.outstanding++
	ten.reserved += req.ExpectedTokens
	c.expireHeads(p, now)
	if p.inFlight < p.cfg.MaxInFlight && p.queued() == 0 && !c.clustered() {
		return c.grant(p, ten, req, 0, nil), nil, nil
	}
	if p.queued() >= p.cfg.MaxQueue {
		victim := p.queues[shedQ].tail
		if crit != Critical || victim == nil {
			ten.outstanding--
			ten.reserved -= req.ExpectedTokens
			c.forget(ten, now)
			return nil, nil, c.refuse(&ShedError{Reason: ReasonQueueFull, RetryAfter: c.cfg.RetryAfter, Pool: p.cfg.Name,
				Tenant: req.Tenant, Detail: fmt.Sprintf("%d runs are queued, the pool's limit", p.queued())})
		}
		c.drop(victim, &ShedError{Reason: ReasonQueueFull, RetryAfter: c.cfg.RetryAfter, Pool: p.cfg.Name,
			Tenant: victim.req.Tenant, Detail: "evicted from the full queue to make room for critical work"}, now)
	}
	w := &waiter{pool: p, req: req, tenant: ten, enqueued: now, deadline: deadline, ch: make(chan result, 1)}
	w.giveUp = c.giveUp(w)
	p.queues[queueOf(req)].pushBack(w)
	p.depth.Set(float64(p.queued()))
	c.dispatch(p, now) // locally, a no-op unless a slot is free, which the fast path above rules out
	return nil, w, nil
}

// wait blocks the caller of a queued request until it is admitted or shed, its ctx ends,
// or its give-up time (queue age, deadline slack) comes, in which case it checks them and
// either sheds itself or waits on.
func (c *Controller) wait(ctx context.Context, w *waiter) (*Ticket, error) {
	timer := time.NewTimer(c.untilGiveUp(w))
	defer timer.Stop()
	for {
		select {
		case r := <-w.ch:
			return r.t, r.err
		case <-ctx.Done():
			c.mu.Lock()
			if w.list != nil {
				c.dropWith(w, ReasonCancelled, ctxStatus(ctx), c.now())
			} else if w.claiming {
				w.cancelErr = ctxStatus(ctx) // the claim's return ends it
			}
			c.mu.Unlock()
			r := <-w.ch
			if r.t != nil { // admitted in the same instant: give the slot back
				r.t.Release(Outcome{Ended: EndCancelled}) //nolint:contextcheck // Release gives the slots back whether or not ctx ended
				return nil, ctxStatus(ctx)
			}
			return nil, r.err
		case <-timer.C:
			c.mu.Lock()
			if w.list != nil {
				now := c.now()
				if e := c.queuedShed(w, now); e != nil {
					c.drop(w, e, now)
				} else {
					w.giveUp = c.giveUp(w)
				}
			}
			c.mu.Unlock()
			timer.Reset(c.untilGiveUp(w))
		}
	}
}

// giveUp is when w's queue age or deadline slack runs out, with the current estimate of
// its expected service time.
func (c *Controller) giveUp(w *waiter) time.Time {
	at := w.enqueued.Add(w.pool.cfg.MaxQueueAge)
	if !w.deadline.IsZero() {
		if s := w.deadline.Add(-(c.expected(w.req) + c.cfg.CancelGrace)); s.Before(at) {
			at = s
		}
	}
	return at
}

// untilGiveUp is the timer period until w's give-up time, at least a millisecond.
func (c *Controller) untilGiveUp(w *waiter) time.Duration {
	return max(w.giveUp.Sub(c.now()), time.Millisecond)
}

// poolFor resolves req's pool: named, or by criticality.
func (c *Controller) poolFor(req Request) (*pool, error) {
	if req.Pool != "" {
		p := c.byName[req.Pool]
		if p == nil {
			return nil, status.Errorf(codes.InvalidArgument, "admission: unknown pool %q", req.Pool)
		}
		return p, nil
	}
	if req.Criticality == Sheddable && c.overflow != nil {
		return c.overflow, nil
	}
	return c.pools[0], nil
}

// expected is req's expected service time: declared, or the estimate of its class.
func (c *Controller) expected(req Request) time.Duration {
	if req.Expected > 0 {
		return req.Expected
	}
	if s := c.classes[req.Class]; s != nil {
		return s.estimate
	}
	return 0
}

// slackShed applies the seed's rule: shed when expected + cancel grace > deadline slack.
func (c *Controller) slackShed(p *pool, req Request, deadline, now time.Time) *ShedError {
	if deadline.IsZero() || !*p.cfg.SlackShed {
		return nil
	}
	exp, slack := c.expected(req), deadline.Sub(now)
	if exp+c.cfg.CancelGrace <= slack {
		return nil
	}
	return &ShedError{Reason: ReasonDeadlineSlack, RetryAfter: slack, Pool: p.cfg.Name, Tenant: req.Tenant,
		Detail: fmt.Sprintf("expected service time %v + cancel grace %v > deadline slack %v",
			exp, c.cfg.CancelGrace, slack.Round(time.Millisecond))}
}

// queuedShed checks a queued waiter's age and slack, as when it leaves the queue.
func (c *Controller) queuedShed(w *waiter, now time.Time) *ShedError {
	p := w.pool
	if waited := now.Sub(w.enqueued); waited >= p.cfg.MaxQueueAge {
		return &ShedError{Reason: ReasonQueueAge, RetryAfter: c.cfg.RetryAfter, Pool: p.cfg.Name, Tenant: w.req.Tenant,
			Detail: fmt.Sprintf("waited %v in the queue, the limit is %v", waited.Round(time.Millisecond), p.cfg.MaxQueueAge)}
	}
	return c.slackShed(p, w.req, w.deadline, now)
}

// expireHeads sheds the waiters of p that are past the queue age limit. The queues are
// FIFO, so they are at the heads.
func (c *Controller) expireHeads(p *pool, now time.Time) {
	for q := range p.queues {
		for w := p.queues[q].head; w != nil && now.Sub(w.enqueued) >= p.cfg.MaxQueueAge; w = p.queues[q].head {
			c.drop(w, c.queuedShed(w, now), now)
		}
	}
}

// dispatch admits waiters of p while it has free slots: critical first, FIFO within a
// criticality. A waiter whose age or slack ran out is shed instead, before any work.
// With cluster-wide slots, each waiter taken goes to the store for its slots instead
// (startClaim), in queue order, unless the pool waits for a slot to be released.
func (c *Controller) dispatch(p *pool, now time.Time) {
	for p.inFlight+p.claims < p.cfg.MaxInFlight {
		if c.clustered() && p.clusterWait {
			return
		}
		w := p.queues[critQ].head
		if w == nil {
			w = p.queues[shedQ].head
		}
		if w == nil {
			return
		}
		if e := c.queuedShed(w, now); e != nil {
			c.drop(w, e, now)
			continue
		}
		w.list.remove(w)
		p.depth.Set(float64(p.queued()))
		if c.clustered() {
			c.startClaim(p, w, now)
			continue // startClaim decided at once (degraded) or counted the claim in p.claims
		}
		w.ch <- result{t: c.grant(p, w.tenant, w.req, now.Sub(w.enqueued), nil)}
	}
}

// grant takes a slot of p for a run whose tenant counts and reservation are already
// made; slots are its cluster-wide slots (none without coordination, or when admitted
// on the local share).
func (c *Controller) grant(p *pool, ten *tenant, req Request, waited time.Duration, slots []*clusterslots.Slot) *Ticket {
	p.inFlight++
	p.inFlightG.Set(float64(p.inFlight))
	p.age.Observe(waited.Seconds())
	ten.running++
	return &Ticket{c: c, pool: p, tenant: ten, class: req.Class, reserved: req.ExpectedTokens, waited: waited, slots: slots}
}

// drop sheds a queued waiter with e.
func (c *Controller) drop(w *waiter, e *ShedError, now time.Time) {
	e.RetryAfter = max(e.RetryAfter, MinRetryAfter)
	c.dropWith(w, e.Reason, e, now)
}

// dropWith takes w out of its queue, undoes its tenant counts and reservation, counts
// reason and hands err to its caller.
func (c *Controller) dropWith(w *waiter, reason Reason, err error, now time.Time) {
	p := w.pool
	w.list.remove(w)
	p.depth.Set(float64(p.queued()))
	p.age.Observe(now.Sub(w.enqueued).Seconds())
	w.tenant.outstanding--
	w.tenant.reserved -= w.req.ExpectedTokens
	c.forget(w.tenant, now)
	c.sheds[reason].Inc()
	w.ch <- result{err: err}
}

// dropAll sheds every waiter of p with the error mk makes for it.
func (c *Controller) dropAll(p *pool, mk func(*waiter) *ShedError, now time.Time) {
	for q := range p.queues {
		for w := p.queues[q].head; w != nil; w = p.queues[q].head {
			c.drop(w, mk(w), now)
		}
	}
}

// AllowRequest takes one token of tenant's request bucket (TenantLimits.RequestRate):
// nil when the call may go on, else a ShedError with ReasonRequestRateLimited and the
// delay until the next token. The orchestrator asks it for every call to its public API
// once the call's tenant is authenticated. It refuses nothing after Close: a stopping
// service still answers reads.
func (c *Controller) AllowRequest(tenant string) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	lim := c.tenantLimits(tenant)
	if lim.RequestRate <= 0 {
		return nil
	}
	now := c.now()
	if now.After(c.nextSweep) {
		c.sweepTenants(now)
	}
	ten := c.tenantFor(tenant)
	if ok, wait := ten.requests.take(now, lim.RequestRate, lim.requestBurst()); !ok {
		return c.refuse(&ShedError{Reason: ReasonRequestRateLimited, RetryAfter: wait, Tenant: tenant,
			Detail: fmt.Sprintf("the tenant may make %g calls per second (burst %g)", lim.RequestRate, lim.requestBurst())})
	}
	return nil
}

// refuse counts an arrival's shed and returns it.
func (c *Controller) refuse(e *ShedError) error {
	e.RetryAfter = max(e.RetryAfter, MinRetryAfter)
	c.sheds[e.Reason].Inc()
	return e
}

// Close sheds every queued run with ReasonShutdown and refuses every later Admit the
// same way. Admitted runs keep their tickets; Release still works. Close is idempotent.
// Without cluster-wide slots the controller has no goroutines or timers of its own;
// with them, Close stops the pools' poll timers and returns once the claims at the store
// have come back (their waiters are shed too).
func (c *Controller) Close() {
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return
	}
	c.closed = true
	now := c.now()
	for _, p := range c.pools {
		if p.poll != nil {
			p.poll.Stop()
		}
		c.dropAll(p, func(w *waiter) *ShedError {
			return &ShedError{Reason: ReasonShutdown, RetryAfter: c.cfg.RetryAfter, Pool: p.cfg.Name, Tenant: w.req.Tenant,
				Detail: "admission is shut down"}
		}, now)
	}
	c.mu.Unlock()
	c.claims.Wait()
}

// afterRun is the context of a Release's store round trip (bounded by ClaimTimeout):
// the run it ends has no context left to give.
var afterRun = context.Background()

// Ticket is an admitted run's lease on a pool slot.
type Ticket struct {
	c        *Controller
	pool     *pool
	tenant   *tenant
	class    string
	reserved int64
	waited   time.Duration
	slots    []*clusterslots.Slot // cluster-wide slots, given back first on Release
	released atomic.Bool
}

// Pool is the name of the pool the run was admitted to.
func (t *Ticket) Pool() string { return t.pool.name }

// Waited is how long the run waited in the queue.
func (t *Ticket) Waited() time.Duration { return t.waited }

// Reserved is the tokens reserved for the run against its tenant's budget.
func (t *Ticket) Reserved() int64 { return t.reserved }

// Release ends the run's lease: it frees the pool slot (admitting the next waiter), ends
// the run's count against its tenant, settles its token reservation with o.Tokens (the
// unused part of the reservation returns to the budget; a spend beyond it is charged),
// and, for a completed run, records o.Service for its class's expected service time.
// Only the first call counts; Release on a nil Ticket is a no-op. Cluster-wide slots go
// back to the store first (one round trip), so that the next claim finds them.
func (t *Ticket) Release(o Outcome) {
	if t == nil || !t.released.CompareAndSwap(false, true) {
		return
	}
	c := t.c
	c.releaseSlots(afterRun, t.slots)
	c.mu.Lock()
	defer c.mu.Unlock()
	now := c.now()
	p := t.pool
	p.inFlight--
	p.inFlightG.Set(float64(p.inFlight))
	ten := t.tenant
	ten.outstanding--
	ten.running--
	c.settle(ten, t.reserved, o.Tokens, now)
	if o.Ended == EndCompleted && o.Service > 0 {
		c.observeService(t.class, o.Service)
	}
	c.forget(ten, now)
	c.dispatch(p, now)
}

// PoolStats is a snapshot of a pool.
type PoolStats struct {
	Name            string
	Overflow        bool
	MaxInFlight     int
	InFlight        int
	QueuedCritical  int
	QueuedSheddable int
}

// Queued is the pool's queue depth.
func (s PoolStats) Queued() int { return s.QueuedCritical + s.QueuedSheddable }

// Stats returns a snapshot of the named pool; false when there is no such pool.
func (c *Controller) Stats(pool string) (PoolStats, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	p := c.byName[pool]
	if p == nil {
		return PoolStats{}, false
	}
	return PoolStats{Name: p.cfg.Name, Overflow: p.cfg.Overflow, MaxInFlight: p.cfg.MaxInFlight, InFlight: p.inFlight,
		QueuedCritical: p.queues[critQ].n, QueuedSheddable: p.queues[shedQ].n}, true
}

// ExpectedService is the current estimate of the service time of class: the median of
// its last ServiceSamples completed runs, 0 before the first.
func (c *Controller) ExpectedService(class string) time.Duration {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.expected(Request{Class: class})
}
