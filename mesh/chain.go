package mesh

import (
	"context"
	"log/slog"
	"runtime/debug"
	"time"

	middleware "github.com/grpc-ecosystem/go-grpc-middleware/v2"
	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors/recovery"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

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

// ServerInterceptors returns the server chain in order (see the package doc).
func ServerInterceptors(cfg ServerConfig) ([]grpc.UnaryServerInterceptor, []grpc.StreamServerInterceptor) {
	log := cfg.logger()
	ids := cfg.RetryIDs
	if ids == nil {
		ids = retryid.New(0, nil)
	}
	rec := recovery.WithRecoveryHandlerContext(func(ctx context.Context, p any) error {
		log.ErrorContext(ctx, "panic in handler", "panic", p, "stack", string(debug.Stack()))
		return status.Error(codes.Internal, "internal error")
	})
	unary := []grpc.UnaryServerInterceptor{
		recovery.UnaryServerInterceptor(rec),
		func(ctx context.Context, req any, info *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
			resp, err := h(ctx, req)
			return resp, mapStatus(ctx, log, info.FullMethod, err)
		},
		func(ctx context.Context, req any, info *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
			ctx, cancel := applyDeadline(ctx, cfg, log, info.FullMethod)
			defer cancel()
			return h(ctx, req)
		},
		func(ctx context.Context, req any, info *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
			return h(md.WithIdentity(ctx, md.FromIncoming(ctx)), req)
		},
		func(ctx context.Context, req any, info *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
			if min, ok := cfg.MinTime[info.FullMethod]; ok {
				if err := deadline.Check(ctx, min, info.FullMethod); err != nil {
					return nil, err
				}
			}
			return h(ctx, req)
		},
		ids.UnaryServerInterceptor(),
	}
	stream := []grpc.StreamServerInterceptor{
		recovery.StreamServerInterceptor(rec),
		func(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, h grpc.StreamHandler) error {
			return mapStatus(ss.Context(), log, info.FullMethod, h(srv, ss))
		},
		func(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, h grpc.StreamHandler) error {
			ctx, cancel := applyDeadline(ss.Context(), cfg, log, info.FullMethod)
			defer cancel()
			return h(srv, wrap(ctx, ss))
		},
		func(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, h grpc.StreamHandler) error {
			ctx := ss.Context()
			return h(srv, wrap(md.WithIdentity(ctx, md.FromIncoming(ctx)), ss))
		},
		func(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, h grpc.StreamHandler) error {
			if min, ok := cfg.MinTime[info.FullMethod]; ok {
				if err := deadline.Check(ss.Context(), min, info.FullMethod); err != nil {
					return err
				}
			}
			return h(srv, ss)
		},
		ids.StreamServerInterceptor(wrap),
	}
	return unary, stream
}

// applyDeadline gives the call the policy's default or capped deadline, then reconciles it
// with the caller's absolute curfew-deadline so that it is never later than the caller's.
func applyDeadline(ctx context.Context, cfg ServerConfig, log *slog.Logger, method string) (context.Context, context.CancelFunc) {
	ctx, cancel1, _ := cfg.Deadline.Apply(ctx, time.Now())
	abs, ok := md.IncomingDeadline(ctx)
	if !ok {
		return ctx, cancel1
	}
	ctx, cancel2, skew := deadline.Reconcile(ctx, abs, deadline.DefaultSkewTolerance)
	if skew > 0 {
		log.WarnContext(ctx, "curfew-deadline disagrees with grpc-timeout; clocks may be skewed, keeping grpc-timeout",
			"method", method, "skew_ms", skew.Milliseconds())
	}
	return ctx, func() { cancel2(); cancel1() }
}

func mapStatus(ctx context.Context, log *slog.Logger, method string, err error) error {
	out, internal := toStatus(err)
	if internal {
		log.ErrorContext(ctx, "internal error", "method", method, "error", err.Error())
	}
	return out
}

func wrap(ctx context.Context, ss grpc.ServerStream) grpc.ServerStream {
	w := middleware.WrapServerStream(ss)
	w.WrappedContext = ctx
	return w
}

// ClientConfig configures the client chain of one connection. The zero value is usable:
// retries by retry.Config's defaults.
type ClientConfig struct {
	// Retry is the retry policy of this connection (one target).
	Retry retry.Config
}

// DialOptions returns the grpc.DialOptions that install curfew's client chain on one
// connection. Transport credentials are the caller's to add.
//
// Client chain, outermost first:
//
//  1. stamp: identity and curfew-deadline go on the outgoing metadata, once per logical
//     call, the same on every attempt.
//  2. retry: one logical call, its attempts (same retry-id, curfew-attempt numbered),
//     backoff, pushback, budget. Outside everything that is per attempt (later: the
//     breaker), so an open breaker's fast failure is judged like any other attempt.
func DialOptions(cfg ClientConfig) []grpc.DialOption {
	return []grpc.DialOption{
		grpc.WithChainUnaryInterceptor(
			func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, inv grpc.UnaryInvoker, opts ...grpc.CallOption) error {
				return inv(md.AppendOutgoing(ctx), method, req, reply, cc, opts...)
			},
			retry.UnaryClientInterceptor(cfg.Retry),
		),
		grpc.WithChainStreamInterceptor(
			func(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, st grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
				return st(md.AppendOutgoing(ctx), desc, cc, method, opts...)
			},
			retry.StreamClientInterceptor(cfg.Retry),
		),
	}
}
