package admission_test

import (
	"testing"
	"time"

	"github.com/curfew-mesh/curfew/mesh/admission"
)

// An operator's close sheds new runs and the queue with pool_closed, condition
// operator, lets admitted runs finish, and lifts when the control goes away.
func TestOperatorClose(t *testing.T) {
	c, reg := newController(t, onePool(1, 4))
	running := mustAdmit(t, c, admission.Request{Tenant: "a"})
	queued := admitAsync(t.Context(), c, "q", admission.Request{Tenant: "b"})
	waitQueued(t, c, "paid", 1)

	c.SetOperatorControls(admission.OperatorControls{Closed: map[string]string{"paid": "rollback step 1"}})
	se := wantShed(t, receive(t, queued).err, admission.ReasonPoolClosed)
	if se.Condition != string(admission.ConditionOperator) || se.Pool != "paid" || se.Tenant != "b" {
		t.Errorf("queued waiter's shed %+v, want pool paid, tenant b, condition operator", se)
	}
	_, err := c.Admit(t.Context(), admission.Request{Tenant: "c"})
	se = wantShed(t, err, admission.ReasonPoolClosed)
	if se.Condition != "operator" || se.Detail != "an operator has closed the pool: rollback step 1" {
		t.Errorf("new run's shed %+v", se)
	}
	if closed, why := c.Closed("paid"); !closed || why != "operator" {
		t.Errorf("Closed(paid) = %v %q, want closed by operator", closed, why)
	}
	if v := metric(t, reg, "curfew_admission_pool_closed", map[string]string{"pool": "paid"}); v != 1 {
		t.Errorf("pool_closed gauge %v, want 1", v)
	}
	if closed, _ := c.Closed("overflow"); closed {
		t.Error("the other pool closed too")
	}
	st := c.PoolStates()
	if len(st) != 2 || st[0].Name != "paid" || !st[0].OperatorClosed || st[0].OperatorReason != "rollback step 1" || st[0].InFlight != 1 || st[0].Queued != 0 {
		t.Errorf("PoolStates %+v", st)
	}
	running.Release(admission.Outcome{}) // what was admitted ran to its end

	c.SetOperatorControls(admission.OperatorControls{})
	mustAdmit(t, c, admission.Request{}).Release(admission.Outcome{})
	if closed, _ := c.Closed("paid"); closed {
		t.Error("paid still closed after the control went away")
	}
}

// A forced open lifts the automatic fail-closed window until its instant, and the
// state still reports the conditions; a close wins over a forced open.
func TestOperatorForcedOpen(t *testing.T) {
	clk := newClock()
	cfg := admission.DefaultConfig()
	cfg.Now = clk.Now
	c, _ := newController(t, cfg)
	sheddable := admission.Request{Tenant: "free", Criticality: admission.Sheddable}
	c.ObserveOrphanTokens(5)
	_, err := c.Admit(t.Context(), sheddable)
	wantShed(t, err, admission.ReasonPoolClosed)

	c.SetOperatorControls(admission.OperatorControls{ForcedOpen: map[string]time.Time{"overflow": clk.Now().Add(30 * time.Second)}})
	mustAdmit(t, c, sheddable).Release(admission.Outcome{})
	if closed, _ := c.Closed("overflow"); closed {
		t.Error("Closed(overflow) while forced open")
	}
	st := c.PoolStates()[1]
	if len(st.AutoConditions) != 1 || st.AutoConditions[0] != "orphan_tokens" || st.ForcedOpenUntil.IsZero() {
		t.Errorf("forced-open state %+v, want orphan_tokens still reported and the forced instant", st)
	}
	c.ObserveOrphanTokens(1) // evidence while forced open does not shed
	mustAdmit(t, c, sheddable).Release(admission.Outcome{})

	c.SetOperatorControls(admission.OperatorControls{Closed: map[string]string{"overflow": ""},
		ForcedOpen: map[string]time.Time{"overflow": clk.Now().Add(30 * time.Second)}})
	_, err = c.Admit(t.Context(), sheddable)
	if se := wantShed(t, err, admission.ReasonPoolClosed); se.Condition != "operator" {
		t.Errorf("closed and forced open: condition %q, want operator", se.Condition)
	}
	c.SetOperatorControls(admission.OperatorControls{ForcedOpen: map[string]time.Time{"overflow": clk.Now().Add(30 * time.Second)}})
	clk.Advance(31 * time.Second) // the force has lapsed; the window (from the second orphan) still holds
	_, err = c.Admit(t.Context(), sheddable)
	if se := wantShed(t, err, admission.ReasonPoolClosed); se.Condition != "orphan_tokens" {
		t.Errorf("after the force: condition %q, want orphan_tokens", se.Condition)
	}
}
