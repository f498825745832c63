package admission_test

import (
	"context"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/curfew-mesh/curfew/mesh/admission"
)

// The paid pool never runs more than its cap, however many runs ask at once, and every
// run is admitted in the end.
func TestPaidPoolNeverExceedsCap(t *testing.T) {
	c, reg := newController(t, admission.DefaultConfig())
	const runs = 50
	var cur, peak atomic.Int32
	var admitted atomic.Int32
	var wg sync.WaitGroup
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	for i := range runs {
		wg.Go(func() {
			tk, err := c.Admit(ctx, admission.Request{Tenant: "t", Criticality: admission.Critical, Class: "sim"})
			if err != nil {
				t.Errorf("run %d: %v", i, err)
				return
			}
			if tk.Pool() != "paid" {
				t.Errorf("run %d admitted to %s, want paid", i, tk.Pool())
			}
			admitted.Add(1)
			n := cur.Add(1)
			for {
				p := peak.Load()
				if n <= p || peak.CompareAndSwap(p, n) {
					break
				}
			}
			time.Sleep(time.Millisecond)
			cur.Add(-1)
			tk.Release(admission.Outcome{Ended: admission.EndCompleted, Service: time.Millisecond})
		})
	}
	wg.Wait()
	if got := admitted.Load(); got != runs {
		t.Fatalf("%d runs admitted, want %d", got, runs)
	}
	if p := peak.Load(); p > 2 {
		t.Fatalf("paid pool ran %d runs at once, cap 2", p)
	} else if p < 2 {
		t.Logf("peak concurrency only %d (cap 2)", p)
	}
	if st, _ := c.Stats("paid"); st.InFlight != 0 || st.Queued() != 0 {
		t.Fatalf("after all releases: %+v", st)
	}
	if v := metric(t, reg, "curfew_admission_in_flight", map[string]string{"pool": "paid"}); v != 0 {
		t.Errorf("in-flight gauge %v after all releases", v)
	}
	if v := metric(t, reg, "curfew_admission_queue_age_seconds", map[string]string{"pool": "paid"}); v != runs {
		t.Errorf("queue age observations %v, want one per admitted run (%d)", v, runs)
	}
}

// Critical work goes to the first pool, sheddable work to the overflow pool, and to the
// first pool when there is none.
func TestCriticalityPicksPool(t *testing.T) {
	c, _ := newController(t, admission.DefaultConfig())
	for _, tc := range []struct {
		crit admission.Criticality
		pool string
	}{{"", "paid"}, {admission.Critical, "paid"}, {admission.Sheddable, "overflow"}, {" Sheddable ", "overflow"}} {
		tk := mustAdmit(t, c, admission.Request{Criticality: tc.crit})
		if tk.Pool() != tc.pool {
			t.Errorf("criticality %q admitted to %s, want %s", tc.crit, tk.Pool(), tc.pool)
		}
		tk.Release(admission.Outcome{})
	}
	tk := mustAdmit(t, c, admission.Request{Criticality: admission.Sheddable, Pool: "paid"})
	if tk.Pool() != "paid" {
		t.Errorf("explicit pool paid: admitted to %s", tk.Pool())
	}
	tk.Release(admission.Outcome{})

	single, _ := newController(t, admission.Config{Pools: []admission.PoolConfig{{Name: "only", MaxInFlight: 1}}})
	tk = mustAdmit(t, single, admission.Request{Criticality: admission.Sheddable})
	if tk.Pool() != "only" {
		t.Errorf("no overflow pool: sheddable admitted to %s, want the first pool", tk.Pool())
	}
	tk.Release(admission.Outcome{})
}

func TestInvalidRequest(t *testing.T) {
	c, _ := newController(t, admission.DefaultConfig())
	for name, req := range map[string]admission.Request{
		"unknown pool":        {Pool: "gold"},
		"unknown criticality": {Criticality: "urgent"},
		"negative tokens":     {ExpectedTokens: -1},
		"negative expected":   {Expected: -time.Second},
	} {
		if _, err := c.Admit(t.Context(), req); status.Code(err) != codes.InvalidArgument {
			t.Errorf("%s: %v, want INVALID_ARGUMENT", name, err)
		}
	}
}

