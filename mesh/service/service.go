package service

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net"
	"net/http"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/reflection"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	"github.com/curfew-mesh/curfew/mesh"
	"github.com/curfew-mesh/curfew/mesh/breaker"
	"github.com/curfew-mesh/curfew/mesh/deadline"
	"github.com/curfew-mesh/curfew/mesh/replicas"
	"github.com/curfew-mesh/curfew/mesh/retry"
	"github.com/curfew-mesh/curfew/mesh/retryid"
	"github.com/curfew-mesh/curfew/mesh/tracing"
)

// Defaults of the common flags.
const (
	DefaultShutdownGrace = 10 * time.Second
	DefaultLogLevel      = "info"
	// DefaultDrainDelay: none, so that a local `curfew up` stops at once. Kubernetes
	// manifests set --drain-delay to a few seconds (see docs/leases.md#drain).
	DefaultDrainDelay = time.Duration(0)
	// DefaultBreakerOff: the services' breakers (one per service dialled) are on. A
	// service's own dependencies' failures it relays carry breaker.Relay's marker (the
	// server chain adds it, see mesh.ServerInterceptors), so they do not open a breaker
	// for the whole service.
	DefaultBreakerOff = false
)

// Options are the flags every service has.
type Options struct {
	Name string
	// Addr is the gRPC listen address.
	Addr string
	// AdminAddr is the admin HTTP listen address (/healthz, /readyz, /metrics).
	AdminAddr string
	// HealthAddr, when set, is a second, plaintext gRPC listen address serving only
	// grpc.health.v1 (the same health as Addr), for probes that cannot do mTLS:
	// Kubernetes' native gRPC probes. Empty (the default): none.
	HealthAddr string
	// TLSDir is the directory of the mesh's mTLS files (package meshtls): ca.crt and
	// <Name>.crt/.key. With it the server requires mesh client certificates (the
	// orchestrator verifies one if given) and authorizes calls by the call graph
	// (meshtls.DefaultPolicy), and Runtime.Dial's connections present Name's
	// certificate. The files are reloaded when rotated.
	TLSDir string
	// Insecure runs plaintext without mTLS, for local debugging: it says so in a warning
	// at start. Exactly one of TLSDir and Insecure must be given: mTLS is the default.
	Insecure bool
	// DrainDelay is how long the server goes on serving after the stop begins, its health
	// already NOT_SERVING, before it stops accepting calls: time for Kubernetes endpoints
	// and clients' health checks to move traffic away (docs/leases.md#drain). 0: none.
	DrainDelay time.Duration
	// MaxConnectionAge, when positive, makes the server close each client connection
	// gracefully (GOAWAY) after about this long; calls in flight then get MaxDeadline to
	// finish. Clients dialling a headless Service with dns:/// then re-resolve it and
	// reach replicas an autoscaler added, which a long-lived connection never would.
	// 0 (the default): connections live as long as their clients keep them.
	MaxConnectionAge time.Duration
	// ShutdownGrace bounds the graceful stop that follows the drain delay: in-flight calls
	// still running at its end are cancelled, and the OnStop functions must be done by
	// then too (see Runtime.StopDeadline).
	ShutdownGrace time.Duration
	// DefaultDeadline is given to requests that arrive without one.
	DefaultDeadline time.Duration
	// MaxDeadline caps any requested deadline.
	MaxDeadline time.Duration
	// LogLevel is debug, info, warn or error.
	LogLevel string
	// Retry configures the retries of this service's outgoing calls.
	Retry RetryOptions
	// Breaker configures the circuit breakers of this service's outgoing calls.
	Breaker BreakerOptions
	// Chaos honours the per-request curfew-chaos header: the drill's fault switches
	// (package chaos, docs/drill.md). Off by default; never set it in production.
	Chaos bool
	// MaxRecvMsgSize bounds one request message, in bytes; a larger one is refused
	// with RESOURCE_EXHAUSTED before any handler runs. DefaultMaxRecvMsgSize when 0.
	MaxRecvMsgSize int
	// MaxHeaderListSize bounds a request's metadata (all headers), in bytes; a larger
	// header list is refused by the transport. DefaultMaxHeaderListSize when 0.
	MaxHeaderListSize int
	// Authenticate, set by the program and not by a flag, resolves the tenant of each
	// call (mesh.ServerConfig.Authenticate): the orchestrator sets an apikey.Guard's
	// Tenant, so that its public API acts only for verified tenants. nil honours the
	// curfew-tenant header, which the leaf services may: mTLS admits only mesh peers.
	Authenticate func(ctx context.Context, fullMethod, claimed string) (string, error)

	fs *flag.FlagSet // where the flags were registered, to tell which were set
}

