package agent_test

import (
	"context"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	modelproxyv1 "github.com/curfew-mesh/curfew/gen/curfew/modelproxy/v1"
	"github.com/curfew-mesh/curfew/mesh/agent"
	"github.com/curfew-mesh/curfew/mesh/meshtest"
)

func okTool(context.Context, string) (string, error) { return `{"ok":true}`, nil }

// Every model step carries the input's system prompt, conversation, max_tokens,
// temperature and response schema; the task is the last user message.
func TestInputReachesEveryModelStep(t *testing.T) {
	r := newRig(t, agent.Config{}, []meshtest.ModelStep{
		{ToolCalls: []*modelproxyv1.ToolCall{call(0, "x", "{}")}},
		{Text: `{"a":1}`},
	}, map[string]meshtest.ToolFunc{"x": okTool})
	ctx, stop := runCtx(t, 5*time.Second)
	defer stop()
	in := agent.Input{Model: "gpt", Task: "now this",
		Messages: []*modelproxyv1.Message{
			{Role: modelproxyv1.Role_ROLE_SYSTEM, Content: "be brief"},
			{Role: modelproxyv1.Role_ROLE_USER, Content: "earlier"},
		},
		MaxTokens: 77, Temperature: proto.Float64(0.3), ResponseSchema: `{"type":"object"}`}
	answer, err := r.loop.RunInput(ctx, "root", in, nil)
	if err != nil || answer != `{"a":1}` {
		t.Fatalf("RunInput = %q, %v", answer, err)
	}
	calls := r.model.Calls()
	if len(calls) != 2 {
		t.Fatalf("%d model calls, want 2", len(calls))
	}
	for i, c := range calls {
		req := c.Request
		if req.GetModel() != "gpt" || req.GetMaxTokens() != 77 || req.Temperature == nil || req.GetTemperature() != 0.3 ||
			req.GetResponseSchema().GetSchemaJson() != `{"type":"object"}` {
			t.Errorf("step %d request: model %q max_tokens %d temperature %v schema %v", i, req.GetModel(), req.GetMaxTokens(), req.Temperature, req.GetResponseSchema())
		}
		var got []string
		for _, m := range req.GetMessages()[:3] {
			got = append(got, m.GetRole().String()+":"+m.GetContent())
		}
		want := []string{"ROLE_SYSTEM:be brief", "ROLE_USER:earlier", "ROLE_USER:now this"}
		if !slices.Equal(got, want) {
			t.Errorf("step %d messages start %q, want %q", i, got, want)
		}
	}
	if n := len(calls[1].Request.GetMessages()); n != 5 { // + the assistant's call and the tool's result
		t.Errorf("second step has %d messages, want 5", n)
	}
}

// Without temperature the request leaves it unset (the provider's default), not 0.
func TestInputWithoutTemperatureLeavesItUnset(t *testing.T) {
	r := newRig(t, agent.Config{}, []meshtest.ModelStep{{Text: "hi"}}, nil)
	ctx, stop := runCtx(t, 5*time.Second)
	defer stop()
	if _, err := r.loop.RunInput(ctx, "root", agent.Input{Model: "gpt", Task: "t"}, nil); err != nil {
		t.Fatal(err)
	}
	if req := r.model.Calls()[0].Request; req.Temperature != nil || req.GetResponseSchema() != nil {
		t.Errorf("temperature %v, schema %v; want both unset", req.Temperature, req.GetResponseSchema())
	}
}

