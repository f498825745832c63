package agent_test

import (
	"context"
	"errors"
	"slices"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	modelproxyv1 "github.com/curfew-mesh/curfew/gen/curfew/modelproxy/v1"
	"github.com/curfew-mesh/curfew/mesh/agent"
	"github.com/curfew-mesh/curfew/mesh/meshtest"
)

// memJournal is a journal in memory; fail, when set, makes Record fail from that Seq on.
type memJournal struct {
	mu      sync.Mutex
	entries []agent.Entry
	failAt  int
	failErr error
}

func (j *memJournal) Replay() []agent.Entry {
	j.mu.Lock()
	defer j.mu.Unlock()
	return slices.Clone(j.entries)
}

func (j *memJournal) Record(_ context.Context, e agent.Entry) error {
	j.mu.Lock()
	defer j.mu.Unlock()
	e.Seq = len(j.entries)
	if j.failErr != nil && e.Seq >= j.failAt {
		return j.failErr
	}
	// Through the encoding, as a durable journal keeps it.
	b, err := agent.MarshalEntry(e)
	if err != nil {
		return err
	}
	back, err := agent.UnmarshalEntry(b)
	if err != nil {
		return err
	}
	back.Seq, back.Tokens = e.Seq, e.Tokens
	j.entries = append(j.entries, back)
	return nil
}

func journalSteps() []meshtest.ModelStep {
	return []meshtest.ModelStep{
		{Text: "put it", ToolCalls: []*modelproxyv1.ToolCall{call(0, "echo", `{"k":1}`), call(1, "echo", `{"k":2}`)}},
		{Text: "now notify", ToolCalls: []*modelproxyv1.ToolCall{call(2, "echo", `{"k":3}`)}},
		{Text: "done and dusted"},
	}
}

func echo(_ context.Context, args string) (string, error) { return `{"echo":` + args + `}`, nil }

// A loop records both entries of every step; a loop resumed from the whole journal
// calls neither the model nor a tool and gives the same answer.
func TestJournalRecordsAndReplaysEveryStep(t *testing.T) {
	j := &memJournal{}
	r := newRig(t, agent.Config{}, journalSteps(), map[string]meshtest.ToolFunc{"echo": echo})
	ctx, cancelRun := runCtx(t, 5*time.Second)
	defer cancelRun()
	answer, err := r.loop.RunJournaled(ctx, "root", "", "task", j)
	if err != nil || answer != "done and dusted" {
		t.Fatalf("run: %q, %v", answer, err)
	}
	var kinds []string
	for i, e := range j.entries {
		if e.Seq != i {
			t.Errorf("entry %d has seq %d", i, e.Seq)
		}
		kinds = append(kinds, string(e.Kind)+":"+string(rune('0'+e.Step)))
	}
	if want := []string{"model:0", "tools:0", "model:1", "tools:1", "model:2"}; !slices.Equal(kinds, want) {
		t.Fatalf("journal = %v, want %v", kinds, want)
	}
	if e := j.entries[0]; e.Text != "put it" || e.Tokens != 2 || len(e.ToolCalls) != 2 || e.FinishReason != "tool_calls" ||
		!proto.Equal(e.ToolCalls[1], call(1, "echo", `{"k":2}`)) {
		t.Errorf("model entry 0 = %+v", e)
	}
	if e := j.entries[1]; !slices.Equal(e.ToolOutputs, []string{`{"echo":{"k":1}}`, `{"echo":{"k":2}}`}) {
		t.Errorf("tools entry 0 = %+v", e.ToolOutputs)
	}

	again := newRig(t, agent.Config{}, journalSteps(), map[string]meshtest.ToolFunc{"echo": echo})
	answer, err = again.loop.RunJournaled(ctx, "root", "", "task", &memJournal{entries: j.Replay()})
	if err != nil || answer != "done and dusted" {
		t.Fatalf("replayed run: %q, %v", answer, err)
	}
	if n, m := len(again.model.Calls()), len(again.tools.Calls()); n != 0 || m != 0 {
		t.Errorf("a fully journaled run made %d model and %d tool calls, want none", n, m)
	}
}

// Resumed after step 1's model output was recorded but before its tools were: the loop
// runs step 1's tools and step 2's model call only, with the conversation the first
// incarnation had built.
func TestJournalResumesMidStep(t *testing.T) {
	first := newRig(t, agent.Config{}, journalSteps(), map[string]meshtest.ToolFunc{"echo": echo})
	ctx, cancelRun := runCtx(t, 5*time.Second)
	defer cancelRun()
	crash := errors.New("process died")
	j := &memJournal{failAt: 3, failErr: crash} // model:0, tools:0, model:1 are recorded
	if _, err := first.loop.RunJournaled(ctx, "root", "", "task", j); !errors.Is(err, crash) {
		t.Fatalf("first incarnation: %v, want its journal's error", err)
	}
	if len(j.entries) != 3 {
		t.Fatalf("journal holds %d entries, want 3", len(j.entries))
	}

	second := newRig(t, agent.Config{}, journalSteps(), map[string]meshtest.ToolFunc{"echo": echo})
	resumed := &memJournal{entries: j.Replay()}
	answer, err := second.loop.RunJournaled(ctx, "root", "", "task", resumed)
	if err != nil || answer != "done and dusted" {
		t.Fatalf("resumed run: %q, %v", answer, err)
	}
	if got := nodeIDs(second.model.Calls()); !slices.Equal(got, []string{"root/m2"}) {
		t.Errorf("resumed model calls on %q, want only root/m2", got)
	}
	if got := nodeIDs(second.tools.Calls()); !slices.Equal(got, []string{"root/s1.t0"}) {
		t.Errorf("resumed tool calls on %q, want only root/s1.t0", got)
	}
	msgs := second.model.Calls()[0].Messages
	if len(msgs) != 6 || msgs[1].GetContent() != "put it" || msgs[3].GetContent() != `{"echo":{"k":2}}` || msgs[5].GetContent() != `{"echo":{"k":3}}` {
		t.Errorf("resumed conversation = %v", msgs)
	}
	if len(resumed.entries) != 5 {
		t.Errorf("resumed journal holds %d entries, want 5", len(resumed.entries))
	}
}

// A journal that does not fit the loop (an entry out of order) is an internal error, not
// a silent re-execution.
func TestJournalOutOfOrderIsAnError(t *testing.T) {
	r := newRig(t, agent.Config{}, journalSteps(), map[string]meshtest.ToolFunc{"echo": echo})
	ctx, cancelRun := runCtx(t, 5*time.Second)
	defer cancelRun()
	j := &memJournal{entries: []agent.Entry{{Step: 1, Kind: agent.EntryModel, Text: "x", FinishReason: "stop"}}}
	_, err := r.loop.RunJournaled(ctx, "root", "", "task", j)
	if status.Code(err) != codes.Internal {
		t.Fatalf("err = %v, want INTERNAL", err)
	}
	if n := len(r.model.Calls()); n != 0 {
		t.Errorf("%d model calls, want none", n)
	}
}
