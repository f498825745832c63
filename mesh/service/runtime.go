package service

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"os"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"google.golang.org/grpc"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/reflection"

	"github.com/curfew-mesh/curfew/mesh"
	"github.com/curfew-mesh/curfew/mesh/breaker"
	"github.com/curfew-mesh/curfew/mesh/configwatch"
	"github.com/curfew-mesh/curfew/mesh/deadline"
	"github.com/curfew-mesh/curfew/mesh/retry"
	"github.com/curfew-mesh/curfew/mesh/retryid"
	"github.com/curfew-mesh/curfew/mesh/retrywindow"
	"github.com/curfew-mesh/curfew/mesh/tracing"
)

// Runtime is a service's running gRPC server and admin port.
type Runtime struct {
	Opts     Options
	Log      *slog.Logger
	Server   *grpc.Server
	Health   *health.Server
	Registry *prometheus.Registry
	lis      net.Listener
	admin    net.Listener

	retries      *retry.Live
	retryMetrics *retry.Metrics
	windows      *retrywindow.Holder // CoordinateRetries; nil: retries are per replica
	configs      configs             // see config.go
	retryIDs     *retryid.Table      // the server's, whose methods Serve exports at 0
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

// New builds the runtime: it listens on every address (so start-up errors surface here),
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
	retries, err := o.Retry.Load(explicit)
	if err != nil {
		return nil, err
	}
	lvl, _ := parseLevel(o.LogLevel)
	log := slog.New(slog.NewJSONHandler(os.Stderr, &slog.HandlerOptions{Level: lvl})).With("service", o.Name)
	rt := &Runtime{Opts: o, Log: log, Registry: prometheus.NewRegistry(), retries: retry.NewLive(retries)}
	rt.configs.kick = make(chan struct{}, 1)
	rt.configs.metrics = configwatch.NewMetrics(o.Name, rt.Registry)
	if err := rt.listen(ctx); err != nil {
		return nil, err
	}
	rt.Registry.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	if o.Retry.File != "" {
		// The retry policies of every connection this service dials follow the file
		// (retry.Live); the flags given explicitly still override it.
		if _, err := WatchConfig(ctx, rt, configwatch.Config[*retry.File]{Name: "retry", Path: o.Retry.File,
			Load:  func(b []byte) (*retry.File, error) { return o.Retry.Decode(b, explicit) },
			Apply: func(f *retry.File) error { rt.retries.Store(f); return nil },
		}); err != nil {
			rt.closeListeners()
			return nil, fmt.Errorf("--retry-config: %w", err)
		}
	}
	rt.retryMetrics = retry.NewMetrics(rt.Registry)
	rt.metrics = newMetrics(rt.Registry)
	bcfg, _ := o.Breaker.Config(o.fs != nil) // checked by Validate
	rt.Breakers = breaker.NewSet(bcfg, rt.Registry)
	rt.Breakers.SetLogger(log)
	if rt.tls, err = newTLS(o, log, rt.Registry); err != nil {
		rt.closeListeners()
		return nil, err
	}
	if err := rt.startTracing(ctx); err != nil {
		rt.closeListeners()
		return nil, err
	}
	rt.retryIDs = retryid.New(0, rt.Registry)
	//nolint:contextcheck // the interceptors take each call's own context; none is needed here
	rt.Server = grpc.NewServer(append(mesh.ServerOptions(rt.serverConfig(minTime)),
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

// serverConfig is the service's server chain: every layer a call passes through, from
// the mTLS handshake to the retry-id table (mesh.ServerOptions).
func (rt *Runtime) serverConfig(minTime map[string]time.Duration) mesh.ServerConfig {
	o := rt.Opts
	return mesh.ServerConfig{
		Credentials:       rt.tls.serverCreds(o.Name),
		MaxHeaderListSize: uint32(o.MaxHeaderListSize), //nolint:gosec // bounded by Validate
		MaxRecvMsgSize:    o.MaxRecvMsgSize,
		Tracing:           rt.serverTracing(),
		Deadline:          deadline.Policy{Default: o.DefaultDeadline, Max: o.MaxDeadline},
		MinTime:           minTime,
		Logger:            rt.Log,
		RetryIDs:          rt.retryIDs,
		Metrics:           rt.metrics.server,
		Chaos:             o.Chaos,
		Authorize:         rt.tls.authorize(),
		Authenticate:      o.Authenticate,
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