// Defaults of the request limits.
const (
	DefaultMaxRecvMsgSize    = 4 << 20  // grpc-go's own default, made explicit
	DefaultMaxHeaderListSize = 64 << 10 // curfew's headers are a few hundred bytes
	minLimit                 = 1 << 10
)

// RetryOptions are the retry flags. A flag given explicitly overrides the file's default
// policy; the file can set per-target and per-method policies (see retry.File).
type RetryOptions struct {
	File        string
	Off         bool
	MaxAttempts int
	Base, Cap   time.Duration
	BudgetRatio float64
	BudgetRPS   float64
	Throttle    bool
}

// BreakerOptions are the circuit breaker flags: one breaker per downstream service name
// given to Runtime.Dial (package breaker). Set without flags (Register not called), a
// zero field means breaker.Config's default for it, and Off is false. Set by flags, whose
// defaults are breaker's (and DefaultBreakerOff), a zero is refused, except
// --breaker-jitter=0, which means no jitter.
type BreakerOptions struct {
	Off         bool
	Failures    uint
	Ratio       float64
	MinRequests uint
	Window      time.Duration
	OpenTimeout time.Duration
	Jitter      float64
}

// Register adds the common flags to fs with the given default listen addresses.
func (o *Options) Register(fs *flag.FlagSet, name, addr, admin string) {
	o.Name, o.fs = name, fs
	fs.StringVar(&o.Addr, "addr", addr, "gRPC listen address")
	fs.StringVar(&o.AdminAddr, "admin-addr", admin, "admin HTTP listen address (/healthz, /readyz, /metrics); empty disables it")
	fs.StringVar(&o.HealthAddr, "health-addr", "", "plaintext gRPC listen address serving only grpc.health.v1, for probes that cannot do mTLS (Kubernetes gRPC probes); empty (the default) disables it")
	fs.StringVar(&o.TLSDir, "tls-dir", "", "directory of the mesh's mTLS files: ca.crt and <service>.crt/.key (curfew up writes them under its data directory); calls are then mutually authenticated and authorized by the call graph, and rotated files are reloaded without a restart")
	fs.BoolVar(&o.Insecure, "insecure", false, "plaintext, no mTLS: every caller may call every method; only for local debugging (a warning says so at start). Exactly one of --tls-dir and --insecure is required")
	fs.DurationVar(&o.DrainDelay, "drain-delay", DefaultDrainDelay, "on SIGTERM, how long to keep serving with health NOT_SERVING before the listener closes; 0 stops at once (local curfew up); Kubernetes manifests set a few seconds so endpoints and clients move away first. A stop takes at most --drain-delay + --shutdown-grace + 2s (docs/leases.md#drain)")
	fs.DurationVar(&o.MaxConnectionAge, "max-connection-age", 0, "close each client connection gracefully after about this long (0: never), so that clients of a headless Service re-resolve it and reach new replicas; in-flight calls get --max-deadline to finish")
	fs.DurationVar(&o.ShutdownGrace, "shutdown-grace", DefaultShutdownGrace, "bound on the graceful stop after --drain-delay: in-flight calls still running then are cancelled")
	fs.DurationVar(&o.DefaultDeadline, "default-deadline", deadline.DefaultTimeout, "deadline given to requests without one")
	fs.DurationVar(&o.MaxDeadline, "max-deadline", deadline.DefaultMax, "cap on any requested deadline")
	fs.StringVar(&o.LogLevel, "log-level", DefaultLogLevel, "log level: debug, info, warn or error")
	fs.IntVar(&o.MaxRecvMsgSize, "max-recv-msg-size", DefaultMaxRecvMsgSize, "largest request message accepted, in bytes; larger ones are refused with RESOURCE_EXHAUSTED")
	fs.IntVar(&o.MaxHeaderListSize, "max-header-list-size", DefaultMaxHeaderListSize, "largest request metadata (all headers) accepted, in bytes")
	fs.BoolVar(&o.Chaos, "chaos", false, "chaos settings for drills: honour the per-request curfew-chaos header's fault switches (docs/drill.md); off by default, never in production")
	r := &o.Retry
	fs.StringVar(&r.File, "retry-config", "", "JSON file of retry policies per target and method (see the README)")
	fs.BoolVar(&r.Off, "retry-off", false, "make no retries at all")
	fs.IntVar(&r.MaxAttempts, "retry-max-attempts", retry.DefaultMaxAttempts, "most attempts per call, the first included (1 to 5)")
	fs.DurationVar(&r.Base, "retry-base", retry.DefaultBase, "backoff base (full jitter)")
	fs.DurationVar(&r.Cap, "retry-cap", retry.DefaultCap, "backoff cap")
	fs.Float64Var(&r.BudgetRatio, "retry-budget-ratio", retry.DefaultBudgetRatio, "retries may add at most this share of calls per target")
	fs.Float64Var(&r.BudgetRPS, "retry-budget-per-second", retry.DefaultBudgetPerSecond, "retries allowed per second beyond the ratio")
	fs.BoolVar(&r.Throttle, "retry-throttle", false, "client-side adaptive throttling (SRE book)")
	b := &o.Breaker
	fs.BoolVar(&b.Off, "breaker-off", DefaultBreakerOff, "no circuit breakers on calls to other services (see docs/breakers.md)")
	fs.UintVar(&b.Failures, "breaker-failures", breaker.DefaultConsecutiveFailures, "a target's breaker opens after this many consecutive failures")
	fs.Float64Var(&b.Ratio, "breaker-ratio", breaker.DefaultFailureRatio, "a target's breaker also opens when at least this share (0 to 1] of its calls in the window failed")
	fs.UintVar(&b.MinRequests, "breaker-min-requests", breaker.DefaultMinRequests, "fewest judged calls in the window before --breaker-ratio applies")
	fs.DurationVar(&b.Window, "breaker-window", breaker.DefaultWindow, "rolling window over which a breaker counts outcomes")
	fs.DurationVar(&b.OpenTimeout, "breaker-open-timeout", breaker.DefaultOpenTimeout, "how long an open breaker refuses calls before one probe goes through")
	fs.Float64Var(&b.Jitter, "breaker-jitter", breaker.DefaultJitter, "each open period is --breaker-open-timeout ± this fraction, in [0, 1); 0 for none")
}

