package admin_test

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	adminv1 "github.com/curfew-mesh/curfew/gen/curfew/admin/v1"
	"github.com/curfew-mesh/curfew/mesh/admission"
	"github.com/curfew-mesh/curfew/mesh/breaker"
	"github.com/curfew-mesh/curfew/mesh/retrywindow"
	"github.com/curfew-mesh/curfew/mesh/store"
	"github.com/curfew-mesh/curfew/mesh/store/memory"
	"github.com/curfew-mesh/curfew/services/orchestrator/internal/admin"
)

// rig is an admin server over a private store and one replica's admission controller,
// with the rest of its configuration set by with, when given.
func rig(t *testing.T, with ...func(*admin.Config)) (*admin.Server, *admission.Controller, store.Store) {
	t.Helper()
	st, err := memory.Open(t.Context(), "memory://"+t.Name())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = st.Close() })
	ctrl, err := admission.New(admission.DefaultConfig(), nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(ctrl.Close)
	cfg := admin.Config{Store: st, Replica: "orch-1", Pools: admin.NewPoolControls(st, ctrl, "orch-1", nil)}
	for _, w := range with {
		w(&cfg)
	}
	return admin.New(cfg), ctrl, st
}

func code(err error) codes.Code { return status.Code(err) }

func TestPoolMethodsRefuseBadInput(t *testing.T) {
	s, _, _ := rig(t)
	ctx := t.Context()
	if _, err := s.ClosePool(ctx, &adminv1.ClosePoolRequest{}); code(err) != codes.InvalidArgument {
		t.Errorf("ClosePool without pool: %v, want INVALID_ARGUMENT", err)
	}
	if _, err := s.OpenPool(ctx, &adminv1.OpenPoolRequest{Pool: "nope"}); code(err) != codes.NotFound {
		t.Errorf("OpenPool of an unknown pool: %v, want NOT_FOUND", err)
	}
	off := admin.New(admin.Config{Store: nil})
	if _, err := off.ClosePool(ctx, &adminv1.ClosePoolRequest{Pool: "paid"}); code(err) != codes.FailedPrecondition {
		t.Errorf("ClosePool with admission off: %v, want FAILED_PRECONDITION", err)
	}
}

// A close is applied on the replica that took it at once, stored, and audited; the
// open lifts it; a forced open lifts the automatic window for one window.
func TestCloseOpenPool(t *testing.T) {
	s, ctrl, st := rig(t)
	ctx := t.Context()
	resp, err := s.ClosePool(ctx, &adminv1.ClosePoolRequest{Pool: "paid", Reason: "drill"})
	if err != nil {
		t.Fatal(err)
	}
	if p := resp.GetPool(); !p.GetOperatorClosed() || p.GetOperatorReason() != "drill" || p.GetOperatorActor() != "unknown" || p.GetReplica() != "orch-1" {
		t.Errorf("ClosePool's state %v", p)
	}
	if closed, why := ctrl.Closed("paid"); !closed || why != "operator" {
		t.Errorf("Closed(paid) = %v %q right after ClosePool", closed, why)
	}
	cs, err := st.ListControls(ctx)
	if err != nil || len(cs) != 1 || cs[0].Kind != store.ControlPoolClosed || cs[0].Target != "paid" {
		t.Errorf("controls %+v (%v)", cs, err)
	}

	ctrl.ObserveOrphanTokens(3) // the overflow pool fails closed by itself
	r2, err := s.OpenPool(ctx, &adminv1.OpenPoolRequest{Pool: "overflow", Reason: "not forced"})
	if err != nil {
		t.Fatal(err)
	}
	if p := r2.GetPool(); !p.GetAutoClosed() || len(p.GetAutoConditions()) != 1 {
		t.Errorf("an open without force lifted the automatic window: %v", p)
	}
	r3, err := s.OpenPool(ctx, &adminv1.OpenPoolRequest{Pool: "overflow", Force: true, Reason: "forced"})
	if err != nil {
		t.Fatal(err)
	}
	p := r3.GetPool()
	if p.GetAutoClosed() || p.GetForcedOpenUntil() == nil || time.Until(p.GetForcedOpenUntil().AsTime()) > time.Minute {
		t.Errorf("a forced open: %v, want admitting until at most one window from now", p)
	}
	if closed, _ := ctrl.Closed("overflow"); closed {
		t.Error("overflow still closed after a forced open")
	}
	if _, err := s.OpenPool(ctx, &adminv1.OpenPoolRequest{Pool: "paid"}); err != nil {
		t.Fatal(err)
	}
	if closed, _ := ctrl.Closed("paid"); closed {
		t.Error("paid still closed after OpenPool")
	}
	audit, err := s.ListAudit(ctx, &adminv1.ListAuditRequest{})
	if err != nil || len(audit.GetEntries()) != 4 {
		t.Fatalf("audit %v (%v), want 4 entries", audit, err)
	}
	if e := audit.GetEntries()[3]; e.GetAction() != "ClosePool" || e.GetTarget() != "pool paid" || e.GetReason() != "drill" {
		t.Errorf("first audit entry %v", e)
	}
}

