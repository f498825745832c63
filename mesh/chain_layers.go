package mesh

import (
	"context"
	"log/slog"
	"runtime/debug"
	"sync"
	"time"

	middleware "github.com/grpc-ecosystem/go-grpc-middleware/v2"
	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors/recovery"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/curfew-mesh/curfew/mesh/breaker"
	"github.com/curfew-mesh/curfew/mesh/deadline"
	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/mesh/retryid"
)

// serverLayers builds the layers of serverChain for one server.
type serverLayers struct {
	cfg       ServerConfig
	log       *slog.Logger
	ids       *retryid.Table
	chaosSeen sync.Once // the warning for a curfew-chaos header ignored
}

func newServerLayers(cfg ServerConfig) *serverLayers {
	ids := cfg.RetryIDs
	if ids == nil {
		ids = retryid.New(0, nil)
	}
	return &serverLayers{cfg: cfg, log: cfg.logger(), ids: ids}
}

func (l *serverLayers) credentials() stage {
	if l.cfg.Credentials == nil {
		return stage{}
	}
	return stage{options: []grpc.ServerOption{grpc.Creds(l.cfg.Credentials)}}
}

func (l *serverLayers) headerLimit() stage {
	if l.cfg.MaxHeaderListSize == 0 {
		return stage{}
	}
	return stage{options: []grpc.ServerOption{grpc.MaxHeaderListSize(l.cfg.MaxHeaderListSize)}}
}

func (l *serverLayers) tracing() stage {
	if l.cfg.Tracing == nil {
		return stage{}
	}
	return stage{options: []grpc.ServerOption{grpc.StatsHandler(l.cfg.Tracing)}}
}

func (l *serverLayers) messageLimit() stage {
	if l.cfg.MaxRecvMsgSize <= 0 {
		return stage{}
	}
	return stage{options: []grpc.ServerOption{grpc.MaxRecvMsgSize(l.cfg.MaxRecvMsgSize)}}
}

// metrics: go-grpc-middleware's Prometheus provider (see metrics.go).
func (l *serverLayers) metrics() stage {
	m := l.cfg.Metrics
	if m == nil {
		return stage{}
	}
	return stage{unary: m.grpc.UnaryServerInterceptor(), stream: m.grpc.StreamServerInterceptor()}
}

// callLog logs the end of every call (see finished in logging.go).
func (l *serverLayers) callLog() stage {
	return stage{
		unary: func(ctx context.Context, req any, info *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
			start := time.Now()
			resp, err := h(ctx, req)
			finished(ctx, l.log, info.FullMethod, start, err)
			return resp, err
		},
		stream: func(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, h grpc.StreamHandler) error {
			start := time.Now()
			err := h(srv, ss)
			finished(ss.Context(), l.log, info.FullMethod, start, err)
			return err
		},
	}
}

// recovery: go-grpc-middleware's, logging the panic with its stack and answering
// INTERNAL "internal error".
func (l *serverLayers) recovery() stage {
	opt := recovery.WithRecoveryHandlerContext(func(ctx context.Context, p any) error {
		l.log.ErrorContext(ctx, "panic in handler", "panic", p, "stack", string(debug.Stack()))
		return status.Error(codes.Internal, "internal error")
	})
	return stage{unary: recovery.UnaryServerInterceptor(opt), stream: recovery.StreamServerInterceptor(opt)}
}

func (l *serverLayers) status() stage {
	return stage{
		unary: func(ctx context.Context, req any, info *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
			resp, err := h(ctx, req)
			return resp, mapStatus(ctx, l.log, info.FullMethod, err)
		},
		stream: func(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, h grpc.StreamHandler) error {
			return mapStatus(ss.Context(), l.log, info.FullMethod, h(srv, ss))
		},
	}
}

func (l *serverLayers) authorize() stage {
	a := l.cfg.Authorize
	if a == nil {
		return stage{}
	}
	return step(func(ctx context.Context, method string) (context.Context, error) {
		return ctx, a(ctx, method)
	})
}

// deadline gives the call the policy's default or capped deadline, reconciled with the
// caller's absolute curfew-deadline (applyDeadline).
// contract refuses a call whose curfew-* headers break the wire contract's rules
// (md.Check): INVALID_ARGUMENT naming the header.
func (l *serverLayers) contract() stage {
	return step(func(ctx context.Context, _ string) (context.Context, error) {
		return ctx, md.Check(ctx)
	})
}

func (l *serverLayers) deadline() stage {
	return stage{derive: func(ctx context.Context, method string) (context.Context, func(), error) {
		ctx, cancel := applyDeadline(ctx, l.cfg, l.log, method, time.Now())
		return ctx, cancel, nil // cancel is nil when the call's own deadline stands
	}}
}

// identity makes curfew-tenant, curfew-run-id, curfew-node-id, curfew-attempt (and the
// rest of md.Identity) the context's identity.
func (l *serverLayers) identity() stage {
	return step(func(ctx context.Context, _ string) (context.Context, error) {
		return md.WithIdentity(ctx, md.FromIncoming(ctx)), nil
	})
}

// chaos clears the curfew-chaos header from the identity unless the server honours it,
// warning the first time.
func (l *serverLayers) chaos() stage {
	if l.cfg.Chaos {
		return stage{}
	}
	return step(func(ctx context.Context, method string) (context.Context, error) {
		id := md.IdentityFrom(ctx)
		if id.Chaos == "" {
			return ctx, nil
		}
		l.chaosSeen.Do(func() {
			l.log.WarnContext(ctx, "ignoring the curfew-chaos header: this service was not started with --chaos", "method", method, "chaos", id.Chaos)
		})
		id.Chaos = ""
		return md.WithIdentity(ctx, id), nil
	})
}

// authenticate replaces the claimed tenant by the one Authenticate resolves.
func (l *serverLayers) authenticate() stage {
	a := l.cfg.Authenticate
	if a == nil {
		return stage{}
	}
	return step(func(ctx context.Context, method string) (context.Context, error) {
		id := md.IdentityFrom(ctx)
		t, err := a(ctx, method, id.Tenant)
		if err != nil {
			return nil, err
		}
		id.Tenant = t
		return md.WithIdentity(ctx, id), nil
	})
}

// fastFail refuses a call with less time left than its method's minimum.
func (l *serverLayers) fastFail() stage {
	if len(l.cfg.MinTime) == 0 {
		return stage{}
	}
	return step(func(ctx context.Context, method string) (context.Context, error) {
		if min, ok := l.cfg.MinTime[method]; ok {
			if err := deadline.Check(ctx, min, method); err != nil {
				return nil, err
			}
		}
		return ctx, nil
	})
}

// retryID admits one attempt per (tenant, method, retry-id) (package retryid).
func (l *serverLayers) retryID() stage {
	return stage{unary: l.ids.UnaryServerInterceptor(), stream: l.ids.StreamServerInterceptor(withContext)}
}

// step makes a layer that only derives the call's context, or refuses the call with the
// error, into a derive stage.
func step(fn func(ctx context.Context, method string) (context.Context, error)) stage {
	return stage{derive: func(ctx context.Context, method string) (context.Context, func(), error) {
		ctx, err := fn(ctx, method)
		return ctx, nil, err
	}}
}

// withContext gives ss the context ctx: in place when ss is already a wrapper made for
// this call, else in a new one.
func withContext(ctx context.Context, ss grpc.ServerStream) grpc.ServerStream {
	w := middleware.WrapServerStream(ss)
	w.WrappedContext = ctx
	return w
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