// breakerFlags names the flag of each breaker.Config field.
var breakerFlags = map[string]string{
	"ConsecutiveFailures": "--breaker-failures", "FailureRatio": "--breaker-ratio", "MinRequests": "--breaker-min-requests",
	"Window": "--breaker-window", "OpenTimeout": "--breaker-open-timeout", "Jitter": "--breaker-jitter",
}

// config returns the breaker.Config of the options; fromFlags says whether they were
// registered as flags (see BreakerOptions).
func (b BreakerOptions) config(fromFlags bool) (breaker.Config, error) {
	if fromFlags {
		switch {
		case b.Failures == 0:
			return breaker.Config{}, errors.New("--breaker-failures must be at least 1")
		case b.MinRequests == 0:
			return breaker.Config{}, errors.New("--breaker-min-requests must be at least 1")
		case b.Ratio == 0:
			return breaker.Config{}, errors.New("--breaker-ratio must be in (0, 1], got 0")
		case b.Window == 0:
			return breaker.Config{}, fmt.Errorf("--breaker-window must be at least %v, got 0s", breaker.MinWindow)
		case b.OpenTimeout == 0:
			return breaker.Config{}, fmt.Errorf("--breaker-open-timeout must be at least %v, got 0s", breaker.MinOpenTimeout)
		case b.Jitter < 0:
			return breaker.Config{}, fmt.Errorf("--breaker-jitter must be in [0, 1), got %v", b.Jitter)
		}
	}
	if b.Failures > math.MaxUint32 || b.MinRequests > math.MaxUint32 {
		return breaker.Config{}, fmt.Errorf("--breaker-failures and --breaker-min-requests must be at most %d", uint32(math.MaxUint32))
	}
	jitter := b.Jitter
	if fromFlags && jitter == 0 {
		jitter = -1 // none
	}
	cfg := breaker.Config{Off: b.Off, ConsecutiveFailures: uint32(b.Failures), FailureRatio: b.Ratio, MinRequests: uint32(b.MinRequests),
		Window: b.Window, OpenTimeout: b.OpenTimeout, Jitter: jitter}
	if err := cfg.Validate(); err != nil {
		var ce *breaker.ConfigError
		if errors.As(err, &ce) {
			v := ce.Value
			if ce.Field == "Jitter" {
				v = b.Jitter
			}
			return breaker.Config{}, fmt.Errorf("%s %v: %s", breakerFlags[ce.Field], v, ce.Reason)
		}
		return breaker.Config{}, err
	}
	return cfg, nil
}

