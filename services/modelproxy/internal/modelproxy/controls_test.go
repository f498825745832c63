package modelproxy

import (
	"context"
	"errors"
	"log/slog"
	"sync"
	"testing"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	modelproxyv1 "github.com/curfew-mesh/curfew/gen/curfew/modelproxy/v1"
	"github.com/curfew-mesh/curfew/mesh"
	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/mesh/meshtest"
	"github.com/curfew-mesh/curfew/mesh/store"
)

// testPoll is the controls' poll interval in these tests; controlBound is how long a
// control may take to act on a loaded machine: a poll and a generous margin.
const (
	testPoll     = 50 * time.Millisecond
	controlBound = testPoll + 2*time.Second
)

// shortPlan answers at once.
const shortPlan = `{"steps":[{"answer_tokens":3}]}`

// fakeControls is a ControlLister whose controls the test sets.
type fakeControls struct {
	mu  sync.Mutex
	cs  []store.Control
	err error
}

func (f *fakeControls) set(cs ...store.Control) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.cs = cs
}

func (f *fakeControls) fail(err error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.err = err
}

func (f *fakeControls) ListControls(context.Context) ([]store.Control, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]store.Control(nil), f.cs...), f.err
}

// controlEnv is a served modelproxy that polls fc every testPoll until the test ends.
func controlEnv(t *testing.T) (*env, *fakeControls) {
	t.Helper()
	e := newEnv(t, mesh.ServerConfig{})
	e.srv.Log = slog.New(slog.DiscardHandler)
	e.srv.Replica = "mp-test"
	fc := &fakeControls{}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		e.srv.WatchControls(ctx, fc, testPoll)
	}()
	t.Cleanup(func() { cancel(); <-done })
	return e, fc
}

// poolCtx is a call context of tenant's run and node, in pool.
func poolCtx(tenant, run, node, pool string) context.Context {
	return md.WithIdentity(context.Background(), md.Identity{Tenant: tenant, RunID: run, NodeID: node, Pool: pool})
}

