package breaker

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/sony/gobreaker/v2"

	"github.com/curfew-mesh/curfew/mesh/store"
)

// Defaults of Coordination's zero fields.
const (
	// DefaultProbePoll is how often a breaker that is not closed reads its target's
	// probe lease, to learn another replica's probe outcome.
	DefaultProbePoll = 250 * time.Millisecond
	// DefaultMaxProbeLease bounds a probe's lease: a probe call without a deadline holds
	// it this long at most; a call with one, until its deadline plus the store timeout.
	DefaultMaxProbeLease = 30 * time.Second
	// DefaultStoreTimeout bounds each store operation of the coordination.
	DefaultStoreTimeout = time.Second
)

// ProbeScopePrefix prefixes a target's probe lease scope in store.Slots: "probe/<target>",
// of size 1.
const ProbeScopePrefix = "probe/"

// Coordination makes the half-open probes of a Set's breakers cluster-wide: see
// [Set.Coordinate] and docs/cluster.md ("One probe per dependency").
type Coordination struct {
	// Store holds the probe leases (required): one slot per target, scope
	// ProbeScopePrefix+target. Every replica of a caller must share it.
	Store store.Slots
	// Holder names this Set in the store; it must be unique among live processes and
	// never reused by a later one. A target's lease is held as Holder+"/"+target.
	// Default: hostname-pid-random.
	Holder string
	// Poll is how often a breaker that is not closed reads its target's lease; 0 means
	// DefaultProbePoll.
	Poll time.Duration
	// MaxProbeLease bounds a probe's lease; 0 means DefaultMaxProbeLease.
	MaxProbeLease time.Duration
	// StoreTimeout bounds each store operation; 0 means DefaultStoreTimeout.
	StoreTimeout time.Duration
}

// coordination is a Set's Coordination, defaults applied, with its metrics.
type coordination struct {
	cfg Coordination
	ctx context.Context

	probes   *prometheus.CounterVec
	refused  *prometheus.CounterVec
	shared   *prometheus.CounterVec
	degraded *prometheus.GaugeVec
}

// Coordinate makes the half-open probes of the set's breakers cluster-wide through
// c.Store, until ctx ends (then each breaker stops reading the store and probes on its
// own). A breaker that half-opens claims its target's probe lease before its probe goes
// out; one that cannot keeps refusing calls as half-open and sends nothing. The prober
// writes the outcome into the lease: a success releases it, and every replica's breaker
// for the target closes when it next reads the lease; a failure keeps it for the prober's
// new open period, which every replica's breaker then waits out, so that the next probe
// is again one cluster-wide. While the store cannot be reached, a breaker probes on its
// own, as without coordination, and says so (CoordinationDegraded, the metric
// curfew_circuit_breaker_coordination_degraded).
//
// Call it once, before the set's breakers half-open (typically right after NewSet).
// It does nothing when the set's breakers are Off. It registers its metrics with the
// Set's registry.
func (s *Set) Coordinate(ctx context.Context, c Coordination) error {
	if c.Store == nil {
		return errors.New("breaker: Coordinate needs a store")
	}
	if c.Poll < 0 || c.MaxProbeLease < 0 || c.StoreTimeout < 0 {
		return errors.New("breaker: Coordinate: negative Poll, MaxProbeLease or StoreTimeout")
	}
	if s.cfg.Off {
		return nil
	}
	if c.Holder == "" {
		host, _ := os.Hostname()
		var b [4]byte
		_, _ = rand.Read(b[:])
		c.Holder = fmt.Sprintf("%s-%d-%s", host, os.Getpid(), hex.EncodeToString(b[:]))
	}
	if c.Poll == 0 {
		c.Poll = DefaultProbePoll
	}
	if c.MaxProbeLease == 0 {
		c.MaxProbeLease = DefaultMaxProbeLease
	}
	if c.StoreTimeout == 0 {
		c.StoreTimeout = DefaultStoreTimeout
	}
	co := &coordination{cfg: c, ctx: ctx,
		probes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "curfew_circuit_breaker_probes_total",
			Help: "Half-open probes sent per downstream target by outcome (success, failure, ignored), under the cluster-wide probe lease or, with the store unreachable, without it.",
		}, []string{"target", "outcome"}),
		refused: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "curfew_circuit_breaker_probe_leases_refused_total",
			Help: "Half-open breakers per downstream target that did not probe because another replica held the target's probe lease.",
		}, []string{"target"}),
		shared: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "curfew_circuit_breaker_shared_outcomes_total",
			Help: "Another replica's probe outcome applied to this replica's breaker per downstream target: closed (its probe succeeded) or reopened (it failed).",
		}, []string{"target", "outcome"}),
		degraded: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "curfew_circuit_breaker_coordination_degraded",
			Help: "1 while a downstream target's breaker is not closed and cannot reach the store of the cluster-wide probe lease, so it probes on its own.",
		}, []string{"target"}),
	}
	if s.reg != nil {
		co.probes = register(s.reg, co.probes)
		co.refused = register(s.reg, co.refused)
		co.shared = register(s.reg, co.shared)
		co.degraded = register(s.reg, co.degraded)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.coord != nil {
		return errors.New("breaker: Coordinate called twice")
	}
	s.coord = co
	for _, b := range s.breakers {
		b.co.Store(co.attach(b)) //nolint:contextcheck // its read loop runs under ctx, kept in co.ctx
	}
	return nil
}