// A real model is told of a tool's failure as the tool's result, and the loop goes on.
func TestToolErrorGoesToModel(t *testing.T) {
	r := newRig(t, agent.Config{}, []meshtest.ModelStep{
		{ToolCalls: []*modelproxyv1.ToolCall{call(0, "bad", `{"n":"x"}`), call(1, "x", "{}")}},
		{Text: "recovered"},
	}, map[string]meshtest.ToolFunc{
		"bad": func(context.Context, string) (string, error) {
			return "", status.Error(codes.InvalidArgument, "args: n: want a number")
		},
		"x": okTool,
	})
	ctx, stop := runCtx(t, 5*time.Second)
	defer stop()
	answer, err := r.loop.RunInput(ctx, "root", agent.Input{Model: "gpt", Task: "t"}, nil)
	if err != nil || answer != "recovered" {
		t.Fatalf("RunInput = %q, %v; want the model's answer after the tool error", answer, err)
	}
	msgs := r.model.Calls()[1].Messages
	var results []string
	for _, m := range msgs {
		if m.GetRole() == modelproxyv1.Role_ROLE_TOOL {
			results = append(results, m.GetToolCallId()+" "+m.GetContent())
		}
	}
	want := []string{`call_0 {"error":"args: n: want a number"}`, `call_1 {"ok":true}`}
	if !slices.Equal(results, want) {
		t.Errorf("tool results %q, want %q", results, want)
	}
	if ns := r.emittedFor("root/s0.t0"); len(ns) == 0 || ns[len(ns)-1].GetErrorCode() != "INVALID_ARGUMENT" {
		t.Errorf("failed tool's node %v; want it ended with INVALID_ARGUMENT", ns)
	}
}

// FailOnToolError, and the sim model, keep today's behaviour: a tool failure fails the loop.
func TestToolErrorFailsRun(t *testing.T) {
	for _, in := range []agent.Input{
		{Model: "gpt", Task: "t", FailOnToolError: true},
		{Model: "sim", Task: "t"},
	} {
		r := newRig(t, agent.Config{}, []meshtest.ModelStep{
			{ToolCalls: []*modelproxyv1.ToolCall{call(0, "bad", "{}")}},
			{Text: "unreachable"},
		}, map[string]meshtest.ToolFunc{"bad": func(context.Context, string) (string, error) {
			return "", status.Error(codes.FailedPrecondition, "tool bad failed: boom")
		}})
		ctx, stop := runCtx(t, 5*time.Second)
		_, err := r.loop.RunInput(ctx, "root", in, nil)
		stop()
		if status.Code(err) != codes.FailedPrecondition || !strings.Contains(err.Error(), "boom") {
			t.Errorf("%+v: RunInput = %v, want the tool's FAILED_PRECONDITION", in, err)
		}
		if n := len(r.model.Calls()); n != 1 {
			t.Errorf("%+v: %d model calls, want 1", in, n)
		}
	}
}

// A tool's cancellation is never handed to the model: the loop ends with it.
func TestToolCancelIsNotAResult(t *testing.T) {
	r := newRig(t, agent.Config{}, []meshtest.ModelStep{
		{ToolCalls: []*modelproxyv1.ToolCall{call(0, "block", "{}")}},
		{Text: "unreachable"},
	}, map[string]meshtest.ToolFunc{"block": func(ctx context.Context, _ string) (string, error) {
		<-ctx.Done()
		return "", ctx.Err()
	}})
	ctx, stop := runCtx(t, 5*time.Second)
	defer stop()
	go func() {
		for len(r.tools.Calls()) == 0 {
			time.Sleep(5 * time.Millisecond)
		}
		stop()
	}()
	_, err := r.loop.RunInput(ctx, "root", agent.Input{Model: "gpt", Task: "t"}, nil)
	if status.Code(err) != codes.Canceled {
		t.Fatalf("RunInput = %v, want CANCELED", err)
	}
	if n := len(r.model.Calls()); n != 1 {
		t.Errorf("%d model calls, want 1: a cancelled tool is not a result", n)
	}
}

