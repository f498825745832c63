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

// Over the real processes, with a real model (an OpenAI-format HTTP server): a run with a
// 3 s reserve spawns two subagents whose tools would outlast the run. The subagents run
// under the run's deadline less the reserve, run out of time there, and return what they
// had, marked partial; the root's model is then asked for its final answer without tools,
// sees their partial results, and the run answers before its deadline.
func TestReserveAnswersWithPartialResults(t *testing.T) {
	t.Parallel()
	ups := map[string]*upstream{"p": startUpstream(t)}
	m := startProviderMesh(t, `{"providers": [{"name": "p", "base_url": "{p}", "models": ["m"]}],
  "models": {"agent": {"chain": ["p/m"]}}}`, ups)
	const reserve = 3 * time.Second
	spawn := func(id, task string) string {
		return fmt.Sprintf(`{"id": %q, "name": "spawn_subagent", "arguments": %q}`, id,
			fmt.Sprintf(`{"task": %q, "model": "agent", "tools": ["sleep"]}`, task))
	}
	ups["p"].enqueue(t,
		`{"tool_calls": [`+spawn("call_a", "count the sheep")+`, `+spawn("call_b", "count the goats")+`]}`,
		// Each subagent says what it has so far, then calls a tool longer than the run.
		`{"content": ["found ", "three ", "so far"], "tool_calls": [{"name": "sleep", "arguments": "{\"ms\": 60000}"}]}`,
		`{"content": ["found ", "three ", "so far"], "tool_calls": [{"name": "sleep", "arguments": "{\"ms\": 60000}"}]}`,
		`{"content": ["about ", "six ", "animals"]}`)
	oc, err := m.Orchestrator()
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 9*time.Second)
	defer cancel()
	fin := runToSummary(ctx, t, oc, &orchestratorv1.RunRequest{Task: "how many animals are there?", Model: "agent",
		Reserve: reserve.String()})
	if fin.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_SUCCEEDED || fin.GetAnswer() != "about six animals" {
		t.Fatalf("run ended %v with %q, want the final answer: %s", fin.GetStatus(), fin.GetAnswer(), dump(fin))
	}
	deadline := fin.GetDeadline().AsTime()
	if !fin.GetEndedAt().AsTime().Before(deadline) {
		t.Errorf("run ended at %v, not before its deadline %v", fin.GetEndedAt().AsTime(), deadline)
	}
	// No child's deadline is later than the run's less the reserve.
	nodes := nodeMap(fin)
	for id, n := range nodes {
		if strings.HasPrefix(id, "root/s") && n.GetDeadline() != nil && n.GetDeadline().AsTime().After(deadline.Add(-reserve)) {
			t.Errorf("node %s has deadline %v, later than the run's %v less the reserve", id, n.GetDeadline().AsTime(), deadline)
		}
	}
	for _, id := range []string{"root/s0.t0/sub", "root/s0.t1/sub"} {
		sub, ok := nodes[id]
		if !ok || sub.GetStatus().String() != "NODE_STATUS_SUCCEEDED" || !sub.GetPartial() || sub.GetDeadline() == nil {
			t.Errorf("subagent %s = %v, want it succeeded with a partial answer, with its deadline\n%s", id, sub, dump(fin))
		}
	}

	type chat struct {
		Messages []struct {
			Role    string `json:"role"`
			Content any    `json:"content"`
		} `json:"messages"`
		Tools []json.RawMessage `json:"tools"`
	}
	calls := ups["p"].calls(t)
	if len(calls) != 4 {
		t.Fatalf("the model saw %d requests, want 4 (root, two subagents, root)", len(calls))
	}
	var first, last chat
	if err := json.Unmarshal(calls[0].Request.Body, &first); err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(calls[3].Request.Body, &last); err != nil {
		t.Fatal(err)
	}
	note := func(c chat) string {
		m := c.Messages[len(c.Messages)-1]
		s, _ := m.Content.(string)
		return m.Role + ": " + s
	}
	if n := note(first); !strings.HasPrefix(n, "system: [curfew] Time left for this task, tools included:") || len(first.Tools) == 0 {
		t.Errorf("the first request ends with %q and offers %d tools, want the time-left note and tools", n, len(first.Tools))
	}
	if n := note(last); !strings.Contains(n, "answer now") || len(last.Tools) != 0 {
		t.Errorf("the final request ends with %q and offers %d tools, want the final-answer note and none", n, len(last.Tools))
	}
	partials := 0
	for _, msg := range last.Messages {
		s, _ := msg.Content.(string)
		if msg.Role == "tool" && strings.Contains(s, `"partial":true`) && strings.Contains(s, "found three so far") {
			partials++
		}
	}
	if partials != 2 {
		t.Errorf("the final request carries %d partial results, want both subagents': %s", partials, calls[3].Request.Body)
	}
}
