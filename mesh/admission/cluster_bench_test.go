package admission_test

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/curfew-mesh/curfew/mesh/admission"
	"github.com/curfew-mesh/curfew/mesh/clusterslots"
	"github.com/curfew-mesh/curfew/mesh/store"
	_ "github.com/curfew-mesh/curfew/mesh/store/postgres" // postgres:// DSNs
	"github.com/curfew-mesh/curfew/mesh/store/storetest"
)

// countingSlots counts the store round trips of slot calls.
type countingSlots struct {
	store.Slots
	calls atomic.Int64
}

func (c *countingSlots) SizeSlots(ctx context.Context, scope string, n int) error {
	c.calls.Add(1)
	return c.Slots.SizeSlots(ctx, scope, n)
}

func (c *countingSlots) ClaimSlot(ctx context.Context, scope, holder string, ttl time.Duration) (store.Slot, bool, error) {
	c.calls.Add(1)
	return c.Slots.ClaimSlot(ctx, scope, holder, ttl)
}

func (c *countingSlots) ClaimSlots(ctx context.Context, scopes []string, holder string, ttl time.Duration) ([]store.Slot, bool, error) {
	c.calls.Add(1)
	return c.Slots.ClaimSlots(ctx, scopes, holder, ttl)
}

func (c *countingSlots) RenewSlots(ctx context.Context, holder string, ttl time.Duration) ([]store.Slot, error) {
	c.calls.Add(1)
	return c.Slots.RenewSlots(ctx, holder, ttl)
}

func (c *countingSlots) ReleaseSlot(ctx context.Context, s store.Slot) error {
	c.calls.Add(1)
	return c.Slots.ReleaseSlot(ctx, s)
}

func (c *countingSlots) ReleaseSlots(ctx context.Context, ss []store.Slot) (int, error) {
	c.calls.Add(1)
	return c.Slots.ReleaseSlots(ctx, ss)
}

// BenchmarkClusterAdmission is issue 24's admission benchmark: runs arrive at 200 per
// second, spread over three replicas, each run holding its ticket 20 ms (a pool of 16
// and a tenant limit of 16, so slots are free and the figure is the decision's own
// cost). Each iteration is one arrival; its Admit is timed from the call to the ticket.
// "local" is the controller alone, "postgres" claims the pool's and the tenant's slots
// in PostgreSQL (one store handle per replica), and "store-floor" is the honest floor:
// the same claim statement (store.ClaimSlots of both scopes) timed alone at the same
// pace, with no controller. Reported: the p50 and p99 decision (or statement) times, and
// store round trips per run (claims, releases, renewals and sizing, all replicas). Run it
// with a fixed count, since iterations are paced:
//
//	go test -run '^$' -bench ClusterAdmission -benchtime 2000x ./admission/
func BenchmarkClusterAdmission(b *testing.B) {
	cfg := admission.Config{Pools: []admission.PoolConfig{{Name: "paid", MaxInFlight: 16, MaxQueue: 1024}},
		DefaultTenant: admission.TenantLimits{MaxInFlight: 16}}
	b.Run("store-floor", benchClaimFloor)
	for _, mode := range []string{"local", "postgres"} {
		b.Run(mode, func(b *testing.B) {
			var ctls []*admission.Controller
			var counters []*countingSlots
			for range 3 {
				c := cfg
				if mode == "postgres" {
					st, err := store.Open(b.Context(), storetest.PostgresDSN(b))
					if err != nil {
						b.Fatal(err)
					}
					defer func() { _ = st.Close() }()
					cs := &countingSlots{Slots: st}
					counters = append(counters, cs)
					h, err := clusterslots.New(clusterslots.Config{Store: cs})
					if err != nil {
						b.Fatal(err)
					}
					defer func() { _ = h.Close(context.Background()) }()
					c.Cluster = admission.ClusterConfig{Slots: h}
				}
				ctl, err := admission.New(c, prometheus.NewRegistry())
				if err != nil {
					b.Fatal(err)
				}
				defer ctl.Close()
				ctls = append(ctls, ctl)
			}
			const every = 5 * time.Millisecond // 200 runs per second
			var (
				mu  sync.Mutex
				ds  []time.Duration
				wg  sync.WaitGroup
				err atomic.Value
			)
			next := time.Now()
			i := 0
			for b.Loop() {
				time.Sleep(time.Until(next))
				next = next.Add(every)
				ctl := ctls[i%3]
				i++
				wg.Add(1)
				go func() {
					defer wg.Done()
					t0 := time.Now()
					tk, e := ctl.Admit(context.Background(), admission.Request{Tenant: "acme"})
					d := time.Since(t0)
					if e != nil {
						err.Store(e)
						return
					}
					mu.Lock()
					ds = append(ds, d)
					mu.Unlock()
					time.Sleep(20 * time.Millisecond)
					tk.Release(admission.Outcome{})
				}()
			}
			wg.Wait()
			b.StopTimer()
			if e := err.Load(); e != nil {
				b.Fatalf("Admit: %v", e)
			}
			slices.Sort(ds)
			q := func(p float64) float64 { return float64(ds[int(p*float64(len(ds)-1))].Microseconds()) / 1000 }
			b.ReportMetric(q(0.50), "p50-ms")
			b.ReportMetric(q(0.99), "p99-ms")
			b.ReportMetric(0, "ns/op")
			if len(counters) > 0 {
				var calls int64
				for _, c := range counters {
					calls += c.calls.Load()
				}
				b.ReportMetric(float64(calls)/float64(len(ds)), "store-trips/run")
			}
		})
	}
}

// benchClaimFloor times store.ClaimSlots of a pool and a tenant scope alone, at 200
// claims per second, each released 20 ms later: what a cluster-wide decision cannot go
// below on this store.
func benchClaimFloor(b *testing.B) {
	st, err := store.Open(b.Context(), storetest.PostgresDSN(b))
	if err != nil {
		b.Fatal(err)
	}
	defer func() { _ = st.Close() }()
	ctx := context.Background()
	scopes := []string{"pool/floor", "tenant/floor"}
	for _, s := range scopes {
		if err := st.SizeSlots(ctx, s, 16); err != nil {
			b.Fatal(err)
		}
	}
	var (
		mu   sync.Mutex
		ds   []time.Duration
		wg   sync.WaitGroup
		fail atomic.Value
	)
	next := time.Now()
	for b.Loop() {
		time.Sleep(time.Until(next))
		next = next.Add(5 * time.Millisecond)
		wg.Add(1)
		go func() {
			defer wg.Done()
			t0 := time.Now()
			ss, ok, err := st.ClaimSlots(ctx, scopes, "floor", 10*time.Second)
			d := time.Since(t0)
			if err != nil || !ok {
				fail.Store(fmt.Errorf("claim: ok %v, %w", ok, err))
				return
			}
			mu.Lock()
			ds = append(ds, d)
			mu.Unlock()
			time.Sleep(20 * time.Millisecond)
			_, _ = st.ReleaseSlots(ctx, ss)
		}()
	}
	wg.Wait()
	b.StopTimer()
	if e := fail.Load(); e != nil {
		b.Fatal(e)
	}
	slices.Sort(ds)
	q := func(p float64) float64 { return float64(ds[int(p*float64(len(ds)-1))].Microseconds()) / 1000 }
	b.ReportMetric(q(0.50), "p50-ms")
	b.ReportMetric(q(0.99), "p99-ms")
	b.ReportMetric(0, "ns/op")
}