// Input.Tools narrows what the model is told of and what it may call.
func TestInputTools(t *testing.T) {
	r := newRig(t, agent.Config{}, []meshtest.ModelStep{
		{ToolCalls: []*modelproxyv1.ToolCall{call(0, "http_get", `{"url":"http://x"}`)}},
		{Text: "done"},
	}, nil)
	ctx, stop := runCtx(t, 5*time.Second)
	defer stop()
	answer, err := r.loop.RunInput(ctx, "root", agent.Input{Model: "gpt", Task: "t", Tools: []string{"sleep"}}, nil)
	if err != nil || answer != "done" {
		t.Fatalf("RunInput = %q, %v", answer, err)
	}
	c := r.model.Calls()
	if !slices.Equal(c[0].Tools, []string{"sleep"}) {
		t.Errorf("model told of %q, want [sleep]", c[0].Tools)
	}
	if n := len(r.tools.Calls()); n != 0 {
		t.Errorf("%d tool calls; want none: http_get is not among the run's tools", n)
	}
	if got := c[1].Messages[len(c[1].Messages)-1].GetContent(); !strings.Contains(got, "not among the run's tools") {
		t.Errorf("tool result %q, want the refusal", got)
	}
}

// Input.MaxSteps bounds the steps, with an error naming the limit.
func TestInputMaxSteps(t *testing.T) {
	step := meshtest.ModelStep{ToolCalls: []*modelproxyv1.ToolCall{call(0, "x", "{}")}}
	r := newRig(t, agent.Config{}, []meshtest.ModelStep{step, step, step, {Text: "late"}},
		map[string]meshtest.ToolFunc{"x": okTool})
	ctx, stop := runCtx(t, 5*time.Second)
	defer stop()
	_, err := r.loop.RunInput(ctx, "root", agent.Input{Model: "gpt", Task: "t", MaxSteps: 2}, nil)
	if status.Code(err) != codes.ResourceExhausted || !strings.Contains(err.Error(), "step limit 2 reached") {
		t.Fatalf("RunInput = %v, want RESOURCE_EXHAUSTED \"step limit 2 reached\"", err)
	}
	if n := len(r.model.Calls()); n != 2 {
		t.Errorf("%d model calls, want 2", n)
	}
}

// A tool's own time limit (DEADLINE_EXCEEDED well before the loop's deadline) is the
// tool's failure, told to the model; the loop's deadline is not (TestToolCancelIsNotAResult
// covers the cancel).
func TestToolTimeoutGoesToModel(t *testing.T) {
	r := newRig(t, agent.Config{}, []meshtest.ModelStep{
		{ToolCalls: []*modelproxyv1.ToolCall{call(0, "slow", "{}")}},
		{Text: "gave up on it"},
	}, map[string]meshtest.ToolFunc{"slow": func(context.Context, string) (string, error) {
		return "", status.Error(codes.DeadlineExceeded, "tool slow: its 1s limit passed")
	}})
	ctx, stop := runCtx(t, 5*time.Second)
	defer stop()
	answer, err := r.loop.RunInput(ctx, "root", agent.Input{Model: "gpt", Task: "t"}, nil)
	if err != nil || answer != "gave up on it" {
		t.Fatalf("RunInput = %q, %v; want the model's answer after the tool's timeout", answer, err)
	}
	msgs := r.model.Calls()[1].Messages
	if got := msgs[len(msgs)-1].GetContent(); got != `{"error":"tool slow: its 1s limit passed"}` {
		t.Errorf("tool result %q", got)
	}
}

// A tool stopped by the loop's deadline is not a result: the loop ends DEADLINE_EXCEEDED.
func TestToolAtDeadlineIsNotAResult(t *testing.T) {
	r := newRig(t, agent.Config{}, []meshtest.ModelStep{
		{ToolCalls: []*modelproxyv1.ToolCall{call(0, "block", "{}")}},
		{Text: "unreachable"},
	}, map[string]meshtest.ToolFunc{"block": func(ctx context.Context, _ string) (string, error) {
		<-ctx.Done()
		return "", ctx.Err()
	}})
	ctx, stop := runCtx(t, 400*time.Millisecond)
	defer stop()
	_, err := r.loop.RunInput(ctx, "root", agent.Input{Model: "gpt", Task: "t"}, nil)
	if status.Code(err) != codes.DeadlineExceeded {
		t.Fatalf("RunInput = %v, want DEADLINE_EXCEEDED", err)
	}
	if n := len(r.model.Calls()); n != 1 {
		t.Errorf("%d model calls, want 1: a tool stopped by the deadline is not a result", n)
	}
}
