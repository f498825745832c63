package admission_test

import (
	"context"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/curfew-mesh/curfew/mesh/admission"
)

// A lowered MaxInFlight stops no admitted run and admits nothing new until enough have
// ended; a raised one admits queued runs at once.
func TestUpdatePoolLimits(t *testing.T) {
	c, reg := newController(t, onePool(2, 8))
	a, b := mustAdmit(t, c, admission.Request{}), mustAdmit(t, c, admission.Request{})

	if err := c.Update(onePool(1, 8)); err != nil {
		t.Fatalf("Update: %v", err)
	}
	if st, _ := c.Stats("paid"); st.MaxInFlight != 1 || st.InFlight != 2 {
		t.Fatalf("after lowering: %+v, want limit 1 with both runs still admitted", st)
	}
	q := admitAsync(t.Context(), c, "queued", admission.Request{})
	waitQueued(t, c, "paid", 1)
	a.Release(admission.Outcome{})
	notYet(t, q, "the queued run with one of one slot still taken")
	b.Release(admission.Outcome{})
	o := receive(t, q)
	if o.err != nil {
		t.Fatalf("queued run: %v", o.err)
	}
	o.t.Release(admission.Outcome{})

	// Raising the limit admits queued runs at once.
	hold := mustAdmit(t, c, admission.Request{})
	q1 := admitAsync(t.Context(), c, "q1", admission.Request{})
	q2 := admitAsync(t.Context(), c, "q2", admission.Request{})
	waitQueued(t, c, "paid", 2)
	if err := c.Update(onePool(3, 8)); err != nil {
		t.Fatalf("Update: %v", err)
	}
	for _, ch := range []<-chan outcome{q1, q2} {
		o := receive(t, ch)
		if o.err != nil {
			t.Fatalf("%s: %v", o.name, o.err)
		}
		o.t.Release(admission.Outcome{})
	}
	hold.Release(admission.Outcome{})
	if got := c.Config().Pools[0].MaxInFlight; got != 3 {
		t.Fatalf("Config says %d, want 3", got)
	}
	if v := metric(t, reg, "curfew_admission_in_flight", map[string]string{"pool": "paid"}); v != 0 {
		t.Fatalf("in flight gauge %v, want 0", v)
	}
}

// A removed pool sheds its queue with pool_closed, keeps its admitted runs, and is
// unknown to later requests; a new pool starts empty, with its metrics.
func TestUpdateRemovesAndAddsPools(t *testing.T) {
	c, reg := newController(t, onePool(1, 8))
	tk := mustAdmit(t, c, admission.Request{Pool: "overflow"})
	q := admitAsync(t.Context(), c, "queued", admission.Request{Pool: "overflow"})
	waitQueued(t, c, "overflow", 1)

	next := admission.Config{Pools: []admission.PoolConfig{
		{Name: "paid", MaxInFlight: 1},
		{Name: "batch", MaxInFlight: 4, Overflow: true},
	}}
	if err := c.Update(next); err != nil {
		t.Fatalf("Update: %v", err)
	}
	wantShed(t, receive(t, q).err, admission.ReasonPoolClosed)
	if _, err := c.Admit(t.Context(), admission.Request{Pool: "overflow"}); status.Code(err) != codes.InvalidArgument {
		t.Fatalf("Admit to the removed pool: %v, want INVALID_ARGUMENT", err)
	}
	// Sheddable work goes to the new overflow pool.
	s := mustAdmit(t, c, admission.Request{Criticality: admission.Sheddable})
	if s.Pool() != "batch" {
		t.Fatalf("sheddable run admitted to %s, want batch", s.Pool())
	}
	s.Release(admission.Outcome{})
	// The removed pool's admitted run ends normally.
	if tk.Pool() != "overflow" {
		t.Fatalf("ticket's pool %s", tk.Pool())
	}
	tk.Release(admission.Outcome{})
	if _, ok := series(t, reg, "curfew_admission_in_flight", map[string]string{"pool": "overflow"}); ok {
		t.Fatal("the removed pool still has an in-flight series")
	}
	if _, ok := series(t, reg, "curfew_admission_pool_closed", map[string]string{"pool": "batch"}); !ok {
		t.Fatal("the new pool has no pool_closed series")
	}
	if _, ok := series(t, reg, "curfew_admission_pool_closed", map[string]string{"pool": "overflow"}); ok {
		t.Fatal("the removed pool still has a pool_closed series")
	}
}

// Tenant limits apply to the next decision; the tenant's outstanding runs carry over.
func TestUpdateTenantLimits(t *testing.T) {
	cfg := onePool(8, 8)
	cfg.Tenants = map[string]admission.TenantLimits{"acme": {MaxInFlight: 3}}
	c, _ := newController(t, cfg)
	t1, t2 := mustAdmit(t, c, admission.Request{Tenant: "acme"}), mustAdmit(t, c, admission.Request{Tenant: "acme"})
	cfg.Tenants = map[string]admission.TenantLimits{"acme": {MaxInFlight: 2}}
	if err := c.Update(cfg); err != nil {
		t.Fatalf("Update: %v", err)
	}
	_, err := c.Admit(t.Context(), admission.Request{Tenant: "acme"})
	wantShed(t, err, admission.ReasonTenantConcurrency)
	if got := c.TenantLimits("acme").MaxInFlight; got != 2 {
		t.Fatalf("TenantLimits: %d, want 2", got)
	}
	t1.Release(admission.Outcome{})
	t3 := mustAdmit(t, c, admission.Request{Tenant: "acme"})
	t2.Release(admission.Outcome{})
	t3.Release(admission.Outcome{})
}

// An invalid config, or one that changes the service label, changes nothing.
func TestUpdateRefusals(t *testing.T) {
	c, _ := newController(t, onePool(2, 8))
	bad := onePool(0, 8)
	if err := c.Update(bad); err == nil {
		t.Fatal("Update with max_in_flight 0 succeeded")
	}
	other := onePool(5, 8)
	other.Service = "elsewhere"
	if err := c.Update(other); err == nil {
		t.Fatal("Update changing the service succeeded")
	}
	if got := c.Config().Pools[0].MaxInFlight; got != 2 {
		t.Fatalf("limit %d after refused updates, want 2", got)
	}
	c.Close()
	if err := c.Update(onePool(3, 8)); err == nil {
		t.Fatal("Update after Close succeeded")
	}
	if _, err := c.Admit(context.Background(), admission.Request{}); err == nil {
		t.Fatal("Admit after Close succeeded")
	}
}