// coord is one breaker's part of the coordination.
type coord struct {
	c             *coordination
	b             *Breaker
	scope, holder string

	probes           [3]prometheus.Counter // by Outcome
	refused          prometheus.Counter
	closed, reopened prometheus.Counter
	degradedG        prometheus.Gauge
	openToClosed     prometheus.Counter // the transition only a shared success makes

	// remote, when in the future (Set.now's scale), is until when another replica
	// holds the lease (its probe, or its failed probe's open period): a half-open
	// breaker refuses until then without asking the store.
	remote atomic.Int64
	// base is the lease's epoch when this breaker left closed, -1 until read: a release
	// (holder "") at a later epoch is a probe that succeeded since.
	base     atomic.Int64
	sized    atomic.Bool
	watching atomic.Bool
	degraded atomic.Bool
	// degradedSince is when degraded became true (Unix nanoseconds).
	degradedSince atomic.Int64

	mu       sync.Mutex
	lease    *store.Slot // ours, while our probe is out
	claiming bool        // a call is asking the store for the lease
}

func (co *coordination) attach(b *Breaker) *coord {
	c := &coord{c: co, b: b, scope: ProbeScopePrefix + b.target, holder: co.cfg.Holder + "/" + b.target,
		refused:      co.refused.WithLabelValues(b.target),
		closed:       co.shared.WithLabelValues(b.target, "closed"),
		reopened:     co.shared.WithLabelValues(b.target, "reopened"),
		degradedG:    co.degraded.WithLabelValues(b.target),
		openToClosed: b.set.m.transitions.WithLabelValues(b.target, StateOpen.String(), StateClosed.String()),
	}
	for _, o := range []Outcome{OutcomeSuccess, OutcomeFailure, OutcomeIgnored} {
		c.probes[o] = co.probes.WithLabelValues(b.target, o.String())
	}
	c.base.Store(-1)
	if b.State() != StateClosed {
		c.watch()
	}
	return c
}

// ProbeCoordination is a coordinated breaker's probe lease as this replica sees it.
type ProbeCoordination struct {
	// Degraded: the breaker is not closed and could not reach the store at its last
	// attempt, so it probes on its own; since DegradedSince.
	Degraded      bool
	DegradedSince time.Time
	// Held: this replica's probe is out under the target's lease.
	Held bool
	// ElsewhereUntil, when not zero, is until when another replica holds the lease (its
	// probe, or its failed probe's open period): this breaker sends nothing before then.
	ElsewhereUntil time.Time
}

