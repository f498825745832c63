package modelproxy

import (
	"context"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	modelproxyv1 "github.com/curfew-mesh/curfew/gen/curfew/modelproxy/v1"
	"github.com/curfew-mesh/curfew/mesh"
	"github.com/curfew-mesh/curfew/mesh/admission"
	"github.com/curfew-mesh/curfew/mesh/budget"
	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/mesh/meshtest"
	"github.com/curfew-mesh/curfew/services/modelproxy/internal/provider/openaitest"
)

// acme returns a context whose outgoing calls are tenant acme's, of run and node.
func acme(run, node string) context.Context {
	return md.WithIdentity(context.Background(), md.Identity{Tenant: "acme", RunID: run, NodeID: node})
}

func withBudget(srv *Server, tokens int64) *budget.Memory {
	b := budget.NewMemory(admission.Config{Tenants: map[string]admission.TenantLimits{"acme": {TokenBudget: tokens}}}, budget.Options{})
	srv.Budgets = b
	return b
}

// One word of prompt (the plan is compact JSON) and 40 tokens per step: the sim's
// reservation is exact, prompt words + the step's tokens.
const budgetPlan = `{"tokens_per_second":2000,"steps":[{"think_tokens":40},{"think_tokens":40},{"answer_tokens":40}]}`

// Calls that fit the tenant's budget run and settle to what they spent; the call that
// does not fit is refused before any decoder starts, with a status that names the
// figures, and its node records the refusal with no tokens.
func TestGenerateRefusedOverBudget(t *testing.T) {
	e := newEnv(t, mesh.ServerConfig{})
	b := withBudget(e.srv, 100)
	for turn, need := range []int64{1 + 40, 3 + 40} { // prompts of 1 and 3 words
		if _, err := generate(acme("r-b", "root/m"+string(rune('0'+turn))), t, e.model,
			&modelproxyv1.GenerateRequest{Messages: conversation(budgetPlan, turn)}); err != nil {
			t.Fatalf("step %d (needs %d of 100): %v", turn, need, err)
		}
	}
	if u := b.Usage("acme"); u.Spent != 84 || u.Reserved != 0 {
		t.Fatalf("usage after two calls = %+v, want 84 spent (41 + 43), none reserved", u)
	}
	_, err := generate(acme("r-b", "root/m2"), t, e.model, &modelproxyv1.GenerateRequest{Messages: conversation(budgetPlan, 2)})
	st := status.Convert(err)
	if st.Code() != codes.ResourceExhausted || !budget.Refused(err) {
		t.Fatalf("third call = %v, want RESOURCE_EXHAUSTED BUDGET_EXHAUSTED", err)
	}
	for _, want := range []string{`tenant "acme"`, "spent 84", "of its 100 tokens", "needs 45", "prompt 5 + the plan step's 40"} {
		if !strings.Contains(st.Message(), want) {
			t.Errorf("message %q does not say %q", st.Message(), want)
		}
	}
	n := meshtest.WaitNode(t, e.srv.Nodes, "r-b", "root/m2")
	if n.GetStatus() != meshv1.NodeStatus_NODE_STATUS_FAILED || n.GetErrorCode() != "RESOURCE_EXHAUSTED" {
		t.Errorf("refused node = %v, want FAILED RESOURCE_EXHAUSTED", n)
	}
	if total, _, _ := e.srv.Ledger.Figures("r-b", "root/m2", time.Time{}); total != 0 || e.srv.Ledger.Prompt("r-b", "root/m2") != 0 {
		t.Errorf("the refused call spent %d tokens", total)
	}
	var spent int64
	for _, id := range []string{"root/m0", "root/m1"} {
		out, _, _ := e.srv.Ledger.Figures("r-b", id, time.Time{})
		spent += out + e.srv.Ledger.Prompt("r-b", id)
	}
	if spent != 84 {
		t.Errorf("ledger total %d, want 84 (what the budget settled)", spent)
	}
	// Another tenant, without a budget, is not held back.
	if _, err := generate(ident("r-other", "root/m0"), t, e.model, &modelproxyv1.GenerateRequest{Messages: conversation(budgetPlan, 0)}); err != nil {
		t.Fatal(err)
	}
}

