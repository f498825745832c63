package admission

import (
	"fmt"

	"github.com/prometheus/client_golang/prometheus"
)

// queueAgeBuckets span an immediate admission (0) to the longest sensible queue age.
var queueAgeBuckets = []float64{0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60}

// metrics are a Controller's collectors. Labels are bounded: pool names from the config
// and the fixed Reasons, never tenants or run ids.
type metrics struct {
	depth    *prometheus.GaugeVec
	age      *prometheus.HistogramVec
	inFlight *prometheus.GaugeVec
	shed     *prometheus.CounterVec
	closed   *closedCollector
	clusterMetrics
}

func newMetrics(service string) *metrics {
	return &metrics{
		depth: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "curfew_admission_queue_depth",
			Help: "Runs waiting in the admission queue per pool.",
		}, []string{"pool"}),
		age: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "curfew_admission_queue_age_seconds",
			Help:    "Time runs waited in the admission queue per pool before they were admitted (0 when admitted at once) or shed from the queue.",
			Buckets: queueAgeBuckets,
		}, []string{"pool"}),
		inFlight: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "curfew_admission_in_flight",
			Help: "Runs admitted and not yet released per pool (the pool's leases in use).",
		}, []string{"pool"}),
		shed: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "curfew_shed_total",
			Help: "Runs refused by admission control, by reason: deadline_slack, queue_age, queue_full, pool_closed, tenant_concurrency, budget, shutdown; cancelled counts runs whose caller left while queued (not a refusal).",
		}, []string{"service", "reason"}),
		clusterMetrics: newClusterMetrics(),
	}
}

// closedCollector is the curfew_admission_pool_closed gauge of every pool the
// controller has now, read at scrape time so that it drops to 0 when the fail-closed
// window ends without any traffic, and follows the pools a reload adds or removes.
type closedCollector struct {
	desc *prometheus.Desc
	c    *Controller
}

func newClosedCollector(c *Controller) *closedCollector {
	return &closedCollector{c: c, desc: prometheus.NewDesc("curfew_admission_pool_closed",
		"1 while the pool refuses every run (an operator closed it; the overflow pool, while the cancel path is not proven; any pool after shutdown), else 0.",
		[]string{"pool"}, nil)}
}

func (cc *closedCollector) Describe(ch chan<- *prometheus.Desc) { ch <- cc.desc }

func (cc *closedCollector) Collect(ch chan<- prometheus.Metric) {
	for _, name := range cc.c.poolNames() {
		v := 0.0
		if closed, _ := cc.c.Closed(name); closed {
			v = 1
		}
		ch <- prometheus.MustNewConstMetric(cc.desc, prometheus.GaugeValue, v, name)
	}
}

// register registers every collector with reg, undoing the registrations made so far
// when one fails.
func (m *metrics) register(reg prometheus.Registerer) error {
	cs := []prometheus.Collector{m.depth, m.age, m.inFlight, m.shed, m.closed,
		m.claims, m.claimSeconds, m.localAdmits, m.slotsLost, m.degraded}
	for i, c := range cs {
		if err := reg.Register(c); err != nil {
			for _, done := range cs[:i] {
				reg.Unregister(done)
			}
			return fmt.Errorf("admission: registering metrics: %w", err)
		}
	}
	return nil
}

// clusterMetrics are the collectors of cluster-wide coordination (cluster.go); they
// stay at 0 without it.
type clusterMetrics struct {
	claims       *prometheus.CounterVec
	claimSeconds prometheus.Histogram
	localAdmits  prometheus.Counter
	slotsLost    prometheus.Counter
	degraded     prometheus.GaugeFunc
}

func newClusterMetrics() clusterMetrics {
	return clusterMetrics{
		claims: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "curfew_admission_cluster_claims_total",
			Help: "Claims of cluster-wide slots per pool, by result: granted, pool_full (every slot held across the cluster), tenant_full (the tenant's concurrency across the cluster), error (the store failed: decided on this replica's share).",
		}, []string{"pool", "result"}),
		claimSeconds: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "curfew_admission_cluster_claim_seconds",
			Help:    "Time of one claim of cluster-wide slots at the store, its round trips included.",
			Buckets: []float64{0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1},
		}),
		localAdmits: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "curfew_admission_cluster_local_admits_total",
			Help: "Runs admitted on this replica's share of a cap while the store was down; they hold no cluster-wide slot.",
		}),
		slotsLost: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "curfew_admission_cluster_slots_lost_total",
			Help: "Cluster-wide slots another holder claimed while their run went on (renewals failed past the TTL).",
		}),
	}
}

// newDegradedGauge is curfew_admission_cluster_degraded, read at scrape time.
func newDegradedGauge(c *Controller) prometheus.GaugeFunc {
	return prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "curfew_admission_cluster_degraded",
		Help: "1 while cluster-wide admission is degraded (the store failed: each replica admits up to its share of every cap), else 0.",
	}, func() float64 {
		if c.ClusterStatus().Degraded {
			return 1
		}
		return 0
	})
}
