package service

import (
	"runtime"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/curfew-mesh/curfew/mesh"
)

// metrics are the chain's metrics of one service process, on its Registry: the standard
// gRPC server and client metrics (go-grpc-middleware's Prometheus provider) and
// curfew_deadline_slack_seconds. See docs/metrics.md for every metric a service serves.
type metrics struct {
	server *mesh.ServerMetrics
	client *mesh.ClientMetrics
}

func newMetrics(reg prometheus.Registerer) *metrics {
	info := prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "curfew_build_info",
		Help: "Always 1; its labels say which curfew version (Version) and Go release built this process.",
	}, []string{"version", "goversion"})
	info.WithLabelValues(BuildVersion(), runtime.Version()).Set(1)
	reg.MustRegister(info)
	return &metrics{server: mesh.NewServerMetrics(reg), client: mesh.NewClientMetrics(reg)}
}
