package breaker

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2" //nolint:gosec // jitter, not secrets
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/sony/gobreaker/v2"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	spb "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/curfew-mesh/curfew/mesh/retry"
)

// State is a breaker's state.
type State int

// States, in gobreaker's order.
const (
	// StateClosed lets every call through and counts outcomes.
	StateClosed State = iota
	// StateHalfOpen lets one probe through; its success closes the breaker, its failure
	// opens it again.
	StateHalfOpen
	// StateOpen refuses every call without sending it.
	StateOpen
)

var states = [...]State{StateClosed, StateHalfOpen, StateOpen}

func (s State) String() string {
	switch s {
	case StateClosed:
		return "closed"
	case StateHalfOpen:
		return "half-open"
	case StateOpen:
		return "open"
	}
	return "unknown"
}

// Name is the state as operators' APIs spell it (AdminService.Status, ListDecoders):
// closed, half_open or open.
func (s State) Name() string { return strings.ReplaceAll(s.String(), "-", "_") }

// The refusal's ErrorInfo.
const (
	// Reason is the ErrorInfo reason of a call refused by an open breaker.
	Reason = "BREAKER_OPEN"
	// Domain is the ErrorInfo domain of curfew's errors.
	Domain = "curfew.dev"
	// MinRetryDelay is the least RetryInfo delay of a refusal: a half-open breaker whose
	// probe is in flight does not know when the probe ends, and a breaker about to
	// half-open should not invite a caller back in the same instant. It is the retry
	// layer's backoff base (Envoy's 25 ms).
	MinRetryDelay = 25 * time.Millisecond
)

// metrics are the breaker metrics of a Set.
type metrics struct {
	state       *prometheus.GaugeVec
	transitions *prometheus.CounterVec
	calls       *prometheus.CounterVec
}

func newMetrics(reg prometheus.Registerer) *metrics {
	m := &metrics{
		state: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "curfew_circuit_breaker_state",
			Help: "Circuit breaker state per downstream target: 1 for the current state (closed, half-open or open), 0 for the others.",
		}, []string{"target", "state"}),
		transitions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "curfew_circuit_breaker_transitions_total",
			Help: "Circuit breaker state changes per downstream target, from one state to another.",
		}, []string{"target", "from", "to"}),
		calls: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "curfew_circuit_breaker_calls_total",
			Help: "Calls through a circuit breaker per downstream target by outcome: success, failure, ignored (says nothing about the target, e.g. cancelled by the caller), endpoint_failure (UNAVAILABLE from one replica while another serves: not counted against the target), rejected (refused by the open breaker, never sent).",
		}, []string{"target", "outcome"}),
	}
	if reg != nil {
		m.state = register(reg, m.state)
		m.transitions = register(reg, m.transitions)
		m.calls = register(reg, m.calls)
	}
	return m
}

// register registers c with reg, or returns the collector already registered there under
// the same description, so that several Sets (the services' and modelproxy's providers')
// can share one registry; their targets must then differ.
func register[C prometheus.Collector](reg prometheus.Registerer, c C) C {
	if err := reg.Register(c); err != nil {
		var are prometheus.AlreadyRegisteredError
		if errors.As(err, &are) {
			if existing, ok := are.ExistingCollector.(C); ok {
				return existing
			}
		}
		panic(fmt.Sprintf("breaker: registering metrics: %v", err))
	}
	return c
}

// Set holds the breakers of one client, one per downstream target, created on first use.
// It is safe for concurrent use.
type Set struct {
	cfg   Config
	m     *metrics
	epoch time.Time // monotonic origin of the breakers' open deadlines
	// rand draws the open periods' jitter, uniform in [0, 1); tests replace it.
	rand func() float64

	mu       sync.RWMutex
	breakers map[string]*Breaker
	reg      prometheus.Registerer
	coord    *coordination // nil: each breaker probes on its own (see Coordinate)
	log      *slog.Logger  // nil: nothing logged (SetLogger)
}

// NewSet returns a set of breakers configured by cfg (defaults applied), registering the
// metrics with reg when it is not nil. Several Sets may share a registry if their targets
// differ. NewSet panics if cfg fails Validate: check configuration first.
func NewSet(cfg Config, reg prometheus.Registerer) *Set {
	if err := cfg.Validate(); err != nil {
		panic(err.Error())
	}
	return &Set{cfg: cfg.WithDefaults(), m: newMetrics(reg), epoch: time.Now(), rand: rand.Float64, breakers: map[string]*Breaker{}, reg: reg}
}

// Config returns the set's configuration, defaults applied.
func (s *Set) Config() Config { return s.cfg }

