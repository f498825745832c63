package e2e

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
)

// budgetTokens is the default tenant's budget in TestBudgetStopsRunMidway. The plan below
// expects 170 output tokens (root 20 + A 120 + B 30), so admission, which reserves the
// plan's output tokens, lets it start; but the sim model also charges prompt tokens (one
// per word of the conversation), and A's later steps re-read its earlier thinking, so
// the run needs far more than the budget (A's third call alone needs > 120).
const budgetTokens = 180

// Subagent A thinks in short steps and soon overruns the budget; subagent B sleeps for
// far longer than the test waits, so it is still running when the budget stops the run.
const budgetPlan = `{"tokens_per_second":1000,"steps":[` +
	`{"think_tokens":20,"tools":[` +
	`{"name":"spawn_subagent","args":{"plan":{"tokens_per_second":1000,"steps":[` +
	`{"think_tokens":40,"tools":[{"name":"sleep","args":{"ms":20}}]},` +
	`{"think_tokens":40,"tools":[{"name":"sleep","args":{"ms":20}}]},` +
	`{"answer_tokens":40}]}}},` +
	`{"name":"spawn_subagent","args":{"plan":{"tokens_per_second":1000,"steps":[` +
	`{"think_tokens":10,"tools":[{"name":"sleep","args":{"ms":20000}}]},` +
	`{"answer_tokens":10}]}}}]},` +
	`{"answer_tokens":10}]}`

// A run that fits its tenant's budget at admission but overruns it mid-run (issue 21's
// acceptance): modelproxy refuses the model call the budget cannot cover before it
// starts, the run's tree is cancelled with cause budget, the run ends CANCELLED budget,
// every node still running at the stop ends with cause budget, no model call starts after
// the stop, and the tenant's ledger total (prompt + output) stays within the budget.
func TestBudgetStopsRunMidway(t *testing.T) {
	t.Parallel()
	adm := filepath.Join(t.TempDir(), "admission.json")
	if err := os.WriteFile(adm, []byte(`{"pools": [{"name": "paid", "max_in_flight": 8}],
	  "default_tenant": {"token_budget": 180, "window": "1h"}}`), 0o600); err != nil {
		t.Fatal(err)
	}
	m := startOwnMesh(t, "CURFEW_ADMISSION_CONFIG="+adm)
	oc, err := m.Orchestrator()
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	start := time.Now()
	r := runToSummary(ctx, t, oc, &orchestratorv1.RunRequest{Task: budgetPlan})
	took := time.Since(start)

	if r.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_CANCELLED || r.GetCause() != meshv1.CancelCause_CANCEL_CAUSE_BUDGET {
		t.Fatalf("run ended %v cause %v (%s: %s), want CANCELLED cause budget", r.GetStatus(), r.GetCause(), r.GetErrorCode(), r.GetErrorMessage())
	}
	if took > 15*time.Second {
		t.Errorf("the run took %v: B's 20 s sleep was not stopped by the budget's cancel", took)
	}
	if r.GetCancelledAt() == nil {
		t.Fatal("no cancel instant on the run")
	}
	stop := r.GetCancelledAt().AsTime()
	refused := 0
	for _, n := range r.GetNodes() {
		started, ended := n.GetStartedAt().AsTime(), n.GetEndedAt().AsTime()
		if n.GetKind() == meshv1.NodeKind_NODE_KIND_MODEL && started.After(stop) {
			t.Errorf("model node %s started %v after the stop", n.GetId(), started.Sub(stop))
		}
		if n.GetKind() == meshv1.NodeKind_NODE_KIND_MODEL && n.GetErrorCode() == "RESOURCE_EXHAUSTED" {
			refused++
			if n.GetTokens() != 0 || n.GetPromptTokens() != 0 {
				t.Errorf("refused model node %s spent %d + %d tokens", n.GetId(), n.GetPromptTokens(), n.GetTokens())
			}
		}
		runningAtStop := !started.After(stop) && (n.GetEndedAt() == nil || ended.After(stop))
		stopped := n.GetStatus() == meshv1.NodeStatus_NODE_STATUS_CANCELLED || n.GetStatus() == meshv1.NodeStatus_NODE_STATUS_DEADLINE_EXCEEDED
		if (runningAtStop || stopped) && n.GetCause() != meshv1.CancelCause_CANCEL_CAUSE_BUDGET {
			t.Errorf("node %s (%v, running at the stop %v) has cause %v, want budget", n.GetId(), n.GetStatus(), runningAtStop, n.GetCause())
		}
		if n.GetStatus() == meshv1.NodeStatus_NODE_STATUS_RUNNING {
			t.Errorf("node %s still running in the summary", n.GetId())
		}
	}
	if refused != 1 {
		t.Errorf("%d model calls refused for the budget, want 1 (the loops stop at the first)", refused)
	}
	// B's sleep was under way, and was stopped for the budget.
	sleeping := false
	for _, n := range r.GetNodes() {
		if n.GetName() == "sleep" && n.GetStatus() == meshv1.NodeStatus_NODE_STATUS_CANCELLED {
			sleeping = true
		}
	}
	if !sleeping {
		t.Error("no sleep tool was cancelled: the test did not stop a running sibling")
	}
	if total := r.GetTokens() + r.GetPromptTokens(); total > budgetTokens || r.GetPromptTokens() == 0 {
		t.Errorf("the ledger's total for the tenant is %d (%d output + %d prompt), want ≤ %d with prompt tokens counted",
			total, r.GetTokens(), r.GetPromptTokens(), budgetTokens)
	}
	t.Logf("run %s: %v, %d output + %d prompt tokens of %d, stopped %v after the start",
		r.GetRunId(), took.Round(time.Millisecond), r.GetTokens(), r.GetPromptTokens(), budgetTokens, stop.Sub(r.GetCreatedAt().AsTime()).Round(time.Millisecond))
}
