package e2e

import (
	"context"
	"fmt"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/types/known/durationpb"

	adminv1 "github.com/curfew-mesh/curfew/gen/curfew/admin/v1"
	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	"github.com/curfew-mesh/curfew/mesh/apikey"
	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/mesh/store"
	"github.com/curfew-mesh/curfew/mesh/store/storetest"
)

// approvalPlan notifies on channel, a call that waits for a human's approval, then
// answers.
func approvalPlan(channel string) string {
	return fmt.Sprintf(`{"tokens_per_second": 200, "steps": [
	  {"think_tokens": 2, "tools": [{"name": "notify", "args": {"channel": %q, "message": "drop the table"}, "approval": true}]},
	  {"answer_tokens": 2}]}`, channel)
}

const approvalNode = "root/s0.t0"

// curfewCLI runs the curfew command on the shared mesh and returns its stdout.
func curfewCLI(ctx context.Context, t *testing.T, args ...string) (string, error) {
	t.Helper()
	cmd := exec.CommandContext(ctx, filepath.Join(mesh.Bin, "curfew"), append(args, "--data-dir", mesh.Dir)...)
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return string(out), fmt.Errorf("curfew %s: %w: %s", strings.Join(args, " "), err, stderr.String())
	}
	return string(out), nil
}

// waitPendingCLI waits until `curfew approvals ls --run ID` lists the run's request.
func waitPendingCLI(ctx context.Context, t *testing.T, runID string) *adminv1.Approval {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		out, err := curfewCLI(ctx, t, "approvals", "ls", "--run", runID, "--json")
		if err != nil {
			t.Fatal(err)
		}
		var resp adminv1.ListApprovalsResponse
		if err := protojson.Unmarshal([]byte(out), &resp); err != nil {
			t.Fatalf("curfew approvals ls printed %s: %v", out, err)
		}
		if as := resp.GetApprovals(); len(as) == 1 {
			return as[0]
		}
		if time.Now().After(deadline) {
			t.Fatalf("run %s has no pending approval after 30s: %s", runID, out)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

func startDetached(ctx context.Context, t *testing.T, oc orchestratorv1.OrchestratorServiceClient, plan string, timeout time.Duration) string {
	t.Helper()
	resp, err := oc.StartRun(ctx, &orchestratorv1.StartRunRequest{Task: plan, Timeout: durationpb.New(timeout)})
	if err != nil {
		t.Fatal(err)
	}
	return resp.GetRun().GetRunId()
}

func toolNode(run *orchestratorv1.Run) *meshv1.Node {
	for _, n := range run.GetNodes() {
		if n.GetId() == approvalNode {
			return n
		}
	}
	return nil
}

// Approval gates on the shared mesh, through the CLI: approved, the notify happens
// once; denied, never, and the run's error is the denial with its reason; no decision,
// the call is denied at its cap with cause approval_timeout, before the run's deadline.
func TestApprovalGates(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	oc := client(t)
	st := openMeshStore(t)
	tag := uuid.NewString()[:8]

	t.Run("approve", func(t *testing.T) {
		ch := "appr-ok-" + tag
		// A streamed run, so that its events are seen from the start.
		rctx, stop := context.WithTimeout(ctx, time.Minute)
		defer stop()
		rs, err := oc.Run(rctx, &orchestratorv1.RunRequest{Task: approvalPlan(ch)})
		if err != nil {
			t.Fatal(err)
		}
		first, err := rs.Recv()
		if err != nil || first.GetStarted() == nil {
			t.Fatalf("first event %v, %v", first, err)
		}
		id := first.GetStarted().GetRunId()
		gates := make(chan []string, 1)
		go func() {
			var states []string
			for {
				ev, err := rs.Recv()
				if err != nil {
					gates <- states
					return
				}
				if g := ev.GetNodeEvent().GetApproval(); g != nil && ev.GetNodeEvent().GetNodeId() == approvalNode {
					states = append(states, g.GetState()+" "+g.GetWhy()+" "+g.GetDecidedBy())
				}
			}
		}()
		a := waitPendingCLI(ctx, t, id)
		if a.GetNodeId() != approvalNode || a.GetTool() != "notify" || a.GetWhy() != "plan" || a.GetExpiresAt() == nil {
			t.Fatalf("request %v", a)
		}
		if n := len(outboxFor(t, st, ch)); n != 0 {
			t.Fatalf("%d notifications before the approval", n)
		}
		if _, err := curfewCLI(ctx, t, "approve", id, approvalNode, "--reason", "checked"); err != nil {
			t.Fatal(err)
		}
		run := summary(ctx, t, oc, id)
		if run.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_SUCCEEDED {
			t.Fatalf("run %s ended %v: %s", id, run.GetStatus(), run.GetErrorMessage())
		}
		if n := len(outboxFor(t, st, ch)); n != 1 {
			t.Fatalf("%d notifications, want exactly 1", n)
		}
		// The run's stream carried the gate's events: waiting, then approved by curfew-cli.
		if got := <-gates; strings.Join(got, "|") != "waiting_approval plan |approved plan mesh:curfew-cli" {
			t.Errorf("approval events %q", got)
		}
		// Approving again changes nothing; denying now is refused: the first decision stands.
		if _, err := curfewCLI(ctx, t, "approve", id, approvalNode); err != nil {
			t.Fatalf("approve again: %v", err)
		}
		if _, err := curfewCLI(ctx, t, "deny", id, approvalNode); err == nil || !strings.Contains(err.Error(), "FailedPrecondition") {
			t.Fatalf("deny after approve: %v, want FailedPrecondition", err)
		}
	})

	t.Run("deny", func(t *testing.T) {
		ch := "appr-no-" + tag
		id := startDetached(ctx, t, oc, approvalPlan(ch), time.Minute)
		waitPendingCLI(ctx, t, id)
		if _, err := curfewCLI(ctx, t, "deny", id, approvalNode, "--reason", "not on a friday"); err != nil {
			t.Fatal(err)
		}
		run := summary(ctx, t, oc, id)
		// The sim plan's step sees the denial as its tool's failure (a real model gets
		// it as the tool's result, {"error": ...}).
		if run.GetStatus() == orchestratorv1.RunStatus_RUN_STATUS_SUCCEEDED || !strings.Contains(run.GetErrorMessage(), "denied") ||
			!strings.Contains(run.GetErrorMessage(), "not on a friday") {
			t.Fatalf("run %s ended %v: %q, want the denial", id, run.GetStatus(), run.GetErrorMessage())
		}
		if n := toolNode(run); n == nil || !strings.Contains(n.GetErrorMessage(), "not on a friday") {
			t.Errorf("tool node %v, want the denial", n)
		}
		time.Sleep(200 * time.Millisecond)
		if n := len(outboxFor(t, st, ch)); n != 0 {
			t.Fatalf("a denied notify was sent %d times", n)
		}
	})

	t.Run("timeout", func(t *testing.T) {
		ch := "appr-late-" + tag
		id := startDetached(ctx, t, oc, approvalPlan(ch), 4*time.Second)
		waitPendingCLI(ctx, t, id)
		run := summary(ctx, t, oc, id)
		if !run.GetEndedAt().AsTime().Before(run.GetDeadline().AsTime()) {
			t.Errorf("run ended at %v, not before its deadline %v", run.GetEndedAt().AsTime(), run.GetDeadline().AsTime())
		}
		if !strings.Contains(run.GetErrorMessage(), "approval_timeout") {
			t.Errorf("run %s ended %v: %q, want approval_timeout", id, run.GetStatus(), run.GetErrorMessage())
		}
		if n := toolNode(run); n == nil || n.GetCause() != meshv1.CancelCause_CANCEL_CAUSE_APPROVAL_TIMEOUT {
			t.Errorf("tool node %v, want cause approval_timeout", n)
		}
		as, err := st.ListApprovals(ctx, store.ApprovalQuery{RunID: id})
		if err != nil || len(as) != 1 || as[0].State != store.ApprovalTimedOut {
			t.Fatalf("requests %+v, %v", as, err)
		}
		if _, err := curfewCLI(ctx, t, "approve", id, approvalNode); err == nil {
			t.Error("an approval after the cap was accepted")
		}
		if n := len(outboxFor(t, st, ch)); n != 0 {
			t.Fatalf("a timed-out notify was sent %d times", n)
		}
	})
}

// Two orchestrators on one PostgreSQL; the one that owns a run waiting for approval is
// SIGKILLed: the other takes the run over, its re-sent call finds the same request and
// keeps waiting, and the approval, given through the survivor's admin API, takes effect
// exactly once.
func TestApprovalSurvivesTakeover(t *testing.T) {
	r := newCrashRig(t, storetest.PostgresDSN(t))
	a, b := r.orchestrator("orchestrator-a"), r.orchestrator("orchestrator-b")
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	ch := "appr-takeover-" + r.tag
	id := startDetached(ctx, t, r.client(a), approvalPlan(ch), 40*time.Second)

	waitRequest := func(what string, ok func(store.Run, []store.Approval) bool) []store.Approval {
		t.Helper()
		deadline := time.Now().Add(30 * time.Second)
		for {
			run, err := r.st.GetRun(ctx, md.DefaultTenant, id)
			as, lerr := r.st.ListApprovals(ctx, store.ApprovalQuery{RunID: id})
			if err == nil && lerr == nil && ok(run, as) {
				return as
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s: not within 30s (run %+v, requests %+v, %v %v)", what, run, as, err, lerr)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	before := waitRequest("a pending request", func(_ store.Run, as []store.Approval) bool {
		return len(as) == 1 && as[0].State == store.ApprovalPending
	})
	if err := a.Kill(); err != nil {
		t.Fatal(err)
	}
	waitRequest("the takeover", func(run store.Run, _ []store.Approval) bool { return run.Epoch > 1 && run.Owner != "" })
	time.Sleep(time.Second) // the new owner's call is on its way to the request
	after := waitRequest("the same request, still pending", func(_ store.Run, as []store.Approval) bool {
		return len(as) == 1 && as[0].State == store.ApprovalPending
	})
	if !after[0].RequestedAt.Equal(before[0].RequestedAt) || after[0].IdempotencyKey != before[0].IdempotencyKey {
		t.Fatalf("the request changed across the takeover: %+v, then %+v", before[0], after[0])
	}
	if n := len(outboxFor(t, r.st, ch)); n != 0 {
		t.Fatalf("%d notifications before the approval", n)
	}

	// An operator approves through the surviving orchestrator's admin API.
	k, err := apikey.New("ops-" + r.tag)
	if err != nil {
		t.Fatal(err)
	}
	k.Record.Scopes = []string{store.ScopeAdmin}
	if _, _, err := r.st.CreateAPIKey(ctx, k.Record, false); err != nil {
		t.Fatal(err)
	}
	cc, err := grpc.NewClient(b.Addr, grpc.WithTransportCredentials(insecure.NewCredentials()), grpc.WithPerRPCCredentials(apikey.Bearer(k.Secret)))
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = cc.Close() }()
	if _, err := adminv1.NewAdminServiceClient(cc).DecideApproval(ctx, &adminv1.DecideApprovalRequest{RunId: id, NodeId: approvalNode,
		Approve: true, Reason: "after the takeover"}); err != nil {
		t.Fatal(err)
	}
	r.runIDs = []string{id}
	run := r.waitEnded(30 * time.Second)[0]
	if run.Status != store.StatusSucceeded || run.Epoch < 2 {
		t.Fatalf("run ended %s at epoch %d: %s %s", run.Status, run.Epoch, run.Cause, run.Error)
	}
	if n := len(outboxFor(t, r.st, ch)); n != 1 {
		t.Fatalf("%d notifications, want exactly 1", n)
	}
}

// The registry gates a tool its MCP server annotates destructiveHint: true explicitly
// (mcptest's drop), and one the tools file marks "approval": true (wait), but not one
// whose annotations leave destructiveHint out (echo): MCP's default of true is not a claim.
func TestApprovalFromRegistry(t *testing.T) {
	recFile := filepath.Join(t.TempDir(), "record.jsonl")
	cfg := fmt.Sprintf(`[{"name": "mcptest", "kind": "mcp_stdio", "command": %q, "args": ["--record", %q],
	  "tools": {"wait": {"approval": true}}}]`, mcptestBin(t), recFile)
	r := newToolsRig(t, cfg)
	r.waitSource("mcptest")
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()

	res, _ := runPlan(ctx, r.orch, toolPlan(`{"name": "mcptest__echo", "args": {"text": "hi"}}`), 20*time.Second, 0, false)
	if res.err != nil || res.finished.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_SUCCEEDED {
		t.Fatalf("echo: %v\n%s", res.err, dump(res.finished))
	}
	if as, err := r.st.ListApprovals(ctx, store.ApprovalQuery{RunID: res.finished.GetRunId()}); err != nil || len(as) != 0 {
		t.Fatalf("echo asked for approval: %+v, %v", as, err)
	}

	for _, c := range []struct{ tool, args, why string }{
		{"mcptest__drop", `{"text": "the table"}`, "destructive_hint"},
		{"mcptest__wait", `{"ms": 1}`, "registry"},
	} {
		id := startDetached(ctx, t, r.orch, toolPlan(fmt.Sprintf(`{"name": %q, "args": %s}`, c.tool, c.args)), 40*time.Second)
		var a store.Approval
		deadline := time.Now().Add(30 * time.Second)
		for {
			as, err := r.st.ListApprovals(ctx, store.ApprovalQuery{RunID: id, PendingOnly: true})
			if err == nil && len(as) == 1 {
				a = as[0]
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s: no pending approval within 30s (%+v, %v)", c.tool, as, err)
			}
			time.Sleep(50 * time.Millisecond)
		}
		if a.Why != c.why || a.Tool != c.tool {
			t.Errorf("%s: request %+v, want why %s", c.tool, a, c.why)
		}
		if _, err := r.st.DecideApproval(ctx, store.ApprovalDecision{Tenant: a.Tenant, RunID: id, NodeID: firstTool, Approve: true, Actor: "key:e2e"}); err != nil {
			t.Fatal(err)
		}
		run := summary(ctx, t, r.orch, id)
		if run.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_SUCCEEDED {
			t.Fatalf("%s: run ended %v: %s", c.tool, run.GetStatus(), run.GetErrorMessage())
		}
	}
}
