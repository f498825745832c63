package breaker_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"flag"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	dto "github.com/prometheus/client_model/go"

	"github.com/curfew-mesh/curfew/mesh/breaker"
	"github.com/curfew-mesh/curfew/mesh/store"
	_ "github.com/curfew-mesh/curfew/mesh/store/memory"
	_ "github.com/curfew-mesh/curfew/mesh/store/postgres"
	"github.com/curfew-mesh/curfew/mesh/store/storetest"
)

// The coordinated breakers' configuration in these tests: open periods of 240–360 ms.
var coordCfg = breaker.Config{ConsecutiveFailures: 3, OpenTimeout: 300 * time.Millisecond, Jitter: 0.2}

const coordPoll = 20 * time.Millisecond

// stores opens n handles on one store of the backend, as n replicas would.
func stores(t *testing.T, backend string, n int) []store.Store {
	t.Helper()
	var dsn string
	switch backend {
	case "memory":
		var b [4]byte
		_, _ = rand.Read(b[:])
		dsn = "memory://breaker-coord-" + hex.EncodeToString(b[:])
	case "postgres":
		dsn = storetest.PostgresDSN(t)
	}
	out := make([]store.Store, n)
	for i := range out {
		st, err := store.Open(t.Context(), dsn)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = st.Close() })
		out[i] = st
	}
	return out
}

// replica is one caller's Set and its registry.
type replica struct {
	set *breaker.Set
	reg *prometheus.Registry
}

// sum is the sum of the metric's series (counters or gauges) whose labels include the
// given name/value pairs.
func (r replica) sum(name string, labels ...string) float64 {
	mfs, _ := r.reg.Gather()
	var sum float64
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	metric:
		for _, m := range mf.GetMetric() {
			for i := 0; i+1 < len(labels); i += 2 {
				if !slices.ContainsFunc(m.GetLabel(), func(l *dto.LabelPair) bool {
					return l.GetName() == labels[i] && l.GetValue() == labels[i+1]
				}) {
					continue metric
				}
			}
			sum += m.GetCounter().GetValue() + m.GetGauge().GetValue()
		}
	}
	return sum
}

// replicas returns n Sets coordinated through their own handles on one store; with
// coordinate false they are not coordinated (today's behaviour).
func replicas(t *testing.T, sts []store.Store, coordinate bool) []replica {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	out := make([]replica, len(sts))
	for i, st := range sts {
		reg := prometheus.NewRegistry()
		s := breaker.NewSet(coordCfg, reg)
		if coordinate {
			if err := s.Coordinate(ctx, breaker.Coordination{Store: st, Holder: fmt.Sprintf("r%d", i), Poll: coordPoll}); err != nil {
				t.Fatal(err)
			}
		}
		out[i] = replica{set: s, reg: reg}
	}
	return out
}

// dependency is the shared target: it records the calls it receives and fails them
// with UNAVAILABLE while failing is set.
type dependency struct {
	failing atomic.Bool
	mu      sync.Mutex
	calls   []time.Time
	by      []int
}

func (d *dependency) serve(r int) error {
	d.mu.Lock()
	d.calls, d.by = append(d.calls, time.Now()), append(d.by, r)
	d.mu.Unlock()
	if d.failing.Load() {
		return errUnavailable
	}
	return nil
}

// since returns the calls received since t, and by which replica.
func (d *dependency) since(t time.Time) (at []time.Time, by []int) {
	d.mu.Lock()
	defer d.mu.Unlock()
	for i, c := range d.calls {
		if !c.Before(t) {
			at, by = append(at, c), append(by, d.by[i])
		}
	}
	return at, by
}

// drive makes every replica call the dependency through its breaker every few
// milliseconds until the returned stop is called.
func drive(t *testing.T, rs []replica, d *dependency) (stop func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(t.Context())
	var wg sync.WaitGroup
	for i, r := range rs {
		b := r.set.Get("dep")
		wg.Go(func() {
			for ctx.Err() == nil {
				cctx, ccancel := context.WithTimeout(ctx, time.Second)
				if done, err := b.Allow(cctx); err == nil {
					done(d.serve(i))
				}
				ccancel()
				time.Sleep(3 * time.Millisecond)
			}
		})
	}
	return func() { cancel(); wg.Wait() }
}

