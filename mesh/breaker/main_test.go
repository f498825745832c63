package breaker_test

import (
	"context"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"go.uber.org/goleak"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/curfew-mesh/curfew/mesh/breaker"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

var (
	errUnavailable = status.Error(codes.Unavailable, "down")
	errBadArg      = status.Error(codes.InvalidArgument, "bad")
)

// call makes one call through b with outcome err and returns Allow's error.
func call(ctx context.Context, b *breaker.Breaker, err error) error {
	done, aerr := b.Allow(ctx)
	if aerr != nil {
		return aerr
	}
	done(err)
	return nil
}

// waitState waits up to limit for b to reach want, failing the test otherwise.
func waitState(t *testing.T, b *breaker.Breaker, want breaker.State, limit time.Duration) {
	t.Helper()
	end := time.Now().Add(limit)
	for b.State() != want {
		if time.Now().After(end) {
			t.Fatalf("breaker %s: state %s after %v, want %s", b.Target(), b.State(), limit, want)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// wantOpen checks that err is a refusal of target in state with a RetryInfo delay in
// [lo, hi].
func wantOpen(t *testing.T, err error, target, state string, lo, hi time.Duration) {
	t.Helper()
	if status.Code(err) != codes.Unavailable {
		t.Fatalf("refusal code %v (%v), want UNAVAILABLE", status.Code(err), err)
	}
	oe, ok := breaker.Open(err)
	if !ok {
		t.Fatalf("error %v carries no BREAKER_OPEN ErrorInfo", err)
	}
	if oe.Target != target || oe.State != state {
		t.Errorf("refusal target %q state %q, want %q %q", oe.Target, oe.State, target, state)
	}
	if oe.RetryAfter < lo || oe.RetryAfter > hi {
		t.Errorf("RetryInfo delay %v, want in [%v, %v]", oe.RetryAfter, lo, hi)
	}
}

// metric returns the value of the counter or gauge name whose labels include want (the
// sum over matching series); absent series read as 0.
func metric(t *testing.T, reg *prometheus.Registry, name string, want map[string]string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatalf("gather: %v", err)
	}
	var v float64
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			if hasLabels(m, want) {
				v += m.GetCounter().GetValue() + m.GetGauge().GetValue()
			}
		}
	}
	return v
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

// stateGauges returns the state gauge of target for closed, half-open and open.
func stateGauges(t *testing.T, reg *prometheus.Registry, target string) [3]float64 {
	t.Helper()
	var g [3]float64
	for i, s := range []string{"closed", "half-open", "open"} {
		g[i] = metric(t, reg, "curfew_circuit_breaker_state", map[string]string{"target": target, "state": s})
	}
	return g
}