// The seed's rule, at arrival: shed when expected service time + cancel grace > deadline
// slack, before the run holds anything.
func TestDeadlineSlackShedAtArrival(t *testing.T) {
	c, reg := newController(t, slackOnPaid(admission.DefaultConfig()))
	withDeadline := func(d time.Duration) context.Context {
		ctx, cancel := context.WithTimeout(t.Context(), d)
		t.Cleanup(cancel)
		return ctx
	}

	// Nothing observed yet: the expected time is 0, so only the 1 s cancel grace counts.
	_, err := c.Admit(withDeadline(500*time.Millisecond), admission.Request{Tenant: "a", ExpectedTokens: 100})
	se := wantShed(t, err, admission.ReasonDeadlineSlack)
	if se.Pool != "paid" || se.Tenant != "a" {
		t.Errorf("shed pool %q tenant %q", se.Pool, se.Tenant)
	}
	if se.RetryAfter > 500*time.Millisecond {
		t.Errorf("RetryAfter %v beyond the slack: a retry layer honouring it must give up", se.RetryAfter)
	}
	tk := admitIn(t, c, withDeadline(5*time.Second), admission.Request{})
	tk.Release(admission.Outcome{})

	// A declared estimate.
	_, err = c.Admit(withDeadline(5*time.Second), admission.Request{Expected: 4500 * time.Millisecond})
	wantShed(t, err, admission.ReasonDeadlineSlack)
	tk = admitIn(t, c, withDeadline(5*time.Second), admission.Request{Expected: 3 * time.Second})
	tk.Release(admission.Outcome{})

	// An observed estimate, per class; only completed runs teach it.
	tk = admitIn(t, c, t.Context(), admission.Request{Class: "big"})
	tk.Release(admission.Outcome{Ended: admission.EndCancelled, Service: time.Hour})
	if got := c.ExpectedService("big"); got != 0 {
		t.Fatalf("a cancelled run taught the estimate: %v", got)
	}
	tk = admitIn(t, c, t.Context(), admission.Request{Class: "big"})
	tk.Release(admission.Outcome{Ended: admission.EndCompleted, Service: 10 * time.Second})
	if got := c.ExpectedService("big"); got != 10*time.Second {
		t.Fatalf("estimate of big %v, want 10s", got)
	}
	_, err = c.Admit(withDeadline(5*time.Second), admission.Request{Class: "big"})
	wantShed(t, err, admission.ReasonDeadlineSlack)
	tk = admitIn(t, c, withDeadline(5*time.Second), admission.Request{Class: "small"})
	tk.Release(admission.Outcome{})

	if st, _ := c.Stats("paid"); st.InFlight != 0 {
		t.Errorf("in flight %d after sheds", st.InFlight)
	}
	if u := c.TenantUsage("a"); u.Reserved != 0 || u.Outstanding != 0 {
		t.Errorf("shed run left tenant usage %+v", u)
	}
	if v := shedCount(t, reg, admission.ReasonDeadlineSlack); v != 3 {
		t.Errorf("deadline_slack sheds counted %v, want 3", v)
	}
}

// slackOnPaid turns the deadline-slack rule on for the first pool (by default it sheds the
// overflow pool only).
func slackOnPaid(cfg admission.Config) admission.Config {
	on := true
	cfg.Pools = append([]admission.PoolConfig(nil), cfg.Pools...)
	cfg.Pools[0].SlackShed = &on
	return cfg
}

// By default the rule sheds sheddable work (the overflow pool) only: critical work on the
// paid pool is admitted with too little slack, and each hop fails it fast instead.
func TestDeadlineSlackShedsOverflowOnlyByDefault(t *testing.T) {
	c, _ := newController(t, admission.DefaultConfig())
	ctx, cancel := context.WithTimeout(t.Context(), 500*time.Millisecond)
	defer cancel()
	tk := admitIn(t, c, ctx, admission.Request{Criticality: admission.Critical})
	tk.Release(admission.Outcome{})
	_, err := c.Admit(ctx, admission.Request{Criticality: admission.Sheddable})
	if se := wantShed(t, err, admission.ReasonDeadlineSlack); se.Pool != "overflow" {
		t.Errorf("shed from pool %q, want overflow", se.Pool)
	}
}

// The rule again when a run leaves the queue: the estimate rose while it waited, so it is
// shed instead of started.
func TestDeadlineSlackRecheckedWhenDequeued(t *testing.T) {
	c, _ := newController(t, slackOnPaid(onePool(1, 10)))
	holder := mustAdmit(t, c, admission.Request{Class: "m"})
	ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
	defer cancel()
	waiter := admitAsync(ctx, c, "w", admission.Request{Class: "m"})
	waitQueued(t, c, "paid", 1)

	holder.Release(admission.Outcome{Ended: admission.EndCompleted, Service: 10 * time.Second})
	o := receive(t, waiter)
	wantShed(t, o.err, admission.ReasonDeadlineSlack)
	if st, _ := c.Stats("paid"); st.InFlight != 0 || st.Queued() != 0 {
		t.Fatalf("after the dequeue shed: %+v, want nothing running or queued", st)
	}
}

// A queued run whose slack runs out while it waits is shed then, before its deadline.
func TestDeadlineSlackRunsOutWhileQueued(t *testing.T) {
	c, _ := newController(t, slackOnPaid(admission.Config{
		CancelGrace: 200 * time.Millisecond,
		Pools:       []admission.PoolConfig{{Name: "paid", MaxInFlight: 1}},
	}))
	holder := mustAdmit(t, c, admission.Request{})
	defer holder.Release(admission.Outcome{})
	ctx, cancel := context.WithTimeout(t.Context(), 400*time.Millisecond)
	defer cancel()
	o := receive(t, admitAsync(ctx, c, "w", admission.Request{}))
	wantShed(t, o.err, admission.ReasonDeadlineSlack)
	if o.took < 150*time.Millisecond || ctx.Err() != nil {
		t.Errorf("shed after %v (ctx %v): want after the slack ran out (~200ms) and before the deadline (400ms)", o.took, ctx.Err())
	}
}

