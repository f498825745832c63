package modelproxy

import (
	"context"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	modelproxyv1 "github.com/curfew-mesh/curfew/gen/curfew/modelproxy/v1"
	"github.com/curfew-mesh/curfew/mesh"
	"github.com/curfew-mesh/curfew/services/modelproxy/internal/provider/openaitest"
)

// The sim model's prompt tokens (one per word of the messages) reach the call's usage,
// the node's record and the prompt counter, apart from its output tokens.
func TestSimPromptTokensOnNodeAndMetrics(t *testing.T) {
	e := newEnv(t, mesh.ServerConfig{})
	reg := prometheus.NewRegistry()
	e.srv.Metrics = NewMetrics(reg)
	plan := `{"tokens_per_second":1000, "steps":[{"answer_tokens":3}]}` // 2 words
	msgs := []*modelproxyv1.Message{{Role: modelproxyv1.Role_ROLE_USER, Content: plan},
		{Role: modelproxyv1.Role_ROLE_USER, Content: "  say  three words\n"}} // 3 words
	chunks, err := generate(ident("r-prompt", "root/m0"), t, e.model, &modelproxyv1.GenerateRequest{Messages: msgs})
	if err != nil {
		t.Fatal(err)
	}
	if u := last(chunks).GetUsage(); u.GetPromptTokens() != 5 || u.GetCompletionTokens() != 3 {
		t.Fatalf("usage %v, want 5 prompt and 3 completion tokens", u)
	}
	resp, err := e.report.ListNodes(context.Background(), &meshv1.ListNodesRequest{RunId: "r-prompt"})
	if err != nil || len(resp.GetNodes()) != 1 {
		t.Fatalf("ListNodes: %v, %v", resp, err)
	}
	if n := resp.GetNodes()[0]; n.GetPromptTokens() != 5 || n.GetTokens() != 3 {
		t.Fatalf("node %v: want prompt_tokens 5 and tokens 3", n)
	}
	if got := testutil.ToFloat64(e.srv.Metrics.prompt.WithLabelValues(SimModel, SimProvider)); got != 5 {
		t.Fatalf("curfew_model_prompt_tokens_total = %v, want 5", got)
	}
	if got := testutil.ToFloat64(e.srv.Metrics.tokens.WithLabelValues(SimModel, SimProvider)); got != 3 {
		t.Fatalf("curfew_model_tokens_total = %v, want 3", got)
	}
	e.srv.Ledger.Forget("r-prompt")
	if p := e.srv.Ledger.Prompt("r-prompt", "root/m0"); p != 0 {
		t.Fatalf("forgotten run still has %d prompt tokens", p)
	}
}

// An OpenAI-compatible provider's usage.prompt_tokens is the node's prompt_tokens; two
// decoders of the same node add up.
func TestProviderPromptTokensFromUsage(t *testing.T) {
	pe := newProviderEnv(t, oneProvider, "p")
	pe.up["p"].Enqueue(openaitest.Reply{Content: openaitest.Tokens(4), Usage: &openaitest.Usage{PromptTokens: 31, CompletionTokens: 4}})
	pe.up["p"].Enqueue(openaitest.Reply{Content: openaitest.Tokens(2), Usage: &openaitest.Usage{PromptTokens: 40, CompletionTokens: 2}})
	for range 2 {
		if _, err := generate(ident("r-up", "root/m0"), t, pe.model, &modelproxyv1.GenerateRequest{Model: "fast", Messages: userMsg("count me")}); err != nil {
			t.Fatal(err)
		}
	}
	resp, err := pe.report.ListNodes(context.Background(), &meshv1.ListNodesRequest{RunId: "r-up"})
	if err != nil || len(resp.GetNodes()) != 1 {
		t.Fatalf("ListNodes: %v, %v", resp, err)
	}
	if n := resp.GetNodes()[0]; n.GetPromptTokens() != 71 || n.GetTokens() != 6 {
		t.Fatalf("node %v: want prompt_tokens 31+40 and tokens 4+2", n)
	}
}

// Without a usage chunk the provider charged nothing this process can know of: no prompt
// tokens are recorded, the output tokens still are.
func TestProviderWithoutUsageRecordsNoPromptTokens(t *testing.T) {
	pe := newProviderEnv(t, oneProvider, "p")
	pe.up["p"].Enqueue(openaitest.Reply{Content: openaitest.Tokens(3), NoUsage: true})
	if _, err := generate(ident("r-nou", "root/m0"), t, pe.model, &modelproxyv1.GenerateRequest{Model: "fast", Messages: userMsg("count me")}); err != nil {
		t.Fatal(err)
	}
	if p := pe.srv.Ledger.Prompt("r-nou", "root/m0"); p != 0 {
		t.Fatalf("%d prompt tokens recorded without a usage chunk", p)
	}
	if total, _, _ := pe.srv.Ledger.Figures("r-nou", "root/m0", time.Time{}); total != 3 {
		t.Fatalf("%d output tokens, want 3", total)
	}
}
