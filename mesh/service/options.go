package service

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"time"

	"github.com/curfew-mesh/curfew/mesh/breaker"
	"github.com/curfew-mesh/curfew/mesh/deadline"
	"github.com/curfew-mesh/curfew/mesh/nodes"
	"github.com/curfew-mesh/curfew/mesh/retry"
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
	DefaultBreakerOff = breaker.DefaultOff
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
	Retry retry.Flags
	// Breaker configures the circuit breakers of this service's outgoing calls.
	Breaker breaker.Flags
	// Chaos honours the per-request curfew-chaos header: the drill's fault switches
	// (package chaos, docs/drill.md). Off by default; never set it in production.
	Chaos bool
	// Retention is how long a run's node records stay in this process's memory after its
	// last node ended (ListNodes, the run's summary; in modelproxy, its ledger's token
	// instants too); nodes.DefaultRetention (15 minutes) when 0. Swept every SweepEvery.
	Retention time.Duration
	// Pprof serves Go's runtime profiles under /debug/pprof/ on the admin address: CPU,
	// allocations, heap (?gc=1 collects first), goroutines. Off by default: a profile
	// costs CPU while it is taken and shows the program's internals to whoever reaches
	// the admin port.
	Pprof bool
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
	fs.DurationVar(&o.Retention, "retention", nodes.DefaultRetention, "how long a run's node records stay in memory after its last node ended (ListNodes, summaries; in modelproxy, the in-memory ledger's token instants): the memory a steady load holds is its throughput times this")
	fs.BoolVar(&o.Pprof, "pprof", false, "serve Go's runtime profiles under /debug/pprof/ on --admin-addr (CPU, allocations, heap with ?gc=1 collecting first, goroutines), for the soak's profiles (docs/soak.md); off by default")
	o.Retry.Register(fs)
	o.Breaker.Register(fs)
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
	if _, err := o.Breaker.Config(o.fs != nil); err != nil {
		return err
	}
	return o.requireTransport()
}

// SweepEvery is how often a service forgets the node records older than its Retention: a
// minute, or half the retention when that is shorter (at least a second).
func (o Options) SweepEvery() time.Duration {
	r := o.Retention
	if r <= 0 {
		r = nodes.DefaultRetention
	}
	return max(min(time.Minute, r/2), time.Second)
}