// reopenStream collects ReopenPool's reports.
type reopenStream struct {
	adminv1.AdminService_ReopenPoolServer
	ctx  context.Context
	reps []*adminv1.ReopenPoolResponse
}

func (r *reopenStream) Context() context.Context { return r.ctx }
func (r *reopenStream) Send(m *adminv1.ReopenPoolResponse) error {
	r.reps = append(r.reps, m)
	return nil
}

// Reopen opens once the orphan total has not grown for the window, and not at the
// caller's deadline.
func TestReopenPool(t *testing.T) {
	s, ctrl, _ := rig(t)
	ctx := t.Context()
	if err := s.ReopenPool(&adminv1.ReopenPoolRequest{Pool: "paid"}, &reopenStream{ctx: ctx}); code(err) != codes.InvalidArgument {
		t.Errorf("ReopenPool without a window: %v, want INVALID_ARGUMENT", err)
	}
	if _, err := s.ClosePool(ctx, &adminv1.ClosePoolRequest{Pool: "paid"}); err != nil {
		t.Fatal(err)
	}
	short, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
	defer cancel()
	err := s.ReopenPool(&adminv1.ReopenPoolRequest{Pool: "paid", Window: durationpb.New(time.Hour)}, &reopenStream{ctx: short})
	if code(err) != codes.DeadlineExceeded {
		t.Errorf("ReopenPool past its deadline: %v, want DEADLINE_EXCEEDED", err)
	}
	if closed, _ := ctrl.Closed("paid"); !closed {
		t.Fatal("a reopen that gave up opened the pool")
	}
	rs := &reopenStream{ctx: ctx}
	if err := s.ReopenPool(&adminv1.ReopenPoolRequest{Pool: "paid", Window: durationpb.New(200 * time.Millisecond)}, rs); err != nil {
		t.Fatal(err)
	}
	last := rs.reps[len(rs.reps)-1]
	if !last.GetOpened() || last.GetQuietFor().AsDuration() < 200*time.Millisecond || last.GetPool().GetOperatorClosed() {
		t.Errorf("last report %v, want opened after the 200 ms window", last)
	}
	if closed, _ := ctrl.Closed("paid"); closed {
		t.Error("paid still closed after the reopen")
	}
}