// load builds the retry file from RetryOptions: the file if given, then explicit flags.
func (r *RetryOptions) load(fs map[string]bool) (*retry.File, error) {
	f := &retry.File{}
	if r.File != "" {
		var err error
		if f, err = retry.LoadFile(r.File); err != nil {
			return nil, fmt.Errorf("--retry-config: %w", err)
		}
	}
	set := func(name string) bool { return fs[name] || r.File == "" }
	if r.Off {
		t := true
		f.Default.Disabled = &t
		f.Targets = nil
	}
	if set("retry-max-attempts") {
		f.Default.MaxAttempts = &r.MaxAttempts
	}
	if set("retry-base") {
		d := retry.Duration(r.Base)
		f.Default.Base = &d
	}
	if set("retry-cap") {
		d := retry.Duration(r.Cap)
		f.Default.Cap = &d
	}
	if set("retry-budget-ratio") {
		f.Budget.Ratio = &r.BudgetRatio
	}
	if set("retry-budget-per-second") {
		f.Budget.PerSecond = &r.BudgetRPS
	}
	if fs["retry-throttle"] || (r.File == "" && r.Throttle) {
		f.Throttle = r.Throttle
	}
	if err := f.Validate(); err != nil {
		return nil, fmt.Errorf("retry flags: %w", err)
	}
	return f, nil
}

// Validate checks the common options.
func (o *Options) Validate() error {
	if o.Addr == "" {
		return errors.New("--addr must not be empty")
	}
	if err := o.validateTLS(); err != nil {
		return err
	}
	if o.ShutdownGrace <= 0 {
		return fmt.Errorf("--shutdown-grace must be positive, got %v", o.ShutdownGrace)
	}
	if o.DrainDelay < 0 {
		return fmt.Errorf("--drain-delay must not be negative, got %v", o.DrainDelay)
	}
	if o.MaxConnectionAge < 0 || (o.MaxConnectionAge > 0 && o.MaxConnectionAge < time.Second) {
		return fmt.Errorf("--max-connection-age must be 0 (off) or at least 1s, got %v", o.MaxConnectionAge)
	}
	if o.DefaultDeadline <= 0 || o.MaxDeadline <= 0 {
		return errors.New("--default-deadline and --max-deadline must be positive")
	}
	if o.DefaultDeadline > o.MaxDeadline {
		return fmt.Errorf("--default-deadline %v exceeds --max-deadline %v", o.DefaultDeadline, o.MaxDeadline)
	}
	if _, err := parseLevel(o.LogLevel); err != nil {
		return err
	}
	if o.MaxRecvMsgSize == 0 {
		o.MaxRecvMsgSize = DefaultMaxRecvMsgSize
	}
	if o.MaxHeaderListSize == 0 {
		o.MaxHeaderListSize = DefaultMaxHeaderListSize
	}
	if o.MaxRecvMsgSize < minLimit || o.MaxHeaderListSize < minLimit || o.MaxHeaderListSize > 1<<30 {
		return fmt.Errorf("--max-recv-msg-size and --max-header-list-size must be at least %d bytes (and the header list at most 1 GiB)", minLimit)
	}
	if _, err := o.Breaker.config(o.fs != nil); err != nil {
		return err
	}
	return o.requireTransport()
}

