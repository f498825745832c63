package mesh

import (
	"context"
	"log/slog"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/stats"

	"github.com/curfew-mesh/curfew/mesh/deadline"
	"github.com/curfew-mesh/curfew/mesh/retryid"
)

// ServerConfig configures the server chain. The zero value is usable: plaintext, no
// tracing, grpc-go's message and header limits, deadline defaults from package deadline,
// no per-method minimum, slog.Default for logs.
type ServerConfig struct {
	// Credentials are the server's transport credentials (mTLS: meshtls.ServerCredentials);
	// nil serves plaintext.
	Credentials credentials.TransportCredentials
	// MaxHeaderListSize, when positive, bounds a request's metadata in bytes; a larger
	// header list is refused by the transport. 0 keeps grpc-go's default.
	MaxHeaderListSize uint32
	// MaxRecvMsgSize, when positive, bounds one request message in bytes; a larger one is
	// refused with RESOURCE_EXHAUSTED. 0 keeps grpc-go's default (4 MiB).
	MaxRecvMsgSize int
	// Tracing, when set, is the stats handler that traces every call
	// (tracing.ServerHandler); nil installs none.
	Tracing stats.Handler
	// Deadline normalizes incoming deadlines.
	Deadline deadline.Policy
	// MinTime maps a full method name ("/curfew.toolrunner.v1.ToolRunnerService/Execute")
	// to the least time left it needs to start; less is refused with DEADLINE_EXCEEDED.
	MinTime map[string]time.Duration
	// Logger receives the call log, internal errors and recovered panics.
	Logger *slog.Logger
	// RetryIDs is the in-flight table of attempts by retry-id; nil means a table with the
	// default grace and unregistered metrics.
	RetryIDs *retryid.Table
	// Metrics, when set, records the standard gRPC server metrics (outside the other
	// interceptors, so it sees every call and the final status code) and the deadline
	// slack on arrival (in the deadline layer); nil records none.
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

// serverChain is the server chain, outermost first: everything a call to a curfew
// server passes through, in the order it does. The package doc lists the same layers in
// the same order, and a test holds the two together. A layer whose setting is off (no
// Credentials, no Metrics, ...) is left out.
var serverChain = []serverLayer{
	{"credentials", "the TLS handshake, once per connection, authenticates the peer before any call exists", (*serverLayers).credentials},
	{"header-limit", "the transport refuses an oversized header list before the call begins", (*serverLayers).headerLimit},
	{"tracing", "the span opens when the call's headers arrive, before every interceptor, and closes after them", (*serverLayers).tracing},
	{"message-limit", "a unary request is read, and refused when too large, before the interceptors run", (*serverLayers).messageLimit},
	{"metrics", "outermost interceptor, so it counts every call with the code the caller receives", (*serverLayers).metrics},
	{"call-log", "outside recovery and status, so its line carries the code and message the caller receives", (*serverLayers).callLog},
	{"recovery", "outside everything that runs the handler's code, so a panic becomes INTERNAL, not a dead process", (*serverLayers).recovery},
	{"status", "outside the layers that refuse calls, whose statuses pass through, and around the handler, whose errors it maps", (*serverLayers).status},
	{"authorize", "first refusal: a caller the call graph forbids takes no deadline, identity or retry-id", (*serverLayers).authorize},
	{"contract", "before any layer reads a curfew-* header, so a malformed one is refused by name and nothing starts", (*serverLayers).contract},
	{"deadline", "before anything that measures time left, so they all see the final deadline", (*serverLayers).deadline},
	{"identity", "after the deadline, so a tenant lookup is bounded by it; the headers become the call's md.Identity", (*serverLayers).identity},
	{"chaos", "right after identity, so no later layer or outgoing call acts on a curfew-chaos header this server does not honour", (*serverLayers).chaos},
	{"authenticate", "after identity, whose claimed tenant it checks; before fast-fail and retry-id, which see only verified tenants", (*serverLayers).authenticate},
	{"fast-fail", "after the deadline, so it sees the final one; before retry-id, so a doomed attempt supersedes nothing", (*serverLayers).fastFail},
	{"retry-id", "innermost, so the handler's context is the one a newer attempt's supersede cancels", (*serverLayers).retryID},
}

// A serverLayer is one named stage of the server chain and why it sits where it does.
// build returns what it installs under a config, the zero stage when it is off.
type serverLayer struct {
	name  string
	why   string
	build func(*serverLayers) stage
}

// A stage is what one layer installs: server options that grpc-go applies before any
// interceptor (credentials, limits, the tracing stats handler), a unary and a stream
// interceptor, or a derive step.
type stage struct {
	name    string
	options []grpc.ServerOption
	unary   grpc.UnaryServerInterceptor
	stream  grpc.StreamServerInterceptor
	// derive is a layer that only derives the call's context or refuses the call. compile
	// runs adjacent derive stages in one interceptor (see derived).
	derive derive
}

// A derive step returns the call's context for the next layer, and a cleanup to run when
// the call ends (nil for none), or refuses the call with a status error.
type derive func(ctx context.Context, method string) (context.Context, func(), error)

// ServerOptions returns everything a call to a curfew server passes through, as
// grpc.ServerOptions: transport credentials, limits and tracing as configured, then the
// interceptor chain. The order is serverChain's (see the package doc).
func ServerOptions(cfg ServerConfig) []grpc.ServerOption {
	return compile(serverStages(cfg))
}

// ServerInterceptors returns the interceptors of the server chain in order, for a server
// that installs its own transport options: ServerOptions without credentials, limits and
// tracing.
func ServerInterceptors(cfg ServerConfig) ([]grpc.UnaryServerInterceptor, []grpc.StreamServerInterceptor) {
	_, us, ss := interceptors(serverStages(cfg))
	return us, ss
}

// serverStages builds the layers of serverChain that cfg turns on, in order.
func serverStages(cfg ServerConfig) []stage {
	l := newServerLayers(cfg)
	var out []stage
	for _, sl := range serverChain {
		s := sl.build(l)
		if s.options == nil && s.unary == nil && s.derive == nil {
			continue
		}
		s.name = sl.name
		out = append(out, s)
	}
	return out
}

// compile turns stages into server options: their own options, then their interceptors
// chained in order by grpc-go.
func compile(stages []stage) []grpc.ServerOption {
	opts, us, ss := interceptors(stages)
	return append(opts, grpc.ChainUnaryInterceptor(us...), grpc.ChainStreamInterceptor(ss...))
}

// interceptors returns the options of stages and their interceptors in order, each run of
// adjacent derive stages as one interceptor.
func interceptors(stages []stage) ([]grpc.ServerOption, []grpc.UnaryServerInterceptor, []grpc.StreamServerInterceptor) {
	var opts []grpc.ServerOption
	var us []grpc.UnaryServerInterceptor
	var ss []grpc.StreamServerInterceptor
	var run []derive
	flush := func() {
		if len(run) > 0 {
			u, s := derived(run)
			us, ss, run = append(us, u), append(ss, s), nil
		}
	}
	for _, s := range stages {
		opts = append(opts, s.options...)
		switch {
		case s.derive != nil:
			run = append(run, s.derive)
		case s.unary != nil:
			flush()
			us, ss = append(us, s.unary), append(ss, s.stream)
		}
	}
	flush()
	return opts, us, ss
}

// derived runs steps in order, each on the context the one before returned, as one
// unary and one stream interceptor. It behaves as the steps chained one interceptor
// each would (a refusal ends the call before the later steps; cleanups run in reverse
// order when the call ends) with one stack frame and no per-call handler closures for the
// whole run instead of two frames and a closure per step: every frame of the chain stays
// on a handler's stack for the call's whole life, and a streaming handler that sleeps
// (toolrunner's tools) keeps its stack resident that long.
func derived(steps []derive) (grpc.UnaryServerInterceptor, grpc.StreamServerInterceptor) {
	unary := func(ctx context.Context, req any, info *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
		var buf [2]func()
		ctx, cleanups, err := deriveAll(ctx, info.FullMethod, steps, buf[:0])
		if err != nil {
			return nil, err
		}
		defer runCleanups(cleanups)
		return h(ctx, req)
	}
	stream := func(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, h grpc.StreamHandler) error {
		var buf [2]func()
		in := ss.Context()
		ctx, cleanups, err := deriveAll(in, info.FullMethod, steps, buf[:0])
		if err != nil {
			return err
		}
		defer runCleanups(cleanups)
		if ctx == in {
			return h(srv, ss)
		}
		return h(srv, withContext(ctx, ss))
	}
	return unary, stream
}

// deriveAll runs steps on ctx in order and returns the last context and the cleanups
// appended to cleanups. When a step refuses the call it runs the cleanups so far and
// returns the step's error.
func deriveAll(ctx context.Context, method string, steps []derive, cleanups []func()) (context.Context, []func(), error) {
	for _, d := range steps {
		next, cleanup, err := d(ctx, method)
		if err != nil {
			runCleanups(cleanups)
			return nil, nil, err
		}
		if cleanup != nil {
			cleanups = append(cleanups, cleanup)
		}
		ctx = next
	}
	return ctx, cleanups, nil
}

// runCleanups runs cleanups last first, as deferred calls would.
func runCleanups(cleanups []func()) {
	for i := len(cleanups) - 1; i >= 0; i-- {
		cleanups[i]()
	}
}
