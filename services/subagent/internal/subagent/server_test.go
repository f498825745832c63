package subagent

import (
	"context"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	modelproxyv1 "github.com/curfew-mesh/curfew/gen/curfew/modelproxy/v1"
	subagentv1 "github.com/curfew-mesh/curfew/gen/curfew/subagent/v1"
	toolrunnerv1 "github.com/curfew-mesh/curfew/gen/curfew/toolrunner/v1"
	"github.com/curfew-mesh/curfew/mesh"
	"github.com/curfew-mesh/curfew/mesh/agent"
	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/mesh/meshtest"
	"github.com/curfew-mesh/curfew/mesh/nodes"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// quiet is the server config of every server here: it logs nothing.
var quiet = mesh.ServerConfig{Logger: slog.New(slog.DiscardHandler)}

// modelCall is what the fake model saw of one Generate call.
type modelCall struct {
	id       md.Identity
	model    string
	msgs     []*modelproxyv1.Message
	tools    []string // the names of the tools the model was told of
	maxTok   int32
	deadline time.Time
}

// fakeModel is a scripted ModelProxyService: the first step calls one sleep tool, the
// second answers "the answer". It records its decoders in a table served as its
// NodeReportService.
type fakeModel struct {
	modelproxyv1.UnimplementedModelProxyServiceServer
	table *nodes.Table
	calls chan modelCall
	// slow makes the first step decode until cancelled, one token per 20 ms.
	slow bool
	// teardown is how long a cancelled decoder takes to end its node.
	teardown time.Duration
}

func (f *fakeModel) Generate(req *modelproxyv1.GenerateRequest, stream modelproxyv1.ModelProxyService_GenerateServer) error {
	ctx := stream.Context()
	id := md.IdentityFrom(ctx)
	dl, _ := ctx.Deadline()
	var tools []string
	for _, t := range req.GetTools() {
		tools = append(tools, t.GetName())
	}
	f.calls <- modelCall{id: id, model: req.GetModel(), msgs: req.GetMessages(), tools: tools, maxTok: req.GetMaxTokens(), deadline: dl}
	if req.GetModel() == "broken" {
		return status.Error(codes.Unavailable, "provider down")
	}
	turns := 0
	for _, m := range req.GetMessages() {
		if m.GetRole() == modelproxyv1.Role_ROLE_ASSISTANT {
			turns++
		}
	}
	f.table.Start(id.RunID, &meshv1.Node{Id: id.NodeID, Kind: meshv1.NodeKind_NODE_KIND_MODEL, Name: req.GetModel()})
	err := f.decode(ctx, stream, turns)
	if ctx.Err() != nil {
		time.Sleep(f.teardown)
	}
	f.table.Finish(ctx, id.RunID, id.NodeID, err, nil)
	return err
}

func (f *fakeModel) decode(ctx context.Context, stream modelproxyv1.ModelProxyService_GenerateServer, turns int) error {
	tok := func(s string) error {
		return stream.Send(&modelproxyv1.GenerateResponse{Delta: s, Tokens: 1})
	}
	if turns == 0 {
		if f.slow {
			tick := time.NewTicker(20 * time.Millisecond)
			defer tick.Stop()
			for {
				select {
				case <-ctx.Done():
					return ctx.Err()
				case <-tick.C:
					if err := tok("hmm "); err != nil {
						return err
					}
				}
			}
		}
		if err := tok("let me "); err != nil {
			return err
		}
		return stream.Send(&modelproxyv1.GenerateResponse{FinishReason: "tool_calls",
			ToolCalls: []*modelproxyv1.ToolCall{{Id: "call_0_0", Name: "sleep", ArgsJson: `{"ms":10}`}}})
	}
	if err := tok("the "); err != nil {
		return err
	}
	if err := tok("answer"); err != nil {
		return err
	}
	return stream.Send(&modelproxyv1.GenerateResponse{FinishReason: "stop"})
}

// fakeTools is a ToolRunnerService whose every tool reports its progress once, half
// way, and succeeds with {"ok":true}.
type fakeTools struct {
	toolrunnerv1.UnimplementedToolRunnerServiceServer
	table *nodes.Table
	// failing, when set, is the name of a tool that fails (INTERNAL) instead.
	failing   string
	mu        sync.Mutex
	seen      []md.Identity
	deadlines []time.Time // the calls' deadlines, in order
}

func (f *fakeTools) Execute(req *toolrunnerv1.ExecuteRequest, stream toolrunnerv1.ToolRunnerService_ExecuteServer) error {
	ctx := stream.Context()
	id := md.IdentityFrom(ctx)
	dl, _ := ctx.Deadline()
	f.mu.Lock()
	f.seen = append(f.seen, id)
	f.deadlines = append(f.deadlines, dl)
	f.mu.Unlock()
	send := func(n *meshv1.Node) {
		_ = stream.Send(&toolrunnerv1.ExecuteResponse{Event: &toolrunnerv1.ExecuteResponse_Node{Node: n}})
	}
	send(f.table.Start(id.RunID, &meshv1.Node{Id: id.NodeID, Kind: meshv1.NodeKind_NODE_KIND_TOOL, Name: req.GetName()}))
	if req.GetName() == f.failing {
		err := status.Error(codes.Internal, "disk full")
		send(f.table.Finish(ctx, id.RunID, id.NodeID, err, nil))
		return err
	}
	_ = stream.Send(&toolrunnerv1.ExecuteResponse{Event: &toolrunnerv1.ExecuteResponse_NodeEvent{NodeEvent: &meshv1.NodeEvent{
		NodeId: id.NodeID, Kind: &meshv1.NodeEvent_Progress{Progress: &meshv1.Progress{Progress: 1, Total: 2, Message: "half"}}}}})
	send(f.table.Finish(ctx, id.RunID, id.NodeID, nil, nil))
	return stream.Send(&toolrunnerv1.ExecuteResponse{Event: &toolrunnerv1.ExecuteResponse_Result{Result: &toolrunnerv1.ExecuteResult{OutputJson: `{"ok":true}`}}})
}

type env struct {
	srv   *Server
	sub   subagentv1.SubagentServiceClient
	model *fakeModel
	tools *fakeTools
}

func newEnv(t *testing.T, fm *fakeModel, maxDepth int) *env {
	t.Helper()
	return newEnvTools(t, fm, &fakeTools{}, maxDepth)
}

func newEnvTools(t *testing.T, fm *fakeModel, ft *fakeTools, maxDepth int) *env {
	t.Helper()
	fm.table, fm.calls = nodes.New(0), make(chan modelCall, 16)
	ft.table = nodes.New(0)
	mc := meshtest.Serve(t, quiet, func(gs *grpc.Server) {
		modelproxyv1.RegisterModelProxyServiceServer(gs, fm)
		meshv1.RegisterNodeReportServiceServer(gs, &nodes.Server{Table: fm.table})
	})
	tc := meshtest.Serve(t, quiet, func(gs *grpc.Server) {
		toolrunnerv1.RegisterToolRunnerServiceServer(gs, ft)
		meshv1.RegisterNodeReportServiceServer(gs, &nodes.Server{Table: ft.table})
	})
	srv := New(Config{MaxDepth: maxDepth, Loop: agent.Config{
		Model:         modelproxyv1.NewModelProxyServiceClient(mc),
		ModelNodes:    meshv1.NewNodeReportServiceClient(mc),
		Tools:         toolrunnerv1.NewToolRunnerServiceClient(tc),
		ToolNodes:     meshv1.NewNodeReportServiceClient(tc),
		SettleTimeout: 2 * time.Second,
	}})
	sc := meshtest.Serve(t, quiet, func(gs *grpc.Server) {
		subagentv1.RegisterSubagentServiceServer(gs, srv)
		meshv1.RegisterNodeReportServiceServer(gs, srv.Report())
	})
	return &env{srv: srv, sub: subagentv1.NewSubagentServiceClient(sc), model: fm, tools: ft}
}

func ident(run, node string) context.Context {
	return md.WithIdentity(context.Background(), md.Identity{RunID: run, NodeID: node})
}

type result struct {
	events []*meshv1.Node
	answer string
	hasAns bool
	err    error
}

func drain(st grpc.ServerStreamingClient[subagentv1.SpawnResponse]) result {
	evs, err := meshtest.Drain(st)
	r := result{err: err}
	for _, ev := range evs {
		switch e := ev.GetEvent().(type) {
		case *subagentv1.SpawnResponse_Node:
			r.events = append(r.events, e.Node)
		case *subagentv1.SpawnResponse_Result:
			r.answer, r.hasAns = e.Result.GetAnswer(), true
		}
	}
	return r
}

func spawn(ctx context.Context, t *testing.T, c subagentv1.SubagentServiceClient, req *subagentv1.SpawnRequest) result {
	t.Helper()
	st, err := c.Spawn(ctx, req)
	if err != nil {
		return result{err: err}
	}
	return drain(st)
}

const task = `{"steps":[{"think_tokens":1,"tools":[{"name":"sleep","args":{"ms":10}}]},{"answer_tokens":2}]}`

func TestSpawnRunsNestedLoop(t *testing.T) {
	e := newEnv(t, &fakeModel{}, 0)
	const run, parent = "r-sub", "root/s0.t1"
	ctx, cancel := context.WithTimeout(ident(run, parent), 5*time.Second)
	defer cancel()
	r := spawn(ctx, t, e.sub, &subagentv1.SpawnRequest{Task: task})
	if r.err != nil {
		t.Fatal(r.err)
	}
	if !r.hasAns || r.answer != "the answer" {
		t.Fatalf("answer = %q, want the model's final text", r.answer)
	}
	if len(r.events) < 2 {
		t.Fatalf("events = %v", r.events)
	}
	first, last := r.events[0], r.events[len(r.events)-1]
	if first.GetId() != parent+"/sub" || first.GetKind() != meshv1.NodeKind_NODE_KIND_SUBAGENT ||
		first.GetStatus() != meshv1.NodeStatus_NODE_STATUS_RUNNING || first.GetDeadline() == nil {
		t.Fatalf("first event = %v, want the running subagent node %s/sub with its deadline", first, parent)
	}
	if last.GetId() != parent+"/sub" || last.GetStatus() != meshv1.NodeStatus_NODE_STATUS_SUCCEEDED {
		t.Fatalf("last event = %v, want the succeeded subagent node", last)
	}
	seen := map[string]meshv1.NodeStatus{}
	for _, n := range r.events {
		seen[n.GetId()] = n.GetStatus()
	}
	for _, id := range []string{parent + "/sub/m0", parent + "/sub/s0.t0", parent + "/sub/m1"} {
		if seen[id] != meshv1.NodeStatus_NODE_STATUS_SUCCEEDED {
			t.Fatalf("node %s ended %v in the events %v, want SUCCEEDED", id, seen[id], r.events)
		}
	}

	// The nested loop addresses its model steps and tools beneath the subagent node,
	// under the caller's run and deadline.
	callerDL, _ := ctx.Deadline()
	var models []string
	for len(e.model.calls) > 0 {
		c := <-e.model.calls
		models = append(models, c.id.NodeID)
		if c.id.RunID != run || c.model != agent.DefaultModel {
			t.Fatalf("model call %+v, want run %s and the default model", c, run)
		}
		if c.deadline.IsZero() || c.deadline.After(callerDL) {
			t.Fatalf("model call deadline %v, want not after the caller's %v", c.deadline, callerDL)
		}
		if c.msgs[0].GetRole() != modelproxyv1.Role_ROLE_USER || c.msgs[0].GetContent() != task {
			t.Fatalf("model conversation starts with %v, want the task", c.msgs[0])
		}
		if len(c.msgs) > 1 {
			if tm := c.msgs[len(c.msgs)-1]; tm.GetRole() != modelproxyv1.Role_ROLE_TOOL || tm.GetToolCallId() != "call_0_0" || tm.GetContent() != `{"ok":true}` {
				t.Fatalf("second step's last message = %v, want the tool's output", tm)
			}
		}
	}
	if strings.Join(models, ",") != parent+"/sub/m0,"+parent+"/sub/m1" {
		t.Fatalf("model steps = %v, want %s/sub/m0 and %s/sub/m1", models, parent, parent)
	}
	e.tools.mu.Lock()
	tools := e.tools.seen
	e.tools.mu.Unlock()
	if len(tools) != 1 || tools[0].NodeID != parent+"/sub/s0.t0" || tools[0].RunID != run {
		t.Fatalf("tool calls = %+v, want one at %s/sub/s0.t0", tools, parent)
	}

	n := meshtest.WaitNode(t, e.srv.Nodes, run, parent+"/sub")
	if n.GetStatus() != meshv1.NodeStatus_NODE_STATUS_SUCCEEDED || n.GetCancelledAt() != nil {
		t.Fatalf("recorded node = %v, want SUCCEEDED", n)
	}
}

func TestSpawnModelOverrideAndFailure(t *testing.T) {
	e := newEnv(t, &fakeModel{}, 0)
	r := spawn(ident("r-broken", "root/s0.t0"), t, e.sub, &subagentv1.SpawnRequest{Task: task, Model: "broken"})
	meshtest.WantCode(t, r.err, codes.Unavailable, "provider down")
	if c := <-e.model.calls; c.model != "broken" {
		t.Fatalf("model = %q, want the request's", c.model)
	}
	n := meshtest.WaitNode(t, e.srv.Nodes, "r-broken", "root/s0.t0/sub")
	if n.GetStatus() != meshv1.NodeStatus_NODE_STATUS_FAILED || n.GetErrorCode() != "UNAVAILABLE" {
		t.Fatalf("node = %v, want FAILED with UNAVAILABLE", n)
	}
	if last := r.events[len(r.events)-1]; last.GetId() != "root/s0.t0/sub" || last.GetStatus() != meshv1.NodeStatus_NODE_STATUS_FAILED {
		t.Fatalf("last event = %v, want the failed subagent node", last)
	}
}

func TestSpawnValidation(t *testing.T) {
	e := newEnv(t, &fakeModel{}, 0)
	e1 := newEnv(t, &fakeModel{}, 1)
	for _, tc := range []struct {
		name     string
		env      *env
		ctx      context.Context
		task     string
		code     codes.Code
		contains []string
	}{
		{"no identity", e, context.Background(), task, codes.InvalidArgument, []string{md.RunID, md.NodeID}},
		{"no node", e, md.WithIdentity(context.Background(), md.Identity{RunID: "r"}), task, codes.InvalidArgument, []string{md.NodeID}},
		{"no run", e, md.WithIdentity(context.Background(), md.Identity{NodeID: "root/s0.t0"}), task, codes.InvalidArgument, []string{md.RunID}},
		{"empty task", e, ident("r", "root/s0.t0"), "", codes.InvalidArgument, []string{"task"}},
		{"depth 4", e, ident("r", "root/s0.t0/sub/s0.t0/sub/s0.t0/sub/s0.t0"), task, codes.FailedPrecondition, []string{"depth 4", "limit 3"}},
		{"depth 2 over max 1", e1, ident("r", "root/s0.t0/sub/s0.t0"), task, codes.FailedPrecondition, []string{"depth 2", "limit 1"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := spawn(tc.ctx, t, tc.env.sub, &subagentv1.SpawnRequest{Task: tc.task})
			meshtest.WantCode(t, r.err, tc.code, tc.contains...)
			if len(r.events) != 0 {
				t.Fatalf("a refused spawn emitted %v", r.events)
			}
		})
	}
	if len(e.model.calls) != 0 || len(e1.model.calls) != 0 {
		t.Fatal("a refused spawn reached the model")
	}
	if len(e.srv.Nodes.Runs()) != 0 || len(e1.srv.Nodes.Runs()) != 0 {
		t.Fatal("a refused spawn recorded a node")
	}

	// Depth 3 is served.
	if r := spawn(ident("r", "root/s0.t0/sub/s0.t0/sub/s0.t0"), t, e.sub, &subagentv1.SpawnRequest{Task: task}); r.err != nil {
		t.Fatalf("spawn at depth 3: %v", r.err)
	}
}

func TestSpawnCancelled(t *testing.T) {
	e := newEnv(t, &fakeModel{slow: true, teardown: 150 * time.Millisecond}, 0)
	const run, parent = "r-subc", "root/s0.t0"
	ctx, cancel := context.WithCancel(ident(run, parent))
	defer cancel()
	st, err := e.sub.Spawn(ctx, &subagentv1.SpawnRequest{Task: task})
	if err != nil {
		t.Fatal(err)
	}
	select {
	case <-e.model.calls:
	case <-time.After(3 * time.Second):
		t.Fatal("the nested loop did not call the model")
	}
	time.Sleep(60 * time.Millisecond) // a few tokens
	cancelAt := time.Now()
	cancel()
	if r := drain(st); status.Code(r.err) != codes.Canceled {
		t.Fatalf("after cancel: %v, want CANCELED", r.err)
	}
	n := meshtest.WaitNode(t, e.srv.Nodes, run, parent+"/sub")
	if n.GetStatus() != meshv1.NodeStatus_NODE_STATUS_CANCELLED || n.GetCancelledAt() == nil {
		t.Fatalf("subagent node = %v, want CANCELLED with cancelled_at", n)
	}
	if n.GetCancelledAt().AsTime().Before(cancelAt) {
		t.Fatalf("cancelled_at %v before the cancel at %v", n.GetCancelledAt().AsTime(), cancelAt)
	}
	m := meshtest.WaitNode(t, e.model.table, run, parent+"/sub/m0")
	if m.GetStatus() != meshv1.NodeStatus_NODE_STATUS_CANCELLED {
		t.Fatalf("model node = %v, want CANCELLED", m)
	}
	// The subagent node ends after its decoder's teardown, not before.
	if end, mEnd := n.GetEndedAt().AsTime(), m.GetEndedAt().AsTime(); end.Before(mEnd) {
		t.Fatalf("subagent node ended at %v, before its model step at %v", end, mEnd)
	}
	if d := n.GetEndedAt().AsTime().Sub(cancelAt); d > 2*time.Second {
		t.Fatalf("subagent node ended %v after the cancel", d)
	}
	if len(e.model.calls) != 0 {
		t.Fatal("the cancelled loop started another model step")
	}
}

// The nested loop's node events go up the Spawn stream among its nodes, in order: a
// tool's progress after its node started and before it ended, and all of them before
// the subagent node's end.
func TestSpawnForwardsNodeEvents(t *testing.T) {
	e := newEnv(t, &fakeModel{}, 0)
	const run, parent = "r-subev", "root/s0.t1"
	ctx, cancel := context.WithTimeout(ident(run, parent), 5*time.Second)
	defer cancel()
	st, err := e.sub.Spawn(ctx, &subagentv1.SpawnRequest{Task: task})
	if err != nil {
		t.Fatal(err)
	}
	resps, err := meshtest.Drain(st)
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	text := map[string]string{} // each model node's text, from its deltas
	running := map[string]bool{}
	var answer string
	for _, r := range resps {
		switch ev := r.GetEvent().(type) {
		case *subagentv1.SpawnResponse_Node:
			if n := ev.Node; n.GetKind() != meshv1.NodeKind_NODE_KIND_MODEL {
				got = append(got, "node "+n.GetId()+" "+strings.TrimPrefix(n.GetStatus().String(), "NODE_STATUS_"))
			} else {
				running[n.GetId()] = n.GetStatus() == meshv1.NodeStatus_NODE_STATUS_RUNNING
			}
		case *subagentv1.SpawnResponse_NodeEvent:
			if d := ev.NodeEvent.GetText(); d != nil {
				id := ev.NodeEvent.GetNodeId()
				if !running[id] {
					t.Fatalf("text of %s outside its node's life", id)
				}
				if int(d.GetOffset()) != len(text[id]) {
					t.Fatalf("text of %s at offset %d, after %d bytes", id, d.GetOffset(), len(text[id]))
				}
				text[id] += d.GetText()
				continue
			}
			got = append(got, "event "+ev.NodeEvent.GetNodeId()+" "+ev.NodeEvent.GetProgress().GetMessage())
		case *subagentv1.SpawnResponse_Result:
			got = append(got, "result")
			answer = ev.Result.GetAnswer()
		}
	}
	if answer == "" || text[parent+"/sub/m1"] != answer {
		t.Fatalf("the answer step's text %q, want the answer %q", text[parent+"/sub/m1"], answer)
	}
	tool := parent + "/sub/s0.t0"
	want := []string{
		"node " + parent + "/sub RUNNING",
		"node " + tool + " RUNNING", // the loop's view of its tool
		"node " + tool + " RUNNING", // the fake tool's own node, which it streams
		"event " + tool + " half",
		"node " + tool + " SUCCEEDED",
		"node " + tool + " SUCCEEDED",
		"node " + parent + "/sub SUCCEEDED",
		"result",
	}
	if strings.Join(got, "\n") != strings.Join(want, "\n") {
		t.Fatalf("stream:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
}

// A subagent runs the model, tools and max_tokens it is given, its model steps under its
// call's deadline less the partial margin, its tools under that less its own reserve, and
// a real model is told of a failed tool and goes on.
func TestSpawnRunInput(t *testing.T) {
	e := newEnvTools(t, &fakeModel{}, &fakeTools{failing: "sleep"}, 0)
	ctx, cancel := context.WithTimeout(ident("r-input", "root/s0.t0"), 10*time.Second)
	defer cancel()
	r := spawn(ctx, t, e.sub, &subagentv1.SpawnRequest{Task: "check the deploy", Model: "gpt-4o-mini",
		Tools: []string{"sleep"}, MaxTokens: 64, Reserve: "4s"})
	if r.err != nil || r.answer != "the answer" {
		t.Fatalf("answer %q, err %v: want the model's answer after the failed tool", r.answer, r.err)
	}
	callerDL, _ := ctx.Deadline()
	// The nested loop's own reserve comes off its tools' deadline.
	e.tools.mu.Lock()
	seen := slices.Clone(e.tools.deadlines)
	e.tools.mu.Unlock()
	if len(seen) != 1 || seen[0].After(callerDL.Add(-agent.DefaultPartialMargin-4*time.Second)) {
		t.Fatalf("tool deadlines %v, want one, 4s (the reserve) and the partial margin before the call's %v", seen, callerDL)
	}
	for i := range 2 {
		c := <-e.model.calls
		if c.model != "gpt-4o-mini" || c.maxTok != 64 || strings.Join(c.tools, ",") != "sleep" {
			t.Fatalf("step %d: model %q, max_tokens %d, tools %v: want gpt-4o-mini, 64, [sleep]", i, c.model, c.maxTok, c.tools)
		}
		if len(c.msgs) == 0 || c.msgs[0].GetRole() != modelproxyv1.Role_ROLE_USER || c.msgs[0].GetContent() != "check the deploy" {
			t.Fatalf("step %d: messages %v, want the task as the first user message", i, c.msgs)
		}
		// The model steps end the partial margin before the call's deadline (the wire
		// carries milliseconds): the nested loop's answer must still reach its caller.
		if d := callerDL.Sub(c.deadline); d < agent.DefaultPartialMargin || d > agent.DefaultPartialMargin+5*time.Millisecond {
			t.Fatalf("step %d: deadline %v, want %v before the call's %v", i, c.deadline, agent.DefaultPartialMargin, callerDL)
		}
		if i == 1 {
			last := c.msgs[len(c.msgs)-1]
			if last.GetRole() != modelproxyv1.Role_ROLE_TOOL || !strings.Contains(last.GetContent(), "disk full") {
				t.Fatalf("step 1: last message %v, want the tool's error", last)
			}
		}
	}
}

// With the sim model a failed tool still fails the subagent, as its plan expects.
func TestSpawnSimFailsOnToolError(t *testing.T) {
	e := newEnvTools(t, &fakeModel{}, &fakeTools{failing: "sleep"}, 0)
	r := spawn(ident("r-simfail", "root/s0.t0"), t, e.sub, &subagentv1.SpawnRequest{Task: task})
	meshtest.WantCode(t, r.err, codes.Internal, "disk full")
}

func TestSpawnInputValidation(t *testing.T) {
	e := newEnv(t, &fakeModel{}, 0)
	for _, tc := range []struct {
		req  *subagentv1.SpawnRequest
		want string
	}{
		{&subagentv1.SpawnRequest{Task: "t", MaxTokens: -1}, "max_tokens"},
		{&subagentv1.SpawnRequest{Task: "t", Tools: []string{""}}, "tools[0]"},
		{&subagentv1.SpawnRequest{Task: "t", Reserve: "later"}, "reserve"},
	} {
		r := spawn(ident("r-bad", "root/s0.t0"), t, e.sub, tc.req)
		meshtest.WantCode(t, r.err, codes.InvalidArgument, tc.want)
	}
}