func TestQueueAgeShed(t *testing.T) {
	c, reg := newController(t, admission.Config{Pools: []admission.PoolConfig{
		{Name: "paid", MaxInFlight: 1, MaxQueueAge: 100 * time.Millisecond}}})
	holder := mustAdmit(t, c, admission.Request{})
	defer holder.Release(admission.Outcome{})
	o := receive(t, admitAsync(t.Context(), c, "w", admission.Request{Tenant: "x", ExpectedTokens: 7}))
	wantShed(t, o.err, admission.ReasonQueueAge)
	if o.took < 100*time.Millisecond {
		t.Errorf("queue_age shed after %v, before the 100ms limit", o.took)
	}
	if st, _ := c.Stats("paid"); st.Queued() != 0 {
		t.Errorf("queue depth %d after the shed", st.Queued())
	}
	if u := c.TenantUsage("x"); u != (admission.TenantUsage{WindowEnd: u.WindowEnd}) {
		t.Errorf("shed run left tenant usage %+v", u)
	}
	if v := shedCount(t, reg, admission.ReasonQueueAge); v != 1 {
		t.Errorf("queue_age sheds counted %v, want 1", v)
	}
}

// With an injected clock, an arrival sheds the queue's stale heads before deciding.
func TestQueueAgeShedOnArrival(t *testing.T) {
	clk := newClock()
	c, _ := newController(t, admission.Config{Now: clk.Now, Pools: []admission.PoolConfig{
		{Name: "paid", MaxInFlight: 1, MaxQueue: 1, MaxQueueAge: 10 * time.Second}}})
	holder := mustAdmit(t, c, admission.Request{})
	defer holder.Release(admission.Outcome{})
	old := admitAsync(t.Context(), c, "old", admission.Request{})
	waitQueued(t, c, "paid", 1)
	clk.Advance(11 * time.Second)
	// The queue is full, but its head is too old: it goes, and the newcomer waits.
	newer := admitAsync(t.Context(), c, "new", admission.Request{})
	wantShed(t, receive(t, old).err, admission.ReasonQueueAge)
	notYet(t, newer, "new")
	holder.Release(admission.Outcome{})
	o := receive(t, newer)
	if o.err != nil {
		t.Fatalf("newer: %v", o.err)
	}
	o.t.Release(admission.Outcome{})
}

func TestQueueFullShed(t *testing.T) {
	c, reg := newController(t, onePool(1, 2))
	holder := mustAdmit(t, c, admission.Request{})
	a := admitAsync(t.Context(), c, "a", admission.Request{})
	waitQueued(t, c, "paid", 1)
	b := admitAsync(t.Context(), c, "b", admission.Request{})
	waitQueued(t, c, "paid", 2)
	_, err := c.Admit(t.Context(), admission.Request{Tenant: "late"})
	se := wantShed(t, err, admission.ReasonQueueFull)
	if se.Tenant != "late" || se.Pool != "paid" {
		t.Errorf("shed %+v", se)
	}
	if v := shedCount(t, reg, admission.ReasonQueueFull); v != 1 {
		t.Errorf("queue_full sheds counted %v", v)
	}
	if v := metric(t, reg, "curfew_admission_queue_depth", map[string]string{"pool": "paid"}); v != 2 {
		t.Errorf("queue depth gauge %v, want 2", v)
	}
	holder.Release(admission.Outcome{})
	first := receive(t, a)
	first.t.Release(admission.Outcome{})
	second := receive(t, b)
	second.t.Release(admission.Outcome{})
}

// Critical runs leave the queue before sheddable ones, FIFO within each.
func TestCriticalityOrder(t *testing.T) {
	c, _ := newController(t, onePool(1, 10))
	holder := mustAdmit(t, c, admission.Request{Pool: "paid"})
	order := []struct {
		name string
		crit admission.Criticality
	}{{"s1", admission.Sheddable}, {"c1", admission.Critical}, {"s2", admission.Sheddable}, {"c2", admission.Critical}}
	chans := map[string]<-chan outcome{}
	for i, r := range order {
		chans[r.name] = admitAsync(t.Context(), c, r.name, admission.Request{Pool: "paid", Criticality: r.crit})
		waitQueued(t, c, "paid", i+1)
	}
	if st, _ := c.Stats("paid"); st.QueuedCritical != 2 || st.QueuedSheddable != 2 {
		t.Fatalf("queues %+v", st)
	}
	cur := holder
	for _, want := range []string{"c1", "c2", "s1", "s2"} {
		cur.Release(admission.Outcome{})
		o := receive(t, chans[want])
		if o.err != nil {
			t.Fatalf("%s: %v", want, o.err)
		}
		for name, ch := range chans {
			if name != want {
				select {
				case o2 := <-ch:
					t.Fatalf("%s admitted together with %s (%v)", name, want, o2.err)
				default:
				}
			}
		}
		delete(chans, want)
		cur = o.t
	}
	cur.Release(admission.Outcome{})
}