// A call cut off mid-stream settles to the tokens it had spent, not to its reservation.
func TestCancelledCallSettlesToItsSpend(t *testing.T) {
	e := newEnv(t, mesh.ServerConfig{})
	b := withBudget(e.srv, 1000)
	const slow = `{"tokens_per_second":100,"steps":[{"answer_tokens":500}]}`
	ctx, cancelCall := context.WithCancel(acme("r-c", "root/m0"))
	st, err := e.model.Generate(ctx, &modelproxyv1.GenerateRequest{Messages: conversation(slow, 0)})
	if err != nil {
		t.Fatal(err)
	}
	for got := 0; got < 3; got++ { // a few tokens, then the caller leaves
		if _, err := st.Recv(); err != nil {
			t.Fatal(err)
		}
	}
	if u := b.Usage("acme"); u.Reserved != 501 {
		t.Fatalf("reserved while decoding = %d, want 501", u.Reserved)
	}
	cancelCall()
	n := meshtest.WaitNode(t, e.srv.Nodes, "r-c", "root/m0") // ended
	deadline := time.Now().Add(5 * time.Second)
	for b.Usage("acme").Reserved != 0 && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	u := b.Usage("acme")
	out, _, _ := e.srv.Ledger.Figures("r-c", "root/m0", time.Time{})
	if u.Reserved != 0 || u.Spent != out || out < 3 || out >= 500 {
		t.Fatalf("after the cancel: usage %+v, ledger %d tokens (node %v); want the reservation settled to the ledger's", u, out, n.GetStatus())
	}
}

// After the run's cancel (CancelNodes), a model call of the run is refused before its
// decoder starts, with the cancel's cause, and no node is recorded for it.
func TestGenerateRefusedAfterRunCancel(t *testing.T) {
	e := newEnv(t, mesh.ServerConfig{})
	if _, err := e.report.CancelNodes(context.Background(), &meshv1.CancelNodesRequest{RunId: "r-x", NodePrefixes: []string{"root"},
		Cause: meshv1.CancelCause_CANCEL_CAUSE_BUDGET}); err != nil {
		t.Fatal(err)
	}
	_, err := generate(acme("r-x", "root/sub/m0"), t, e.model, &modelproxyv1.GenerateRequest{Messages: conversation(budgetPlan, 0)})
	if status.Code(err) != codes.Canceled || !strings.Contains(status.Convert(err).Message(), "budget") {
		t.Fatalf("Generate after the run's cancel = %v, want CANCELLED naming the cause", err)
	}
	resp, err := e.report.ListNodes(context.Background(), &meshv1.ListNodesRequest{RunId: "r-x"})
	if err != nil || len(resp.GetNodes()) != 0 {
		t.Fatalf("nodes after the refused call = %v, %v; want none", resp.GetNodes(), err)
	}
}

// A real provider's call without max_tokens reserves DefaultMaxTokens and is sent that
// bound, so the reservation holds; it settles to the provider's usage.
func TestProviderCallReservesBoundAndSettlesToUsage(t *testing.T) {
	pe := newProviderEnv(t, oneProvider, "p")
	b := withBudget(pe.srv, 1_000_000)
	pe.up["p"].Enqueue(openaitest.Reply{Content: openaitest.Tokens(5), Usage: &openaitest.Usage{PromptTokens: 7, CompletionTokens: 5}})
	if _, err := generate(acme("r-p", "root/m0"), t, pe.model, &modelproxyv1.GenerateRequest{Model: "fast", Messages: userMsg("hello there")}); err != nil {
		t.Fatal(err)
	}
	reqs := pe.up["p"].Requests()
	if len(reqs) != 1 || !strings.Contains(string(reqs[0].Body), `"max_tokens":2048`) {
		t.Fatalf("upstream request %s: want max_tokens 2048", reqs[0].Body)
	}
	if u := b.Usage("acme"); u.Spent != 12 || u.Reserved != 0 {
		t.Fatalf("usage = %+v, want the provider's 7 + 5", u)
	}
	// A budget below prompt bound + max_tokens refuses before any upstream request.
	b2 := withBudget(pe.srv, 100)
	_, err := generate(acme("r-p", "root/m1"), t, pe.model, &modelproxyv1.GenerateRequest{Model: "fast", Messages: userMsg("hello"), MaxTokens: 95})
	if !budget.Refused(err) {
		t.Fatalf("call needing > 100 = %v, want a refusal status", err)
	}
	if !strings.Contains(status.Convert(err).Message(), "max_tokens 95") {
		t.Errorf("message %q does not name max_tokens", status.Convert(err).Message())
	}
	if n := len(pe.up["p"].Requests()); n != 1 {
		t.Errorf("%d upstream requests, want 1: the refused call must not reach the provider", n)
	}
	if u := b2.Usage("acme"); u.Reserved != 0 {
		t.Errorf("reserved %d after a refusal", u.Reserved)
	}
}
