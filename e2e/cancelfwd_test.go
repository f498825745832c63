package e2e

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/protobuf/types/known/durationpb"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	"github.com/curfew-mesh/curfew/internal/meshproc"
	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/mesh/store"
	"github.com/curfew-mesh/curfew/mesh/store/storetest"
)

// A CancelRun that reaches an orchestrator which does not own the run (behind a Kubernetes
// Service, any replica may receive it) is forwarded to the owner, whose address its lease
// names; when the owner is dead, the cancel is kept and the orchestrator that takes the run
// over ends it cancelled instead of resuming it.

// cancelFwdPlan: kv_put, then a long sleep the cancel interrupts, then a notify that must
// never happen.
func cancelFwdPlan(tag string) string {
	return fmt.Sprintf(`{"tokens_per_second": 100, "steps": [
	  {"think_tokens": 5, "tools": [{"name": "kv_put", "args": {"key": "%s", "value": 1}}]},
	  {"think_tokens": 5, "tools": [{"name": "sleep", "args": {"ms": 30000}}]},
	  {"think_tokens": 5, "tools": [{"name": "notify", "args": {"channel": "%s", "message": "must not happen"}}]},
	  {"answer_tokens": 3}]}`, tag, tag)
}

// startOne starts one detached run on p and waits until its sleep has begun (three
// checkpoints: the first model step, its kv_put, the second model step).
func startOne(t *testing.T, r *crashRig, p *meshproc.Proc, tag string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	resp, err := r.client(p).StartRun(ctx, &orchestratorv1.StartRunRequest{Task: cancelFwdPlan(tag),
		IdempotencyKey: tag, Timeout: durationpb.New(60 * time.Second)})
	if err != nil {
		t.Fatal(err)
	}
	r.runIDs = []string{resp.GetRun().GetRunId()}
	r.waitCheckpoints(3)
	return resp.GetRun().GetRunId()
}

func checkCancelled(t *testing.T, r *crashRig, run *orchestratorv1.Run, tag string) store.Run {
	t.Helper()
	if run.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_CANCELLED || run.GetCause() != meshv1.CancelCause_CANCEL_CAUSE_OPERATOR {
		t.Errorf("CancelRun answered %s (cause %s), want CANCELLED by the operator", run.GetStatus(), run.GetCause())
	}
	stored, err := r.st.GetRun(context.Background(), md.DefaultTenant, run.GetRunId())
	if err != nil {
		t.Fatal(err)
	}
	if stored.Status != store.StatusCancelled || stored.Cause != "operator" {
		t.Errorf("stored run %s (cause %q), want cancelled by the operator", stored.Status, stored.Cause)
	}
	// Give a wrongly resumed run time to reach its notify: none may happen.
	time.Sleep(time.Second)
	if rows := outboxFor(t, r.st, tag); len(rows) != 0 {
		t.Errorf("%d notifications on %s after the cancel, want none", len(rows), tag)
	}
	return stored
}

func TestCancelRunIsForwardedToTheRunsOwner(t *testing.T) {
	r := newCrashRig(t, storetest.PostgresDSN(t))
	a, b := r.orchestrator("orchestrator-a"), r.orchestrator("orchestrator-b")
	tag := fmt.Sprintf("cancelfwd-%d", time.Now().UnixNano())
	id := startOne(t, r, a, tag)

	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	begin := time.Now()
	resp, err := r.client(b).CancelRun(ctx, &orchestratorv1.CancelRunRequest{RunId: id, Reason: "e2e: via another replica"})
	took := time.Since(begin)
	if err != nil {
		t.Fatalf("CancelRun via orchestrator-b: %v", err)
	}
	stored := checkCancelled(t, r, resp.GetRun(), tag)
	if stored.Epoch != 1 {
		t.Errorf("run at epoch %d, want 1: its owner, orchestrator-a, ended it", stored.Epoch)
	}
	// The owner's own cancel path: a forwarded call, not a wait for the leaves.
	if took > 5*time.Second {
		t.Errorf("CancelRun took %v", took)
	}
	if log := readLog(t, r.c, "orchestrator-b"); !strings.Contains(log, "through its owner") {
		t.Errorf("orchestrator-b did not forward the cancel to the owner; its log:\n%s", log)
	}
	if log := readLog(t, r.c, "orchestrator-a"); !strings.Contains(log, `"run cancelled by operator"`) {
		t.Errorf("orchestrator-a did not cancel the run itself; its log:\n%s", log)
	}
	t.Logf("CancelRun via the other replica took %v", took.Round(time.Millisecond))
}

func TestCancelRunOfADeadOwnersRunIsNotLost(t *testing.T) {
	r := newCrashRig(t, storetest.PostgresDSN(t))
	a, b := r.orchestrator("orchestrator-a"), r.orchestrator("orchestrator-b")
	tag := fmt.Sprintf("cancelfwd-dead-%d", time.Now().UnixNano())
	id := startOne(t, r, a, tag)
	if err := a.Kill(); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	resp, err := r.client(b).CancelRun(ctx, &orchestratorv1.CancelRunRequest{RunId: id, Reason: "e2e: owner dead"})
	if err != nil {
		t.Fatalf("CancelRun via orchestrator-b: %v", err)
	}
	stored := checkCancelled(t, r, resp.GetRun(), tag)
	if stored.Epoch < 2 {
		t.Errorf("run at epoch %d, want it taken over (≥ 2) by orchestrator-b", stored.Epoch)
	}
	if !b.Running() {
		t.Error("orchestrator-b is not running")
	}
}

func readLog(t *testing.T, c *meshproc.Cluster, name string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(c.Dir, name+".log"))
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}
