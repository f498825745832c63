package agent_test

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	modelproxyv1 "github.com/curfew-mesh/curfew/gen/curfew/modelproxy/v1"
	toolrunnerv1 "github.com/curfew-mesh/curfew/gen/curfew/toolrunner/v1"
	"github.com/curfew-mesh/curfew/mesh"
	"github.com/curfew-mesh/curfew/mesh/agent"
	"github.com/curfew-mesh/curfew/mesh/cancel"
	"github.com/curfew-mesh/curfew/mesh/catalog"
	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/mesh/meshtest"
	"github.com/curfew-mesh/curfew/mesh/nodes"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

const runID = "run-1"

// rig is an agent loop wired to scripted model and tool services over real gRPC.
type rig struct {
	model *meshtest.Model
	tools *meshtest.Tools
	notes *nodes.Table
	loop  *agent.Loop

	mu      sync.Mutex
	emitted []*meshv1.Node
	// order is what Emit and EmitEvent got, in order: "node ID STATUS" and
	// "event ID PROGRESS".
	order []string
}

func newRig(t *testing.T, cfg agent.Config, steps []meshtest.ModelStep, funcs map[string]meshtest.ToolFunc) *rig {
	t.Helper()
	r := &rig{model: meshtest.NewModel(steps...), tools: meshtest.NewTools(funcs), notes: nodes.New(0)}
	mc := meshtest.Serve(t, mesh.ServerConfig{}, r.model.Register)
	tc := meshtest.Serve(t, mesh.ServerConfig{}, r.tools.Register)
	cfg.Model = modelproxyv1.NewModelProxyServiceClient(mc)
	cfg.ModelNodes = meshv1.NewNodeReportServiceClient(mc)
	cfg.Tools = toolrunnerv1.NewToolRunnerServiceClient(tc)
	cfg.ToolNodes = meshv1.NewNodeReportServiceClient(tc)
	cfg.Notes = r.notes
	if cfg.SettleTimeout == 0 {
		cfg.SettleTimeout = 2 * time.Second
	}
	cfg.Emit = func(n *meshv1.Node) { // kept as given: the loop must hand over snapshots
		r.mu.Lock()
		defer r.mu.Unlock()
		r.emitted = append(r.emitted, n)
		r.order = append(r.order, "node "+n.GetId()+" "+strings.TrimPrefix(n.GetStatus().String(), "NODE_STATUS_"))
	}
	cfg.EmitEvent = func(ev *meshv1.NodeEvent) {
		r.mu.Lock()
		defer r.mu.Unlock()
		if d := ev.GetText(); d != nil {
			r.order = append(r.order, fmt.Sprintf("text %s %d %q", ev.GetNodeId(), d.GetOffset(), d.GetText()))
			return
		}
		r.order = append(r.order, fmt.Sprintf("event %s %g", ev.GetNodeId(), ev.GetProgress().GetProgress()))
	}
	r.loop = agent.New(cfg)
	return r
}

func (r *rig) emittedFor(id string) []*meshv1.Node {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []*meshv1.Node
	for _, n := range r.emitted {
		if n.Id == id {
			out = append(out, proto.Clone(n).(*meshv1.Node))
		}
	}
	return out
}

// runCtx is a run's context: its identity and absolute deadline.
func runCtx(t *testing.T, timeout time.Duration) (context.Context, context.CancelFunc) {
	t.Helper()
	ctx := md.WithIdentity(context.Background(), md.Identity{Tenant: "acme", RunID: runID, NodeID: "root"})
	return context.WithTimeout(ctx, timeout)
}

func call(i int, name, args string) *modelproxyv1.ToolCall {
	return &modelproxyv1.ToolCall{Id: fmt.Sprintf("call_%d", i), Name: name, ArgsJson: args}
}

func nodeIDs(calls []meshtest.Call) []string {
	out := make([]string, len(calls))
	for i, c := range calls {
		out[i] = c.ID.NodeID
	}
	return out
}

