package mesh

import (
	"context"
	"log/slog"
	"runtime/debug"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/curfew-mesh/curfew/mesh/breaker"
	"github.com/curfew-mesh/curfew/mesh/deadline"
	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/mesh/retry"
	"github.com/curfew-mesh/curfew/mesh/retryid"
)

// ServerConfig configures the server chain. The zero value is usable: deadline defaults
// from package deadline, no per-method minimum, slog.Default for logs.
type ServerConfig struct {
	// Deadline normalizes incoming deadlines.
	Deadline deadline.Policy
	// MinTime maps a full method name ("/curfew.toolrunner.v1.ToolRunnerService/Execute")
	// to the least time left it needs to start; less is refused with DEADLINE_EXCEEDED.
	MinTime map[string]time.Duration
	// Logger receives internal errors and recovered panics.
	Logger *slog.Logger
	// RetryIDs is the in-flight table of attempts by retry-id; nil means a table with the
	// default grace and unregistered metrics.
	RetryIDs *retryid.Table
	// Metrics, when set, records the standard gRPC server metrics (outside the whole
	// chain, so it sees every call and the final status code: for unary calls wrapped
	// around the chain in the same interceptor, for streams an interceptor before it) and the deadline slack on
	// arrival (in the deadline layer); nil records none.
	Metrics *ServerMetrics
	// Chaos honours the curfew-chaos header (package chaos): the drill's fault switches.
	// Off (the default), the chain clears it from the call's identity, so it is neither
	// acted on nor sent on, and logs a warning the first time it sees one.
	Chaos bool
	// Authorize, when set, decides whether the caller of ctx may call fullMethod (a
	// meshtls.Policy's Authorize): a non-nil error, a status, refuses the call before the
	// deadline layer, so a refused call holds no deadline, identity or retry-id. It runs
	// inside metrics, recovery and status, so refusals are counted and logged with their
	// code. nil authorizes every call (plaintext, where there are no identities).
	Authorize func(ctx context.Context, fullMethod string) error
	// Authenticate, when set, decides which tenant the call acts for: it is given the
	// tenant the call's curfew-tenant header claims (md.DefaultTenant when none) and
	// returns the tenant the identity carries on, or a status error that refuses the call
	// (an apikey.Guard's Tenant: the tenant of a verified API key, the claim only from a
	// trusted mesh peer). It runs after the deadline layer, so a lookup it makes is bounded
	// by the call's deadline, and before fast-fail and the retry-id table, which therefore
	// see only authenticated tenants. nil honours the claim (the leaf services, whose
	// callers mTLS has authenticated as mesh peers).
	Authenticate func(ctx context.Context, fullMethod, claimed string) (string, error)
}

func (c ServerConfig) logger() *slog.Logger {
	if c.Logger != nil {
		return c.Logger
	}
	return slog.Default()
}

// ServerOptions returns the grpc.ServerOptions that install curfew's server chain.
func ServerOptions(cfg ServerConfig) []grpc.ServerOption {
	u, s := ServerInterceptors(cfg)
	return []grpc.ServerOption{grpc.ChainUnaryInterceptor(u...), grpc.ChainStreamInterceptor(s...)}
}

// ServerInterceptors returns the server chain (see the package doc). The layers are
// composed in one unary and one stream interceptor, in the documented order: a chain of
// separate interceptors costs grpc-go a closure per layer per call, and each layer would
// wrap the stream again.
func ServerInterceptors(cfg ServerConfig) ([]grpc.UnaryServerInterceptor, []grpc.StreamServerInterceptor) {
	ids := cfg.RetryIDs
	if ids == nil {
		ids = retryid.New(0, nil)
	}
	c := &serverChain{cfg: cfg, log: cfg.logger(), idsUnary: ids.UnaryServerInterceptor(), idsStream: ids.StreamServerInterceptor(rewrap)}
	if m := cfg.Metrics; m != nil {
		// Unary: the metrics around the chain as one interceptor, not two that grpc-go
		// would chain with a closure per call.
		return []grpc.UnaryServerInterceptor{m.grpc.WrapUnary(c.unary)}, []grpc.StreamServerInterceptor{m.stream, c.stream}
	}
	return []grpc.UnaryServerInterceptor{c.unary}, []grpc.StreamServerInterceptor{c.stream}
}

// serverChain is the server chain of one server. The retry-id layer, innermost, is the
// table's own interceptor, called directly.
type serverChain struct {
	cfg       ServerConfig
	log       *slog.Logger
	idsUnary  grpc.UnaryServerInterceptor
	idsStream grpc.StreamServerInterceptor
	chaosSeen sync.Once // the warning for a curfew-chaos header ignored
}

// unary is the whole chain for a unary call: recovery outermost, then the status mapping,
// authorization, deadline, identity and fast-fail (enter), and retry-id, then the handler. Its end is
// logged (finished) with the code the caller receives.
func (c *serverChain) unary(ctx context.Context, req any, info *grpc.UnaryServerInfo, h grpc.UnaryHandler) (_ any, err error) {
	start := time.Now()
	panicked := true
	defer func() {
		if p := recover(); p != nil || panicked {
			err = c.recovered(ctx, p)
		}
		finished(ctx, c.log, info.FullMethod, start, err)
	}()
	resp, err := c.unaryInner(ctx, req, info, h, start)
	panicked = false
	return resp, mapStatus(ctx, c.log, info.FullMethod, err)
}

