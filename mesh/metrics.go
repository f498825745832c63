package mesh

import (
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"

	"github.com/curfew-mesh/curfew/mesh/rpcmetrics"
)

// The standard gRPC metrics are go-grpc-middleware v2's Prometheus metrics
// (grpc_server_* and grpc_client_*, the names every gRPC dashboard already queries),
// recorded by its reporting interceptors through package rpcmetrics, not the OpenTelemetry
// Prometheus exporter: the services already expose a prometheus.Registry, these write
// straight into it with no second metrics SDK and no per-scrape translation, and their
// names and labels are the long-standing ones (see docs/metrics.md). rpcmetrics records
// exactly what the provider (providers/prometheus) records, its test checks that against
// the provider, but resolves each method's series once instead of on every call.

// SlackBuckets are the bucket bounds of curfew_deadline_slack_seconds: from 5 ms (a
// call that arrives with less is about to be refused by fast-fail) to the default
// --max-deadline of 10 minutes.
var SlackBuckets = []float64{0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600}

// ServerMetrics are the server chain's metrics: the standard gRPC server metrics and the
// deadline slack of every call on arrival. Make one per server with NewServerMetrics.
type ServerMetrics struct {
	grpc   *rpcmetrics.Server
	stream grpc.StreamServerInterceptor
	slack  *prometheus.HistogramVec
	// byMethod caches slack's observer per method: WithLabelValues hashes its labels on
	// every call. Methods are the server's registered ones, so it stays small.
	byMethod sync.Map // string → prometheus.Observer
}

// NewServerMetrics returns the server metrics, registered with reg when not nil.
func NewServerMetrics(reg prometheus.Registerer) *ServerMetrics {
	m := &ServerMetrics{
		grpc: rpcmetrics.NewServer(),
		slack: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "curfew_deadline_slack_seconds",
			Help:    "Time left before the call's deadline when it arrived, after the server chain reconciled grpc-timeout with curfew-deadline (and applied the default or the cap), by method.",
			Buckets: SlackBuckets,
		}, []string{"method"}),
	}
	m.stream = m.grpc.StreamServerInterceptor()
	if reg != nil {
		reg.MustRegister(m.grpc, m.slack)
	}
	return m
}

// observeSlack records the time left, dl − now, for a call of method.
func (m *ServerMetrics) observeSlack(method string, dl, now time.Time) {
	o, ok := m.byMethod.Load(method)
	if !ok {
		o, _ = m.byMethod.LoadOrStore(method, m.slack.WithLabelValues(method))
	}
	o.(prometheus.Observer).Observe(max(dl.Sub(now), 0).Seconds())
}

// ClientMetrics are the client chain's metrics: the standard gRPC client metrics, one
// set per process shared by all its connections. Make one with NewClientMetrics.
type ClientMetrics struct {
	grpc   *rpcmetrics.Client
	stream grpc.StreamClientInterceptor
}

// NewClientMetrics returns the client metrics, registered with reg when not nil.
func NewClientMetrics(reg prometheus.Registerer) *ClientMetrics {
	m := &ClientMetrics{grpc: rpcmetrics.NewClient()}
	m.stream = m.grpc.StreamClientInterceptor()
	if reg != nil {
		reg.MustRegister(m.grpc)
	}
	return m
}
