package toolrunner

import (
	"context"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"google.golang.org/grpc/codes"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	toolrunnerv1 "github.com/curfew-mesh/curfew/gen/curfew/toolrunner/v1"
	"github.com/curfew-mesh/curfew/mesh"
	"github.com/curfew-mesh/curfew/mesh/cancel"
	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/mesh/meshtest"
	"github.com/curfew-mesh/curfew/mesh/store"
	"github.com/curfew-mesh/curfew/mesh/store/sqlite"
)

const notifyArgs = `{"channel": "ops", "message": "drop the table"}`

func approvalEnv(t *testing.T) (*env, store.Store) {
	t.Helper()
	s, err := sqlite.Open(context.Background(), filepath.Join(t.TempDir(), "curfew.db"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	return newEnv(t, mesh.ServerConfig{}, Config{Store: s, Owner: "test-owner", ApprovalPoll: 10 * time.Millisecond}), s
}

// gatedCall is one Execute of notify that asks for approval, with what it streamed.
type gatedCall struct {
	out    string
	err    error
	states []string // the ApprovalGate events' states, in order
	gates  []*meshv1.ApprovalGate
}

func callGated(ctx context.Context, e *env) gatedCall {
	st, err := e.tools.Execute(ctx, &toolrunnerv1.ExecuteRequest{Name: "notify", ArgsJson: notifyArgs, RequireApproval: true})
	if err != nil {
		return gatedCall{err: err}
	}
	evs, err := meshtest.Drain(st)
	c := gatedCall{err: err}
	for _, ev := range evs {
		if g := ev.GetNodeEvent().GetApproval(); g != nil {
			c.states, c.gates = append(c.states, g.GetState()), append(c.gates, g)
		}
		if r := ev.GetResult(); r != nil {
			c.out = r.GetOutputJson()
		}
	}
	return c
}

// goCall runs callGated in the background.
func goCall(ctx context.Context, e *env) <-chan gatedCall {
	ch := make(chan gatedCall, 1)
	go func() { ch <- callGated(ctx, e) }()
	return ch
}

// pending waits until run's node has a pending request and returns it.
func pending(t *testing.T, s store.Store, run, node string) store.Approval {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		as, err := s.ListApprovals(context.Background(), store.ApprovalQuery{PendingOnly: true, RunID: run})
		if err != nil {
			t.Fatal(err)
		}
		for _, a := range as {
			if a.NodeID == node {
				return a
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("no pending approval request of %s %s within 5s (have %+v)", run, node, as)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func decide(t *testing.T, s store.Store, run, node string, approve bool, reason string) {
	t.Helper()
	if _, err := s.DecideApproval(context.Background(), store.ApprovalDecision{Tenant: md.DefaultTenant, RunID: run, NodeID: node,
		Approve: approve, Actor: "key:ops", Reason: reason}); err != nil {
		t.Fatal(err)
	}
}

func outbox(t *testing.T, s store.Store) int {
	t.Helper()
	rows, err := s.ListOutbox(context.Background(), md.DefaultTenant, 0, 0)
	if err != nil {
		t.Fatal(err)
	}
	return len(rows)
}

func withDeadline(ctx context.Context, t *testing.T, d time.Duration) context.Context {
	ctx, stop := context.WithTimeout(ctx, d)
	t.Cleanup(stop)
	return ctx
}

// Approved: the effect happens once, and a repeat of the call replays it.
func TestApprovalApprovedRunsOnce(t *testing.T) {
	e, s := approvalEnv(t)
	ctx := withDeadline(ident("r-a", "root/s0.t0"), t, 30*time.Second)
	done := goCall(ctx, e)
	a := pending(t, s, "r-a", "root/s0.t0")
	if a.Why != "plan" || a.Tool != "notify" || a.ArgumentsJSON != notifyArgs || a.ExpiresAt.IsZero() {
		t.Fatalf("request %+v", a)
	}
	if outbox(t, s) != 0 {
		t.Fatal("the effect happened before the approval")
	}
	decide(t, s, "r-a", "root/s0.t0", true, "ok")
	c := <-done
	if c.err != nil || !strings.Contains(c.out, `"queued":true`) {
		t.Fatalf("approved call: %q, %v", c.out, c.err)
	}
	if strings.Join(c.states, ",") != "waiting_approval,approved" || c.gates[1].GetDecidedBy() != "key:ops" || c.gates[0].GetExpiresAt() == nil {
		t.Fatalf("events %v %v", c.states, c.gates)
	}
	// The same call again (a retry): the decision stands, the effect is not repeated.
	if c := callGated(ctx, e); c.err != nil {
		t.Fatal(c.err)
	}
	if n := outbox(t, s); n != 1 {
		t.Fatalf("%d notifications, want 1", n)
	}
	if v := testutil.ToFloat64(e.srv.approvals.WithLabelValues("approved")); v != 2 {
		t.Fatalf("approvals{approved} = %v, want 2", v)
	}
}

// Denied: never the effect, and the call's error is the denial with its reason.
func TestApprovalDenied(t *testing.T) {
	e, s := approvalEnv(t)
	ctx := withDeadline(ident("r-d", "root/s0.t0"), t, 30*time.Second)
	done := goCall(ctx, e)
	pending(t, s, "r-d", "root/s0.t0")
	decide(t, s, "r-d", "root/s0.t0", false, "not on a friday")
	c := <-done
	meshtest.WantCode(t, c.err, codes.FailedPrecondition, "denied by key:ops", "not on a friday")
	if strings.Join(c.states, ",") != "waiting_approval,denied" || c.gates[1].GetReason() != "not on a friday" {
		t.Fatalf("events %v", c.states)
	}
	if n := outbox(t, s); n != 0 {
		t.Fatalf("a denied call had its effect: %d notifications", n)
	}
	ns, _ := e.srv.Nodes.List(context.Background(), "r-d", nil, time.Second)
	if len(ns) != 1 || ns[0].GetStatus() != meshv1.NodeStatus_NODE_STATUS_FAILED {
		t.Fatalf("nodes %v", ns)
	}
}

// No decision before the cap (the deadline less notify's grace): timed out, denied with
// cause approval_timeout, before the deadline.
func TestApprovalTimeout(t *testing.T) {
	e, s := approvalEnv(t)
	start := time.Now()
	dl := start.Add(1500 * time.Millisecond)
	ctx, stop := context.WithDeadline(ident("r-t", "root/s0.t0"), dl)
	defer stop()
	c := callGated(ctx, e)
	ended := time.Now()
	meshtest.WantCode(t, c.err, codes.FailedPrecondition, "approval_timeout")
	if !ended.Before(dl) {
		t.Fatalf("the call ended at %v, after the deadline %v", ended.Sub(start), dl.Sub(start))
	}
	if strings.Join(c.states, ",") != "waiting_approval,approval_timeout" {
		t.Fatalf("events %v", c.states)
	}
	a, err := s.GetApproval(context.Background(), md.DefaultTenant, "r-t", "root/s0.t0", pending0(t, s, "r-t").IdempotencyKey)
	if err != nil || a.State != store.ApprovalTimedOut {
		t.Fatalf("request %+v, %v", a, err)
	}
	ns, _ := e.srv.Nodes.List(context.Background(), "r-t", nil, time.Second)
	if len(ns) != 1 || ns[0].GetCause() != meshv1.CancelCause_CANCEL_CAUSE_APPROVAL_TIMEOUT {
		t.Fatalf("nodes %v", ns)
	}
	// An approval after the cap changes nothing.
	if _, err := s.DecideApproval(context.Background(), store.ApprovalDecision{Tenant: md.DefaultTenant, RunID: "r-t", NodeID: "root/s0.t0",
		Approve: true, Actor: "key:ops"}); store.Code(err) != codes.Aborted {
		t.Fatalf("approve after the cap: %v", err)
	}
	if n := outbox(t, s); n != 0 {
		t.Fatalf("%d notifications, want 0", n)
	}
}

// pending0 returns run's one request, whatever its state.
func pending0(t *testing.T, s store.Store, run string) store.Approval {
	t.Helper()
	as, err := s.ListApprovals(context.Background(), store.ApprovalQuery{RunID: run})
	if err != nil || len(as) != 1 {
		t.Fatalf("requests of %s: %+v, %v", run, as, err)
	}
	return as[0]
}

// The run's cancel while waiting: the request is cancelled, no effect, and a late
// approval is refused.
func TestApprovalCancelledWhileWaiting(t *testing.T) {
	e, s := approvalEnv(t)
	ctx := withDeadline(ident("r-c", "root/s0.t0"), t, 30*time.Second)
	done := goCall(ctx, e)
	pending(t, s, "r-c", "root/s0.t0")
	waitRunning(t, e.srv.Nodes, "r-c", "root/s0.t0")
	e.srv.Nodes.CancelRun("r-c", nil, cancel.ErrOperator)
	c := <-done
	meshtest.WantCode(t, c.err, codes.Canceled)
	if a := pending0(t, s, "r-c"); a.State != store.ApprovalCancelled {
		t.Fatalf("request %+v", a)
	}
	if _, err := s.DecideApproval(context.Background(), store.ApprovalDecision{Tenant: md.DefaultTenant, RunID: "r-c", NodeID: "root/s0.t0",
		Approve: true, Actor: "key:ops"}); store.Code(err) != codes.Aborted {
		t.Fatalf("approve after the cancel: %v", err)
	}
	if n := outbox(t, s); n != 0 {
		t.Fatalf("%d notifications, want 0", n)
	}
}

// The caller goes away while waiting (its orchestrator died): the request stays
// pending; the call re-sent by the run's new owner finds the same request, keeps
// waiting, and an approval then takes effect once.
func TestApprovalResentAfterTakeover(t *testing.T) {
	e, s := approvalEnv(t)
	first, stop := context.WithCancel(withDeadline(ident("r-k", "root/s0.t0"), t, 30*time.Second))
	done := goCall(first, e)
	a := pending(t, s, "r-k", "root/s0.t0")
	stop()
	meshtest.WantCode(t, (<-done).err, codes.Canceled)
	if cur := pending0(t, s, "r-k"); cur.State != store.ApprovalPending {
		t.Fatalf("the request after its caller went away: %+v", cur)
	}
	again := goCall(withDeadline(ident("r-k", "root/s0.t0"), t, 30*time.Second), e)
	time.Sleep(50 * time.Millisecond) // it waits on the same request
	if as, _ := s.ListApprovals(context.Background(), store.ApprovalQuery{RunID: "r-k"}); len(as) != 1 || !as[0].RequestedAt.Equal(a.RequestedAt) {
		t.Fatalf("requests after the re-send: %+v", as)
	}
	decide(t, s, "r-k", "root/s0.t0", true, "")
	if c := <-again; c.err != nil {
		t.Fatal(c.err)
	}
	if n := outbox(t, s); n != 1 {
		t.Fatalf("%d notifications, want 1", n)
	}
}

// A gate needs a store other processes share: the decision comes from another one.
func TestApprovalNeedsSharedStore(t *testing.T) {
	e := newEnv(t, mesh.ServerConfig{}, Config{})
	c := callGated(withDeadline(ident("r-m", "root/s0.t0"), t, 30*time.Second), e)
	meshtest.WantCode(t, c.err, codes.FailedPrecondition, "--store")
}
