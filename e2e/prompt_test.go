package e2e

import (
	"context"
	"strings"
	"testing"
	"time"

	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
)

// A sim run through the real processes: each model node of the summary carries its
// prompt tokens (the sim model's rule: one per word of the messages sent) beside its
// output tokens, and the run sums both.
func TestSummaryPromptTokens(t *testing.T) {
	t.Parallel()
	const plan = `{"tokens_per_second": 500, "steps": [
	  {"think_tokens": 5, "tools": [{"name": "sleep", "args": {"ms": 10}}]},
	  {"answer_tokens": 7}]}`
	res, _ := runPlan(context.Background(), client(t), plan, 20*time.Second, 0, false)
	if res.err != nil || res.finished.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_SUCCEEDED {
		t.Fatalf("run: %v %v", res.err, res.finished.GetStatus())
	}
	r := res.finished
	ns := nodeMap(r)
	m0, m1 := ns["root/m0"], ns["root/m1"]
	// The first step's conversation is the task alone, as one user message.
	if want := int64(len(strings.Fields(plan))); m0.GetPromptTokens() != want || m0.GetTokens() != 5 {
		t.Fatalf("root/m0 prompt %d tokens %d, want %d and 5:\n%s", m0.GetPromptTokens(), m0.GetTokens(), want, dump(r))
	}
	// The second step's conversation adds the first step's answer and the tool's result.
	if m1.GetPromptTokens() <= m0.GetPromptTokens() || m1.GetTokens() != 7 {
		t.Fatalf("root/m1 prompt %d tokens %d, want more prompt than root/m0's %d and 7:\n%s",
			m1.GetPromptTokens(), m1.GetTokens(), m0.GetPromptTokens(), dump(r))
	}
	if r.GetPromptTokens() != m0.GetPromptTokens()+m1.GetPromptTokens() || r.GetTokens() != 12 {
		t.Fatalf("run prompt %d tokens %d, want the nodes' sums", r.GetPromptTokens(), r.GetTokens())
	}
	for _, n := range r.GetNodes() {
		if !strings.HasPrefix(n.GetId(), "root/m") && n.GetPromptTokens() != 0 {
			t.Errorf("node %s is no model node but has %d prompt tokens", n.GetId(), n.GetPromptTokens())
		}
	}
}