func (c *serverChain) unaryInner(ctx context.Context, req any, info *grpc.UnaryServerInfo, h grpc.UnaryHandler, start time.Time) (any, error) {
	if a := c.cfg.Authorize; a != nil {
		if err := a(ctx, info.FullMethod); err != nil {
			return nil, err
		}
	}
	ctx, cancel := applyDeadline(ctx, c.cfg, c.log, info.FullMethod, start)
	if cancel != nil {
		defer cancel()
	}
	ctx, err := c.enter(ctx, info.FullMethod)
	if err != nil {
		return nil, err
	}
	return c.idsUnary(ctx, req, info, h)
}

// stream is unary's counterpart for streaming calls; the handler's stream carries the
// final context.
func (c *serverChain) stream(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, h grpc.StreamHandler) (err error) {
	ctx := ss.Context()
	start := time.Now()
	panicked := true
	defer func() {
		if p := recover(); p != nil || panicked {
			err = c.recovered(ctx, p)
		}
		finished(ctx, c.log, info.FullMethod, start, err)
	}()
	err = c.streamInner(ctx, srv, ss, info, h, start)
	panicked = false
	return mapStatus(ctx, c.log, info.FullMethod, err)
}

func (c *serverChain) streamInner(ctx context.Context, srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, h grpc.StreamHandler, start time.Time) error {
	if a := c.cfg.Authorize; a != nil {
		if err := a(ctx, info.FullMethod); err != nil {
			return err
		}
	}
	ctx, cancel := applyDeadline(ctx, c.cfg, c.log, info.FullMethod, start)
	if cancel != nil {
		defer cancel()
	}
	ctx, err := c.enter(ctx, info.FullMethod)
	if err != nil {
		return err
	}
	return c.idsStream(srv, &chainStream{ServerStream: ss, ctx: ctx}, info, h)
}

// enter runs the layers between the deadline and the retry-id: identity (with the tenant
// Authenticate resolves), fast-fail.
func (c *serverChain) enter(ctx context.Context, method string) (context.Context, error) {
	id := md.FromIncoming(ctx)
	if id.Chaos != "" && !c.cfg.Chaos {
		c.chaosSeen.Do(func() {
			c.log.WarnContext(ctx, "ignoring the curfew-chaos header: this service was not started with --chaos", "method", method, "chaos", id.Chaos)
		})
		id.Chaos = ""
	}
	if a := c.cfg.Authenticate; a != nil {
		t, err := a(ctx, method, id.Tenant)
		if err != nil {
			return nil, err
		}
		id.Tenant = t
	}
	ctx = md.WithIdentity(ctx, id)
	if min, ok := c.cfg.MinTime[method]; ok {
		if err := deadline.Check(ctx, min, method); err != nil {
			return nil, err
		}
	}
	return ctx, nil
}

// recovered turns a panic (or a handler that did not return) into INTERNAL, logging it
// with the stack.
func (c *serverChain) recovered(ctx context.Context, p any) error {
	c.log.ErrorContext(ctx, "panic in handler", "panic", p, "stack", string(debug.Stack()))
	return status.Error(codes.Internal, "internal error")
}

// applyDeadline gives the call the policy's default or capped deadline, reconciled with
// the caller's absolute curfew-deadline so that it is never later than the caller's. The
// final deadline is computed first and at most one context is derived; cancel is nil when
// the call's own deadline stands.
func applyDeadline(ctx context.Context, cfg ServerConfig, log *slog.Logger, method string, now time.Time) (context.Context, context.CancelFunc) {
	cur, had := ctx.Deadline()
	dl := cfg.Deadline.Resolve(cur, had, now).Deadline
	if abs, ok := md.IncomingDeadline(ctx); ok {
		var skew time.Duration
		if dl, skew = deadline.Reconciled(dl, abs, deadline.DefaultSkewTolerance); skew > 0 {
			log.WarnContext(ctx, "curfew-deadline disagrees with grpc-timeout; clocks may be skewed, keeping grpc-timeout",
				"method", method, "skew_ms", skew.Milliseconds())
		}
	}
	if cfg.Metrics != nil {
		cfg.Metrics.observeSlack(method, dl, now)
	}
	if had && !dl.Before(cur) {
		return ctx, nil
	}
	return context.WithDeadline(ctx, dl)
}

