package nodes

import (
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
)

// PropagationBuckets are the bucket bounds of curfew_cancel_propagation_seconds: the
// product's promise is milliseconds, so they are fine below 100 ms.
var PropagationBuckets = []float64{0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10}

// Metrics are a node table's metrics, observed by its [Server]. Make them with NewMetrics.
type Metrics struct {
	propagation *prometheus.HistogramVec
}

// NewMetrics returns the metrics, registered with reg when not nil. The kinds of node a
// process executes are initialized to empty histograms so that they are exported before
// the first cancel.
func NewMetrics(reg prometheus.Registerer, kinds ...meshv1.NodeKind) *Metrics {
	m := &Metrics{propagation: prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name:    "curfew_cancel_propagation_seconds",
		Help:    "Time from a run's cancel instant (as the orchestrator recorded it) to a node executed here stopping because of it (its cancelled_at, this process's clock), by node kind. Observed once per cancelled node, when the run's summary is assembled.",
		Buckets: PropagationBuckets,
	}, []string{"kind"})}
	for _, k := range kinds {
		m.propagation.WithLabelValues(KindName(k))
	}
	if reg != nil {
		reg.MustRegister(m.propagation)
	}
	return m
}

// KindName is a node kind's label value: "model", "tool", "subagent", "run".
func KindName(k meshv1.NodeKind) string {
	return strings.ToLower(strings.TrimPrefix(k.String(), "NODE_KIND_"))
}

// observe records n's cancel propagation if it stopped after the run's cancel instant:
// at its cancelled_at, or at its end when it has none (it stopped on a cancelled child's
// error a moment before its own cancel arrived). A node stopped before the instant was
// stopped by something else (a failed sibling, a newer attempt): it is not this cancel's
// propagation.
func (m *Metrics) observe(n *meshv1.Node, cancelAt time.Time) {
	if m == nil || !stopped(n.GetStatus()) {
		return
	}
	at := n.GetCancelledAt()
	if at == nil {
		at = n.GetEndedAt()
	}
	if at == nil {
		return
	}
	d := at.AsTime().Sub(cancelAt)
	if d < 0 {
		return
	}
	m.propagation.WithLabelValues(KindName(n.GetKind())).Observe(d.Seconds())
}
