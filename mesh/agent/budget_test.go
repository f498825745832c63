package agent_test

import (
	"context"
	"testing"
	"time"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	modelproxyv1 "github.com/curfew-mesh/curfew/gen/curfew/modelproxy/v1"
	"github.com/curfew-mesh/curfew/mesh/agent"
	"github.com/curfew-mesh/curfew/mesh/budget"
	"github.com/curfew-mesh/curfew/mesh/meshtest"
)

// A budget refusal from below a tool (a subagent's model call, through spawn_subagent) is
// not handed to a real model as the tool's error: the loop ends with it, and the sibling
// it cancels is noted with cause budget, not sibling_failed.
func TestBudgetRefusalStopsTheLoop(t *testing.T) {
	refusal := (&budget.Refusal{Tenant: "acme", Spent: 90, Budget: 100, Window: time.Hour, Need: 20}).GRPCStatus().Err()
	r := newRig(t, agent.Config{}, []meshtest.ModelStep{
		{ToolCalls: []*modelproxyv1.ToolCall{call(0, "wait", "{}"), call(1, "spawn_subagent", `{"task": "t"}`)}},
		{Text: "must not be asked"},
	}, map[string]meshtest.ToolFunc{
		"wait": func(ctx context.Context, _ string) (string, error) {
			<-ctx.Done()
			return "", ctx.Err()
		},
		"spawn_subagent": func(context.Context, string) (string, error) { return "", refusal },
	})
	ctx, stop := runCtx(t, 10*time.Second)
	defer stop()
	_, err := r.loop.RunInput(ctx, "root", agent.Input{Model: "gpt", Task: "task"}, nil)
	if !budget.Refused(err) {
		t.Fatalf("RunInput = %v, want the budget refusal", err)
	}
	if n := len(r.model.Calls()); n != 1 {
		t.Errorf("%d model calls, want 1: the refusal must not go back to the model", n)
	}
	notes, _ := r.notes.List(context.Background(), runID, nil, 0)
	if len(notes) != 1 || notes[0].GetId() != "root/s0.t0" || notes[0].GetCause() != meshv1.CancelCause_CANCEL_CAUSE_BUDGET {
		t.Errorf("notes = %v, want root/s0.t0 cancelled with cause budget", notes)
	}
}