// Parse parses args into fs, then fills every flag not given on the command line from its
// CURFEW_* environment variable.
func Parse(fs *flag.FlagSet, args []string, getenv func(string) string) error {
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected arguments: %s", strings.Join(fs.Args(), " "))
	}
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })

	var errs []error
	fs.VisitAll(func(f *flag.Flag) {
		if set[f.Name] {
			return
		}
		env := EnvName(f.Name)
		if v := getenv(env); v != "" {
			if err := fs.Set(f.Name, v); err != nil {
				errs = append(errs, fmt.Errorf("%s=%q: invalid value for --%s: %w", env, v, f.Name, err))
			}
		}
	})
	return errors.Join(errs...)
}

// EnvName returns the environment variable of a flag: --foo-bar → CURFEW_FOO_BAR.
func EnvName(flagName string) string {
	return "CURFEW_" + strings.ToUpper(strings.ReplaceAll(flagName, "-", "_"))
}

func parseLevel(s string) (slog.Level, error) {
	var l slog.Level
	if err := l.UnmarshalText([]byte(s)); err != nil {
		return 0, fmt.Errorf("--log-level: %q is not one of debug, info, warn, error", s)
	}
	return l, nil
}

// Runtime is a service's running gRPC server and admin port.
type Runtime struct {
	Opts     Options
	Log      *slog.Logger
	Server   *grpc.Server
	Health   *health.Server
	Registry *prometheus.Registry
	lis      net.Listener
	admin    net.Listener

	retries      *retry.File
	retryMetrics *retry.Metrics
	metrics      *metrics

	// Breakers are the circuit breakers of this service's outgoing calls, one per service
	// name given to Dial, with their metrics on Registry. Code that calls other targets
	// (modelproxy's providers) may take breakers from it under names of its own.
	Breakers *breaker.Set

	tracing *tracing.Provider // see tracing.go
	tls     *tlsState         // see tls.go; nil when plaintext

	healthLis net.Listener // --health-addr, or nil
	healthSrv *grpc.Server
	onDrain   []func()
	onStop    []func()

	stopMu sync.Mutex
	stopBy time.Time // see StopDeadline
}

