package service

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/pprof"
	"time"

	"github.com/prometheus/client_golang/prometheus/promhttp"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
)

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

// OnStop registers fn to run when Serve stops, after the gRPC server has stopped and
// before the spans are flushed: work that outlives the server's calls (the
// orchestrator's detached runs) ends there, so that its spans are exported too. The
// functions run in registration order and must return by StopDeadline.
func (rt *Runtime) OnStop(fn func()) { rt.onStop = append(rt.onStop, fn) }

// stopped runs the OnStop functions.
func (rt *Runtime) stopped() {
	for _, fn := range rt.onStop {
		fn()
	}
}

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
	// The services are registered by now: their methods' retry-id series start at 0.
	rt.retryIDs.Known(serverMethods(rt.Server)...)
	rt.Health.SetServingStatus("", healthpb.HealthCheckResponse_SERVING)
	errc := make(chan error, 3) // the gRPC, admin and health servers
	go func() { errc <- rt.Server.Serve(rt.lis) }()
	if rt.healthSrv != nil {
		go func() { errc <- rt.healthSrv.Serve(rt.healthLis) }()
	}
	var hs *http.Server
	if rt.admin != nil {
		hs = &http.Server{Handler: rt.adminMux(), ReadHeaderTimeout: 5 * time.Second}
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

// adminMux is the admin port's handler: /healthz (the process is up), /readyz (health
// is SERVING), /metrics (Registry) and, with Options.Pprof, /debug/pprof/.
func (rt *Runtime) adminMux() *http.ServeMux {
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
	// A collector that reads the store (dead-letter depth, outbox lag) fails while the
	// store is down, which is when the other series matter most: serve them anyway, and
	// log the failure, rather than answer 500 for the whole page.
	mux.Handle("/metrics", promhttp.HandlerFor(rt.Registry, promhttp.HandlerOpts{
		ErrorHandling: promhttp.ContinueOnError, ErrorLog: slogPrinter{rt.Log}}))
	if rt.Opts.Pprof {
		mux.HandleFunc("/debug/pprof/", pprof.Index) // heap, allocs, goroutine, block, mutex
		mux.HandleFunc("/debug/pprof/cmdline", pprof.Cmdline)
		mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
		mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
		mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
	}
	return mux
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

// slogPrinter is promhttp's error log on the service's logger.
type slogPrinter struct {
	log interface{ Warn(string, ...any) }
}

// Println logs a collection error of /metrics.
func (p slogPrinter) Println(v ...any) {
	p.log.Warn("metrics: a collector failed", "error", fmt.Sprint(v...))
}
