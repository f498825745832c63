package orchestrator

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// leaseMetrics are the run-lease metrics of a server on a shared store; a nil
// *leaseMetrics counts nothing.
type leaseMetrics struct {
	takeovers *prometheus.CounterVec // by outcome: resumed, deadline_exceeded
	lost      prometheus.Counter
	// The runs waiting for the store to take a checkpoint (storewait.go): now, and
	// every wait begun.
	waiting    prometheus.Gauge
	storeWaits prometheus.Counter
}

// Takeover outcomes.
const (
	takeoverResumed  = "resumed"
	takeoverDeadline = "deadline_exceeded"
	// takeoverCancelled: cancelled by an operator while its owner was unreachable.
	takeoverCancelled = "cancelled"
)

func newLeaseMetrics(reg prometheus.Registerer, s *Server) *leaseMetrics {
	m := &leaseMetrics{
		takeovers: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "curfew_run_takeovers_total",
			Help: "Runs this orchestrator claimed after their owner's lease expired: resumed from their checkpoints, or ended deadline_exceeded because their deadline passed while unowned.",
		}, []string{"outcome"}),
		lost: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "curfew_run_leases_lost_total",
			Help: "Runs this orchestrator stopped advancing because another orchestrator had claimed them (a fenced write or heartbeat).",
		}),
		waiting: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "curfew_runs_waiting_for_store",
			Help: "Runs of this orchestrator waiting, within their deadline, for an unavailable store to take their checkpoint, or their record as they start.",
		}),
		storeWaits: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "curfew_run_store_waits_total",
			Help: "Times a run of this orchestrator began waiting for an unavailable store to take its checkpoint or its record, instead of failing.",
		}),
	}
	for _, o := range []string{takeoverResumed, takeoverDeadline, takeoverCancelled} {
		m.takeovers.WithLabelValues(o)
	}
	held := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "curfew_run_leases_held",
		Help: "Run leases this orchestrator holds: its live durable runs.",
	}, func() float64 { return float64(len(s.live())) })
	oldest := prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "curfew_run_lease_heartbeat_age_seconds",
		Help: "Time since the least recently renewed run lease this orchestrator holds was last renewed (created, claimed or heartbeated); it should stay under the lease TTL (alert CurfewRunLeaseStale).",
	}, func() float64 { return s.oldestLeaseAge(time.Now()).Seconds() })
	reg.MustRegister(m.takeovers, m.lost, m.waiting, m.storeWaits, held, oldest)
	return m
}

func (m *leaseMetrics) takeover(outcome string) {
	if m != nil {
		m.takeovers.WithLabelValues(outcome).Inc()
	}
}

func (m *leaseMetrics) leaseLost() {
	if m != nil {
		m.lost.Inc()
	}
}

func (m *leaseMetrics) storeWaitBegan() {
	if m != nil {
		m.storeWaits.Inc()
		m.waiting.Inc()
	}
}

func (m *leaseMetrics) storeWaitEnded() {
	if m != nil {
		m.waiting.Dec()
	}
}

// oldestLeaseAge is how long ago the least recently renewed lease of a live run was
// renewed: expiry minus TTL is the renewal instant. 0 without live runs.
func (s *Server) oldestLeaseAge(now time.Time) time.Duration {
	var age time.Duration
	for _, rn := range s.live() {
		rn.mu.Lock()
		exp := rn.lease.Expires
		rn.mu.Unlock()
		if exp.IsZero() {
			continue
		}
		age = max(age, now.Sub(exp.Add(-s.cfg.LeaseTTL)))
	}
	return age
}