// ProbeCoordination reports the breaker's probe lease; ok is false when the breaker's
// probes are not coordinated (Set.Coordinate was not called, or its breakers are off).
func (b *Breaker) ProbeCoordination() (pc ProbeCoordination, ok bool) {
	co := b.co.Load()
	if co == nil {
		return ProbeCoordination{}, false
	}
	if co.degraded.Load() {
		pc.Degraded = true
		if ns := co.degradedSince.Load(); ns != 0 {
			pc.DegradedSince = time.Unix(0, ns)
		}
	}
	co.mu.Lock()
	pc.Held = co.lease != nil
	co.mu.Unlock()
	if r, now := co.remote.Load(), b.set.now(); r > now {
		pc.ElsewhereUntil = time.Now().Add(time.Duration(r - now))
	}
	return pc, true
}

// Detail says pc in a line, at now (for status).
func (pc ProbeCoordination) Detail(now time.Time) string {
	switch {
	case pc.Degraded:
		return "store unreachable: probes on its own until a read of the lease succeeds"
	case pc.Held:
		return "this replica's probe is out under the lease"
	case pc.ElsewhereUntil.After(now):
		return "another replica holds the probe lease for " + pc.ElsewhereUntil.Sub(now).Round(time.Millisecond).String()
	}
	return "one probe per open period across replicas"
}

// CoordinationDegraded reports whether the breaker is coordinated, not closed, and could
// not reach the store at its last attempt, and so probes on its own.
func (b *Breaker) CoordinationDegraded() bool {
	co := b.co.Load()
	return co != nil && co.degraded.Load()
}

func (co *coord) setDegraded(d bool) {
	if co.degraded.Swap(d) == d {
		return
	}
	if d {
		co.degradedSince.Store(time.Now().UnixNano())
		co.degradedG.Set(1)
	} else {
		co.degradedG.Set(0)
	}
}

// allowProbe is allow for a coordinated breaker that gobreaker says is half-open: the
// probe goes out only under the target's lease.
func (co *coord) allowProbe(ctx context.Context, cb *gobreaker.TwoStepCircuitBreaker[struct{}], noRetry bool) (func(error), error) {
	b := co.b
	if r := co.remote.Load(); r > b.set.now() {
		return nil, b.refuse(StateHalfOpen, time.Duration(r-b.set.now()), noRetry)
	}
	if co.degraded.Load() || co.c.ctx.Err() != nil {
		return co.local(ctx, cb, noRetry)
	}
	co.mu.Lock()
	if co.claiming || co.lease != nil {
		co.mu.Unlock()
		return nil, b.refuse(StateHalfOpen, 0, noRetry)
	}
	co.claiming = true
	co.mu.Unlock()
	defer func() {
		co.mu.Lock()
		co.claiming = false
		co.mu.Unlock()
	}()
	sctx, cancel := context.WithTimeout(ctx, co.c.cfg.StoreTimeout)
	defer cancel()
	// Read first: another replica's probe may have succeeded, or may be out now.
	sl, err := co.read(sctx)
	if err != nil {
		co.setDegraded(true)
		return co.local(ctx, cb, noRetry)
	}
	if co.apply(sl) {
		return b.allowLocal(ctx, b.cb.Load(), noRetry)
	}
	if r := co.remote.Load(); r > b.set.now() { // held elsewhere: apply opened the breaker
		st := StateHalfOpen
		if b.State() == StateOpen {
			st = StateOpen
		}
		return nil, b.refuse(st, time.Duration(r-b.set.now()), noRetry)
	}
	got, ok, err := co.c.cfg.Store.ClaimSlot(sctx, co.scope, co.holder, co.leaseTTL(ctx))
	if err != nil {
		co.setDegraded(true)
		return co.local(ctx, cb, noRetry)
	}
	co.setDegraded(false)
	if !ok {
		// Taken between the read and the claim: wait for the next read to say until when.
		co.refused.Inc()
		co.remote.Store(b.set.now() + int64(co.c.cfg.Poll))
		return nil, b.refuse(StateHalfOpen, co.c.cfg.Poll, noRetry)
	}
	if b.cb.Load() != cb || cb.State() != gobreaker.StateHalfOpen {
		// The read loop closed the breaker between the read and the claim: another
		// replica's probe succeeded. This call is no probe; releasing our claim keeps
		// the lease saying so (free, at a later epoch), for the replicas still open.
		_ = co.c.cfg.Store.ReleaseSlot(sctx, got) // if this fails, the lease lapses by its TTL
		return b.allowLocal(ctx, b.cb.Load(), noRetry)
	}
	if got.Epoch > sl.Epoch+1 {
		// Another replica claimed the lease and finished its probe between our read and
		// our claim, with an outcome we did not see: send nothing, give the lease back
		// and let the next read decide.
		_ = co.expire(sctx) // if this fails, the lease lapses by its TTL
		co.remote.Store(b.set.now() + int64(co.c.cfg.Poll))
		return nil, b.refuse(StateHalfOpen, co.c.cfg.Poll, noRetry)
	}
	gdone, err := cb.Allow()
	if err != nil { // gobreaker moved on meanwhile: give the lease back unused
		_ = co.expire(ctx) // if this fails, the lease lapses by its TTL
		return nil, b.refuse(StateHalfOpen, 0, noRetry)
	}
	co.mu.Lock()
	co.lease = &got
	co.mu.Unlock()
	c := &call{b: b, ctx: ctx, gdone: gdone, after: func(o Outcome) { co.report(ctx, got, o) }}
	return c.done, nil
}

