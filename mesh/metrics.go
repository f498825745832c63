package mesh

import (
	"time"

	grpcprom "github.com/grpc-ecosystem/go-grpc-middleware/providers/prometheus"
	"github.com/prometheus/client_golang/prometheus"
)

// The standard gRPC metrics are go-grpc-middleware v2's Prometheus provider
// (grpc_server_* and grpc_client_*, the names every gRPC dashboard already queries), with
// the handling-time histograms on (buckets prometheus.DefBuckets), not the OpenTelemetry
// Prometheus exporter: the services already expose a prometheus.Registry, the provider
// writes straight into it with no second metrics SDK and no per-scrape translation, and
// its names and labels are the long-standing ones (see docs/metrics.md). Series appear on
// a method's first call.

// SlackBuckets are the bucket bounds of curfew_deadline_slack_seconds: from 5 ms (a
// call that arrives with less is about to be refused by fast-fail) to the default
// --max-deadline of 10 minutes.
var SlackBuckets = []float64{0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600}

// ServerMetrics are the server chain's metrics: the standard gRPC server metrics and the
// deadline slack of every call on arrival. Make one per server with NewServerMetrics.
type ServerMetrics struct {
	grpc  *grpcprom.ServerMetrics
	slack *prometheus.HistogramVec
}

// NewServerMetrics returns the server metrics, registered with reg when not nil.
func NewServerMetrics(reg prometheus.Registerer) *ServerMetrics {
	m := &ServerMetrics{
		grpc: grpcprom.NewServerMetrics(grpcprom.WithServerHandlingTimeHistogram()),
		slack: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "curfew_deadline_slack_seconds",
			Help:    "Time left before the call's deadline when it arrived, after the server chain reconciled grpc-timeout with curfew-deadline (and applied the default or the cap), by method.",
			Buckets: SlackBuckets,
		}, []string{"method"}),
	}
	if reg != nil {
		reg.MustRegister(m.grpc, m.slack)
	}
	return m
}

// observeSlack records the time left, dl − now, for a call of method.
func (m *ServerMetrics) observeSlack(method string, dl, now time.Time) {
	m.slack.WithLabelValues(method).Observe(max(dl.Sub(now), 0).Seconds())
}

// ClientMetrics are the client chain's metrics: the standard gRPC client metrics, one
// set per process shared by all its connections. Make one with NewClientMetrics.
type ClientMetrics struct {
	grpc *grpcprom.ClientMetrics
}

// NewClientMetrics returns the client metrics, registered with reg when not nil.
func NewClientMetrics(reg prometheus.Registerer) *ClientMetrics {
	m := &ClientMetrics{grpc: grpcprom.NewClientMetrics(grpcprom.WithClientHandlingTimeHistogram())}
	if reg != nil {
		reg.MustRegister(m.grpc)
	}
	return m
}
