package admission

import (
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// BenchmarkAdmitWith1000Queued measures admission decisions with 1,000 runs queued (the
// issue's target: p99 ≤ 50 µs). Each iteration is two decisions on the same pool: an
// arrival that is checked (slack, tenant concurrency and budget, queue) and queued behind
// the 1,000, and a Release that settles a run and admits the queue's head after checking
// its age and slack again. A quarter of the runs are critical, so both queues are used;
// 100 tenants have budgets and concurrency limits; metrics are registered. The decisions
// are timed one by one under the controller's lock exactly as Admit and Release run them;
// what Admit does outside the lock (starting the waiter's timer, blocking) is the
// caller's own and not part of the decision.
func BenchmarkAdmitWith1000Queued(b *testing.B) {
	const queued = 1000
	c, err := New(Config{
		Pools:         []PoolConfig{{Name: "paid", MaxInFlight: 1, MaxQueue: 4 * queued, MaxQueueAge: time.Hour}, {Name: "overflow", MaxInFlight: 8, Overflow: true}},
		DefaultTenant: TenantLimits{MaxInFlight: 1 << 20, TokenBudget: 1 << 50, Window: time.Hour},
	}, prometheus.NewRegistry())
	if err != nil {
		b.Fatal(err)
	}
	defer c.Close()
	deadline := time.Now().Add(time.Hour)
	// The requests cycle through 100 tenants, 8 classes and both criticalities; they are
	// made up front so that only the decisions are timed.
	reqs := make([]Request, 400)
	for i := range reqs {
		crit := Sheddable
		if i%4 == 0 {
			crit = Critical
		}
		reqs[i] = Request{Pool: "paid", Tenant: fmt.Sprintf("tenant-%d", i%100), Criticality: crit,
			Class: fmt.Sprintf("model-%d", i%8), ExpectedTokens: 800}
	}
	n := 0
	var fifo [2][]*waiter // the benchmark's own view of the queues, to find the admitted head
	queue := func(w *waiter, err error) {
		if err != nil || w == nil {
			b.Fatalf("arrival not queued: %v", err)
		}
		q := shedQ
		if w.req.Criticality == Critical {
			q = critQ
		}
		fifo[q] = append(fifo[q], w)
	}
	holder, _, err := c.arrive(reqs[0], deadline)
	if err != nil || holder == nil {
		b.Fatalf("first run not admitted: %v", err)
	}
	for n = 1; n <= queued; n++ {
		_, w, err := c.arrive(reqs[n%len(reqs)], deadline)
		queue(w, err)
	}
	// step is one arrival and one release, each timed into the given slices (when not nil).
	step := func(arrivals, grants *[]time.Duration) {
		req := reqs[n%len(reqs)]
		n++
		t0 := time.Now()
		_, w, err := c.arrive(req, deadline)
		d := time.Since(t0)
		if arrivals != nil {
			*arrivals = append(*arrivals, d)
		}
		queue(w, err)

		t0 = time.Now()
		holder.Release(Outcome{Tokens: 700, Service: 2 * time.Second, Ended: EndCompleted})
		d = time.Since(t0)
		if grants != nil {
			*grants = append(*grants, d)
		}

		q := critQ
		if len(fifo[critQ]) == 0 {
			q = shedQ
		}
		head := fifo[q][0]
		fifo[q] = fifo[q][1:]
		r := <-head.ch
		if r.t == nil {
			b.Fatalf("head not admitted: %v", r.err)
		}
		holder = r.t
	}
	// Warm up to a steady state first: a long-running orchestrator's heap is grown, and
	// the page faults of growing it are not the decisions' cost.
	for range 20 * queued {
		step(nil, nil)
	}
	arrivals := make([]time.Duration, 0, 1<<16)
	grants := make([]time.Duration, 0, 1<<16)
	for b.Loop() {
		step(&arrivals, &grants)
	}
	b.StopTimer()
	if st, _ := c.Stats("paid"); st.Queued() != queued {
		b.Fatalf("queue depth %d at the end, want %d", st.Queued(), queued)
	}
	report := func(prefix string, ds []time.Duration) {
		slices.Sort(ds)
		q := func(p float64) float64 { return float64(ds[int(p*float64(len(ds)-1))].Nanoseconds()) }
		b.ReportMetric(q(0.50), prefix+"p50-ns")
		b.ReportMetric(q(0.99), prefix+"p99-ns")
	}
	report("", slices.Concat(arrivals, grants))
	report("arrive-", arrivals)
	report("grant-", grants)
	b.ReportMetric(float64(max(slices.Max(arrivals), slices.Max(grants)).Nanoseconds()), "max-ns")
}