func waitAll(t *testing.T, rs []replica, what string, limit time.Duration, ok func(breaker.State) bool) {
	t.Helper()
	end := time.Now().Add(limit)
	for {
		all := true
		for _, r := range rs {
			all = all && ok(r.set.Get("dep").State())
		}
		if all {
			return
		}
		if time.Now().After(end) {
			var got []string
			for _, r := range rs {
				got = append(got, r.set.Get("dep").State().String())
			}
			t.Fatalf("breakers not %s after %v: %v", what, limit, got)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

func notClosed(s breaker.State) bool { return s != breaker.StateClosed }

var backends = []string{"memory", "postgres"}

// TestCoordinatedOneProbePerOpenPeriod: four replicas' breakers against one failing
// target send one probe per open period cluster-wide, each after the previous probe's
// open period, and the others stay open; a success then closes every replica's breaker
// with one probe.
func TestCoordinatedOneProbePerOpenPeriod(t *testing.T) {
	for _, backend := range backends {
		t.Run(backend, func(t *testing.T) {
			const n = 4
			rs := replicas(t, stores(t, backend, n), true)
			d := &dependency{}
			d.failing.Store(true)
			stop := drive(t, rs, d)
			defer stop()
			waitAll(t, rs, "open", 5*time.Second, notClosed)
			from := time.Now()
			time.Sleep(1500 * time.Millisecond)
			at, by := d.since(from)
			// Every call now is a probe: none while the breakers are open.
			openMin := coordCfg.OpenPeriod(0)
			t.Logf("%s: %d probes in %v by replicas %v", backend, len(at), time.Since(from).Round(time.Millisecond), by)
			if len(at) < 2 || len(at) > int(1500*time.Millisecond/openMin)+1 {
				t.Errorf("%d probes in 1.5 s, want 2 to %d (one per open period of %v..%v)", len(at), int(1500*time.Millisecond/openMin)+1, openMin, coordCfg.OpenPeriod(1))
			}
			for i := 1; i < len(at); i++ {
				if gap := at[i].Sub(at[i-1]); gap < openMin-10*time.Millisecond {
					t.Errorf("probes %d and %d (replicas %d, %d) %v apart, want at least the shortest open period %v", i-1, i, by[i-1], by[i], gap, openMin)
				}
			}
			var failed, reopened float64
			for _, r := range rs {
				failed += r.sum("curfew_circuit_breaker_probes_total", "outcome", "failure")
				reopened += r.sum("curfew_circuit_breaker_shared_outcomes_total", "outcome", "reopened")
			}
			if int(failed) != len(at) && int(failed) != len(at)-1 { // the last may still be out
				t.Errorf("probes_total{failure} summed %v, the target saw %d probes", failed, len(at))
			}
			if reopened < 1 {
				t.Errorf("shared_outcomes_total{reopened} summed %v, want other replicas reopened by the probes", reopened)
			}

			// The target heals: one probe succeeds and every breaker closes.
			healed := time.Now()
			d.failing.Store(false)
			waitAll(t, rs, "closed", 3*time.Second, func(s breaker.State) bool { return s == breaker.StateClosed })
			t.Logf("%s: all closed %v after the target healed", backend, time.Since(healed).Round(time.Millisecond))
			var succeeded, closed float64
			for _, r := range rs {
				succeeded += r.sum("curfew_circuit_breaker_probes_total", "outcome", "success")
				closed += r.sum("curfew_circuit_breaker_shared_outcomes_total", "outcome", "closed")
			}
			if succeeded != 1 || closed != n-1 {
				t.Errorf("after healing: probes_total{success} summed %v, shared closes %v; want 1 and %d", succeeded, closed, n-1)
			}
		})
	}
}

// TestCoordinatedFailureReopensAll: when a probe fails, every replica's breaker is open
// (not half-open) within a few polls, until about the prober's open period ends.
func TestCoordinatedFailureReopensAll(t *testing.T) {
	rs := replicas(t, stores(t, "memory", 3), true)
	d := &dependency{}
	d.failing.Store(true)
	stop := drive(t, rs, d)
	defer stop()
	waitAll(t, rs, "open", 5*time.Second, notClosed)
	from := time.Now()
	// Wait for the first probe, then all must be open shortly after it.
	for {
		if at, _ := d.since(from); len(at) > 0 {
			break
		}
		if time.Since(from) > 3*time.Second {
			t.Fatal("no probe within 3 s")
		}
		time.Sleep(time.Millisecond)
	}
	waitAll(t, rs, "open", 5*coordPoll+100*time.Millisecond, func(s breaker.State) bool { return s == breaker.StateOpen })
	// The replicas that did not probe say until when the prober holds the lease.
	for deadline := time.Now().Add(2 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		elsewhere := 0
		for _, r := range rs {
			pc, ok := r.set.Get("dep").ProbeCoordination()
			if ok && pc.ElsewhereUntil.After(time.Now()) && strings.Contains(pc.Detail(time.Now()), "another replica holds") {
				elsewhere++
			}
		}
		if elsewhere > 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("no replica reports the probe lease held elsewhere within 2 s")
		}
	}
}

// TestUncoordinatedProbesPerReplica is the control: without Coordinate each replica
// probes on its own, so the target sees about one probe per replica per open period.
func TestUncoordinatedProbesPerReplica(t *testing.T) {
	const n = 4
	rs := replicas(t, make([]store.Store, n), false)
	d := &dependency{}
	d.failing.Store(true)
	stop := drive(t, rs, d)
	defer stop()
	waitAll(t, rs, "open", 5*time.Second, notClosed)
	from := time.Now()
	time.Sleep(1500 * time.Millisecond)
	at, by := d.since(from)
	t.Logf("uncoordinated: %d probes in 1.5 s by replicas %v", len(at), by)
	if len(at) < n*2 {
		t.Errorf("%d probes in 1.5 s from %d uncoordinated replicas, want at least %d", len(at), n, 2*n)
	}
	if testutil.CollectAndCount(rs[0].reg, "curfew_circuit_breaker_probes_total") != 0 {
		t.Error("an uncoordinated set has probe metrics")
	}
}

// TestCoordinatedStoreDown: with its store unreachable a coordinated breaker probes on
// its own, as without coordination, and says so in CoordinationDegraded and the
// degraded gauge.
func TestCoordinatedStoreDown(t *testing.T) {
	sts := stores(t, "memory", 1)
	rs := replicas(t, sts, true)
	_ = sts[0].Close() // every store call now fails
	b := rs[0].set.Get("dep")
	for range coordCfg.ConsecutiveFailures {
		if err := call(t.Context(), b, errUnavailable); err != nil {
			t.Fatal(err)
		}
	}
	waitState(t, b, breaker.StateHalfOpen, 2*time.Second)
	done, err := b.Allow(t.Context())
	if err != nil {
		t.Fatalf("half-open breaker with its store down refused its probe: %v", err)
	}
	if pc, ok := b.ProbeCoordination(); !ok || !pc.Degraded || pc.DegradedSince.IsZero() || pc.Held ||
		!strings.Contains(pc.Detail(time.Now()), "store unreachable") {
		t.Errorf("probe out: ProbeCoordination %+v, %v; want degraded since its first failed read, no lease held", pc, ok)
	}
	if !b.CoordinationDegraded() || rs[0].sum("curfew_circuit_breaker_coordination_degraded") != 1 {
		t.Errorf("probe out: CoordinationDegraded %v, gauge %v; want true and 1", b.CoordinationDegraded(), rs[0].sum("curfew_circuit_breaker_coordination_degraded"))
	}
	done(nil)
	if b.State() != breaker.StateClosed {
		t.Errorf("state %s after the local probe succeeded, want closed", b.State())
	}
	if b.CoordinationDegraded() || rs[0].sum("curfew_circuit_breaker_coordination_degraded") != 0 {
		t.Errorf("closed: CoordinationDegraded %v, gauge %v; want false and 0 (a closed breaker does not use the store)", b.CoordinationDegraded(), rs[0].sum("curfew_circuit_breaker_coordination_degraded"))
	}
	if got := rs[0].sum("curfew_circuit_breaker_probes_total", "outcome", "success"); got != 1 {
		t.Errorf("probes_total{success} %v, want 1", got)
	}
}

// TestCoordinationFlag: --breaker-coordination is store by default, takes off, and
// refuses anything else naming the flag.
func TestCoordinationFlag(t *testing.T) {
	var f breaker.Flags
	fs := flag.NewFlagSet("x", flag.ContinueOnError)
	f.Register(fs)
	if !f.Coordinated() || f.Coordination != breaker.DefaultCoordination {
		t.Errorf("default coordination %q (Coordinated %v), want store", f.Coordination, f.Coordinated())
	}
	for _, c := range []struct {
		v       string
		coord   bool
		problem string
	}{{"store", true, ""}, {"off", false, ""}, {"nats", false, `--breaker-coordination must be store or off, got "nats"`}} {
		if err := fs.Set("breaker-coordination", c.v); err != nil {
			t.Fatal(err)
		}
		_, err := f.Config(true)
		if c.problem == "" && (err != nil || f.Coordinated() != c.coord) {
			t.Errorf("%s: err %v, Coordinated %v; want nil, %v", c.v, err, f.Coordinated(), c.coord)
		}
		if c.problem != "" && (err == nil || err.Error() != c.problem) {
			t.Errorf("%s: err %v, want %q", c.v, err, c.problem)
		}
	}
}