// meet is a tool that returns only once n calls of it are running at the same time, so
// it fails (after 2 s) unless its calls run in parallel.
func meet(n int) meshtest.ToolFunc {
	var mu sync.Mutex
	arrived := 0
	all := make(chan struct{})
	return func(ctx context.Context, args string) (string, error) {
		mu.Lock()
		if arrived++; arrived == n {
			close(all)
		}
		mu.Unlock()
		select {
		case <-all:
			return `{"met":` + args + `}`, nil
		case <-ctx.Done():
			return "", ctx.Err()
		case <-time.After(2 * time.Second):
			return "", status.Error(codes.FailedPrecondition, "the calls did not run in parallel")
		}
	}
}

// block is a tool that signals started, runs until its context is done, then spends
// teardown on its cleanup before returning.
func block(started chan<- string, teardown time.Duration) meshtest.ToolFunc {
	return func(ctx context.Context, _ string) (string, error) {
		started <- md.IdentityFrom(ctx).NodeID
		<-ctx.Done()
		time.Sleep(teardown)
		return "", ctx.Err()
	}
}

func TestRunTwoStepsWithParallelTools(t *testing.T) {
	r := newRig(t, agent.Config{MaxFanout: 2}, []meshtest.ModelStep{
		{Text: "let me look", ToolCalls: []*modelproxyv1.ToolCall{call(0, "meet", `{"i":0}`), call(1, "meet", `{"i":1}`)}},
		{Text: "the answer is 42"},
	}, map[string]meshtest.ToolFunc{"meet": meet(2)})
	ctx, cancelRun := runCtx(t, 5*time.Second)
	defer cancelRun()
	runDL, _ := ctx.Deadline()

	answer, err := r.loop.Run(ctx, "root", "", "the task")
	if err != nil {
		t.Fatal(err)
	}
	if answer != "the answer is 42" {
		t.Errorf("answer = %q", answer)
	}

	models := r.model.Calls()
	if got := nodeIDs(models); !slices.Equal(got, []string{"root/m0", "root/m1"}) {
		t.Fatalf("model calls on nodes %q, want root/m0, root/m1", got)
	}
	tools := meshtest.ByNode(r.tools.Calls())
	if got := nodeIDs(tools); !slices.Equal(got, []string{"root/s0.t0", "root/s0.t1"}) {
		t.Fatalf("tool calls on nodes %q, want root/s0.t0, root/s0.t1", got)
	}
	for _, c := range append(models, tools...) {
		if c.ID.Tenant != "acme" || c.ID.RunID != runID {
			t.Errorf("%s carried identity %+v, want tenant acme, run %s", c.ID.NodeID, c.ID, runID)
		}
		if c.Deadline.IsZero() || c.Deadline.After(runDL) {
			t.Errorf("%s ran under deadline %v, want the run's %v or earlier", c.ID.NodeID, c.Deadline, runDL)
		}
		if c.Err != nil {
			t.Errorf("%s failed: %v", c.ID.NodeID, c.Err)
		}
	}
	if models[0].Name != agent.DefaultModel {
		t.Errorf("model = %q, want the default %q", models[0].Name, agent.DefaultModel)
	}
	// Every model step is told the built-in tools.
	var builtins []string
	for _, ts := range catalog.Specs() {
		builtins = append(builtins, ts.GetName())
	}
	for _, c := range models {
		if !slices.Equal(c.Tools, builtins) {
			t.Errorf("%s was told tools %q, want %q", c.ID.NodeID, c.Tools, builtins)
		}
	}
	// Parallel: each tool started before the other ended.
	if !tools[0].Start.Before(tools[1].End) || !tools[1].Start.Before(tools[0].End) {
		t.Errorf("tool calls did not overlap: t0 %v–%v, t1 %v–%v", tools[0].Start, tools[0].End, tools[1].Start, tools[1].End)
	}
	if tools[0].Args != `{"i":0}` || tools[0].Name != "meet" {
		t.Errorf("t0 called %s with %s", tools[0].Name, tools[0].Args)
	}

	// The second step sees the task, the first step's request and both results in order.
	msgs := models[1].Messages
	if len(msgs) != 4 {
		t.Fatalf("second model call got %d messages, want 4: %v", len(msgs), msgs)
	}
	if msgs[0].GetRole() != modelproxyv1.Role_ROLE_USER || msgs[0].GetContent() != "the task" {
		t.Errorf("message 0 = %v", msgs[0])
	}
	if msgs[1].GetRole() != modelproxyv1.Role_ROLE_ASSISTANT || msgs[1].GetContent() != "let me look" || len(msgs[1].GetToolCalls()) != 2 {
		t.Errorf("message 1 = %v", msgs[1])
	}
	for j := range 2 {
		m := msgs[2+j]
		if m.GetRole() != modelproxyv1.Role_ROLE_TOOL || m.GetToolCallId() != fmt.Sprintf("call_%d", j) || m.GetContent() != fmt.Sprintf(`{"met":{"i":%d}}`, j) {
			t.Errorf("message %d = %v", 2+j, m)
		}
	}

	// Every node the executors ran has ended, successfully.
	for name, tb := range map[string]*nodes.Table{"model": r.model.Table(), "tools": r.tools.Table()} {
		ns, settled := tb.List(context.Background(), runID, nil, 0)
		if !settled || len(ns) != 2 {
			t.Errorf("%s table: %d nodes, settled=%v", name, len(ns), settled)
		}
		for _, n := range ns {
			if n.Status != meshv1.NodeStatus_NODE_STATUS_SUCCEEDED {
				t.Errorf("%s node %s = %v", name, n.Id, n.Status)
			}
		}
	}
}

