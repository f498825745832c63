package service_test

import (
	"context"
	"path/filepath"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/curfew-mesh/curfew/mesh/breaker"
	"github.com/curfew-mesh/curfew/mesh/service"
	"github.com/curfew-mesh/curfew/mesh/store"
	"github.com/curfew-mesh/curfew/mesh/store/memory"
	_ "github.com/curfew-mesh/curfew/mesh/store/sqlite"
)

// TestCoordinateBreakers: the service's breakers, and the other sets given, are
// coordinated through a shared store by default, not through a private one nor with
// --breaker-coordination=off.
func TestCoordinateBreakers(t *testing.T) {
	ctx := t.Context()
	shared, err := store.Open(ctx, "sqlite://"+filepath.Join(t.TempDir(), "curfew.db"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = shared.Close() })
	private, err := memory.Open(ctx, "memory://coordinate-breakers")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = private.Close() })
	for _, c := range []struct {
		name string
		st   service.BreakerStore
		off  bool
		want bool
	}{{"shared store", shared, false, true}, {"private store", private, false, false}, {"off", shared, true, false}} {
		t.Run(c.name, func(t *testing.T) {
			o := validOptions()
			if c.off {
				o.Breaker.Coordination = breaker.CoordinationOff
			}
			startHooked(t, o, nil, func(rt *service.Runtime) {
				cctx, cancel := context.WithCancel(context.Background())
				t.Cleanup(cancel)
				reg := prometheus.NewRegistry()
				other := breaker.NewSet(breaker.Config{}, reg)
				other.Get("provider")
				got, err := rt.CoordinateBreakers(cctx, c.st, other)
				if err != nil || got != c.want {
					t.Fatalf("CoordinateBreakers = %v, %v; want %v, nil", got, err, c.want)
				}
				rt.Breakers.Get("dep")
				want := 0
				if c.want {
					want = 3 // success, failure, ignored
				}
				if n := testutil.CollectAndCount(rt.Registry, "curfew_circuit_breaker_probes_total"); n != want {
					t.Errorf("service breakers: %d probes_total series, want %d", n, want)
				}
				if n := testutil.CollectAndCount(reg, "curfew_circuit_breaker_probes_total"); n != want {
					t.Errorf("other set: %d probes_total series, want %d", n, want)
				}
			})
		})
	}
}
