package breaker

import (
	"context"
	"log/slog"
	"sync"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"
)

// A target is a service, and a service may have several replicas (endpoints) behind one
// connection, balanced by gRPC. One replica going down (a crash, a rollout) must not
// fence off the service while another replica serves: gRPC's balancer already stops
// picking a replica it cannot connect to, and the retry layer sends the failed attempt
// to another. So a call that failed UNAVAILABLE at one endpoint, while another endpoint's
// last judged call succeeded within the breaker's Window, is not counted against the
// target: it is an endpoint failure (outcome "endpoint_failure" in the calls metric).
// Only UNAVAILABLE is judged this way, as the code of an endpoint that is down or
// unreachable; INTERNAL, UNKNOWN, DATA_LOSS and a target's own timeout count as before,
// since they say the service's code or state is broken wherever it runs. With one
// endpoint, or when every endpoint fails, every failure counts. A call whose endpoint is
// not known (no connection was picked; Allow without an interceptor) counts as well.

// endpoints is a breaker's record of each endpoint's last judged outcome.
type endpoints struct {
	mu   sync.Mutex
	last map[string]lastOutcome // by peer address
}

type lastOutcome struct {
	ok bool
	at int64 // Set.now's scale
}

// maxEndpoints is how many endpoints are kept before those silent for a Window are
// dropped (replicas come and go under a rollout).
const maxEndpoints = 32

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
	if e.last == nil {
		e.last = map[string]lastOutcome{}
	}
	if len(e.last) >= maxEndpoints {
		for a, l := range e.last {
			if now-l.at > window {
				delete(e.last, a)
			}
		}
	}
	e.last[addr] = lastOutcome{ok: o == OutcomeSuccess, at: now}
	if o != OutcomeFailure || status.Code(err) != codes.Unavailable {
		return false
	}
	for a, l := range e.last {
		if a != addr && l.ok && now-l.at <= window {
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

// logOpened logs b's opening, if the set has a logger.
func (b *Breaker) logOpened(period time.Duration) {
	if b.set.log == nil {
		return
	}
	args := []any{"target", b.target, "half_open_in", period.Round(time.Millisecond)}
	if f := b.lastFail.Load(); f != nil {
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
	peer   *peer.Peer // filled in by gRPC once the call has an endpoint
}

func withCall(ctx context.Context, method string, p *peer.Peer) context.Context {
	return context.WithValue(ctx, callKey{}, &callInfo{method: method, peer: p})
}

// callOf returns the method and endpoint address of the call made with ctx ("" unknown).
func callOf(ctx context.Context) (method, addr string) {
	ci, _ := ctx.Value(callKey{}).(*callInfo)
	if ci == nil {
		return "", ""
	}
	if ci.peer != nil && ci.peer.Addr != nil {
		addr = ci.peer.Addr.String()
	}
	return ci.method, addr
}