// A full queue makes room for a critical arrival by shedding its newest sheddable waiter;
// with no sheddable waiter left, the critical arrival itself is shed.
func TestSheddableEvictedFirst(t *testing.T) {
	c, reg := newController(t, onePool(1, 2))
	holder := mustAdmit(t, c, admission.Request{Pool: "paid"})
	s1 := admitAsync(t.Context(), c, "s1", admission.Request{Pool: "paid", Criticality: admission.Sheddable})
	waitQueued(t, c, "paid", 1)
	s2 := admitAsync(t.Context(), c, "s2", admission.Request{Pool: "paid", Criticality: admission.Sheddable})
	waitQueued(t, c, "paid", 2)

	// A sheddable arrival is refused; it evicts nobody.
	_, err := c.Admit(t.Context(), admission.Request{Pool: "paid", Criticality: admission.Sheddable})
	wantShed(t, err, admission.ReasonQueueFull)

	c1 := admitAsync(t.Context(), c, "c1", admission.Request{Pool: "paid"})
	se := wantShed(t, receive(t, s2).err, admission.ReasonQueueFull)
	if !strings.Contains(se.Detail, "evicted") {
		t.Errorf("evicted waiter's shed detail %q", se.Detail)
	}
	notYet(t, s1, "s1")
	c2 := admitAsync(t.Context(), c, "c2", admission.Request{Pool: "paid"})
	wantShed(t, receive(t, s1).err, admission.ReasonQueueFull)
	waitQueued(t, c, "paid", 2)
	_, err = c.Admit(t.Context(), admission.Request{Pool: "paid"})
	wantShed(t, err, admission.ReasonQueueFull)
	if v := shedCount(t, reg, admission.ReasonQueueFull); v != 4 {
		t.Errorf("queue_full sheds counted %v, want 4", v)
	}

	holder.Release(admission.Outcome{})
	o := receive(t, c1)
	notYet(t, c2, "c2")
	o.t.Release(admission.Outcome{})
	o = receive(t, c2)
	o.t.Release(admission.Outcome{})
}

// A tenant's admitted and queued runs count against its concurrency, across pools.
func TestTenantConcurrency(t *testing.T) {
	cfg := onePool(1, 10)
	cfg.Pools[1].MaxInFlight = 5
	cfg.DefaultTenant = admission.TenantLimits{MaxInFlight: 10}
	cfg.Tenants = map[string]admission.TenantLimits{"acme": {MaxInFlight: 3}}
	c, reg := newController(t, cfg)
	acme := admission.Request{Tenant: "acme"}
	paid := mustAdmit(t, c, acme)
	over := mustAdmit(t, c, admission.Request{Tenant: "acme", Criticality: admission.Sheddable})
	queued := admitAsync(t.Context(), c, "q", acme)
	waitQueued(t, c, "paid", 1)
	_, err := c.Admit(t.Context(), admission.Request{Tenant: "acme", Criticality: admission.Sheddable})
	se := wantShed(t, err, admission.ReasonTenantConcurrency)
	if se.Tenant != "acme" {
		t.Errorf("shed tenant %q", se.Tenant)
	}
	if u := c.TenantUsage("acme"); u.Outstanding != 3 {
		t.Errorf("acme outstanding %d, want 3", u.Outstanding)
	}
	// Another tenant is not limited by acme.
	other := mustAdmit(t, c, admission.Request{Tenant: "other", Criticality: admission.Sheddable})
	other.Release(admission.Outcome{})

	over.Release(admission.Outcome{})
	again := mustAdmit(t, c, admission.Request{Tenant: "acme", Criticality: admission.Sheddable})
	again.Release(admission.Outcome{})
	paid.Release(admission.Outcome{})
	o := receive(t, queued)
	o.t.Release(admission.Outcome{})
	if u := c.TenantUsage("acme"); u.Outstanding != 0 {
		t.Errorf("acme outstanding %d after all releases", u.Outstanding)
	}
	if v := shedCount(t, reg, admission.ReasonTenantConcurrency); v != 1 {
		t.Errorf("tenant_concurrency sheds counted %v", v)
	}
}

// A caller that leaves while queued leaves the queue at once, with its context's status,
// and gives back its tenant count and reservation.
func TestCancelWhileQueued(t *testing.T) {
	c, reg := newController(t, onePool(1, 10))
	holder := mustAdmit(t, c, admission.Request{})
	defer holder.Release(admission.Outcome{})
	ctx, cancel := context.WithCancel(t.Context())
	w := admitAsync(ctx, c, "w", admission.Request{Tenant: "x", ExpectedTokens: 50})
	waitQueued(t, c, "paid", 1)
	if u := c.TenantUsage("x"); u.Reserved != 50 || u.Outstanding != 1 {
		t.Fatalf("queued run: usage %+v", u)
	}
	cancel()
	o := receive(t, w)
	if status.Code(o.err) != codes.Canceled {
		t.Fatalf("Admit after cancel: %v, want CANCELED", o.err)
	}
	if _, ok := admission.AsShed(o.err); ok {
		t.Fatal("a caller's cancel is not a shed")
	}
	if st, _ := c.Stats("paid"); st.Queued() != 0 {
		t.Fatalf("cancelled waiter still queued: %+v", st)
	}
	if u := c.TenantUsage("x"); u.Reserved != 0 || u.Outstanding != 0 {
		t.Fatalf("cancelled waiter left usage %+v", u)
	}
	if v := shedCount(t, reg, admission.ReasonCancelled); v != 1 {
		t.Errorf("cancelled counted %v", v)
	}
	// An already-ended context never queues.
	if _, err := c.Admit(ctx, admission.Request{}); status.Code(err) != codes.Canceled {
		t.Errorf("Admit with a cancelled ctx: %v", err)
	}
}