func TestEmitHandsOverSnapshots(t *testing.T) {
	r := newRig(t, agent.Config{}, []meshtest.ModelStep{{Text: "one two three"}}, nil)
	ctx, cancelRun := runCtx(t, 5*time.Second)
	defer cancelRun()
	if _, err := r.loop.Run(ctx, "root", "", "task"); err != nil {
		t.Fatal(err)
	}
	ev := r.emittedFor("root/m0")
	if len(ev) < 2 {
		t.Fatalf("emitted %d events for root/m0, want a start and an end", len(ev))
	}
	first, last := ev[0], ev[len(ev)-1]
	if first.Status != meshv1.NodeStatus_NODE_STATUS_RUNNING || first.EndedAt != nil {
		t.Errorf("first event = %v; want RUNNING as it was when emitted (an event must not change after Emit)", first)
	}
	if last.Status != meshv1.NodeStatus_NODE_STATUS_SUCCEEDED || last.Tokens != 3 || last.EndedAt == nil || last.Kind != meshv1.NodeKind_NODE_KIND_MODEL {
		t.Errorf("last event = %v; want SUCCEEDED with 3 tokens", last)
	}
}

func TestSiblingFailureCancelsAndWaitsForTeardown(t *testing.T) {
	started := make(chan string, 2)
	const teardown = 150 * time.Millisecond
	r := newRig(t, agent.Config{}, []meshtest.ModelStep{
		{ToolCalls: []*modelproxyv1.ToolCall{call(0, "block", "{}"), call(1, "fail", "{}"), call(2, "block", "{}")}},
		{Text: "unreachable"},
	}, map[string]meshtest.ToolFunc{
		"block": block(started, teardown),
		"fail": func(ctx context.Context, _ string) (string, error) {
			// Fail once both siblings are running.
			for range 2 {
				select {
				case id := <-started:
					_ = id
				case <-time.After(3 * time.Second):
					return "", status.Error(codes.FailedPrecondition, "siblings did not start")
				}
			}
			// INTERNAL, not UNAVAILABLE: the client chain would retry UNAVAILABLE.
			return "", status.Error(codes.Internal, "tool broke")
		},
	})
	ctx, cancelRun := runCtx(t, 5*time.Second)
	defer cancelRun()

	_, err := r.loop.Run(ctx, "root", "", "task")
	returned := time.Now()
	calls := meshtest.ByNode(r.tools.Calls()) // as they were when Run returned

	if st := status.Convert(err); st.Code() != codes.Internal || st.Message() != "tool broke" {
		t.Fatalf("Run = %v; want the failing tool's INTERNAL \"tool broke\"", err)
	}
	if got := nodeIDs(calls); !slices.Equal(got, []string{"root/s0.t0", "root/s0.t1", "root/s0.t2"}) {
		t.Fatalf("tool calls %q", got)
	}
	failedAt := calls[1].End
	for _, i := range []int{0, 2} {
		c := calls[i]
		if c.End.IsZero() || c.End.After(returned) {
			t.Errorf("%s: handler had not returned when Run returned (end %v)", c.ID.NodeID, c.End)
			continue
		}
		if c.CtxErr == nil {
			t.Errorf("%s: handler context was not cancelled", c.ID.NodeID)
		}
		if c.End.Sub(failedAt) < teardown {
			t.Errorf("%s ended %v after the failure, before its %v teardown could finish", c.ID.NodeID, c.End.Sub(failedAt), teardown)
		}
	}
	if n := len(r.model.Calls()); n != 1 {
		t.Errorf("%d model calls, want 1: the loop must stop at the failed step", n)
	}

	// The loop noted why it cancelled the siblings, and the merged tree says so.
	notes, _ := r.notes.List(context.Background(), runID, nil, 0)
	var noted []string
	for _, n := range notes {
		if n.Cause != meshv1.CancelCause_CANCEL_CAUSE_SIBLING_FAILED {
			t.Errorf("note for %s has cause %v", n.Id, n.Cause)
		}
		noted = append(noted, n.Id)
	}
	if !slices.Equal(noted, []string{"root/s0.t0", "root/s0.t2"}) {
		t.Errorf("notes for %q, want the two siblings", noted)
	}
	executed, settled := r.tools.Table().List(context.Background(), runID, nil, 0)
	if !settled {
		t.Error("tool nodes still running after Run returned")
	}
	merged := nodes.Merge(executed, notes)
	want := map[string][2]string{
		"root/s0.t0": {"NODE_STATUS_CANCELLED", "CANCEL_CAUSE_SIBLING_FAILED"},
		"root/s0.t1": {"NODE_STATUS_FAILED", "CANCEL_CAUSE_UNSPECIFIED"},
		"root/s0.t2": {"NODE_STATUS_CANCELLED", "CANCEL_CAUSE_SIBLING_FAILED"},
	}
	for _, n := range merged {
		if w := want[n.Id]; n.Status.String() != w[0] || n.Cause.String() != w[1] {
			t.Errorf("merged %s = %v/%v, want %v", n.Id, n.Status, n.Cause, w)
		}
	}
}