// waitDecoders waits until the server runs n decoders.
func waitDecoders(t *testing.T, s *Server, n int) {
	t.Helper()
	for end := time.Now().Add(5 * time.Second); len(s.decoders.list(nil)) != n; {
		if time.Now().After(end) {
			t.Fatalf("the server runs %d decoders, want %d", len(s.decoders.list(nil)), n)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// waitControls waits until the server has read a control set that satisfies ok.
func waitControls(t *testing.T, s *Server, ok func(*controlSet) bool) {
	t.Helper()
	for end := time.Now().Add(controlBound); !ok(s.controls.Load()); {
		if time.Now().After(end) {
			t.Fatal("the server did not read the controls in time")
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// started runs a long decoder in the background and returns what its stream ends with.
func started(ctx context.Context, t *testing.T, e *env) <-chan error {
	t.Helper()
	st, err := e.model.Generate(ctx, &modelproxyv1.GenerateRequest{Messages: conversation(longPlan, 0)})
	if err != nil {
		t.Fatal(err)
	}
	out := make(chan error, 1)
	go func() {
		_, err := meshtest.Drain(st)
		out <- err
	}()
	return out
}

// wantRefused checks err is FAILED_PRECONDITION with ErrorInfo reason.
func wantRefused(t *testing.T, err error, reason string, contains ...string) {
	t.Helper()
	meshtest.WantCode(t, err, codes.FailedPrecondition, contains...)
	for _, d := range status.Convert(err).Details() {
		if ei, ok := d.(*errdetails.ErrorInfo); ok && ei.GetReason() == reason && ei.GetDomain() == "curfew.dev" {
			return
		}
	}
	t.Fatalf("%v: no ErrorInfo %s", err, reason)
}

func wantOperatorCancel(t *testing.T, e *env, run, node string, ended <-chan error) {
	t.Helper()
	select {
	case err := <-ended:
		meshtest.WantCode(t, err, codes.Canceled)
	case <-time.After(controlBound):
		t.Fatalf("the decoder of %s %s still runs %v after the control", run, node, controlBound)
	}
	n := meshtest.WaitNode(t, e.srv.Nodes, run, node)
	if n.GetStatus() != meshv1.NodeStatus_NODE_STATUS_CANCELLED || n.GetCause() != meshv1.CancelCause_CANCEL_CAUSE_OPERATOR {
		t.Fatalf("node = %v, want CANCELLED with cause OPERATOR", n)
	}
}

func TestFreezeRunStopsItsDecodersAndThawLetsThemStart(t *testing.T) {
	e, fc := controlEnv(t)
	frozen := started(poolCtx("acme", "r-frozen", "root/m0", "paid"), t, e)
	other := started(poolCtx("acme", "r-other", "root/m0", "paid"), t, e)
	waitDecoders(t, e.srv, 2)

	fc.set(store.Control{Kind: store.ControlFreezeRun, Target: "r-frozen", Tenant: "acme", Reason: "leak", CreatedAt: time.Now()})
	wantOperatorCancel(t, e, "r-frozen", "root/m0", frozen)
	// A new decoder of the frozen run is refused before it starts: no node, no lease.
	_, err := generate(poolCtx("acme", "r-frozen", "root/m1", "paid"), t, e.model, &modelproxyv1.GenerateRequest{Messages: conversation(shortPlan, 0)})
	wantRefused(t, err, ReasonLedgerFrozen, "run r-frozen of tenant acme is frozen", "leak")
	if n := e.srv.Nodes.Update("r-frozen", "root/m1", func(*meshv1.Node) {}); n != nil {
		t.Fatalf("a refused call left node %v", n)
	}
	// Another tenant's run of the same id is not frozen.
	if _, err := generate(poolCtx("globex", "r-frozen", "root/m1", "paid"), t, e.model, &modelproxyv1.GenerateRequest{Messages: conversation(shortPlan, 0)}); err != nil {
		t.Fatalf("another tenant's run: %v", err)
	}
	// The other run of the tenant goes on.
	select {
	case err := <-other:
		t.Fatalf("the other run's decoder ended: %v", err)
	default:
	}
	if got := len(e.srv.decoders.list(nil)); got != 1 {
		t.Fatalf("%d decoders run, want the other run's", got)
	}

	fc.set() // thawed
	waitControls(t, e.srv, func(c *controlSet) bool { _, ok := c.freeze("acme", "r-frozen"); return c != nil && !ok })
	if _, err := generate(poolCtx("acme", "r-frozen", "root/m2", "paid"), t, e.model, &modelproxyv1.GenerateRequest{Messages: conversation(shortPlan, 0)}); err != nil {
		t.Fatalf("after the thaw: %v", err)
	}
	if _, err := e.model.CancelDecoders(context.Background(), &modelproxyv1.CancelDecodersRequest{OlderThan: durationpb.New(time.Millisecond)}); err != nil {
		t.Fatal(err)
	}
	wantOperatorCancel(t, e, "r-other", "root/m0", other)
}

func TestFreezeTenantAndStoreErrorsKeepIt(t *testing.T) {
	e, fc := controlEnv(t)
	run := started(poolCtx("acme", "r-t", "root/m0", ""), t, e)
	waitDecoders(t, e.srv, 1)
	fc.set(store.Control{Kind: store.ControlFreezeTenant, Target: "acme", CreatedAt: time.Now()})
	wantOperatorCancel(t, e, "r-t", "root/m0", run)
	// A store that stops answering keeps the freeze.
	fc.fail(errors.New("store down"))
	fc.set()
	time.Sleep(3 * testPoll)
	_, err := generate(poolCtx("acme", "r-new", "root/m0", ""), t, e.model, &modelproxyv1.GenerateRequest{Messages: conversation(shortPlan, 0)})
	wantRefused(t, err, ReasonLedgerFrozen, "tenant acme is frozen")
	if _, err := generate(poolCtx("globex", "r-new", "root/m0", ""), t, e.model, &modelproxyv1.GenerateRequest{Messages: conversation(shortPlan, 0)}); err != nil {
		t.Fatalf("another tenant: %v", err)
	}
}

func TestDrainByPoolRefusesOnlyThatPool(t *testing.T) {
	e, fc := controlEnv(t)
	running := started(poolCtx("acme", "r-run", "root/m0", "overflow"), t, e)
	waitDecoders(t, e.srv, 1)
	fc.set(store.Control{Kind: store.ControlDrain, Target: "overflow", Reason: "rollback", CreatedAt: time.Now()})
	waitControls(t, e.srv, func(c *controlSet) bool { _, ok := c.drain("overflow"); return ok })
	_, err := generate(poolCtx("acme", "r-o", "root/m0", "overflow"), t, e.model, &modelproxyv1.GenerateRequest{Messages: conversation(shortPlan, 0)})
	wantRefused(t, err, ReasonDecodersDrained, "pool overflow", "rollback")
	for _, pool := range []string{"paid", ""} {
		if _, err := generate(poolCtx("acme", "r-p"+pool, "root/m0", pool), t, e.model, &modelproxyv1.GenerateRequest{Messages: conversation(shortPlan, 0)}); err != nil {
			t.Fatalf("pool %q: %v", pool, err)
		}
	}
	// Without a cancel-at the running decoder goes on.
	time.Sleep(3 * testPoll)
	select {
	case err := <-running:
		t.Fatalf("the running decoder ended under a drain without cancel-at: %v", err)
	default:
	}
	// A drain of every run refuses a run without a pool too.
	fc.set(store.Control{Kind: store.ControlDrain, Target: store.DrainAll, CreatedAt: time.Now()})
	waitControls(t, e.srv, func(c *controlSet) bool { _, ok := c.drain(""); return ok })
	_, err = generate(poolCtx("acme", "r-none", "root/m0", ""), t, e.model, &modelproxyv1.GenerateRequest{Messages: conversation(shortPlan, 0)})
	wantRefused(t, err, ReasonDecodersDrained, "every run")
	fc.set()
	waitControls(t, e.srv, func(c *controlSet) bool { _, ok := c.drain(""); return !ok })
	if _, err := e.model.CancelDecoders(context.Background(), &modelproxyv1.CancelDecodersRequest{OlderThan: durationpb.New(time.Millisecond)}); err != nil {
		t.Fatal(err)
	}
	wantOperatorCancel(t, e, "r-run", "root/m0", running)
}

func TestDrainCancelsAtItsBound(t *testing.T) {
	e, fc := controlEnv(t)
	covered := started(poolCtx("acme", "r-c", "root/m0", "overflow"), t, e)
	spared := started(poolCtx("acme", "r-s", "root/m0", "paid"), t, e)
	waitDecoders(t, e.srv, 2)
	const after = 400 * time.Millisecond
	set := time.Now()
	fc.set(store.Control{Kind: store.ControlDrain, Target: "overflow", CreatedAt: set, Until: set.Add(after)})
	wantOperatorCancel(t, e, "r-c", "root/m0", covered)
	if took := time.Since(set); took < after {
		t.Fatalf("the drained decoder was cancelled %v after the drain, before its cancel-at (%v)", took, after)
	}
	select {
	case err := <-spared:
		t.Fatalf("another pool's decoder ended: %v", err)
	default:
	}
	if _, err := e.model.CancelDecoders(context.Background(), &modelproxyv1.CancelDecodersRequest{OlderThan: durationpb.New(time.Millisecond)}); err != nil {
		t.Fatal(err)
	}
	wantOperatorCancel(t, e, "r-s", "root/m0", spared)
}

func TestListAndCancelDecodersOlderThan(t *testing.T) {
	e, _ := controlEnv(t)
	old := started(poolCtx("acme", "r-old", "root/m0", "overflow"), t, e)
	waitDecoders(t, e.srv, 1)
	time.Sleep(1500 * time.Millisecond)
	young := started(poolCtx("acme", "r-young", "root/m0", "paid"), t, e)
	waitDecoders(t, e.srv, 2)

	ctx := context.Background()
	ls, err := e.model.ListDecoders(ctx, &modelproxyv1.ListDecodersRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if ls.GetReplica() != "mp-test" || len(ls.GetDecoders()) != 2 {
		t.Fatalf("ListDecoders = %v, want two decoders of mp-test", ls)
	}
	d0 := ls.GetDecoders()[0]
	if d0.GetRunId() != "r-old" || d0.GetPool() != "overflow" || d0.GetTenant() != "acme" || d0.GetModel() != SimModel ||
		d0.GetProvider() != SimModel || d0.GetReplica() != "mp-test" || d0.GetStartedAt() == nil || d0.GetLastHeartbeat() == nil {
		t.Fatalf("first decoder = %v, want the old one, of pool overflow, sim", d0)
	}
	if d0.GetTokens() <= 0 {
		t.Errorf("the old decoder reports %d tokens, want its tokens so far", d0.GetTokens())
	}
	ls, err = e.model.ListDecoders(ctx, &modelproxyv1.ListDecodersRequest{OlderThan: durationpb.New(750 * time.Millisecond)})
	if err != nil {
		t.Fatal(err)
	}
	if len(ls.GetDecoders()) != 1 || ls.GetDecoders()[0].GetRunId() != "r-old" {
		t.Fatalf("ListDecoders older than 750ms = %v, want the old one", ls.GetDecoders())
	}

	for _, bad := range []*durationpb.Duration{nil, durationpb.New(0), durationpb.New(-time.Second)} {
		_, err := e.model.CancelDecoders(ctx, &modelproxyv1.CancelDecodersRequest{OlderThan: bad})
		meshtest.WantCode(t, err, codes.InvalidArgument, "older_than")
	}
	cr, err := e.model.CancelDecoders(ctx, &modelproxyv1.CancelDecodersRequest{OlderThan: durationpb.New(750 * time.Millisecond), Reason: "grace"})
	if err != nil {
		t.Fatal(err)
	}
	if len(cr.GetCancelled()) != 1 || cr.GetCancelled()[0].GetRunId() != "r-old" {
		t.Fatalf("CancelDecoders = %v, want the old one", cr)
	}
	wantOperatorCancel(t, e, "r-old", "root/m0", old)
	select {
	case err := <-young:
		t.Fatalf("the young decoder ended: %v", err)
	default:
	}
	cr, err = e.model.CancelDecoders(ctx, &modelproxyv1.CancelDecodersRequest{OlderThan: durationpb.New(time.Millisecond)})
	if err != nil || len(cr.GetCancelled()) != 1 {
		t.Fatalf("CancelDecoders 1ms = %v, %v; want the young one", cr, err)
	}
	wantOperatorCancel(t, e, "r-young", "root/m0", young)
	waitDecoders(t, e.srv, 0)
}