// Status gathers each of its parts from its source: this replica's pools and breakers,
// the dead letters, the replicas' configuration versions and the controls from the
// store; with no modelproxy replica known, no decoder.
func TestStatusGathersEveryPart(t *testing.T) {
	ctx := t.Context()
	// The retry windows and the breakers' probe leases are coordinated on a store of
	// their own, which the test stops after the orchestrator took a window of modelproxy.
	coord, err := memory.Open(ctx, "memory://"+t.Name()+"-coord")
	if err != nil {
		t.Fatal(err)
	}
	windows, err := retrywindow.New(retrywindow.Config{Store: coord, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = windows.Close(context.Background()) })
	windows.Known("subagent")
	if err := windows.AllowRetry(ctx, "modelproxy"); err != nil {
		t.Fatalf("a window of modelproxy: %v", err)
	}
	breakers := breaker.NewSet(breaker.Config{ConsecutiveFailures: 2, OpenTimeout: time.Minute}, nil)
	if err := breakers.Coordinate(ctx, breaker.Coordination{Store: coord}); err != nil {
		t.Fatal(err)
	}
	breakers.Get("toolrunner")
	_ = coord.Close() // every store call of the coordination fails from now on
	if err := windows.AllowRetry(ctx, "toolrunner"); !errors.Is(err, retrywindow.ErrStoreDown) {
		t.Fatalf("a retry of toolrunner with the store down: %v, want ErrStoreDown", err)
	}
	mp := breakers.Get("modelproxy")
	for range 2 {
		done, err := mp.Allow(ctx)
		if err != nil {
			t.Fatal(err)
		}
		done(status.Error(codes.Unavailable, "down"))
	}
	for deadline := time.Now().Add(5 * time.Second); !mp.CoordinationDegraded(); time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the open breaker of modelproxy did not find the store down within 5 s")
		}
	}
	s, _, st := rig(t, func(c *admin.Config) { c.Breakers, c.RetryWindows = breakers, windows })
	if _, _, err := st.AddDeadLetter(ctx, store.DeadLetter{Tenant: "acme", RunID: "r1", Step: "0", LastError: "boom"}); err != nil {
		t.Fatal(err)
	}
	if err := st.PutReplicaConfig(ctx, store.ReplicaConfig{Service: "orchestrator", Replica: "orch-2", Config: "admission", Version: "abc123",
		LoadedAt: time.Now()}); err != nil {
		t.Fatal(err)
	}
	if _, err := s.FreezeLedger(ctx, &adminv1.FreezeLedgerRequest{Tenant: "acme", Reason: "leak"}); err != nil {
		t.Fatal(err)
	}
	if _, err := s.DrainDecoders(ctx, &adminv1.DrainDecodersRequest{Pool: "overflow", Reason: "drill"}); err != nil {
		t.Fatal(err)
	}
	// The store keeps milliseconds and counts what was recorded strictly after the
	// freeze: the tokens come a millisecond later, as any decoder's would.
	time.Sleep(2 * time.Millisecond)
	if _, err := st.AddTokens(ctx, store.LedgerEntry{Tenant: "acme", RunID: "r1", NodeID: "root/m0", Tokens: 5, Kind: store.KindOrphan, Key: "o1"}); err != nil {
		t.Fatal(err)
	}
	if _, err := s.ClosePool(ctx, &adminv1.ClosePoolRequest{Pool: "overflow", Reason: "drill"}); err != nil {
		t.Fatal(err)
	}

	out, err := s.Status(ctx, &adminv1.StatusRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if out.GetReplica() != "orch-1" || out.GetDeadLetterDepth() != 1 || out.GetOrphanDelta() != 5 || out.GetOrphanWindow().AsDuration() != time.Minute {
		t.Errorf("status header: replica %q, dead letters %d, orphan delta %d over %v", out.GetReplica(), out.GetDeadLetterDepth(),
			out.GetOrphanDelta(), out.GetOrphanWindow().AsDuration())
	}
	if len(out.GetPools()) != 2 || out.GetPools()[1].GetPool() != "overflow" || !out.GetPools()[1].GetOperatorClosed() {
		t.Errorf("pools %v", out.GetPools())
	}
	if b := out.GetBreakers(); len(b) != 2 || b[0].GetService() != "orchestrator" || b[0].GetTarget() != "modelproxy" || b[0].GetState() != "open" ||
		b[1].GetTarget() != "toolrunner" || b[1].GetState() != "closed" {
		t.Errorf("breakers %v", b)
	}
	// Coordination: the retry windows by target, then the breakers' probe leases.
	want := []struct {
		part, target string
		degraded     bool
		held         bool
		detail       string
	}{
		{admin.PartRetryWindow, "modelproxy", false, true, "held for"},
		{admin.PartRetryWindow, "subagent", false, false, "no window held; 1 window(s) of 10s across replicas"},
		{admin.PartRetryWindow, "toolrunner", true, false, "store unreachable: retries that need a window are refused; 1 retries refused"},
		{admin.PartBreakerProbe, "modelproxy", true, false, "store unreachable: probes on its own"},
		{admin.PartBreakerProbe, "toolrunner", false, false, "one probe per open period across replicas"},
	}
	co := out.GetCoordination()
	if len(co) != len(want) {
		t.Fatalf("coordination %v, want %d entries", co, len(want))
	}
	for i, w := range want {
		c := co[i]
		if c.GetService() != "orchestrator" || c.GetReplica() != "orch-1" || c.GetPart() != w.part || c.GetTarget() != w.target ||
			c.GetDegraded() != w.degraded || c.GetHeld() != w.held || !strings.Contains(c.GetDetail(), w.detail) {
			t.Errorf("coordination[%d] = %v, want %s %s degraded %v held %v, detail with %q", i, c, w.part, w.target, w.degraded, w.held, w.detail)
		}
		if w.degraded != (c.GetSince() != nil) {
			t.Errorf("coordination[%d] = %v: since %v, want it set exactly when degraded", i, c, c.GetSince())
		}
	}
	if until := co[0].GetUntil().AsTime(); until.Before(time.Now()) || until.After(time.Now().Add(10*time.Second)) {
		t.Errorf("the held window ends at %v, want within its 10 s length", until)
	}
	if c := out.GetConfigs(); len(c) != 1 || c[0].GetReplica() != "orch-2" || c[0].GetVersion() != "abc123" {
		t.Errorf("configs %v", c)
	}
	if f := out.GetFreezes(); len(f) != 1 || f[0].GetTenant() != "acme" || f[0].GetReason() != "leak" || f[0].GetTokensAfterFreeze() != 5 {
		t.Errorf("freezes %v", f)
	}
	if d := out.GetDrains(); len(d) != 1 || d[0].GetPool() != "overflow" {
		t.Errorf("drains %v", d)
	}
	if len(out.GetLeases()) != 0 || len(out.GetUnreachable()) != 0 {
		t.Errorf("leases %v, unreachable %v; want none without modelproxy replicas", out.GetLeases(), out.GetUnreachable())
	}
}