func TestSingleToolFailureIsReturnedWithoutNotes(t *testing.T) {
	r := newRig(t, agent.Config{}, []meshtest.ModelStep{
		{ToolCalls: []*modelproxyv1.ToolCall{call(0, "nope", "{}")}},
		{Text: "unreachable"},
	}, nil)
	ctx, cancelRun := runCtx(t, 5*time.Second)
	defer cancelRun()
	_, err := r.loop.Run(ctx, "root", "", "task")
	if status.Code(err) != codes.NotFound {
		t.Fatalf("Run = %v, want the tool's NOT_FOUND", err)
	}
	if notes, _ := r.notes.List(context.Background(), runID, nil, 0); len(notes) != 0 {
		t.Errorf("notes %v for a step without siblings", notes)
	}
}

func TestDeadlineFastFail(t *testing.T) {
	t.Run("model", func(t *testing.T) {
		r := newRig(t, agent.Config{MinModelTime: 2 * time.Second}, []meshtest.ModelStep{{Text: "hi"}}, nil)
		ctx, cancelRun := runCtx(t, time.Second)
		defer cancelRun()
		_, err := r.loop.Run(ctx, "root", "", "task")
		if status.Code(err) != codes.DeadlineExceeded || !strings.Contains(status.Convert(err).Message(), "no time left to start model call root/m0") {
			t.Fatalf("Run = %v, want DEADLINE_EXCEEDED \"no time left to start model call root/m0\"", err)
		}
		if n := len(r.model.Calls()); n != 0 {
			t.Errorf("%d model calls reached the model; want none", n)
		}
	})
	t.Run("tool", func(t *testing.T) {
		r := newRig(t, agent.Config{MinToolTime: 10 * time.Second}, []meshtest.ModelStep{
			{ToolCalls: []*modelproxyv1.ToolCall{call(0, "sleep", `{"ms":1}`)}}, {Text: "x"},
		}, map[string]meshtest.ToolFunc{"sleep": func(context.Context, string) (string, error) { return "{}", nil }})
		ctx, cancelRun := runCtx(t, 5*time.Second)
		defer cancelRun()
		_, err := r.loop.Run(ctx, "root", "", "task")
		if status.Code(err) != codes.DeadlineExceeded || !strings.Contains(status.Convert(err).Message(), "no time left to start tool sleep") {
			t.Fatalf("Run = %v, want DEADLINE_EXCEEDED \"no time left to start tool sleep\"", err)
		}
		if n := len(r.tools.Calls()); n != 0 {
			t.Errorf("%d tool calls reached the runner; want none", n)
		}
	})
	t.Run("expired", func(t *testing.T) {
		r := newRig(t, agent.Config{}, []meshtest.ModelStep{{Text: "hi"}}, nil)
		ctx, cancelRun := runCtx(t, -time.Second)
		defer cancelRun()
		_, err := r.loop.Run(ctx, "root", "", "task")
		if status.Code(err) != codes.DeadlineExceeded {
			t.Fatalf("Run = %v, want DEADLINE_EXCEEDED", err)
		}
		if n := len(r.model.Calls()); n != 0 {
			t.Errorf("%d model calls after the deadline", n)
		}
	})
}

