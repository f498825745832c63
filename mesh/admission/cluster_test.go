package admission_test

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/curfew-mesh/curfew/mesh/admission"
	"github.com/curfew-mesh/curfew/mesh/clusterslots"
	"github.com/curfew-mesh/curfew/mesh/store"
	"github.com/curfew-mesh/curfew/mesh/store/storetest"
)

// flakyStore is a store whose slot calls fail while down is set, and whose claims wait
// while hold is set: the store stopped, or slow.
type flakyStore struct {
	store.Slots
	down atomic.Bool
	hold chan struct{} // when not nil, claims wait for it to close
	mu   sync.Mutex
}

var errStoreDown = errors.New("store down")

func (f *flakyStore) gate(ctx context.Context) error {
	f.mu.Lock()
	hold := f.hold
	f.mu.Unlock()
	if hold != nil {
		select {
		case <-hold:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	if f.down.Load() {
		return errStoreDown
	}
	return nil
}

func (f *flakyStore) SizeSlots(ctx context.Context, scope string, n int) error {
	if err := f.gate(ctx); err != nil {
		return err
	}
	return f.Slots.SizeSlots(ctx, scope, n)
}

func (f *flakyStore) ClaimSlot(ctx context.Context, scope, holder string, ttl time.Duration) (store.Slot, bool, error) {
	if err := f.gate(ctx); err != nil {
		return store.Slot{}, false, err
	}
	return f.Slots.ClaimSlot(ctx, scope, holder, ttl)
}

func (f *flakyStore) ClaimSlots(ctx context.Context, scopes []string, holder string, ttl time.Duration) ([]store.Slot, bool, error) {
	if err := f.gate(ctx); err != nil {
		return nil, false, err
	}
	return f.Slots.ClaimSlots(ctx, scopes, holder, ttl)
}

// replica is one orchestrator's admission on a shared store: its own slot holder and
// controller.
type replica struct {
	h *clusterslots.Holder
	c *admission.Controller
}

// newReplica starts a controller of cfg whose caps are claimed in st.
func newReplica(t *testing.T, st store.Slots, name string, cfg admission.Config, replicas int) replica {
	t.Helper()
	var ctl atomic.Pointer[admission.Controller]
	h, err := clusterslots.New(clusterslots.Config{Store: st, Name: name, TTL: 10 * time.Second, Poll: 20 * time.Millisecond,
		OnRelease: func(scope string) {
			if c := ctl.Load(); c != nil {
				c.Kick(scope)
			}
		}})
	if err != nil {
		t.Fatal(err)
	}
	cfg.Cluster = admission.ClusterConfig{Slots: h, Replicas: func() int { return replicas }, Poll: 20 * time.Millisecond,
		DegradedFor: 100 * time.Millisecond}
	c, err := admission.New(cfg, prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	ctl.Store(c)
	t.Cleanup(func() {
		c.Close()
		_ = h.Close(context.Background())
	})
	return replica{h: h, c: c}
}

// TestClusterCapAcrossReplicas: three controllers on one store admit at most the pool's
// cap at any moment between them, and every run is admitted in the end.
func TestClusterCapAcrossReplicas(t *testing.T) {
	st := storetest.OpenMemory(t)
	const cap, perReplica = 2, 20
	var rs []replica
	for _, n := range []string{"a", "b", "c"} {
		rs = append(rs, newReplica(t, st, n, onePool(cap, 100), 3))
	}
	var running, high atomic.Int64
	var wg sync.WaitGroup
	errs := make(chan error, 3*perReplica)
	for _, r := range rs {
		for range perReplica {
			wg.Add(1)
			go func() {
				defer wg.Done()
				ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
				defer cancel()
				tk, err := r.c.Admit(ctx, admission.Request{Tenant: "t"})
				if err != nil {
					errs <- err
					return
				}
				n := running.Add(1)
				for h := high.Load(); n > h && !high.CompareAndSwap(h, n); h = high.Load() {
				}
				time.Sleep(2 * time.Millisecond)
				running.Add(-1)
				tk.Release(admission.Outcome{Ended: admission.EndCompleted})
			}()
		}
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Errorf("Admit: %v", err)
	}
	if h := high.Load(); h > cap || h < 1 {
		t.Errorf("high-water mark of runs in flight across replicas = %d, want 1..%d", h, cap)
	}
	slots, err := st.ListSlots(t.Context(), admission.PoolScope("paid"))
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range slots {
		if s.Held(time.Now()) {
			t.Errorf("slot %d still held by %s after every run ended", s.N, s.Holder)
		}
	}
}

// TestClusterTenantConcurrency: a tenant at its concurrency limit on one replica is shed
// with tenant_concurrency on another.
func TestClusterTenantConcurrency(t *testing.T) {
	st := storetest.OpenMemory(t)
	cfg := onePool(4, 10)
	cfg.Tenants = map[string]admission.TenantLimits{"acme": {MaxInFlight: 1}}
	a, b := newReplica(t, st, "a", cfg, 2), newReplica(t, st, "b", cfg, 2)
	tk := mustAdmit(t, a.c, admission.Request{Tenant: "acme"})
	_, err := b.c.Admit(t.Context(), admission.Request{Tenant: "acme"})
	if e, ok := admission.AsShed(err); !ok || e.Reason != admission.ReasonTenantConcurrency {
		t.Fatalf("second run of the tenant on another replica: %v, want a tenant_concurrency shed", err)
	}
	// Another tenant is not held back, and the pool's slot the refused claim took is back.
	other := mustAdmit(t, b.c, admission.Request{Tenant: "other"})
	other.Release(admission.Outcome{})
	tk.Release(admission.Outcome{})
	again := mustAdmit(t, b.c, admission.Request{Tenant: "acme"})
	again.Release(admission.Outcome{})
}

// TestClusterWaiterAdmittedWhenAnotherReplicaReleases: a run queued on one replica for
// a slot held on another is admitted once it is released there.
func TestClusterWaiterAdmittedWhenAnotherReplicaReleases(t *testing.T) {
	st := storetest.OpenMemory(t)
	a, b := newReplica(t, st, "a", onePool(1, 10), 2), newReplica(t, st, "b", onePool(1, 10), 2)
	tk := mustAdmit(t, a.c, admission.Request{})
	ch := admitAsync(t.Context(), b.c, "b", admission.Request{})
	waitQueued(t, b.c, "paid", 1)
	notYet(t, ch, "b")
	tk.Release(admission.Outcome{})
	o := receive(t, ch)
	if o.err != nil {
		t.Fatalf("queued run on b: %v", o.err)
	}
	o.t.Release(admission.Outcome{})
}

// TestClusterCallerLeavesDuringClaim: a caller whose ctx ends while its claim is at the
// store gets ctx's status, and the slot the claim took goes back.
func TestClusterCallerLeavesDuringClaim(t *testing.T) {
	st := &flakyStore{Slots: storetest.OpenMemory(t)}
	r := newReplica(t, st, "a", onePool(1, 10), 1)
	hold := make(chan struct{})
	st.mu.Lock()
	st.hold = hold
	st.mu.Unlock()
	ctx, cancel := context.WithCancel(t.Context())
	ch := admitAsync(ctx, r.c, "a", admission.Request{})
	time.Sleep(20 * time.Millisecond) // the claim is at the store
	cancel()
	st.mu.Lock()
	st.hold = nil
	st.mu.Unlock()
	close(hold)
	if o := receive(t, ch); o.err == nil {
		o.t.Release(admission.Outcome{})
		t.Fatal("Admit succeeded after its caller left")
	}
	// The slot is free: the next run is admitted at once.
	tk := mustAdmit(t, r.c, admission.Request{})
	tk.Release(admission.Outcome{})
}

// TestClusterDegradedShare: while the store fails, a replica admits up to its share of
// the cap (here 2 replicas: ceil(2/2) = 1), says so in its status, and claims in the
// store again once it answers.
func TestClusterDegradedShare(t *testing.T) {
	st := &flakyStore{Slots: storetest.OpenMemory(t)}
	r := newReplica(t, st, "a", onePool(2, 10), 2)
	warm := mustAdmit(t, r.c, admission.Request{}) // sizes the scope while the store is up
	warm.Release(admission.Outcome{})
	st.down.Store(true)
	first := mustAdmit(t, r.c, admission.Request{})
	s := r.c.ClusterStatus()
	if !s.Degraded || s.LocalAdmits != 1 || s.LastError == "" {
		t.Fatalf("status while the store is down: %+v, want degraded with 1 local admit and the error", s)
	}
	ch := admitAsync(t.Context(), r.c, "second", admission.Request{})
	waitQueued(t, r.c, "paid", 1)
	notYet(t, ch, "second") // its share is 1
	first.Release(admission.Outcome{})
	o := receive(t, ch)
	if o.err != nil {
		t.Fatalf("second run after the first ended: %v", o.err)
	}
	o.t.Release(admission.Outcome{})
	st.down.Store(false)
	time.Sleep(150 * time.Millisecond) // DegradedFor passes
	back := mustAdmit(t, r.c, admission.Request{})
	defer back.Release(admission.Outcome{})
	if s := r.c.ClusterStatus(); s.Degraded || s.Holder.Held[admission.PoolScope("paid")] != 1 {
		t.Fatalf("status once the store is back: %+v, want coordination with the slot held", s)
	}
}

// TestClusterCloseWaitsForClaims: Close sheds a waiter whose claim is at the store and
// returns once it is back, leaving no goroutine behind (TestMain's goleak).
func TestClusterCloseWaitsForClaims(t *testing.T) {
	st := &flakyStore{Slots: storetest.OpenMemory(t)}
	r := newReplica(t, st, "a", onePool(1, 10), 1)
	hold := make(chan struct{})
	st.mu.Lock()
	st.hold = hold
	st.mu.Unlock()
	ch := admitAsync(t.Context(), r.c, "a", admission.Request{})
	time.Sleep(20 * time.Millisecond)
	go func() {
		time.Sleep(20 * time.Millisecond)
		st.mu.Lock()
		st.hold = nil
		st.mu.Unlock()
		close(hold)
	}()
	r.c.Close()
	o := receive(t, ch)
	if e, ok := admission.AsShed(o.err); !ok || e.Reason != admission.ReasonShutdown {
		if o.t != nil {
			o.t.Release(admission.Outcome{})
		}
		t.Fatalf("Admit across Close: %v, want a shutdown shed", o.err)
	}
}

// TestClusterReloadResizes: a reload that raises a pool's cap sizes its scope in the
// store anew at the next claim, so the cap holds across replicas at its new value.
func TestClusterReloadResizes(t *testing.T) {
	st := storetest.OpenMemory(t)
	a, b := newReplica(t, st, "a", onePool(1, 10), 2), newReplica(t, st, "b", onePool(1, 10), 2)
	first := mustAdmit(t, a.c, admission.Request{})
	defer first.Release(admission.Outcome{})
	ch := admitAsync(t.Context(), b.c, "b", admission.Request{})
	waitQueued(t, b.c, "paid", 1)
	notYet(t, ch, "b") // the one slot is a's
	for _, r := range []replica{a, b} {
		if err := r.c.Update(onePool(2, 10)); err != nil {
			t.Fatal(err)
		}
	}
	o := receive(t, ch) // b's next claim sizes the scope to 2 and takes the second slot
	if o.err != nil {
		t.Fatalf("b's run after the reload: %v", o.err)
	}
	defer o.t.Release(admission.Outcome{})
	slots, err := st.ListSlots(t.Context(), admission.PoolScope("paid"))
	if err != nil {
		t.Fatal(err)
	}
	held := 0
	for _, s := range slots {
		if s.Held(time.Now()) {
			held++
		}
	}
	if len(slots) != 2 || held != 2 {
		t.Fatalf("after the reload: %d slots, %d held; want 2 and 2", len(slots), held)
	}
	// A third run waits: the cap is 2 across both replicas.
	third := admitAsync(t.Context(), a.c, "a", admission.Request{})
	waitQueued(t, a.c, "paid", 1)
	notYet(t, third, "a")
}