// Release frees the slot once, admits the next waiter, and is a no-op after.
func TestReleaseIdempotentWakesNext(t *testing.T) {
	c, _ := newController(t, onePool(1, 10))
	first := mustAdmit(t, c, admission.Request{Tenant: "a", ExpectedTokens: 10})
	next := admitAsync(t.Context(), c, "next", admission.Request{})
	waitQueued(t, c, "paid", 1)
	first.Release(admission.Outcome{Tokens: 4})
	o := receive(t, next)
	if o.err != nil {
		t.Fatalf("next: %v", o.err)
	}
	if o.t.Waited() <= 0 {
		t.Errorf("queued run reports Waited %v", o.t.Waited())
	}
	first.Release(admission.Outcome{Tokens: 4})
	if st, _ := c.Stats("paid"); st.InFlight != 1 {
		t.Fatalf("in flight %d after a second Release of the first ticket, want 1", st.InFlight)
	}
	if u := c.TenantUsage("a"); u.Used != 4 || u.Reserved != 0 {
		t.Fatalf("settled twice? usage %+v", u)
	}
	o.t.Release(admission.Outcome{})
	o.t.Release(admission.Outcome{})
	if st, _ := c.Stats("paid"); st.InFlight != 0 {
		t.Fatalf("in flight %d", st.InFlight)
	}
	var nilTicket *admission.Ticket
	nilTicket.Release(admission.Outcome{})
}

// Close sheds every queued run, refuses later ones, and leaves admitted runs alone.
func TestClose(t *testing.T) {
	c, reg := newController(t, onePool(1, 10))
	paid := mustAdmit(t, c, admission.Request{})
	over := mustAdmit(t, c, admission.Request{Criticality: admission.Sheddable})
	w1 := admitAsync(t.Context(), c, "w1", admission.Request{})
	w2 := admitAsync(t.Context(), c, "w2", admission.Request{Criticality: admission.Sheddable})
	waitQueued(t, c, "paid", 1)
	waitQueued(t, c, "overflow", 1)
	c.Close()
	for _, ch := range []<-chan outcome{w1, w2} {
		o := receive(t, ch)
		wantShed(t, o.err, admission.ReasonShutdown)
		if status.Code(o.err) != codes.Unavailable {
			t.Errorf("shutdown shed code %v, want UNAVAILABLE", status.Code(o.err))
		}
	}
	_, err := c.Admit(t.Context(), admission.Request{})
	wantShed(t, err, admission.ReasonShutdown)
	if closed, why := c.Closed("paid"); !closed || why != "shutdown" {
		t.Errorf("Closed(paid) after Close: %v %q", closed, why)
	}
	if v := metric(t, reg, "curfew_admission_pool_closed", map[string]string{"pool": "paid"}); v != 1 {
		t.Errorf("pool_closed gauge of paid %v after Close", v)
	}
	paid.Release(admission.Outcome{})
	over.Release(admission.Outcome{})
	c.Close()
	if st, _ := c.Stats("paid"); st.InFlight != 0 {
		t.Errorf("in flight %d", st.InFlight)
	}
}

// Each fail-closed condition closes the overflow pool (and only it) for the window after
// its last occurrence, shedding its queue; then it reopens by itself.
func TestFailClosed(t *testing.T) {
	for _, tc := range []struct {
		cond    admission.Condition
		trigger func(*admission.Controller)
		benign  func(*admission.Controller)
	}{
		{admission.ConditionOrphanTokens,
			func(c *admission.Controller) { c.ObserveOrphanTokens(12) },
			func(c *admission.Controller) { c.ObserveOrphanTokens(0) }},
		{admission.ConditionSlowCancel,
			func(c *admission.Controller) { c.ObserveCancelPropagation(3*time.Second, 2*time.Second) },
			func(c *admission.Controller) {
				c.ObserveCancelPropagation(100*time.Millisecond, 2*time.Second)
				c.ObserveCancelPropagation(500*time.Millisecond, 0) // the deadline itself: judged against the 1 s grace
			}},
		{admission.ConditionRetryWithoutID,
			func(c *admission.Controller) { c.ObserveRetryWithoutID() },
			nil},
	} {
		t.Run(string(tc.cond), func(t *testing.T) {
			clk := newClock()
			cfg := admission.DefaultConfig()
			cfg.Now = clk.Now
			cfg.Pools[1].MaxInFlight = 1
			c, reg := newController(t, cfg)
			closedGauge := func() float64 {
				return metric(t, reg, "curfew_admission_pool_closed", map[string]string{"pool": "overflow"})
			}
			sheddable := admission.Request{Tenant: "free", Criticality: admission.Sheddable}
			if tc.benign != nil {
				tc.benign(c)
			}
			if closed, _ := c.Closed("overflow"); closed || closedGauge() != 0 {
				t.Fatal("overflow closed without any condition")
			}
			running := mustAdmit(t, c, sheddable)
			queued := admitAsync(t.Context(), c, "q", sheddable)
			waitQueued(t, c, "overflow", 1)

			tc.trigger(c)
			se := wantShed(t, receive(t, queued).err, admission.ReasonPoolClosed)
			if se.Condition != string(tc.cond) || se.Pool != "overflow" || se.Tenant != "free" {
				t.Errorf("queued waiter's shed %+v", se)
			}
			closed, why := c.Closed("overflow")
			if !closed || why != string(tc.cond) || closedGauge() != 1 {
				t.Fatalf("Closed(overflow) = %v %q, gauge %v; want closed by %s", closed, why, closedGauge(), tc.cond)
			}
			_, err := c.Admit(t.Context(), sheddable)
			se = wantShed(t, err, admission.ReasonPoolClosed)
			if se.RetryAfter != time.Minute {
				t.Errorf("RetryAfter %v, want the whole window (1m)", se.RetryAfter)
			}
			// Only the overflow pool closes; what runs there keeps running.
			if closed, _ := c.Closed("paid"); closed {
				t.Error("paid pool closed too")
			}
			mustAdmit(t, c, admission.Request{}).Release(admission.Outcome{})
			running.Release(admission.Outcome{})

			clk.Advance(50 * time.Second)
			tc.trigger(c) // a new occurrence restarts the window
			clk.Advance(50 * time.Second)
			_, err = c.Admit(t.Context(), sheddable)
			se = wantShed(t, err, admission.ReasonPoolClosed)
			if se.RetryAfter != 10*time.Second {
				t.Errorf("RetryAfter %v, want the 10s left of the restarted window", se.RetryAfter)
			}
			clk.Advance(10 * time.Second)
			if closed, why := c.Closed("overflow"); closed || closedGauge() != 0 {
				t.Fatalf("overflow still closed (%q) a window after the last occurrence", why)
			}
			mustAdmit(t, c, sheddable).Release(admission.Outcome{})
			if v := shedCount(t, reg, admission.ReasonPoolClosed); v != 3 {
				t.Errorf("pool_closed sheds counted %v, want 3", v)
			}
		})
	}
}

