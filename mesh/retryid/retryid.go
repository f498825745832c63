package retryid

import (
	"context"
	"errors"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/curfew-mesh/curfew/mesh/cancel"
	"github.com/curfew-mesh/curfew/mesh/md"
)

// DefaultGrace bounds how long a new attempt waits for the one it supersedes to tear down.
const DefaultGrace = time.Second

// Table is a service's in-flight attempts by tenant, method and retry-id.
type Table struct {
	grace time.Duration
	mu    sync.Mutex
	m     map[key]*entry

	inflight   *prometheus.GaugeVec
	maxSeen    *prometheus.GaugeVec
	superseded *prometheus.CounterVec
	byMethod   map[string]*methodStats // under mu
}

// methodStats are one method's metrics, looked up once (WithLabelValues hashes its labels
// on every call).
type methodStats struct {
	inflight   prometheus.Gauge
	maxSeen    prometheus.Gauge
	superseded prometheus.Counter
	max        int
}

// key is one logical call's twin: a hedged call's backup (curfew-hedge) is keyed apart
// from the attempt it runs beside, so that neither supersedes the other, while a retry of
// either still supersedes its own earlier attempt.
type key struct {
	tenant, method, id string
	hedge              bool
}

type entry struct {
	attempt int
	cancel  context.CancelCauseFunc
	// done is closed when the attempt's handler has returned. It is made (under the table's
	// lock) only when a newer attempt waits for it: most attempts are never superseded.
	done    chan struct{}
	running int // attempts of this key whose handler has not returned (never above 1)
}

// New returns a table with the given grace (DefaultGrace when 0), registering its metrics
// with reg when not nil.
func New(grace time.Duration, reg prometheus.Registerer) *Table {
	if grace <= 0 {
		grace = DefaultGrace
	}
	t := &Table{grace: grace, m: map[key]*entry{}, byMethod: map[string]*methodStats{},
		inflight: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "curfew_inflight_by_retry_id",
			Help: "Logical calls (retry-ids) with an attempt in flight on this service, by method.",
		}, []string{"method"}),
		maxSeen: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "curfew_inflight_by_retry_id_max",
			Help: "The most attempts of one retry-id ever in flight at once on this service, by method (1 when retries never overlap).",
		}, []string{"method"}),
		superseded: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "curfew_superseded_total",
			Help: "Attempts cancelled because a newer attempt of the same retry-id arrived, by method.",
		}, []string{"method"}),
	}
	if reg != nil {
		reg.MustRegister(t.inflight, t.maxSeen, t.superseded)
	}
	return t
}

// Known exports the metrics of the methods (full names) at 0 from the start, so that
// rate() and the alerts see 0 rather than nothing before their first call.
func (t *Table) Known(methods ...string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, m := range methods {
		t.statsLocked(m)
	}
}

// statsLocked returns method's metrics; t.mu must be held.
func (t *Table) statsLocked(method string) *methodStats {
	ms := t.byMethod[method]
	if ms == nil {
		ms = &methodStats{inflight: t.inflight.WithLabelValues(method), maxSeen: t.maxSeen.WithLabelValues(method),
			superseded: t.superseded.WithLabelValues(method)}
		t.byMethod[method] = ms
	}
	return ms
}

// Admit registers an attempt of a call and returns the context it must run under and a
// release func to call when its handler returns. Calls without a retry-id pass through.
func (t *Table) Admit(ctx context.Context, method string) (context.Context, func(), error) {
	id := md.IdentityFrom(ctx)
	if id.RetryID == "" {
		return ctx, func() {}, nil
	}
	k := key{id.Tenant, method, id.RetryID, md.HedgeFrom(ctx)}
	attempt := max(id.Attempt, 1)
	for {
		t.mu.Lock()
		e := t.m[k]
		if e == nil {
			break // keep the lock
		}
		if attempt <= e.attempt {
			t.mu.Unlock()
			return nil, nil, status.Errorf(codes.Aborted, "attempt %d of retry-id %s arrived after attempt %d: a late duplicate", attempt, id.RetryID, e.attempt)
		}
		// Supersede the earlier attempt and wait for its teardown, bounded.
		e.cancel(cancel.ErrSuperseded)
		t.statsLocked(method).superseded.Inc()
		if e.done == nil {
			e.done = make(chan struct{})
		}
		done := e.done
		t.mu.Unlock()
		timer := time.NewTimer(t.grace)
		select {
		case <-done:
			timer.Stop()
		case <-timer.C:
			return nil, nil, status.Errorf(codes.Aborted, "attempt %d of retry-id %s: the attempt it supersedes did not stop within %v", attempt, id.RetryID, t.grace)
		case <-ctx.Done():
			timer.Stop()
			return nil, nil, status.FromContextError(ctx.Err()).Err()
		}
	}
	// A handle: the handler's node (nodes.Table.Begin) cancels through this same context
	// instead of deriving another.
	cctx, cancelFn := cancel.WithHandle(ctx)
	e := &entry{attempt: attempt, cancel: cancelFn, running: 1}
	t.m[k] = e
	ms := t.statsLocked(method)
	ms.inflight.Inc()
	if e.running > ms.max {
		ms.max = e.running
		ms.maxSeen.Set(float64(e.running))
	}
	t.mu.Unlock()
	release := func() {
		t.mu.Lock()
		e.running--
		if t.m[k] == e {
			delete(t.m, k)
		}
		ms.inflight.Dec()
		done := e.done // made by a newer attempt waiting for this one, if any
		t.mu.Unlock()
		cancelFn(nil)
		if done != nil {
			close(done)
		}
	}
	return cctx, release, nil
}

// UnaryServerInterceptor admits unary calls through t.
func (t *Table) UnaryServerInterceptor() grpc.UnaryServerInterceptor {
	return func(ctx context.Context, req any, info *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
		ctx, release, err := t.Admit(ctx, info.FullMethod)
		if err != nil {
			return nil, err
		}
		defer release()
		resp, err := h(ctx, req)
		return resp, supersededErr(ctx, err)
	}
}

// supersededErr tells the client of a superseded attempt why it was cancelled.
func supersededErr(ctx context.Context, err error) error {
	if err != nil && errors.Is(context.Cause(ctx), cancel.ErrSuperseded) {
		return status.Error(codes.Canceled, "superseded by a newer attempt of the same retry-id")
	}
	return err
}

// StreamServerInterceptor admits streaming calls through t; wrap replaces the stream's context.
func (t *Table) StreamServerInterceptor(wrap func(context.Context, grpc.ServerStream) grpc.ServerStream) grpc.StreamServerInterceptor {
	return func(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, h grpc.StreamHandler) error {
		ctx, release, err := t.Admit(ss.Context(), info.FullMethod)
		if err != nil {
			return err
		}
		defer release()
		return supersededErr(ctx, h(srv, wrap(ctx, ss)))
	}
}