// New builds the runtime: it listens on both addresses (so start-up errors surface here),
// creates the gRPC server with the mesh chain, and registers health and reflection.
// minTime is the per-method fast-fail minimum of mesh.ServerConfig.
func New(ctx context.Context, o Options, minTime map[string]time.Duration) (*Runtime, error) {
	if err := o.Validate(); err != nil {
		return nil, err
	}
	explicit := map[string]bool{}
	if o.fs != nil {
		o.fs.Visit(func(f *flag.Flag) { explicit[f.Name] = true })
	}
	retries, err := o.Retry.load(explicit)
	if err != nil {
		return nil, err
	}
	lvl, _ := parseLevel(o.LogLevel)
	log := slog.New(slog.NewJSONHandler(os.Stderr, &slog.HandlerOptions{Level: lvl})).With("service", o.Name)
	var lc net.ListenConfig
	lis, err := lc.Listen(ctx, "tcp", o.Addr)
	if err != nil {
		return nil, fmt.Errorf("listen on --addr %s: %w", o.Addr, err)
	}
	rt := &Runtime{Opts: o, Log: log, lis: lis, Registry: prometheus.NewRegistry(), retries: retries}
	if o.AdminAddr != "" {
		if rt.admin, err = lc.Listen(ctx, "tcp", o.AdminAddr); err != nil {
			_ = lis.Close()
			return nil, fmt.Errorf("listen on --admin-addr %s: %w", o.AdminAddr, err)
		}
	}
	rt.Registry.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	rt.retryMetrics = retry.NewMetrics(rt.Registry)
	rt.metrics = newMetrics(rt.Registry)
	bcfg, _ := o.Breaker.config(o.fs != nil) // checked by Validate
	rt.Breakers = breaker.NewSet(bcfg, rt.Registry)
	closeListeners := func() {
		_ = lis.Close()
		if rt.admin != nil {
			_ = rt.admin.Close()
		}
		if rt.healthLis != nil {
			_ = rt.healthLis.Close()
		}
	}
	if err := rt.listenHealth(ctx); err != nil {
		closeListeners()
		return nil, err
	}
	if rt.tls, err = newTLS(o, log, rt.Registry); err != nil {
		closeListeners()
		return nil, err
	}
	if err := rt.startTracing(ctx); err != nil {
		closeListeners()
		return nil, err
	}
	//nolint:contextcheck // the interceptors take each call's own context; none is needed here
	rt.Server = grpc.NewServer(append(mesh.ServerOptions(mesh.ServerConfig{
		Deadline: deadline.Policy{Default: o.DefaultDeadline, Max: o.MaxDeadline},
		MinTime:  minTime,
		Logger:   log,
		RetryIDs: retryid.New(0, rt.Registry),
		Metrics:  rt.metrics.server,
		Chaos:    o.Chaos,
		// After the metrics, before the deadline and retry-id layers (mesh's doc).
		Authorize:    rt.tls.authorize(),
		Authenticate: o.Authenticate,
	}), rt.tls.serverCreds(o.Name), rt.serverTracing(), grpc.MaxRecvMsgSize(o.MaxRecvMsgSize),
		grpc.MaxHeaderListSize(uint32(o.MaxHeaderListSize)), //nolint:gosec // bounded by Validate
		connectionAge(o.MaxConnectionAge, o.MaxDeadline))...)
	rt.Health = health.NewServer()
	healthpb.RegisterHealthServer(rt.Server, rt.Health)
	reflection.Register(rt.Server)
	if rt.healthLis != nil {
		rt.healthSrv = grpc.NewServer()
		healthpb.RegisterHealthServer(rt.healthSrv, rt.Health)
	}
	return rt, nil
}

// Addr returns the bound gRPC address.
func (rt *Runtime) Addr() string { return rt.lis.Addr().String() }

// AdminAddr returns the bound admin address, or "".
func (rt *Runtime) AdminAddr() string {
	if rt.admin == nil {
		return ""
	}
	return rt.admin.Addr().String()
}

// Dial returns a client connection to target with the mesh client chain and default
// retries, over creds (Runtime.Credentials; nil: plaintext). Connections are lazy, so
// services that call each other can start in any order.
func Dial(target string, creds credentials.TransportCredentials) (*grpc.ClientConn, error) {
	if creds == nil {
		creds = insecure.NewCredentials()
	}
	opts := append(mesh.DialOptions(mesh.ClientConfig{}), grpc.WithTransportCredentials(creds))
	return grpc.NewClient(target, opts...)
}

// Dial returns a client connection to the service name at target with the mesh client
// chain, this service's retry policy for that target, and the breaker of name from
// rt.Breakers (metrics on the admin port). Connections dialled with one name share its
// breaker. With --tls-dir the connection is mTLS (Credentials(name)): name must then be
// the server's mesh identity.
func (rt *Runtime) Dial(name, target string) (*grpc.ClientConn, error) {
	rc := rt.retries.For(name)
	rc.Metrics, rc.Logger = rt.retryMetrics, rt.Log
	opts := append(mesh.DialOptions(mesh.ClientConfig{Retry: rc, Breakers: rt.Breakers, Metrics: rt.metrics.client}), grpc.WithTransportCredentials(rt.Credentials(name)),
		rt.clientTracing())
	return grpc.NewClient(target, opts...)
}