// Two conditions at once are both named, and the pool stays closed until the later ends.
func TestFailClosedConditionsCombine(t *testing.T) {
	clk := newClock()
	cfg := admission.DefaultConfig()
	cfg.Now = clk.Now
	cfg.FailClosedWindow = 10 * time.Second
	c, _ := newController(t, cfg)
	c.ObserveOrphanTokens(1)
	clk.Advance(5 * time.Second)
	c.ObserveRetryWithoutID()
	if _, why := c.Closed("overflow"); why != "orphan_tokens,retry_without_id" {
		t.Errorf("Closed reason %q", why)
	}
	clk.Advance(6 * time.Second)
	if closed, why := c.Closed("overflow"); !closed || why != "retry_without_id" {
		t.Errorf("after the first window: %v %q", closed, why)
	}
	clk.Advance(5 * time.Second)
	if closed, _ := c.Closed("overflow"); closed {
		t.Error("still closed after both windows")
	}
}

// A tenant over its budget is refused before anything starts, leaving no reservation
// behind; a run that ends early gives back the unused part of its reservation.
func TestTokenBudget(t *testing.T) {
	clk := newClock()
	cfg := admission.DefaultConfig()
	cfg.Now = clk.Now
	cfg.Pools[0].MaxInFlight = 10
	cfg.Tenants = map[string]admission.TenantLimits{"acme": {TokenBudget: 1000, Window: time.Hour}}
	c, reg := newController(t, cfg)
	req := func(tokens int64) admission.Request { return admission.Request{Tenant: "acme", ExpectedTokens: tokens} }

	first := mustAdmit(t, c, req(600))
	if first.Reserved() != 600 {
		t.Errorf("reserved %d", first.Reserved())
	}
	_, err := c.Admit(t.Context(), req(500))
	se := wantShed(t, err, admission.ReasonBudget)
	u := c.TenantUsage("acme")
	if u.Reserved != 600 || u.Used != 0 || u.Outstanding != 1 || u.Budget != 1000 {
		t.Fatalf("refused run left usage %+v, want only the first run's 600 reserved", u)
	}
	if want := u.WindowEnd.Sub(clk.Now()); se.RetryAfter != max(want, admission.MinRetryAfter) {
		t.Errorf("RetryAfter %v, want the window's end in %v", se.RetryAfter, want)
	}
	if st, _ := c.Stats("paid"); st.InFlight != 1 {
		t.Errorf("in flight %d: the refused run started", st.InFlight)
	}

	// The first run ends early, having spent 200 of its 600.
	first.Release(admission.Outcome{Tokens: 200})
	if u := c.TenantUsage("acme"); u.Used != 200 || u.Reserved != 0 {
		t.Fatalf("after settling: %+v, want used 200 reserved 0", u)
	}
	second := mustAdmit(t, c, req(500)) // 200 + 500 ≤ 1000
	_, err = c.Admit(t.Context(), req(400))
	wantShed(t, err, admission.ReasonBudget) // 200 + 500 + 400 > 1000

	// A run that overspends its reservation is charged what it spent.
	second.Release(admission.Outcome{Tokens: 700})
	if u := c.TenantUsage("acme"); u.Used != 900 {
		t.Fatalf("used %d, want 900", u.Used)
	}
	// Used up: even a run expecting nothing is refused.
	mustAdmit(t, c, req(100)).Release(admission.Outcome{Tokens: 100})
	_, err = c.Admit(t.Context(), req(0))
	wantShed(t, err, admission.ReasonBudget)

	// The next window starts afresh; other tenants have no budget.
	mustAdmit(t, c, admission.Request{Tenant: "other", ExpectedTokens: 1 << 40}).Release(admission.Outcome{})
	clk.Advance(time.Hour)
	third := mustAdmit(t, c, req(1000))
	third.Release(admission.Outcome{Tokens: 1000})
	if v := shedCount(t, reg, admission.ReasonBudget); v != 3 {
		t.Errorf("budget sheds counted %v, want 3", v)
	}
}