// Get returns the breaker of target, creating it (closed) on first use.
func (s *Set) Get(target string) *Breaker {
	s.mu.RLock()
	b := s.breakers[target]
	s.mu.RUnlock()
	if b != nil {
		return b
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if b = s.breakers[target]; b == nil {
		b = s.newBreaker(target)
		if s.coord != nil {
			b.co.Store(s.coord.attach(b))
		}
		s.breakers[target] = b
	}
	return b
}

// All returns the set's breakers, by target.
func (s *Set) All() []*Breaker {
	s.mu.RLock()
	out := make([]*Breaker, 0, len(s.breakers))
	for _, b := range s.breakers {
		out = append(out, b)
	}
	s.mu.RUnlock()
	slices.SortFunc(out, func(a, b *Breaker) int { return strings.Compare(a.target, b.target) })
	return out
}

// now is the set's monotonic clock in nanoseconds since its epoch (always > 0 after it).
func (s *Set) now() int64 { return int64(time.Since(s.epoch)) + 1 }

// Breaker is the circuit breaker of one target: gobreaker's two-step breaker with
// curfew's classification, open-period jitter, refusal status and metrics.
type Breaker struct {
	set    *Set
	target string
	// cb is gobreaker's breaker. A coordinated breaker replaces it with a new, closed
	// one when another replica's probe succeeded while this one was still open, since
	// gobreaker has no way to close an open breaker early.
	cb atomic.Pointer[gobreaker.TwoStepCircuitBreaker[struct{}]]
	// co is the breaker's share of the Set's coordination, nil without it.
	co atomic.Pointer[coord]
	// sharedUntil, when not 0, is the end (Set.now's scale) of the next open period,
	// set just before a coordinated breaker is opened by another replica's failed probe:
	// the period is then the prober's, not one drawn here.
	sharedUntil atomic.Int64

	// openUntil is when the current open period ends (Set.now's scale), 0 when not
	// open. gobreaker's own Timeout is the shortest open period (see Config.openMin); the
	// jitter on top is enforced here, before gobreaker is asked, because gobreaker's
	// Settings have no jitter and its Timeout is fixed for the breaker's life.
	openUntil atomic.Int64

	// info is the refusal's ErrorInfo detail per state (open, half-open), made once.
	info [len(states)]*anypb.Any

	gauges   [len(states)]prometheus.Gauge
	trans    map[[2]State]prometheus.Counter // the four possible transitions
	outcomes [3]prometheus.Counter           // by Outcome
	rejected prometheus.Counter
	// endpointFailed counts failures of one endpoint not counted against the target
	// (endpoints.go).
	endpointFailed prometheus.Counter

	endpoints endpoints
	lastFail  atomic.Pointer[lastFailure] // for the log line of the next opening
}

// errIgnored and errFailed tell gobreaker the outcome Classify found.
var (
	errIgnored = errors.New("ignored")
	errFailed  = errors.New("failed")
)

func (s *Set) newBreaker(target string) *Breaker {
	b := &Breaker{set: s, target: target, trans: map[[2]State]prometheus.Counter{}}
	for _, st := range states {
		b.gauges[st] = s.m.state.WithLabelValues(target, st.String())
	}
	b.gauges[StateClosed].Set(1)
	for _, t := range [][2]State{{StateClosed, StateOpen}, {StateOpen, StateHalfOpen}, {StateHalfOpen, StateOpen}, {StateHalfOpen, StateClosed}} {
		b.trans[t] = s.m.transitions.WithLabelValues(target, t[0].String(), t[1].String())
	}
	for _, o := range []Outcome{OutcomeSuccess, OutcomeFailure, OutcomeIgnored} {
		b.outcomes[o] = s.m.calls.WithLabelValues(target, o.String())
	}
	b.rejected = s.m.calls.WithLabelValues(target, "rejected")
	b.endpointFailed = s.m.calls.WithLabelValues(target, "endpoint_failure")
	for _, st := range []State{StateOpen, StateHalfOpen} {
		b.info[st] = mustAny(&errdetails.ErrorInfo{Reason: Reason, Domain: Domain, Metadata: map[string]string{"target": target, "state": st.String()}})
	}
	b.cb.Store(b.newCB())
	return b
}

// newCB returns a new, closed gobreaker breaker for b.
func (b *Breaker) newCB() *gobreaker.TwoStepCircuitBreaker[struct{}] {
	cfg, target := b.set.cfg, b.target
	var cb *gobreaker.TwoStepCircuitBreaker[struct{}]
	cb = gobreaker.NewTwoStepCircuitBreaker[struct{}](gobreaker.Settings{
		Name:         target,
		MaxRequests:  1, // exactly one half-open probe
		Interval:     cfg.Window,
		BucketPeriod: cfg.Window / WindowBuckets,
		Timeout:      cfg.openMin(),
		ReadyToTrip: func(c gobreaker.Counts) bool {
			if c.ConsecutiveFailures >= cfg.ConsecutiveFailures {
				return true
			}
			judged := uint64(c.TotalSuccesses) + uint64(c.TotalFailures)
			return judged >= uint64(cfg.MinRequests) && float64(c.TotalFailures) >= cfg.FailureRatio*float64(judged)
		},
		OnStateChange: func(name string, from, to gobreaker.State) {
			if b.cb.Load() == cb { // a replaced breaker's late outcomes change nothing
				b.changed(name, from, to)
			}
		},
		IsSuccessful: func(err error) bool { return err == nil },
		IsExcluded:   func(err error) bool { return err == errIgnored }, //nolint:errorlint // our own sentinel, never wrapped
	})
	return cb
}

// changed is gobreaker's OnStateChange. gobreaker calls it with its lock held, so it must
// not call into the breaker.
func (b *Breaker) changed(_ string, from, to gobreaker.State) {
	if to == gobreaker.StateOpen {
		now := b.set.now()
		period := b.set.cfg.openPeriod(b.set.rand())
		shared := b.sharedUntil.Swap(0)
		if shared > now {
			period = time.Duration(shared - now)
		}
		until := now + int64(period)
		b.openUntil.Store(until)
		// Half-open on time even with no call to notice it, so that the state gauge and
		// State tell the truth. Harmless when a call notices first.
		time.AfterFunc(period, func() { b.wake(until) })
		b.logOpened(period, shared > now)
	} else {
		b.openUntil.Store(0)
	}
	if co := b.co.Load(); co != nil {
		if to == gobreaker.StateClosed {
			co.base.Store(-1)     // the next open period reads its own
			co.setDegraded(false) // a closed breaker does not use the store
		} else {
			co.watch()
		}
	}
	f, t := State(from), State(to)
	b.gauges[f].Set(0)
	b.gauges[t].Set(1)
	if c := b.trans[[2]State{f, t}]; c != nil {
		c.Inc()
	}
	if t == StateClosed && b.set.log != nil {
		b.set.log.Info("circuit breaker closed: calls to the target flow again", "target", b.target)
	}
}

// wake asks the breaker for its state when the open period ending at until is over, which
// turns it half-open. gobreaker's timeout ends no later, but it compares strictly, so at
// the very same nanosecond it still says open: then wake asks again a millisecond later.
// A timer of an earlier open period finds another until and does nothing.
func (b *Breaker) wake(until int64) {
	if b.openUntil.Load() != until {
		return
	}
	if b.State() == StateOpen && b.openUntil.Load() == until {
		time.AfterFunc(time.Millisecond, func() { b.wake(until) })
	}
}

// Target returns the breaker's target.
func (b *Breaker) Target() string { return b.target }

// State returns the breaker's state; an open breaker whose open period has ended turns
// half-open here.
func (b *Breaker) State() State {
	if b.set.cfg.Off {
		return StateClosed
	}
	if until := b.openUntil.Load(); until != 0 && b.set.now() < until {
		return StateOpen
	}
	return State(b.cb.Load().State())
}

// Allow asks to make one call. When the breaker is open, or half-open with its single
// probe already in flight, it returns a gRPC status error UNAVAILABLE carrying RetryInfo
// (the time until the breaker half-opens, at least MinRetryDelay) and an ErrorInfo
// {Reason: "BREAKER_OPEN", Domain: "curfew.dev", Metadata: {"target": ..., "state": ...}},
// and the call must not be made. Otherwise done must be called exactly once with the
// call's outcome (calls after the first are ignored); it classifies it with Classify(ctx,
// err).
func (b *Breaker) Allow(ctx context.Context) (done func(err error), err error) {
	return b.allow(ctx, false)
}

// allow is Allow; noRetry also marks a refusal as retried to exhaustion (see the
// interceptors).
func (b *Breaker) allow(ctx context.Context, noRetry bool) (done func(err error), err error) {
	if b.set.cfg.Off {
		return noop, nil
	}
	if until := b.openUntil.Load(); until != 0 {
		if now := b.set.now(); now < until {
			return nil, b.refuse(StateOpen, time.Duration(until-now), noRetry)
		}
	}
	cb := b.cb.Load()
	if co := b.co.Load(); co != nil && cb.State() == gobreaker.StateHalfOpen {
		return co.allowProbe(ctx, cb, noRetry)
	}
	return b.allowLocal(ctx, cb, noRetry)
}

// allowLocal asks gobreaker alone: today's behaviour, and a coordinated breaker's
// when it is closed or its store cannot be reached.
func (b *Breaker) allowLocal(ctx context.Context, cb *gobreaker.TwoStepCircuitBreaker[struct{}], noRetry bool) (done func(err error), err error) {
	gdone, err := cb.Allow()
	if err != nil {
		if errors.Is(err, gobreaker.ErrOpenState) {
			wait := time.Duration(0)
			if until := b.openUntil.Load(); until != 0 {
				wait = time.Duration(until - b.set.now())
			}
			return nil, b.refuse(StateOpen, wait, noRetry)
		}
		return nil, b.refuse(StateHalfOpen, 0, noRetry)
	}
	c := &call{b: b, ctx: ctx, gdone: gdone}
	return c.done, nil
}

func noop(error) {}

// call is one allowed call, until its outcome.
type call struct {
	b        *Breaker
	ctx      context.Context
	gdone    func(error)
	reported atomic.Bool
	// after, if set, is told the outcome once gobreaker has been (a coordinated
	// breaker's probe: it shares the outcome).
	after func(Outcome)
}

func (c *call) done(err error) {
	if c.reported.Swap(true) {
		return
	}
	o := Classify(c.ctx, err)
	method, addr := callOf(c.ctx)
	switch {
	case c.b.judge(addr, o, err):
		c.b.endpointFailed.Inc()
		retry.NoteEndpointFailure(c.ctx) // its retry needs no retry window
		o = OutcomeIgnored
	case o == OutcomeFailure:
		c.b.outcomes[o].Inc()
		c.b.lastFail.Store(&lastFailure{method: method, peer: addr, err: err})
	default:
		c.b.outcomes[o].Inc()
	}
	if c.after != nil {
		defer c.after(o)
	}
	switch o {
	case OutcomeSuccess:
		c.gdone(nil)
	case OutcomeFailure:
		c.gdone(errFailed)
	default:
		c.gdone(errIgnored)
	}
}

// refuse counts a refused call and returns its status error: UNAVAILABLE with RetryInfo
// (wait, at least MinRetryDelay) and the ErrorInfo of state s, and with noRetry the retry
// package's exhaustion marker. The status is assembled from details marshalled once; only
// the RetryInfo is made per call.
func (b *Breaker) refuse(s State, wait time.Duration, noRetry bool) error {
	b.rejected.Inc()
	if wait < MinRetryDelay {
		wait = MinRetryDelay
	}
	var msg string
	if s == StateHalfOpen {
		msg = "circuit breaker for " + b.target + " is half-open with its probe in flight: call not sent"
	} else {
		msg = "circuit breaker for " + b.target + " is open: call not sent; it half-opens in " + wait.Round(time.Millisecond).String()
	}
	details := make([]*anypb.Any, 2, 3)
	details[0], details[1] = mustAny(&errdetails.RetryInfo{RetryDelay: durationpb.New(wait)}), b.info[s]
	if noRetry {
		details = append(details, exhaustedInfo)
	}
	return status.ErrorProto(&spb.Status{Code: int32(codes.Unavailable), Message: msg, Details: details})
}

// exhaustedInfo is the retry package's marker of an error not to be retried, with
// attempts "0": nothing reached the target.
var exhaustedInfo = mustAny(&errdetails.ErrorInfo{Reason: retry.ExhaustedReason, Domain: retry.ExhaustedDomain,
	Metadata: map[string]string{"attempts": "0"}})

// mustAny wraps m in an Any; m is one of the well-formed details above, so it cannot fail.
func mustAny(m proto.Message) *anypb.Any {
	a, err := anypb.New(m)
	if err != nil {
		panic(fmt.Sprintf("breaker: marshalling %T: %v", m, err))
	}
	return a
}

// OpenError describes a refusal by an open breaker.
type OpenError struct {
	// Target is the refusing breaker's target.
	Target string
	// State is "open" or "half-open" (probe in flight).
	State string
	// RetryAfter is the refusal's RetryInfo delay.
	RetryAfter time.Duration
}

// IsOpen reports whether err is a breaker's refusal (UNAVAILABLE with the BREAKER_OPEN
// ErrorInfo), here or at a hop below.
func IsOpen(err error) bool {
	_, ok := Open(err)
	return ok
}

// Open returns the details of a breaker's refusal, and whether err is one.
func Open(err error) (OpenError, bool) {
	st, ok := status.FromError(err)
	if !ok || st.Code() != codes.Unavailable {
		return OpenError{}, false
	}
	ei := openInfo(st)
	if ei == nil {
		return OpenError{}, false
	}
	oe := OpenError{Target: ei.GetMetadata()["target"], State: ei.GetMetadata()["state"]}
	for _, d := range st.Details() {
		if ri, ok := d.(*errdetails.RetryInfo); ok {
			oe.RetryAfter = ri.GetRetryDelay().AsDuration()
		}
	}
	return oe, true
}

func openInfo(st *status.Status) *errdetails.ErrorInfo {
	for _, d := range st.Details() {
		if ei, ok := d.(*errdetails.ErrorInfo); ok && ei.GetReason() == Reason && ei.GetDomain() == Domain {
			return ei
		}
	}
	return nil
}

// String describes the breaker for logs: target and state.
func (b *Breaker) String() string { return b.target + " (" + b.State().String() + ")" }