// NodeReports returns the node report client of the service name at target that asks
// every replica (package replicas): with a dns:/// target (a headless Service), each
// address the name resolves to; otherwise the target alone. A run's nodes are in the
// tables of the replicas that ran them, so cancel broadcasts, summaries and teardown
// waits must reach them all, where the connection Dial makes reaches one per call. Its
// connections have the mesh client chain, name's retry policy, metrics and tracing, but
// not name's breaker: one replica's failures must not open the breaker of the calls that
// any replica can serve. Close the returned closer when done.
func (rt *Runtime) NodeReports(name, target string) (meshv1.NodeReportServiceClient, io.Closer, error) {
	rc := rt.retries.For(name)
	rc.Metrics, rc.Logger = rt.retryMetrics, rt.Log
	dial := func(addr string) (*grpc.ClientConn, error) {
		opts := append(mesh.DialOptions(mesh.ClientConfig{Retry: rc, Metrics: rt.metrics.client}), grpc.WithTransportCredentials(rt.Credentials(name)),
			rt.clientTracing())
		return grpc.NewClient(addr, opts...)
	}
	set, err := replicas.New(target, dial, replicas.WithLogger(rt.Log))
	if err != nil {
		return nil, nil, err
	}
	return replicas.NodeReports(set), set, nil
}

// StopFlush bounds the last phase of a stop (see Serve): closing the admin port and
// exporting the spans left.
const StopFlush = 2 * time.Second

// StopBound is the longest a stop takes from ctx's end to Serve's return:
// DrainDelay + ShutdownGrace + StopFlush. Kubernetes' terminationGracePeriodSeconds must
// exceed it (docs/leases.md#drain).
func (o Options) StopBound() time.Duration { return o.DrainDelay + o.ShutdownGrace + StopFlush }

// OnDrain registers fn to run when the stop begins (see Serve), right after health has
// turned NOT_SERVING, while the server still serves: a service stops admitting
// long-lived work there. The functions run in registration order and must not block.
func (rt *Runtime) OnDrain(fn func()) { rt.onDrain = append(rt.onDrain, fn) }

// StopDeadline is when the graceful stop ends (DrainDelay + ShutdownGrace after the stop
// began): calls still in flight are cancelled then, and the OnStop functions must have
// returned by it. It is the zero time until the stop begins; the OnDrain and OnStop
// functions see it set.
func (rt *Runtime) StopDeadline() time.Time {
	rt.stopMu.Lock()
	defer rt.stopMu.Unlock()
	return rt.stopBy
}

