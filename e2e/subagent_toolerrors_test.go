package e2e

import (
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
)

// Over the real processes, with a real model (an OpenAI-format HTTP server): a run's
// tool_errors policy reaches its subagents. The root's model spawns a subagent whose
// model calls sleep with bad arguments. With TOOL_ERRORS_FAIL_RUN that failure fails the
// subagent and so the run, and no model request carries the error; with
// TOOL_ERRORS_TO_MODEL the subagent's next request carries it as the tool message, and
// the run answers.
func TestSubagentTakesTheRunsToolErrors(t *testing.T) {
	t.Parallel()
	ups := map[string]*upstream{"p": startUpstream(t)}
	m := startProviderMesh(t, `{"providers": [{"name": "p", "base_url": "{p}", "models": ["m"]}],
  "models": {"agent": {"chain": ["p/m"]}}}`, ups)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	oc, err := m.Orchestrator()
	if err != nil {
		t.Fatal(err)
	}
	const (
		spawn   = `{"tool_calls": [{"id": "call_sub", "name": "spawn_subagent", "arguments": "{\"task\": \"nap\", \"model\": \"agent\"}"}], "finish_reason": "tool_calls"}`
		badCall = `{"tool_calls": [{"id": "call_bad", "name": "sleep", "arguments": "{\"ms\": \"x\"}"}], "finish_reason": "tool_calls"}`
		toolErr = "args.ms: must be int, got string"
	)
	// The model requests so far; each round reads the ones after.
	seen := 0
	newCalls := func() []chatRequest {
		calls := ups["p"].calls(t)
		var out []chatRequest
		for _, c := range calls[seen:] {
			var r chatRequest
			if err := json.Unmarshal(c.Request.Body, &r); err != nil {
				t.Fatalf("request: %v: %s", err, c.Request.Body)
			}
			out = append(out, r)
		}
		seen = len(calls)
		return out
	}

	t.Run("fail run", func(t *testing.T) {
		// Only the two replies this policy uses: a third request (the error sent to the
		// subagent's model) would find none.
		ups["p"].enqueue(t, spawn, badCall)
		fin := runToSummary(ctx, t, oc, &orchestratorv1.RunRequest{Task: "have a helper nap", Model: "agent",
			ToolErrors: orchestratorv1.ToolErrors_TOOL_ERRORS_FAIL_RUN})
		if fin.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_FAILED || !strings.Contains(fin.GetErrorMessage(), toolErr) {
			t.Errorf("run ended %v %q, want FAILED with the subagent's tool error\n%s", fin.GetStatus(), fin.GetErrorMessage(), dump(fin))
		}
		if n := nodeMap(fin)["root/s0.t0/sub/s0.t0"]; n.GetName() != "sleep" || n.GetStatus() != meshv1.NodeStatus_NODE_STATUS_FAILED {
			t.Errorf("the subagent's sleep node = %v, want failed\n%s", n, dump(fin))
		}
		if reqs := newCalls(); len(reqs) != 2 {
			t.Errorf("the model saw %d requests, want 2 (the root's, the subagent's): the error must not go to a model", len(reqs))
		}
	})

	t.Run("to model", func(t *testing.T) {
		ups["p"].enqueue(t, spawn, badCall, `{"content": ["slept"]}`, `{"content": ["done"]}`)
		fin := runToSummary(ctx, t, oc, &orchestratorv1.RunRequest{Task: "have a helper nap", Model: "agent",
			ToolErrors: orchestratorv1.ToolErrors_TOOL_ERRORS_TO_MODEL})
		if fin.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_SUCCEEDED || fin.GetAnswer() != "done" {
			t.Fatalf("run ended %v: %s", fin.GetStatus(), dump(fin))
		}
		reqs := newCalls()
		if len(reqs) != 4 {
			t.Fatalf("the model saw %d requests, want 4 (root, subagent, subagent, root)", len(reqs))
		}
		msgs, _ := withoutTimeNote(reqs[2].Messages)
		last := msgs[len(msgs)-1]
		if content, _ := last.Content.(string); last.Role != "tool" || last.ToolCallID != "call_bad" || !strings.Contains(content, toolErr) {
			t.Errorf("the subagent's second request ends %+v, want the tool message with the error", last)
		}
	})
}
