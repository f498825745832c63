package retrywindow

import "github.com/prometheus/client_golang/prometheus"

// metrics are the retry windows' metrics (docs/observability.md).
type metrics struct {
	heldG    *prometheus.GaugeVec
	refusedC *prometheus.CounterVec
	lostC    *prometheus.CounterVec
	claimsC  *prometheus.CounterVec
}

func newMetrics(reg prometheus.Registerer) *metrics {
	m := &metrics{
		heldG: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "curfew_retry_window_leases_held",
			Help: "Retry windows this process holds, by target (0 or 1); summed over replicas, at most the window's replicas.",
		}, []string{"target"}),
		refusedC: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "curfew_retry_window_refused_total",
			Help: "Retries refused for want of a retry window, by target and reason (busy: other replicas hold the windows; store_down: the store could not be asked; closed).",
		}, []string{"target", "reason"}),
		lostC: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "curfew_retry_window_leases_lost_total",
			Help: "Retry windows that ended before their length, by target and reason (taken: the slot's epoch or holder changed; verify_failed: the store could not be asked).",
		}, []string{"target", "reason"}),
		claimsC: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "curfew_retry_window_claims_total",
			Help: "Retry windows this process claimed, by target.",
		}, []string{"target"}),
	}
	if reg != nil {
		reg.MustRegister(m.heldG, m.refusedC, m.lostC, m.claimsC)
	}
	return m
}

func (m *metrics) known(target string) {
	m.heldG.WithLabelValues(target)
	m.claimsC.WithLabelValues(target)
	for _, r := range []string{"busy", "store_down"} {
		m.refusedC.WithLabelValues(target, r)
	}
	for _, r := range []string{"taken", "verify_failed"} {
		m.lostC.WithLabelValues(target, r)
	}
}

func (m *metrics) held(target string, v float64) { m.heldG.WithLabelValues(target).Set(v) }
func (m *metrics) claimed(target string) {
	m.claimsC.WithLabelValues(target).Inc()
	m.held(target, 1)
}
func (m *metrics) refused(target, reason string) { m.refusedC.WithLabelValues(target, reason).Inc() }
func (m *metrics) lost(target, reason string)    { m.lostC.WithLabelValues(target, reason).Inc() }