// A queued run holds its reservation; shedding it gives the reservation back.
func TestBudgetReservationOfShedWaiter(t *testing.T) {
	cfg := onePool(1, 10)
	cfg.Pools[0].MaxQueueAge = 50 * time.Millisecond
	cfg.DefaultTenant = admission.TenantLimits{TokenBudget: 1000}
	c, _ := newController(t, cfg)
	holder := mustAdmit(t, c, admission.Request{Tenant: "a", ExpectedTokens: 300})
	defer holder.Release(admission.Outcome{})
	w := admitAsync(t.Context(), c, "w", admission.Request{Tenant: "a", ExpectedTokens: 600})
	waitQueued(t, c, "paid", 1)
	_, err := c.Admit(t.Context(), admission.Request{Tenant: "a", ExpectedTokens: 200})
	wantShed(t, err, admission.ReasonBudget) // 300 + 600 queued + 200 > 1000
	wantShed(t, receive(t, w).err, admission.ReasonQueueAge)
	if u := c.TenantUsage("a"); u.Reserved != 300 {
		t.Fatalf("reserved %d after the waiter was shed, want the holder's 300", u.Reserved)
	}
}

// Every series exists from the start, at 0, so that rate() sees the first shed.
func TestMetricsPrecreated(t *testing.T) {
	c, reg := newController(t, admission.DefaultConfig())
	for _, r := range admission.Reasons() {
		if v, ok := series(t, reg, "curfew_shed_total", map[string]string{"service": "orchestrator", "reason": string(r)}); !ok || v != 0 {
			t.Errorf("curfew_shed_total{reason=%s}: %v, present %v", r, v, ok)
		}
	}
	for _, p := range []string{"paid", "overflow"} {
		for _, name := range []string{"curfew_admission_queue_depth", "curfew_admission_in_flight", "curfew_admission_pool_closed", "curfew_admission_queue_age_seconds"} {
			if _, ok := series(t, reg, name, map[string]string{"pool": p}); !ok {
				t.Errorf("%s{pool=%s} missing", name, p)
			}
		}
	}
	tk := mustAdmit(t, c, admission.Request{})
	if v := metric(t, reg, "curfew_admission_in_flight", map[string]string{"pool": "paid"}); v != 1 {
		t.Errorf("in flight gauge %v", v)
	}
	tk.Release(admission.Outcome{})

	// One controller per registry.
	if _, err := admission.New(admission.DefaultConfig(), reg); err == nil {
		t.Error("a second controller registered on the same registry")
	}
	// A nil registry is fine.
	c2, err := admission.New(admission.DefaultConfig(), nil)
	if err != nil {
		t.Fatal(err)
	}
	c2.Close()
}

func TestExpectedServiceMedian(t *testing.T) {
	c, _ := newController(t, admission.DefaultConfig())
	for _, d := range []time.Duration{1, 9, 2, 8, 3} {
		mustAdmit(t, c, admission.Request{Class: "m"}).Release(admission.Outcome{Ended: admission.EndCompleted, Service: d * time.Second})
	}
	if got := c.ExpectedService("m"); got != 3*time.Second {
		t.Errorf("estimate %v, want the median 3s", got)
	}
	// Only the last ServiceSamples count.
	for range admission.ServiceSamples {
		mustAdmit(t, c, admission.Request{Class: "m"}).Release(admission.Outcome{Ended: admission.EndCompleted, Service: time.Second})
	}
	if got := c.ExpectedService("m"); got != time.Second {
		t.Errorf("estimate %v after %d 1s runs, want 1s", got, admission.ServiceSamples)
	}
	if got := c.ExpectedService("never"); got != 0 {
		t.Errorf("unobserved class estimate %v, want 0", got)
	}
}

// A waiter admitted in the same instant its caller left gives its slot back.
func TestCancelRacingAdmission(t *testing.T) {
	c, _ := newController(t, onePool(1, 100))
	for range 200 {
		holder := mustAdmit(t, c, admission.Request{})
		ctx, cancel := context.WithCancel(t.Context())
		w := admitAsync(ctx, c, "w", admission.Request{})
		waitQueued(t, c, "paid", 1)
		go cancel()
		holder.Release(admission.Outcome{})
		o := receive(t, w)
		if o.err == nil {
			o.t.Release(admission.Outcome{})
		} else if status.Code(o.err) != codes.Canceled {
			t.Fatalf("racing cancel: %v", o.err)
		}
		cancel()
		if st, _ := c.Stats("paid"); st.InFlight != 0 || st.Queued() != 0 {
			t.Fatalf("leaked a slot: %+v", st)
		}
	}
}

// A heartbeat period above a third of the slack closes the overflow pool (seed 003:
// "heartbeat period is larger than one third of the deadline"); one within it does not.
func TestFailClosedOnSlowHeartbeat(t *testing.T) {
	clk := newClock()
	cfg := admission.DefaultConfig()
	cfg.Now = clk.Now
	c, _ := newController(t, cfg)
	c.ObserveHeartbeat(4*time.Second, 12*time.Second)
	c.ObserveHeartbeat(time.Second, 0)
	if closed, why := c.Closed("overflow"); closed {
		t.Fatalf("closed (%q) by a heartbeat of a third of the slack", why)
	}
	c.ObserveHeartbeat(5*time.Second, 12*time.Second)
	if closed, why := c.Closed("overflow"); !closed || why != "slow_heartbeat" {
		t.Fatalf("after a 5s heartbeat with 12s of slack: closed %v (%q), want slow_heartbeat", closed, why)
	}
	_, err := c.Admit(context.Background(), admission.Request{Criticality: admission.Sheddable})
	if se := wantShed(t, err, admission.ReasonPoolClosed); se.Condition != "slow_heartbeat" {
		t.Errorf("condition %q", se.Condition)
	}
}

