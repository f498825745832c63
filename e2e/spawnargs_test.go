package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
)

// Over the real processes, with a real model (an OpenAI-format HTTP server): the root's
// model calls spawn_subagent with a task, a model, tools and max_tokens; the subagent's
// model request carries that task as its user message, that model, only those tools and
// that bound, and its answer comes back to the root's model as the call's result.
func TestSpawnSubagentOverRealModel(t *testing.T) {
	t.Parallel()
	ups := map[string]*upstream{"p": startUpstream(t)}
	m := startProviderMesh(t, `{"providers": [{"name": "p", "base_url": "{p}", "models": ["m", "m2"]}],
  "models": {"agent": {"chain": ["p/m"]}, "helper": {"chain": ["p/m2"]}}}`, ups)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	args := `{"task": "count the sheep", "model": "helper", "tools": ["sleep"], "max_tokens": 32, "reserve": "1s"}`
	ups["p"].enqueue(t,
		fmt.Sprintf(`{"tool_calls": [{"id": "call_sub", "name": "spawn_subagent", "arguments": %q}], "finish_reason": "tool_calls"}`, args),
		`{"content": ["42 ", "sheep"]}`,
		`{"content": ["the helper counted 42"]}`)
	oc, err := m.Orchestrator()
	if err != nil {
		t.Fatal(err)
	}
	fin := runToSummary(ctx, t, oc, &orchestratorv1.RunRequest{Task: "ask a helper to count the sheep", Model: "agent"})
	if fin.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_SUCCEEDED || fin.GetAnswer() != "the helper counted 42" {
		t.Fatalf("run ended %v: %s", fin.GetStatus(), dump(fin))
	}
	if sub, ok := nodeMap(fin)["root/s0.t0/sub"]; !ok || sub.GetStatus().String() != "NODE_STATUS_SUCCEEDED" {
		t.Errorf("subagent node = %v, want it succeeded\n%s", sub, dump(fin))
	}

	type spawnChat struct {
		Model     string        `json:"model"`
		Messages  []chatMessage `json:"messages"`
		MaxTokens *int          `json:"max_tokens"`
		Tools     []struct {
			Function struct {
				Name string `json:"name"`
			} `json:"function"`
		} `json:"tools"`
	}
	calls := ups["p"].calls(t)
	if len(calls) != 3 {
		t.Fatalf("the model saw %d requests, want 3 (root, subagent, root)", len(calls))
	}
	reqs := make([]spawnChat, len(calls))
	for i, c := range calls {
		if err := json.Unmarshal(c.Request.Body, &reqs[i]); err != nil {
			t.Fatalf("request %d: %v: %s", i, err, c.Request.Body)
		}
	}
	if reqs[0].Model != "m" || reqs[2].Model != "m" {
		t.Errorf("root requests name models %q and %q, want m", reqs[0].Model, reqs[2].Model)
	}
	sub := reqs[1]
	var noted bool
	if sub.Messages, noted = withoutTimeNote(sub.Messages); !noted {
		t.Errorf("subagent request %s: want the time-left note last", calls[1].Request.Body)
	}
	var tools []string
	for _, tl := range sub.Tools {
		tools = append(tools, tl.Function.Name)
	}
	if sub.Model != "m2" || len(sub.Messages) != 1 || sub.Messages[0].Role != "user" || sub.Messages[0].Content != "count the sheep" ||
		sub.MaxTokens == nil || *sub.MaxTokens != 32 || strings.Join(tools, ",") != "sleep" {
		t.Errorf("subagent request: %s\nwant model m2, the task as its only message, max_tokens 32, tools [sleep]", calls[1].Request.Body)
	}
	root, _ := withoutTimeNote(reqs[2].Messages)
	last := root[len(root)-1]
	if content, _ := last.Content.(string); last.Role != "tool" || content != `{"answer":"42 sheep"}` {
		t.Errorf("the root's second request ends %+v, want the subagent's answer as the call's result", last)
	}
}
