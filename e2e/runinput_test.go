package e2e

import (
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
)

// chatRequest is the part of a chat completions request the run-input test reads.
type chatRequest struct {
	Messages       []chatMessage   `json:"messages"`
	MaxTokens      *int            `json:"max_tokens"`
	Temperature    *float64        `json:"temperature"`
	ResponseFormat json.RawMessage `json:"response_format"`
}

// Over the real processes, with a real model (an OpenAI-format HTTP server): a run's
// system prompt, max_tokens, temperature and response schema reach every model request;
// the model calls a tool with bad arguments, the next request carries the tool's error
// as the tool message, the model calls it again rightly, and the run answers.
func TestRunInputOverRealModel(t *testing.T) {
	t.Parallel()
	ups := map[string]*upstream{"p": startUpstream(t)}
	m := startProviderMesh(t, `{"providers": [{"name": "p", "base_url": "{p}", "models": ["m"]}],
  "models": {"agent": {"chain": ["p/m"]}}}`, ups)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	ups["p"].enqueue(t,
		`{"tool_calls": [{"id": "call_bad", "name": "sleep", "arguments": "{\"ms\": \"x\"}"}], "finish_reason": "tool_calls"}`,
		`{"tool_calls": [{"id": "call_ok", "name": "sleep", "arguments": "{\"ms\": 10}"}], "finish_reason": "tool_calls"}`,
		`{"content": ["{\"done\":", " true}"]}`)
	oc, err := m.Orchestrator()
	if err != nil {
		t.Fatal(err)
	}
	fin := runToSummary(ctx, t, oc, &orchestratorv1.RunRequest{Task: "wait a little, then say you are done", Model: "agent",
		Messages:  []*orchestratorv1.Message{{Role: orchestratorv1.MessageRole_MESSAGE_ROLE_SYSTEM, Content: "You are terse."}},
		MaxTokens: 64, Temperature: proto.Float64(0.2), ResponseSchemaJson: `{"type":"object","required":["done"]}`,
		Tools: []string{"sleep"}})
	if fin.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_SUCCEEDED || !strings.Contains(fin.GetAnswer(), `"done": true`) {
		t.Fatalf("run ended %v: %s", fin.GetStatus(), dump(fin))
	}
	nm := nodeMap(fin)
	bad, ok := nm["root/s0.t0"], nm["root/s1.t0"]
	if bad.GetName() != "sleep" || bad.GetStatus() != meshv1.NodeStatus_NODE_STATUS_FAILED || bad.GetErrorCode() != "INVALID_ARGUMENT" {
		t.Errorf("the bad call's node = %v, want sleep failed INVALID_ARGUMENT\n%s", bad, dump(fin))
	}
	if ok.GetName() != "sleep" || ok.GetStatus() != meshv1.NodeStatus_NODE_STATUS_SUCCEEDED {
		t.Errorf("the good call's node = %v, want sleep succeeded\n%s", ok, dump(fin))
	}

	calls := ups["p"].calls(t)
	if len(calls) != 3 {
		t.Fatalf("the model saw %d requests, want 3", len(calls))
	}
	reqs := make([]chatRequest, len(calls))
	for i, c := range calls {
		if err := json.Unmarshal(c.Request.Body, &reqs[i]); err != nil {
			t.Fatalf("request %d: %v: %s", i, err, c.Request.Body)
		}
		r := reqs[i]
		if len(r.Messages) < 2 || r.Messages[0].Role != "system" || r.Messages[0].Content != "You are terse." ||
			r.Messages[1].Role != "user" || r.Messages[1].Content != "wait a little, then say you are done" {
			t.Errorf("request %d starts %+v, want the system prompt, then the task", i, r.Messages)
		}
		if r.MaxTokens == nil || *r.MaxTokens != 64 || r.Temperature == nil || *r.Temperature != 0.2 ||
			!strings.Contains(string(r.ResponseFormat), `"required":["done"]`) {
			t.Errorf("request %d: max_tokens %v temperature %v response_format %s", i, r.MaxTokens, r.Temperature, r.ResponseFormat)
		}
	}
	// The request after the bad call carries the tool's error as that call's result, its
	// last message before the time-left note.
	msgs, noted := withoutTimeNote(reqs[1].Messages)
	if !noted {
		t.Errorf("second request: %+v, want the time-left note last", reqs[1].Messages)
	}
	last := msgs[len(msgs)-1]
	content, _ := last.Content.(string)
	var result struct{ Error string }
	if last.Role != "tool" || last.ToolCallID != "call_bad" || json.Unmarshal([]byte(content), &result) != nil ||
		!strings.Contains(result.Error, "args.ms") || !strings.Contains(bad.GetErrorMessage(), result.Error) {
		t.Errorf("second request's last message %+v, want the tool's error %q as call_bad's result", last, bad.GetErrorMessage())
	}
	t.Logf("the model was told: %s", content)
}

// curfew run's input flags reach the run: --max-steps 1 stops a two-step plan at its
// step limit, and a bad --temperature is refused naming the field.
func TestCLIRunInputFlags(t *testing.T) {
	t.Parallel()
	plan := `{"tokens_per_second": 500, "steps": [{"think_tokens": 2, "tools": [{"name": "sleep", "args": {"ms": 5}}]}, {"answer_tokens": 2}]}`
	out, stderr, code := curfew(t, "run", "--deadline", "10s", "--system", "be brief", "--max-tokens", "20", "--max-steps", "1", plan)
	if code == 0 || !strings.Contains(out+stderr, "step limit 1 reached") {
		t.Errorf("--max-steps 1: exit %d, want the step limit:\n%s\n%s", code, out, stderr)
	}
	out, stderr, code = curfew(t, "run", "--deadline", "10s", "--temperature", "3", plan)
	if code == 0 || !strings.Contains(out+stderr, "temperature: must be between 0 and 2") {
		t.Errorf("--temperature 3: exit %d, want INVALID_ARGUMENT naming temperature:\n%s\n%s", code, out, stderr)
	}
	out, stderr, code = curfew(t, "run", "--deadline", "10s", "--system", "be brief", "--temperature", "0", "--tools", "sleep", plan)
	if code != 0 || !strings.Contains(out, "succeeded") {
		t.Errorf("with input flags: exit %d:\n%s\n%s", code, out, stderr)
	}
}