func TestCancelMidTool(t *testing.T) {
	const teardown = 100 * time.Millisecond
	steps := []meshtest.ModelStep{{ToolCalls: []*modelproxyv1.ToolCall{call(0, "block", "{}")}}, {Text: "unreachable"}}

	t.Run("operator", func(t *testing.T) {
		started := make(chan string, 1)
		r := newRig(t, agent.Config{}, steps, map[string]meshtest.ToolFunc{"block": block(started, teardown)})
		ctx, stop := runCtx(t, 5*time.Second)
		defer stop()
		ctx, cancelRun := context.WithCancelCause(ctx)
		defer cancelRun(nil)
		go func() {
			select {
			case <-started:
				cancelRun(cancel.ErrOperator)
			case <-ctx.Done():
			}
		}()
		_, err := r.loop.Run(ctx, "root", "", "task")
		returned := time.Now()
		if st := status.Convert(err); st.Code() != codes.Canceled || !strings.Contains(st.Message(), "cancelled by operator") {
			t.Fatalf("Run = %v, want CANCELED with the operator cause", err)
		}
		c := r.tools.Calls()
		if len(c) != 1 || c[0].End.IsZero() || c[0].End.After(returned) || c[0].CtxErr == nil {
			t.Fatalf("tool call %+v: want it cancelled and ended before Run returned", c)
		}
		if n := len(r.model.Calls()); n != 1 {
			t.Errorf("%d model calls, want 1", n)
		}
	})

	t.Run("deadline", func(t *testing.T) {
		started := make(chan string, 1)
		r := newRig(t, agent.Config{}, steps, map[string]meshtest.ToolFunc{"block": block(started, teardown)})
		const timeout = time.Second
		ctx, stop := runCtx(t, timeout)
		defer stop()
		begin := time.Now()
		_, err := r.loop.Run(ctx, "root", "", "task")
		elapsed := time.Since(begin)
		if status.Code(err) != codes.DeadlineExceeded {
			t.Fatalf("Run = %v, want DEADLINE_EXCEEDED", err)
		}
		if elapsed < timeout-50*time.Millisecond || elapsed > timeout+2*time.Second {
			t.Errorf("Run returned after %v with a %v deadline", elapsed, timeout)
		}
		c := r.tools.Calls()
		if len(c) != 1 || c[0].End.IsZero() || c[0].CtxErr == nil {
			t.Fatalf("Run = %v; tool call %+v: want it stopped by the deadline and ended", err, c)
		}
	})
}

