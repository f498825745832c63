package sim

import (
	"context"
	"errors"
	"io"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	modelproxyv1 "github.com/curfew-mesh/curfew/gen/curfew/modelproxy/v1"
	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/services/modelproxy/internal/provider"
)

func request(planJSON string, turns int) *provider.Request {
	msgs := []*modelproxyv1.Message{{Role: modelproxyv1.Role_ROLE_USER, Content: planJSON}}
	for range turns {
		msgs = append(msgs, &modelproxyv1.Message{Role: modelproxyv1.Role_ROLE_ASSISTANT, Content: "thinking"})
	}
	return &provider.Request{Model: Name, Messages: msgs}
}

// The sim model is a provider: a step's tokens, one per chunk, then its final chunk and
// io.EOF.
func TestStreamDecodesStep(t *testing.T) {
	var p provider.Provider = New()
	if p.Name() != "sim" {
		t.Fatalf("name %q", p.Name())
	}
	req := request(`{"tokens_per_second":1000,"steps":[{"think_tokens":3,"tools":[{"name":"sleep","args":{"ms":5}}]},{"answer_tokens":2}]}`, 0)
	st, err := p.Stream(context.Background(), req)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = st.Close() }()
	for i := range 3 {
		c, err := st.Recv()
		if err != nil || c.Tokens != 1 || c.Delta == "" || c.FinishReason != "" {
			t.Fatalf("chunk %d = %+v, %v; want one token", i, c, err)
		}
	}
	final, err := st.Recv()
	if err != nil || final.FinishReason != "tool_calls" || final.Usage.GetCompletionTokens() != 3 || len(final.ToolCalls) != 1 ||
		final.ToolCalls[0].GetId() != "call_0_0" || final.ToolCalls[0].GetArgsJson() != `{"ms":5}` {
		t.Fatalf("final = %+v, %v", final, err)
	}
	if _, err := st.Recv(); !errors.Is(err, io.EOF) {
		t.Fatalf("after the final chunk: %v, want io.EOF", err)
	}
}

func TestCheckRefusesBadConversation(t *testing.T) {
	p := New()
	for _, req := range []*provider.Request{
		{Messages: []*modelproxyv1.Message{{Role: modelproxyv1.Role_ROLE_SYSTEM, Content: "{}"}}},
		request("write me a poem", 0),
		request(`{"steps":[{"answer_tokens":1}]}`, 1),
	} {
		if err := p.Check(req); status.Code(err) != codes.InvalidArgument {
			t.Errorf("Check(%v) = %v, want INVALID_ARGUMENT", req.Messages, err)
		}
	}
	ok := request(`{"steps":[{"answer_tokens":1}]}`, 0)
	if err := p.Check(ok); err != nil || ok.Checked == nil {
		t.Fatalf("Check = %v, Checked %v; want nil and the step for Stream", err, ok.Checked)
	}
}

func TestStreamStopsAtTokenBoundaryOnCancel(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	st, err := New().Stream(ctx, request(`{"tokens_per_second":20,"steps":[{"answer_tokens":100}]}`, 0))
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = st.Close() }()
	if _, err := st.Recv(); err != nil {
		t.Fatal(err)
	}
	cancel()
	start := time.Now()
	if _, err := st.Recv(); !errors.Is(err, context.Canceled) {
		t.Fatalf("after cancel: %v, want context.Canceled", err)
	}
	if d := time.Since(start); d > 40*time.Millisecond {
		t.Fatalf("stopped after %v, want before the next token (50ms)", d)
	}
}

func TestModelErrorFailsAttempt(t *testing.T) {
	req := request(`{"steps":[{"answer_tokens":1,"model_error":{"attempts":1,"code":"RESOURCE_EXHAUSTED"}}]}`, 0)
	ctx := md.WithIdentity(context.Background(), md.Identity{Attempt: 1})
	_, err := New().Stream(ctx, req)
	var injected *InjectedError
	if status.Code(err) != codes.ResourceExhausted || !errors.As(err, &injected) {
		t.Fatalf("attempt 1: %v, want the injected RESOURCE_EXHAUSTED", err)
	}
	if want := "rpc error: code = ResourceExhausted desc = sim model: injected error on attempt 1 of 1"; err.Error() != want {
		t.Fatalf("error %q, want %q", err, want)
	}
	st, err := New().Stream(WithoutModelError(ctx), req)
	if err != nil {
		t.Fatalf("without model_error: %v", err)
	}
	_ = st.Close()
	st, err = New().Stream(md.WithIdentity(context.Background(), md.Identity{Attempt: 2}), req)
	if err != nil {
		t.Fatalf("attempt 2: %v", err)
	}
	_ = st.Close()
}

// The sim model's prompt tokens are the words of every message's content; tool calls
// count none.
func TestPromptTokensCountWords(t *testing.T) {
	msgs := []*modelproxyv1.Message{
		{Role: modelproxyv1.Role_ROLE_SYSTEM, Content: "be brief"},
		{Role: modelproxyv1.Role_ROLE_USER, Content: " one\ttwo\n three  "},
		{Role: modelproxyv1.Role_ROLE_ASSISTANT, ToolCalls: []*modelproxyv1.ToolCall{{Name: "sleep", ArgsJson: `{"ms": 5}`}}},
		{Role: modelproxyv1.Role_ROLE_TOOL, Content: ""},
	}
	if n := PromptTokens(msgs); n != 5 {
		t.Fatalf("PromptTokens = %d, want 2+3", n)
	}
	if n := PromptTokens(nil); n != 0 {
		t.Fatalf("PromptTokens(nil) = %d", n)
	}
}