// A tenant's request rate is a token bucket of its own: its burst of calls is allowed,
// the next is refused with request_rate_limited, RESOURCE_EXHAUSTED and the delay of the
// next token, and it refills with time; runs' start rate is separate, other tenants are
// not affected, and a closed controller still allows calls.
func TestTenantRequestRate(t *testing.T) {
	clk := newClock()
	cfg := onePool(100, 10)
	cfg.Now = clk.Now
	cfg.Tenants = map[string]admission.TenantLimits{"acme": {RequestRate: 4, RequestBurst: 2}}
	c, reg := newController(t, cfg)
	for i := range 2 {
		if err := c.AllowRequest("acme"); err != nil {
			t.Fatalf("call %d of the burst: %v", i, err)
		}
	}
	err := c.AllowRequest("acme")
	se := wantShed(t, err, admission.ReasonRequestRateLimited)
	if se.RetryAfter < 200*time.Millisecond || se.RetryAfter > 250*time.Millisecond || status.Code(err) != codes.ResourceExhausted ||
		!strings.Contains(se.Error(), "4 calls per second") {
		t.Errorf("refusal %v (RetryAfter %v), want RESOURCE_EXHAUSTED in ≈ 250ms (one token at 4/s)", err, se.RetryAfter)
	}
	if err := c.AllowRequest("other"); err != nil {
		t.Errorf("another tenant: %v", err)
	}
	mustAdmit(t, c, admission.Request{Tenant: "acme"}).Release(admission.Outcome{}) // runs are not calls
	clk.Advance(250 * time.Millisecond)
	if err := c.AllowRequest("acme"); err != nil {
		t.Errorf("after a token's time: %v", err)
	}
	if v := shedCount(t, reg, admission.ReasonRequestRateLimited); v != 1 {
		t.Errorf("request_rate_limited counted %v, want 1", v)
	}
	// Idle past a sweep, the bucket is full again: the tenant was kept until it was.
	clk.Advance(2 * time.Minute)
	for range 2 {
		if err := c.AllowRequest("acme"); err != nil {
			t.Fatal(err)
		}
	}
	wantShed(t, c.AllowRequest("acme"), admission.ReasonRequestRateLimited)
	c.Close()
	clk.Advance(time.Second)
	if err := c.AllowRequest("acme"); err != nil {
		t.Errorf("a closed controller refused a call: %v", err)
	}
	for _, l := range []admission.TenantLimits{{RequestRate: -1}, {RequestBurst: -1}} {
		bad := onePool(1, 1)
		bad.DefaultTenant = l
		if err := bad.Validate(); err == nil {
			t.Errorf("%+v validated", l)
		}
	}
}

// A tenant's start rate is a token bucket: its burst is admitted, the next run is shed
// with rate_limited and a RetryInfo delay of when the next token comes, and the bucket
// refills with time. Other tenants are not affected.
func TestTenantRate(t *testing.T) {
	clk := newClock()
	cfg := onePool(100, 10)
	cfg.Now = clk.Now
	cfg.Tenants = map[string]admission.TenantLimits{"acme": {Rate: 2, Burst: 3}}
	c, reg := newController(t, cfg)
	for range 3 {
		mustAdmit(t, c, admission.Request{Tenant: "acme"}).Release(admission.Outcome{})
	}
	_, err := c.Admit(t.Context(), admission.Request{Tenant: "acme"})
	se := wantShed(t, err, admission.ReasonRateLimited)
	if se.RetryAfter < 400*time.Millisecond || se.RetryAfter > 500*time.Millisecond {
		t.Errorf("RetryAfter %v, want ≈ 500ms (one token at 2/s)", se.RetryAfter)
	}
	mustAdmit(t, c, admission.Request{Tenant: "other"}).Release(admission.Outcome{})
	clk.Advance(500 * time.Millisecond)
	mustAdmit(t, c, admission.Request{Tenant: "acme"}).Release(admission.Outcome{})
	_, err = c.Admit(t.Context(), admission.Request{Tenant: "acme"})
	wantShed(t, err, admission.ReasonRateLimited)
	if v := shedCount(t, reg, admission.ReasonRateLimited); v != 2 {
		t.Errorf("rate_limited sheds counted %v, want 2", v)
	}
	// An idle tenant is not forgotten while its bucket refills (that would refill it).
	clk.Advance(2 * time.Minute)
	for range 3 {
		mustAdmit(t, c, admission.Request{Tenant: "acme"}).Release(admission.Outcome{})
	}
	_, err = c.Admit(t.Context(), admission.Request{Tenant: "acme"})
	wantShed(t, err, admission.ReasonRateLimited)
	bad := onePool(1, 1)
	bad.DefaultTenant = admission.TenantLimits{Rate: -1}
	if err := bad.Validate(); err == nil {
		t.Error("a negative rate validated")
	}
}