// Serve serves until ctx is done, then stops in three phases, within Options.StopBound
// (DrainDelay + ShutdownGrace + StopFlush) of ctx's end:
//
//  1. Drain, for DrainDelay: health turns NOT_SERVING at once (gRPC health and /readyz),
//     the OnDrain functions run, and the server goes on accepting and serving calls, so
//     that Kubernetes endpoints and clients move away before the listener closes.
//     Skipped when DrainDelay is 0 or the server failed.
//  2. Graceful stop, until StopDeadline (ShutdownGrace after the drain): the listener
//     closes, new calls are refused, and in-flight calls may finish; those still running
//     at the deadline are cancelled. Then the OnStop functions run, done by the deadline.
//  3. Flush, at most StopFlush: the admin port closes and the spans left are exported.
//
// It returns nil after a clean stop, else the error that made the server fail.
func (rt *Runtime) Serve(ctx context.Context) error {
	rt.Health.SetServingStatus("", healthpb.HealthCheckResponse_SERVING)
	errc := make(chan error, 3) // the gRPC, admin and health servers
	go func() { errc <- rt.Server.Serve(rt.lis) }()
	if rt.healthSrv != nil {
		go func() { errc <- rt.healthSrv.Serve(rt.healthLis) }()
	}
	var hs *http.Server
	if rt.admin != nil {
		mux := http.NewServeMux()
		mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write([]byte("ok\n")) })
		mux.HandleFunc("/readyz", func(w http.ResponseWriter, r *http.Request) {
			resp, err := rt.Health.Check(r.Context(), &healthpb.HealthCheckRequest{})
			if err != nil || resp.GetStatus() != healthpb.HealthCheckResponse_SERVING {
				http.Error(w, "not serving", http.StatusServiceUnavailable)
				return
			}
			_, _ = w.Write([]byte("ok\n"))
		})
		mux.Handle("/metrics", promhttp.HandlerFor(rt.Registry, promhttp.HandlerOpts{}))
		hs = &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second}
		go func() {
			if err := hs.Serve(rt.admin); err != nil && !errors.Is(err, http.ErrServerClosed) {
				errc <- err
			}
		}()
	}
	rt.Log.Info("serving", "addr", rt.Addr(), "admin_addr", rt.AdminAddr(), "health_addr", rt.HealthAddr(), "tls", rt.tls != nil, "version", BuildVersion())
	var serveErr error
	select {
	case <-ctx.Done():
	case serveErr = <-errc:
	}

	// 1. Drain.
	begin := time.Now()
	by := begin.Add(rt.Opts.DrainDelay + rt.Opts.ShutdownGrace)
	rt.stopMu.Lock()
	rt.stopBy = by
	rt.stopMu.Unlock()
	rt.Health.Shutdown()
	rt.Log.Info("stopping: health is NOT_SERVING; draining", "drain_delay", rt.Opts.DrainDelay.String(),
		"shutdown_grace", rt.Opts.ShutdownGrace.String(), "bound", rt.Opts.StopBound().String())
	for _, fn := range rt.onDrain {
		fn()
	}
	if serveErr == nil && rt.Opts.DrainDelay > 0 {
		t := time.NewTimer(time.Until(begin.Add(rt.Opts.DrainDelay)))
		select {
		case <-t.C:
		case serveErr = <-errc:
		}
		t.Stop()
	}

	// 2. Graceful stop, then the OnStop functions.
	done := make(chan struct{})
	go func() { rt.Server.GracefulStop(); close(done) }()
	t := time.NewTimer(time.Until(by))
	select {
	case <-done:
	case <-t.C:
		rt.Log.Warn("shutdown grace passed; cancelling in-flight calls", "grace", rt.Opts.ShutdownGrace.String())
		rt.Server.Stop()
		<-done
	}
	t.Stop()
	if rt.healthSrv != nil {
		rt.healthSrv.Stop() // health checks are short; NOT_SERVING since the drain began
	}
	rt.stopped()

	// 3. Flush.
	fctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), StopFlush)
	defer cancel()
	if hs != nil {
		hctx, stop := context.WithTimeout(fctx, StopFlush/2)
		if err := hs.Shutdown(hctx); err != nil {
			_ = hs.Close()
		}
		stop()
	}
	rt.flushTraces(fctx)
	rt.Log.Info("stopped", "took", time.Since(begin).Round(time.Millisecond).String())
	return serveErr
}

// Every calls fn with the current time every period until ctx is done.
func Every(ctx context.Context, period time.Duration, fn func(time.Time)) {
	t := time.NewTicker(period)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case now := <-t.C:
			fn(now)
		}
	}
}

// connectionAge is the server option of Options.MaxConnectionAge: grpc-go adds ±10 %
// jitter to the age, so that a fleet's connections do not all cycle at once.
func connectionAge(age, maxDeadline time.Duration) grpc.ServerOption {
	if age <= 0 {
		return grpc.EmptyServerOption{}
	}
	return grpc.KeepaliveParams(keepalive.ServerParameters{MaxConnectionAge: age, MaxConnectionAgeGrace: maxDeadline})
}
