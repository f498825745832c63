package agent_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	modelproxyv1 "github.com/curfew-mesh/curfew/gen/curfew/modelproxy/v1"
	"github.com/curfew-mesh/curfew/mesh/agent"
	"github.com/curfew-mesh/curfew/mesh/meshtest"
	"github.com/curfew-mesh/curfew/mesh/plan"
)

// notesOf is the text of a model request's notes.
func notesOf(req *modelproxyv1.GenerateRequest) string {
	var b strings.Builder
	for _, n := range req.GetNotes() {
		b.WriteString(n.GetContent())
	}
	return b.String()
}

// waitDone is a tool that runs until its context ends.
func waitDone(ctx context.Context, _ string) (string, error) {
	<-ctx.Done()
	return "", ctx.Err()
}

// With a reserve, the loop's tools run under its deadline minus the reserve, its model
// steps under the whole deadline, and every model step is told the time left in a note
// kept apart from the conversation.
func TestReserveShortensTheToolsDeadline(t *testing.T) {
	r := newRig(t, agent.Config{}, []meshtest.ModelStep{
		{ToolCalls: []*modelproxyv1.ToolCall{call(0, "x", "{}")}},
		{Text: "done"},
	}, map[string]meshtest.ToolFunc{"x": okTool})
	ctx, stop := runCtx(t, 20*time.Second)
	defer stop()
	dl, _ := ctx.Deadline()
	res, err := r.loop.RunResult(ctx, "root", agent.Input{Model: "gpt", Task: "t", Reserve: plan.Reserve{Duration: 5 * time.Second}}, nil)
	if err != nil || res.Answer != "done" || res.Partial {
		t.Fatalf("RunResult = %+v, %v", res, err)
	}
	tools := r.tools.Calls()
	if len(tools) != 1 || tools[0].Deadline.After(dl.Add(-5*time.Second)) || tools[0].Deadline.Before(dl.Add(-6*time.Second)) {
		t.Fatalf("tool calls %v: want one, under the deadline %v minus the 5s reserve", tools, dl)
	}
	models := r.model.Calls()
	if len(models) != 2 {
		t.Fatalf("%d model calls, want 2", len(models))
	}
	for i, c := range models {
		if d := c.Deadline.Sub(dl); d < -5*time.Millisecond || d > 0 { // the wire carries milliseconds
			t.Errorf("model step %d ran under %v, want the whole deadline %v", i, c.Deadline, dl)
		}
		// 20 s less the 5 s reserve leaves the model 10 s to 30 s for its tools.
		if n := notesOf(c.Request); !strings.Contains(n, "Time left for this task, tools included: 10s to 30s") {
			t.Errorf("model step %d's note = %q, want the time left in its bucket", i, n)
		}
		for _, m := range c.Request.GetMessages() {
			if strings.Contains(m.GetContent(), "[curfew]") {
				t.Errorf("model step %d: the note is in the conversation: %v", i, m)
			}
		}
	}
}

// When the reserve stops a round of tools, the stopped calls' results say so, and the
// model is then asked for its final answer without tools, before the deadline.
func TestReserveAsksForTheFinalAnswer(t *testing.T) {
	r := newRig(t, agent.Config{}, []meshtest.ModelStep{
		{Text: "looking", ToolCalls: []*modelproxyv1.ToolCall{call(0, "slow", "{}"), call(1, "x", "{}")}},
		{Text: "best effort"},
	}, map[string]meshtest.ToolFunc{"slow": waitDone, "x": okTool})
	ctx, stop := runCtx(t, 6*time.Second)
	defer stop()
	dl, _ := ctx.Deadline()
	res, err := r.loop.RunResult(ctx, "root", agent.Input{Model: "gpt", Task: "t", Reserve: plan.Reserve{Duration: 4 * time.Second}}, nil)
	if err != nil || res.Answer != "best effort" {
		t.Fatalf("RunResult = %+v, %v", res, err)
	}
	if !time.Now().Before(dl) {
		t.Fatal("the loop answered after its deadline")
	}
	models := r.model.Calls()
	if len(models) != 2 {
		t.Fatalf("%d model calls, want 2", len(models))
	}
	last := models[1].Request
	if len(last.GetTools()) != 0 {
		t.Errorf("the final step offered %d tools, want none", len(last.GetTools()))
	}
	if n := notesOf(last); !strings.Contains(n, "answer now") {
		t.Errorf("the final step's note = %q, want it to ask for the answer", n)
	}
	msgs := last.GetMessages()
	if len(msgs) != 4 {
		t.Fatalf("final step has %d messages, want the task, the call and two results", len(msgs))
	}
	if c := msgs[2].GetContent(); !strings.Contains(c, "tool slow stopped: the time for tools ran out") {
		t.Errorf("the stopped call's result = %s", c)
	}
	if c := msgs[3].GetContent(); c != `{"ok":true}` {
		t.Errorf("the finished call's result = %s, want its own", c)
	}
}