func TestCancelMidModel(t *testing.T) {
	started := make(chan struct{})
	r := newRig(t, agent.Config{}, []meshtest.ModelStep{{
		Before: func(ctx context.Context) error {
			close(started)
			<-ctx.Done()
			time.Sleep(100 * time.Millisecond) // the decoder stops at its next token
			return ctx.Err()
		},
		Text: "never",
	}}, nil)
	ctx, stop := runCtx(t, 5*time.Second)
	defer stop()
	ctx, cancelRun := context.WithCancelCause(ctx)
	defer cancelRun(nil)
	go func() {
		select {
		case <-started:
			cancelRun(cancel.ErrClientDisconnect)
		case <-ctx.Done():
		}
	}()
	_, err := r.loop.Run(ctx, "root", "", "task")
	returned := time.Now()
	if st := status.Convert(err); st.Code() != codes.Canceled || !strings.Contains(st.Message(), "client disconnected") {
		t.Fatalf("Run = %v, want CANCELED with the client_disconnect cause", err)
	}
	c := r.model.Calls()
	if len(c) != 1 || c[0].End.IsZero() || c[0].End.After(returned) || c[0].CtxErr == nil {
		t.Fatalf("model call %+v: want it cancelled and ended before Run returned", c)
	}
	if ev := r.emittedFor("root/m0"); len(ev) == 0 || ev[len(ev)-1].Status != meshv1.NodeStatus_NODE_STATUS_CANCELLED {
		t.Errorf("model node events %v, want the last one CANCELLED", ev)
	}
}

func TestMaxFanout(t *testing.T) {
	r := newRig(t, agent.Config{MaxFanout: 2}, []meshtest.ModelStep{
		{ToolCalls: []*modelproxyv1.ToolCall{call(0, "x", "{}"), call(1, "x", "{}"), call(2, "x", "{}")}},
		{Text: "unreachable"},
	}, map[string]meshtest.ToolFunc{"x": func(context.Context, string) (string, error) { return "{}", nil }})
	ctx, stop := runCtx(t, 5*time.Second)
	defer stop()
	_, err := r.loop.Run(ctx, "root", "", "task")
	if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), "fan-out limit 2") {
		t.Fatalf("Run = %v, want INVALID_ARGUMENT naming the fan-out limit", err)
	}
	if n := len(r.tools.Calls()); n != 0 {
		t.Errorf("%d tools started beyond the fan-out limit; want none", n)
	}
}

func TestMaxSteps(t *testing.T) {
	toolStep := meshtest.ModelStep{ToolCalls: []*modelproxyv1.ToolCall{call(0, "x", "{}")}}
	r := newRig(t, agent.Config{MaxSteps: 2}, []meshtest.ModelStep{toolStep, toolStep, toolStep, {Text: "late"}},
		map[string]meshtest.ToolFunc{"x": func(context.Context, string) (string, error) { return "{}", nil }})
	ctx, stop := runCtx(t, 5*time.Second)
	defer stop()
	_, err := r.loop.Run(ctx, "root", "", "task")
	if status.Code(err) != codes.ResourceExhausted {
		t.Fatalf("Run = %v, want RESOURCE_EXHAUSTED at the step limit", err)
	}
	if n := len(r.model.Calls()); n != 2 {
		t.Errorf("%d model calls, want 2", n)
	}
}

func TestThinkOnlyStepContinues(t *testing.T) {
	r := newRig(t, agent.Config{ModelName: "m"}, []meshtest.ModelStep{
		{Text: "hmm", FinishReason: "tool_calls"}, // thinks, calls no tool
		{Text: "done"},
	}, nil)
	ctx, stop := runCtx(t, 5*time.Second)
	defer stop()
	answer, err := r.loop.Run(ctx, "sub", "override", "task")
	if err != nil || answer != "done" {
		t.Fatalf("Run = %q, %v; want \"done\"", answer, err)
	}
	c := r.model.Calls()
	if got := nodeIDs(c); !slices.Equal(got, []string{"sub/m0", "sub/m1"}) || c[0].Name != "override" {
		t.Fatalf("model calls %q with model %q", got, c[0].Name)
	}
	if n := len(r.tools.Calls()); n != 0 {
		t.Errorf("%d tool calls", n)
	}
}