// local lets the probe out without the lease (the store is unreachable): today's
// behaviour, counted as a probe.
func (co *coord) local(ctx context.Context, cb *gobreaker.TwoStepCircuitBreaker[struct{}], noRetry bool) (func(error), error) {
	done, err := co.b.allowLocal(ctx, cb, noRetry)
	if err != nil {
		return nil, err
	}
	return func(err error) {
		done(err)
		co.probes[Classify(ctx, err)].Inc()
	}, nil
}

// leaseTTL bounds the probe's lease by its call: until the call's deadline plus the
// time to report the outcome, at most MaxProbeLease.
func (co *coord) leaseTTL(ctx context.Context) time.Duration {
	ttl := co.c.cfg.MaxProbeLease
	if dl, ok := ctx.Deadline(); ok {
		ttl = min(ttl, time.Until(dl)+co.c.cfg.StoreTimeout)
	}
	return max(ttl, time.Millisecond)
}

// report writes the probe's outcome into the lease, after gobreaker took it: a success
// releases the lease (other replicas close), a failure keeps it for this breaker's new
// open period (other replicas wait it out), an ignored outcome lets it expire at once
// (the next call anywhere may probe).
func (co *coord) report(ctx context.Context, sl store.Slot, o Outcome) {
	co.probes[o].Inc()
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), co.c.cfg.StoreTimeout)
	defer cancel()
	var err error
	switch o {
	case OutcomeSuccess:
		err = co.c.cfg.Store.ReleaseSlot(rctx, sl)
	case OutcomeFailure:
		ttl := time.Millisecond
		if until := co.b.openUntil.Load(); until != 0 {
			ttl = max(ttl, time.Duration(until-co.b.set.now()))
		}
		_, err = co.c.cfg.Store.RenewSlots(rctx, co.holder, ttl)
	default:
		err = co.expire(rctx)
	}
	co.mu.Lock()
	co.lease = nil
	co.mu.Unlock()
	co.setDegraded(err != nil && !errors.Is(err, store.ErrStaleEpoch))
}

// expire shortens our lease to nothing, so that it is free to claim.
func (co *coord) expire(ctx context.Context) error {
	_, err := co.c.cfg.Store.RenewSlots(ctx, co.holder, time.Millisecond)
	return err
}

// read returns the target's lease, sizing its scope first the first time.
func (co *coord) read(ctx context.Context) (store.Slot, error) {
	st := co.c.cfg.Store
	if !co.sized.Load() {
		if err := st.SizeSlots(ctx, co.scope, 1); err != nil {
			return store.Slot{}, err
		}
		co.sized.Store(true)
	}
	sls, err := st.ListSlots(ctx, co.scope)
	if err != nil || len(sls) == 0 {
		return store.Slot{Scope: co.scope}, err
	}
	return sls[0], nil
}