// A model step that ends past the reserve gets no tools run: its calls' results say
// they were not run, and the next step is the final answer.
func TestReserveRunsNoToolAfterIt(t *testing.T) {
	r := newRig(t, agent.Config{}, []meshtest.ModelStep{
		{Before: func(ctx context.Context) error {
			time.Sleep(2500 * time.Millisecond) // past the 6 s run's 4 s reserve
			return nil
		}, ToolCalls: []*modelproxyv1.ToolCall{call(0, "x", "{}")}},
		{Text: "no tools needed"},
	}, map[string]meshtest.ToolFunc{"x": okTool})
	ctx, stop := runCtx(t, 6*time.Second)
	defer stop()
	res, err := r.loop.RunResult(ctx, "root", agent.Input{Model: "gpt", Task: "t", Reserve: plan.Reserve{Fraction: 2.0 / 3}}, nil)
	if err != nil || res.Answer != "no tools needed" {
		t.Fatalf("RunResult = %+v, %v", res, err)
	}
	if calls := r.tools.Calls(); len(calls) != 0 {
		t.Fatalf("tools ran after the reserve: %v", calls)
	}
	msgs := r.model.Calls()[1].Request.GetMessages()
	if c := msgs[len(msgs)-1].GetContent(); !strings.Contains(c, "tool x not run") {
		t.Errorf("the unrun call's result = %s", c)
	}
}

// With Partial, a loop that runs out of time returns what it has, marked partial, a
// margin before its deadline; a cancel is still a cancel.
func TestPartialAnswerAtTheDeadline(t *testing.T) {
	r := newRig(t, agent.Config{PartialMargin: 200 * time.Millisecond}, []meshtest.ModelStep{
		{Text: "found three so far", ToolCalls: []*modelproxyv1.ToolCall{call(0, "slow", "{}")}},
	}, map[string]meshtest.ToolFunc{"slow": waitDone})
	ctx, stop := runCtx(t, 1500*time.Millisecond)
	defer stop()
	res, err := r.loop.RunResult(ctx, "root", agent.Input{Model: "gpt", Task: "t", Partial: true}, nil)
	if err != nil || !res.Partial || res.Answer != "found three so far" {
		t.Fatalf("RunResult = %+v, %v; want the model's text as a partial answer", res, err)
	}
	if ctx.Err() != nil {
		t.Fatal("the partial answer came after the deadline")
	}

	r = newRig(t, agent.Config{}, []meshtest.ModelStep{
		{Text: "found", ToolCalls: []*modelproxyv1.ToolCall{call(0, "slow", "{}")}},
	}, map[string]meshtest.ToolFunc{"slow": waitDone})
	ctx, stop = runCtx(t, 10*time.Second)
	defer stop()
	time.AfterFunc(300*time.Millisecond, stop)
	res, err = r.loop.RunResult(ctx, "root", agent.Input{Model: "gpt", Task: "t", Partial: true}, nil)
	if status.Code(err) != codes.Canceled || res.Partial {
		t.Fatalf("cancelled loop: RunResult = %+v, %v; want CANCELED", res, err)
	}
}

// Without Partial (a run's root), running out of time is DEADLINE_EXCEEDED, as before.
func TestNoPartialWithoutTheInput(t *testing.T) {
	r := newRig(t, agent.Config{}, []meshtest.ModelStep{
		{Text: "found", ToolCalls: []*modelproxyv1.ToolCall{call(0, "slow", "{}")}},
	}, map[string]meshtest.ToolFunc{"slow": waitDone})
	ctx, stop := runCtx(t, time.Second)
	defer stop()
	_, err := r.loop.RunResult(ctx, "root", agent.Input{Model: "gpt", Task: "t"}, nil)
	if status.Code(err) != codes.DeadlineExceeded {
		t.Fatalf("RunResult error = %v, want DEADLINE_EXCEEDED", err)
	}
}
