package admission_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	"github.com/curfew-mesh/curfew/mesh/admission"
)

// clock is an injectable clock that moves only when told.
type clock struct {
	mu sync.Mutex
	t  time.Time
}

func newClock() *clock { return &clock{t: time.Now()} }

func (c *clock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *clock) Advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = c.t.Add(d)
}

// newController builds a controller with a fresh registry and closes it at the end of the
// test, which sheds whatever a failed test left queued.
func newController(t *testing.T, cfg admission.Config) (*admission.Controller, *prometheus.Registry) {
	t.Helper()
	reg := prometheus.NewRegistry()
	c, err := admission.New(cfg, reg)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	t.Cleanup(c.Close)
	return c, reg
}

// onePool is a config with one pool "paid" of n slots and, for explicit use, an
// overflow pool of one slot.
func onePool(n, queue int) admission.Config {
	return admission.Config{Pools: []admission.PoolConfig{
		{Name: "paid", MaxInFlight: n, MaxQueue: queue},
		{Name: "overflow", MaxInFlight: 1, MaxQueue: queue, Overflow: true},
	}}
}

// outcome is an asynchronous Admit's result.
type outcome struct {
	name string
	t    *admission.Ticket
	err  error
	took time.Duration
}

// admitAsync runs Admit in a goroutine and delivers its result on the returned channel.
func admitAsync(ctx context.Context, c *admission.Controller, name string, req admission.Request) <-chan outcome {
	ch := make(chan outcome, 1)
	go func() {
		start := time.Now()
		tk, err := c.Admit(ctx, req)
		ch <- outcome{name: name, t: tk, err: err, took: time.Since(start)}
	}()
	return ch
}

// mustAdmit admits req at once or fails the test.
func mustAdmit(t *testing.T, c *admission.Controller, req admission.Request) *admission.Ticket {
	t.Helper()
	tk, err := c.Admit(t.Context(), req)
	if err != nil {
		t.Fatalf("Admit(%+v): %v", req, err)
	}
	return tk
}

// admitIn admits req with ctx at once or fails the test.
func admitIn(t *testing.T, c *admission.Controller, ctx context.Context, req admission.Request) *admission.Ticket { //nolint:revive // t first, as in every helper
	t.Helper()
	tk, err := c.Admit(ctx, req)
	if err != nil {
		t.Fatalf("Admit(%+v): %v", req, err)
	}
	return tk
}

// waitQueued waits until pool has n queued runs.
func waitQueued(t *testing.T, c *admission.Controller, pool string, n int) {
	t.Helper()
	end := time.Now().Add(5 * time.Second)
	for {
		st, ok := c.Stats(pool)
		if !ok {
			t.Fatalf("no pool %q", pool)
		}
		if st.Queued() == n {
			return
		}
		if time.Now().After(end) {
			t.Fatalf("pool %s: %d queued after 5s, want %d", pool, st.Queued(), n)
		}
		time.Sleep(time.Millisecond)
	}
}

// receive waits for an asynchronous Admit's result.
func receive(t *testing.T, ch <-chan outcome) outcome {
	t.Helper()
	select {
	case o := <-ch:
		return o
	case <-time.After(5 * time.Second):
		t.Fatal("Admit still blocked after 5s")
		return outcome{}
	}
}

// notYet checks that an asynchronous Admit is still blocked.
func notYet(t *testing.T, ch <-chan outcome, name string) {
	t.Helper()
	select {
	case o := <-ch:
		t.Fatalf("%s returned (%v, %v), want it still queued", name, o.t != nil, o.err)
	case <-time.After(20 * time.Millisecond):
	}
}

// wantShed checks that err is a shed with reason, and returns it (as a value, so that
// ignoring it is fine).
func wantShed(t *testing.T, err error, reason admission.Reason) admission.ShedError {
	t.Helper()
	var se *admission.ShedError
	if !errors.As(err, &se) {
		t.Fatalf("error %v, want a shed %s", err, reason)
	}
	if se.Reason != reason {
		t.Fatalf("shed reason %s (%v), want %s", se.Reason, se, reason)
	}
	if se.RetryAfter < admission.MinRetryAfter {
		t.Errorf("RetryAfter %v below the minimum %v", se.RetryAfter, admission.MinRetryAfter)
	}
	return *se
}

// metric returns the sum of the counter, gauge or histogram-count series of name whose
// labels include want; absent series read as 0.
func metric(t *testing.T, reg *prometheus.Registry, name string, want map[string]string) float64 {
	t.Helper()
	v, _ := series(t, reg, name, want)
	return v
}

// series is metric that also reports whether a matching series exists.
func series(t *testing.T, reg *prometheus.Registry, name string, want map[string]string) (float64, bool) {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatalf("gather: %v", err)
	}
	var v float64
	found := false
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			if hasLabels(m, want) {
				found = true
				v += m.GetCounter().GetValue() + m.GetGauge().GetValue() + float64(m.GetHistogram().GetSampleCount())
			}
		}
	}
	return v, found
}

func hasLabels(m *dto.Metric, want map[string]string) bool {
	got := map[string]string{}
	for _, l := range m.GetLabel() {
		got[l.GetName()] = l.GetValue()
	}
	for k, v := range want {
		if got[k] != v {
			return false
		}
	}
	return true
}

func shedCount(t *testing.T, reg *prometheus.Registry, reason admission.Reason) float64 {
	t.Helper()
	return metric(t, reg, "curfew_shed_total", map[string]string{"service": "orchestrator", "reason": string(reason)})
}
