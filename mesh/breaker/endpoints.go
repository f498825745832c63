package breaker

import (
	"context"
	"log/slog"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// A target is a service, and a service may have several replicas (endpoints) behind one
// connection, balanced by gRPC. One replica going down (a crash, a rollout) must not
// fence off the service while another replica serves: gRPC's balancer already stops
// picking a replica it cannot connect to, and the retry layer sends the failed attempt
// to another. So a call that failed UNAVAILABLE at one endpoint, while another endpoint
// is up, is not counted against the target: it is an endpoint failure (outcome
// "endpoint_failure" in the calls metric). An endpoint is up when, within the breaker's
// Window and after its last failure, a call to it succeeded or a stream was opened on it
// (a replica whose calls are all long streams still open has no success yet).
// Only UNAVAILABLE is judged this way, as the code of an endpoint that is down or
// unreachable; INTERNAL, UNKNOWN, DATA_LOSS and a target's own timeout count as before,
// since they say the service's code or state is broken wherever it runs. With one
// endpoint, or when every endpoint fails, every failure counts. A call whose endpoint is
// not known (no connection was picked; Allow without an interceptor) counts as well.

// endpoints is a breaker's record of what each endpoint last showed.
type endpoints struct {
	mu   sync.Mutex
	last map[string]*endpointSeen // by peer address
}

// endpointSeen is when an endpoint last showed it is up (a success, or a stream opened on
// it) and when it last failed, on Set.now's scale (0: never).
type endpointSeen struct {
	up, failed int64
}

// healthy reports whether the endpoint showed it was up, after its last failure and
// within window of now.
func (e *endpointSeen) healthy(now, window int64) bool {
	return e.up > e.failed && now-e.up <= window
}

// maxEndpoints is how many endpoints are kept before those silent for a Window are
// dropped (replicas come and go under a rollout).
const maxEndpoints = 32

// seen returns addr's record, making it; e.mu is held.
func (e *endpoints) seen(addr string, now, window int64) *endpointSeen {
	if e.last == nil {
		e.last = map[string]*endpointSeen{}
	}
	if s := e.last[addr]; s != nil {
		return s
	}
	if len(e.last) >= maxEndpoints {
		for a, s := range e.last {
			if now-max(s.up, s.failed) > window {
				delete(e.last, a)
			}
		}
	}
	s := &endpointSeen{}
	e.last[addr] = s
	return s
}

// up records that the endpoint addr answered: a stream was opened on it.
func (b *Breaker) up(addr string) {
	if addr == "" {
		return
	}
	now, window := b.set.now(), int64(b.set.cfg.Window)
	e := &b.endpoints
	e.mu.Lock()
	e.seen(addr, now, window).up = now
	e.mu.Unlock()
}

// judge records the outcome o (from Classify) of a call answered by the endpoint addr
// ("" unknown) and returns whether it is an endpoint failure, not to be counted against
// the target.
func (b *Breaker) judge(addr string, o Outcome, err error) bool {
	if addr == "" || o == OutcomeIgnored {
		return false
	}
	now, window := b.set.now(), int64(b.set.cfg.Window)
	e := &b.endpoints
	e.mu.Lock()
	defer e.mu.Unlock()
	s := e.seen(addr, now, window)
	if o == OutcomeSuccess {
		s.up = now
		return false
	}
	s.failed = now
	if status.Code(err) != codes.Unavailable {
		return false
	}
	for a, other := range e.last {
		if a != addr && other.healthy(now, window) {
			return true
		}
	}
	return false
}

// lastFailure is the most recent failure counted against a breaker's target, for the
// log line that says why it opened.
type lastFailure struct {
	method string
	peer   string
	err    error
}

// SetLogger makes the set log each breaker's opening (Warn, with the failure that tipped
// it: method, endpoint and status) and its closing (Info). Without it nothing is logged;
// the metrics are kept either way. Call it before the breakers are used.
func (s *Set) SetLogger(l *slog.Logger) { s.log = l }

// logOpened logs b's opening, if the set has a logger; shared says another replica's
// probe opened it (a coordinated breaker).
func (b *Breaker) logOpened(period time.Duration, shared bool) {
	f := b.lastFail.Swap(nil)
	if b.set.log == nil {
		return
	}
	args := []any{"target", b.target, "half_open_in", period.Round(time.Millisecond)}
	switch {
	case shared:
		args = append(args, "cause", "another replica's probe failed or is still out")
	case f != nil:
		args = append(args, "last_method", f.method, "last_endpoint", f.peer,
			"last_code", status.Code(f.err).String(), "last_error", status.Convert(f.err).Message())
	}
	b.set.log.Warn("circuit breaker opened: calls to the target are refused", args...)
}

// callKey carries an intercepted call's method and endpoint from the interceptor to the
// call's outcome (call.done), through the context the breaker keeps for the call.
type callKey struct{}

// callInfo is what an interceptor knows of a call.
type callInfo struct {
	method string
	addr   atomic.Pointer[string] // its endpoint, once known: a stream may end meanwhile
}

// withCall returns ctx carrying a new callInfo for method, and the callInfo.
func withCall(ctx context.Context, method string) (context.Context, *callInfo) {
	ci := &callInfo{method: method}
	return context.WithValue(ctx, callKey{}, ci), ci
}

// setPeer records the call's endpoint, if known.
func (ci *callInfo) setPeer(a net.Addr) {
	if a != nil {
		s := a.String()
		ci.addr.Store(&s)
	}
}

// callOf returns the method and endpoint address of the call made with ctx ("" unknown).
func callOf(ctx context.Context) (method, addr string) {
	ci, _ := ctx.Value(callKey{}).(*callInfo)
	if ci == nil {
		return "", ""
	}
	if a := ci.addr.Load(); a != nil {
		addr = *a
	}
	return ci.method, addr
}