// apply brings the breaker in line with the lease as read, and reports whether that
// closed it.
func (co *coord) apply(sl store.Slot) (closed bool) {
	co.mu.Lock()
	defer co.mu.Unlock()
	if co.b.State() == StateClosed {
		return false
	}
	if co.base.Load() < 0 {
		co.base.Store(sl.Epoch)
	}
	now := time.Now()
	switch {
	case sl.Holder == co.holder: // our probe, or our failed probe's open period
		co.remote.Store(0)
	case sl.Holder == "" && sl.Epoch > co.base.Load(): // a probe succeeded since we opened
		co.remote.Store(0)
		co.closeShared()
		return true
	case sl.Holder != "" && sl.Expiry.After(now):
		// Another replica's probe is out, or its probe failed and the lease holds its new
		// open period: either way this breaker is open until the lease ends (and a
		// release before then closes it).
		until := co.b.set.now() + int64(time.Until(sl.Expiry))
		co.remote.Store(until)
		co.reopenShared(until)
	default: // free or expired, with no news: the next call may claim it
		co.remote.Store(0)
	}
	return false
}

// closeShared closes the breaker after another replica's successful probe. co.mu is held.
func (co *coord) closeShared() {
	b := co.b
	cb := b.cb.Load()
	switch cb.State() {
	case gobreaker.StateHalfOpen:
		gdone, err := cb.Allow()
		if err != nil {
			return // our own unleased probe is out (store was down): its outcome decides
		}
		gdone(nil) // half-open → closed, through gobreaker
	case gobreaker.StateOpen:
		// gobreaker cannot close an open breaker early: replace it with a new one.
		b.cb.Store(b.newCB())
		b.openUntil.Store(0)
		b.gauges[StateOpen].Set(0)
		b.gauges[StateClosed].Set(1)
		co.openToClosed.Inc()
		co.base.Store(-1)
	default:
		return
	}
	co.closed.Inc()
}

// reopenShared keeps the breaker open until until (Set.now's scale), the end of another
// replica's lease: a half-open breaker opens again, an open one stays open until then.
// A breaker opened here stays open at least the shortest open period, gobreaker's own
// timeout, which it cannot shorten. co.mu is held.
func (co *coord) reopenShared(until int64) {
	b := co.b
	cb := b.cb.Load()
	switch cb.State() {
	case gobreaker.StateHalfOpen:
		b.sharedUntil.Store(max(until, b.set.now()+int64(b.set.cfg.openMin())))
		gdone, err := cb.Allow()
		if err != nil {
			b.sharedUntil.Store(0)
			return
		}
		gdone(errFailed) // half-open → open for the prober's period, through gobreaker
	case gobreaker.StateOpen:
		if until <= b.openUntil.Load() {
			return
		}
		b.openUntil.Store(until)
		time.AfterFunc(time.Duration(until-b.set.now()), func() { b.wake(until) })
	default:
		return
	}
	co.reopened.Inc()
}

// watch starts the breaker's read loop unless it runs: called when the breaker leaves
// closed, from gobreaker's callback (so it takes no lock).
func (co *coord) watch() {
	if co.watching.CompareAndSwap(false, true) {
		go co.loop(co.c.ctx)
	}
}

// loop reads the lease every Poll while the breaker is not closed, and applies it,
// until ctx (Coordinate's) ends.
func (co *coord) loop(ctx context.Context) {
	t := time.NewTimer(0)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			co.watching.Store(false)
			return
		case <-t.C:
		}
		if co.b.State() == StateClosed {
			co.watching.Store(false)
			// A trip between the check and the Store found the loop running: look again.
			if co.b.State() == StateClosed || !co.watching.CompareAndSwap(false, true) {
				return
			}
		}
		rctx, cancel := context.WithTimeout(ctx, co.c.cfg.StoreTimeout)
		sl, err := co.read(rctx)
		cancel()
		if err != nil {
			if ctx.Err() == nil {
				co.setDegraded(true)
			}
		} else {
			co.setDegraded(false)
			co.apply(sl)
		}
		t.Reset(co.c.cfg.Poll)
	}
}