// An UNAVAILABLE or RESOURCE_EXHAUSTED that a handler returns is marked relayed
// (breaker.Relay): the service answered, so the failure is something it depends on (a
// tool's backend, a model provider, a service further down) and not the service itself.
// Callers' breakers for this service then ignore it, and one failing tool or model does
// not fence off the whole service for every other call. What still counts against a
// service is what only the service can cause: the transport's UNAVAILABLE (it is down,
// unreachable or refusing streams), INTERNAL and UNKNOWN (its own bugs), and a
// DEADLINE_EXCEEDED it gave up with while its caller still had time.
func mapStatus(ctx context.Context, log *slog.Logger, method string, err error) error {
	out, internal := toStatus(err)
	if internal {
		log.ErrorContext(ctx, "internal error", "method", method, "error", err.Error())
		return out
	}
	if c := status.Code(out); c == codes.Unavailable || c == codes.ResourceExhausted {
		return breaker.Relay(out)
	}
	return out
}

// chainStream is the handler's stream: the call's stream with the chain's context.
type chainStream struct {
	grpc.ServerStream
	ctx context.Context
}

func (s *chainStream) Context() context.Context { return s.ctx }

// rewrap gives a stream the retry-id layer's context: in place when it is the chain's own
// (made for this call, one allocation per stream), else in a new wrapper.
func rewrap(ctx context.Context, ss grpc.ServerStream) grpc.ServerStream {
	if cs, ok := ss.(*chainStream); ok {
		cs.ctx = ctx
		return cs
	}
	return &chainStream{ServerStream: ss, ctx: ctx}
}

// ClientConfig configures the client chain of one connection. The zero value is usable:
// retries by retry.Config's defaults, no breaker.
type ClientConfig struct {
	// Retry is the retry policy of this connection (one target).
	Retry retry.Config
	// Breakers, when set and not Off, guards every attempt on this connection with the
	// set's breaker for Retry.Target (the downstream service's name): one breaker per
	// target, shared by every connection to it that uses the same set.
	Breakers *breaker.Set
	// Metrics, when set, records the standard gRPC client metrics, outermost: one
	// logical call each, whatever its attempts (curfew_retry_attempts_total counts
	// those). nil records none.
	Metrics *ClientMetrics
}

// DialOptions returns the grpc.DialOptions that install curfew's client chain on one
// connection. Transport credentials are the caller's to add.
//
// Client chain, outermost first:
//
//  0. metrics (ClientConfig.Metrics, when set): the standard gRPC client metrics, one
//     logical call each, with its final code and whole duration, retries included.
//  1. stamp: identity and curfew-deadline go on the outgoing metadata, once per logical
//     call, the same on every attempt.
//  2. retry: one logical call, its attempts (same retry-id, curfew-attempt numbered),
//     backoff, pushback, budget. Outside everything that is per attempt, so each attempt
//     passes the breaker and is counted by it, and the one retrying layer sees every
//     attempt's outcome, the breaker's refusals included.
//  3. breaker (package breaker, when ClientConfig.Breakers is set): the target's circuit
//     breaker, innermost, next to the transport, so that it counts what the target did
//     to each attempt and an open breaker refuses an attempt before anything is sent.
//     Its refusal (UNAVAILABLE with RetryInfo and a BREAKER_OPEN ErrorInfo) is marked
//     as retried to exhaustion, so the retry layer returns it at once instead of
//     sleeping out the open period, and no retry layer further up retries it either.
//     Were the breaker outside the retry layer, it would count one outcome per logical
//     call, hiding the failed attempts that a retry rescued, and a trip in the middle of
//     a call would not stop that call's remaining attempts.
//
// The retry interceptors stamp (retry.Config.StampIdentity) together with the retry-id
// and attempt, in one metadata append per attempt: the values stamped come from the
// call's context, so they are the same on every attempt.
//
// The connection balances calls over every address its target resolves to
// (LoadBalancingConfig, round_robin): a dns:/// target of a headless Service reaches every
// ready replica, where gRPC's default, pick_first, would send every call to one of them
// and leave replicas the autoscaler adds idle. A target of one address is unaffected.
func DialOptions(cfg ClientConfig) []grpc.DialOption {
	rc := cfg.Retry
	rc.StampIdentity = true
	ru, rs := retry.ClientInterceptors(rc)
	us, ss := []grpc.UnaryClientInterceptor{ru}, []grpc.StreamClientInterceptor{rs}
	if m := cfg.Metrics; m != nil {
		// Unary: the metrics around retry as one interceptor, one closure fewer per call
		// than grpc-go chaining two.
		us[0] = m.grpc.WrapUnary(ru)
		ss = append([]grpc.StreamClientInterceptor{m.stream}, ss...)
	}
	if cfg.Breakers != nil && !cfg.Breakers.Config().Off {
		us = append(us, cfg.Breakers.UnaryClientInterceptor(rc.Target))
		ss = append(ss, cfg.Breakers.StreamClientInterceptor(rc.Target))
	}
	return []grpc.DialOption{grpc.WithChainUnaryInterceptor(us...), grpc.WithChainStreamInterceptor(ss...),
		grpc.WithDefaultServiceConfig(LoadBalancingConfig)}
}

// LoadBalancingConfig is the default service config of DialOptions' connections: calls
// round-robin over every address of the target. A service config the target's resolver
// returns (DNS TXT records, which grpc-go ignores by default) would override it.
const LoadBalancingConfig = `{"loadBalancingConfig": [{"round_robin": {}}]}`
