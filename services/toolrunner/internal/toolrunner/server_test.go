package toolrunner

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	subagentv1 "github.com/curfew-mesh/curfew/gen/curfew/subagent/v1"
	toolrunnerv1 "github.com/curfew-mesh/curfew/gen/curfew/toolrunner/v1"
	"github.com/curfew-mesh/curfew/mesh"
	"github.com/curfew-mesh/curfew/mesh/cancel"
	"github.com/curfew-mesh/curfew/mesh/deadline"
	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/mesh/meshtest"
	"github.com/curfew-mesh/curfew/mesh/nodes"
	"github.com/curfew-mesh/curfew/mesh/store/storetest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// quiet is the servers' logger: it drops what the refused calls would log.
var quiet = slog.New(slog.DiscardHandler)

type env struct {
	srv   *Server
	tools toolrunnerv1.ToolRunnerServiceClient
}

func newEnv(t *testing.T, scfg mesh.ServerConfig, cfg Config) *env {
	t.Helper()
	if scfg.Logger == nil {
		scfg.Logger = quiet
	}
	if cfg.Store == nil { // what main opens without --store
		cfg.Store = storetest.OpenMemory(t)
	}
	if cfg.Owner == "" {
		cfg.Owner = "test-owner"
	}
	srv := New(cfg)
	cc := meshtest.Serve(t, scfg, func(gs *grpc.Server) {
		toolrunnerv1.RegisterToolRunnerServiceServer(gs, srv)
		meshv1.RegisterNodeReportServiceServer(gs, srv.Report())
	})
	return &env{srv: srv, tools: toolrunnerv1.NewToolRunnerServiceClient(cc)}
}

func ident(run, node string) context.Context {
	return md.WithIdentity(context.Background(), md.Identity{RunID: run, NodeID: node})
}

func withAttempt(ctx context.Context, a string) context.Context {
	return metadata.AppendToOutgoingContext(ctx, md.Attempt, a)
}

// result is what an Execute stream delivered.
type result struct {
	events []*meshv1.Node
	out    string
	hasOut bool
	err    error
}

func drain(st grpc.ServerStreamingClient[toolrunnerv1.ExecuteResponse]) result {
	evs, err := meshtest.Drain(st)
	r := result{err: err}
	for _, ev := range evs {
		switch e := ev.GetEvent().(type) {
		case *toolrunnerv1.ExecuteResponse_Node:
			r.events = append(r.events, e.Node)
		case *toolrunnerv1.ExecuteResponse_Result:
			r.out, r.hasOut = e.Result.GetOutputJson(), true
		}
	}
	return r
}

func execute(ctx context.Context, t *testing.T, c toolrunnerv1.ToolRunnerServiceClient, name, args string) result {
	t.Helper()
	st, err := c.Execute(ctx, &toolrunnerv1.ExecuteRequest{Name: name, ArgsJson: args})
	if err != nil {
		return result{err: err}
	}
	return drain(st)
}

// waitRunning polls tbl (without settling) until node of run is recorded RUNNING and
// returns that record. It fails the test if that does not happen within 3s. It is how a
// test learns that a tool has started, since the tool's own node is not streamed.
func waitRunning(t *testing.T, tbl *nodes.Table, run, node string) *meshv1.Node {
	t.Helper()
	deadline := time.Now().Add(3 * time.Second)
	for {
		ns, _ := tbl.List(context.Background(), run, []string{node}, 0)
		for _, n := range ns {
			if n.GetId() == node && n.GetStatus() == meshv1.NodeStatus_NODE_STATUS_RUNNING {
				return n
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("node %s of run %s not RUNNING within 3s (have %v)", node, run, ns)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// noOwnEvents fails the test if the stream carried an event for the tool's own node:
// that node is only recorded in the node table, so that the stream stays message-free
// (and so retryable) until its result.
func noOwnEvents(t *testing.T, r result, node string) {
	t.Helper()
	for _, n := range r.events {
		if n.GetId() == node {
			t.Fatalf("the stream carried the tool's own node %s: %v", node, r.events)
		}
	}
}

func TestSleepCompletes(t *testing.T) {
	e := newEnv(t, mesh.ServerConfig{}, Config{})
	start := time.Now()
	r := execute(ident("r-sleep", "root/s0.t0"), t, e.tools, "sleep", `{"ms":60}`)
	elapsed := time.Since(start)
	if r.err != nil {
		t.Fatal(r.err)
	}
	if elapsed < 55*time.Millisecond || elapsed > 3*time.Second {
		t.Fatalf("sleep of 60ms took %v", elapsed)
	}
	if !r.hasOut || r.out != `{"slept_ms":60}` {
		t.Fatalf("output = %q, want the slept time", r.out)
	}
	if len(r.events) != 0 {
		t.Fatalf("events = %v, want none: the tool's own node is recorded, not streamed", r.events)
	}
	n := meshtest.WaitNode(t, e.srv.Nodes, "r-sleep", "root/s0.t0")
	if n.GetStatus() != meshv1.NodeStatus_NODE_STATUS_SUCCEEDED || n.GetKind() != meshv1.NodeKind_NODE_KIND_TOOL ||
		n.GetName() != "sleep" || n.GetDeadline() == nil {
		t.Fatalf("recorded node = %v, want the succeeded tool node with its deadline", n)
	}
	if n.GetStartedAt() == nil || n.GetEndedAt() == nil {
		t.Fatalf("recorded node = %v, want started_at and ended_at", n)
	}
	if d := n.GetEndedAt().AsTime().Sub(n.GetStartedAt().AsTime()); d < 55*time.Millisecond {
		t.Fatalf("recorded node ran %v, want the 60ms sleep", d)
	}
	if n.GetStartedAt().AsTime().Before(start) || n.GetEndedAt().AsTime().After(start.Add(elapsed)) {
		t.Fatalf("recorded node ran %v..%v, outside the call %v..%v", n.GetStartedAt().AsTime(), n.GetEndedAt().AsTime(), start, start.Add(elapsed))
	}
}

func TestSleepCancelled(t *testing.T) {
	e := newEnv(t, mesh.ServerConfig{}, Config{})
	ctx, cancel := context.WithCancel(ident("r-sleepc", "root/s0.t0"))
	defer cancel()
	st, err := e.tools.Execute(ctx, &toolrunnerv1.ExecuteRequest{Name: "sleep", ArgsJson: `{"ms":60000}`})
	if err != nil {
		t.Fatal(err)
	}
	if n := waitRunning(t, e.srv.Nodes, "r-sleepc", "root/s0.t0"); n.GetKind() != meshv1.NodeKind_NODE_KIND_TOOL || n.GetName() != "sleep" {
		t.Fatalf("running node = %v, want the sleep tool", n)
	}
	cancelAt := time.Now()
	cancel()
	r := drain(st)
	if status.Code(r.err) != codes.Canceled {
		t.Fatalf("after cancel: %v, want CANCELED", r.err)
	}
	noOwnEvents(t, r, "root/s0.t0")
	n := meshtest.WaitNode(t, e.srv.Nodes, "r-sleepc", "root/s0.t0")
	if n.GetStatus() != meshv1.NodeStatus_NODE_STATUS_CANCELLED || n.GetCancelledAt() == nil {
		t.Fatalf("node = %v, want CANCELLED with cancelled_at", n)
	}
	if d := n.GetEndedAt().AsTime().Sub(cancelAt); d < 0 || d > time.Second {
		t.Fatalf("node ended %v after the cancel, want promptly", d)
	}
}

func TestFailTool(t *testing.T) {
	e := newEnv(t, mesh.ServerConfig{}, Config{})
	const run, node = "r-fail", "root/s0.t0"
	args := `{"times":2,"code":"aborted","after_ms":50}`
	for _, a := range []string{"1", "2"} {
		start := time.Now()
		r := execute(withAttempt(ident(run, node), a), t, e.tools, "fail", args)
		meshtest.WantCode(t, r.err, codes.Aborted, "attempt "+a+" of 2")
		if d := time.Since(start); d < 45*time.Millisecond {
			t.Fatalf("attempt %s failed after %v, want after_ms 50", a, d)
		}
		if len(r.events) != 0 {
			t.Fatalf("attempt %s events = %v, want none: the tool's own node is not streamed", a, r.events)
		}
		end := meshtest.WaitNode(t, e.srv.Nodes, run, node)
		if end.GetStatus() != meshv1.NodeStatus_NODE_STATUS_FAILED || end.GetErrorCode() != "ABORTED" ||
			end.GetStartedAt() == nil || end.GetEndedAt() == nil {
			t.Fatalf("attempt %s node = %v, want FAILED with ABORTED, started and ended", a, end)
		}
		if d := end.GetEndedAt().AsTime().Sub(end.GetStartedAt().AsTime()); d < 45*time.Millisecond {
			t.Fatalf("attempt %s node ran %v, want after_ms 50", a, d)
		}
	}
	r := execute(withAttempt(ident(run, node), "3"), t, e.tools, "fail", args)
	if r.err != nil || r.out != `{"attempt":3}` {
		t.Fatalf("attempt 3 = %q, %v; want success", r.out, r.err)
	}
	if len(r.events) != 0 {
		t.Fatalf("attempt 3 events = %v, want none", r.events)
	}
	n := meshtest.WaitNode(t, e.srv.Nodes, run, node)
	if n.GetStatus() != meshv1.NodeStatus_NODE_STATUS_SUCCEEDED || n.GetErrorCode() != "" {
		t.Fatalf("node after attempt 3 = %v", n)
	}
	// The two failed attempts are kept on the record.
	if ea := n.GetEarlierAttempts(); len(ea) != 2 || ea[0].GetStatus() != meshv1.NodeStatus_NODE_STATUS_FAILED || ea[0].GetErrorCode() != "ABORTED" ||
		ea[1].GetStatus() != meshv1.NodeStatus_NODE_STATUS_FAILED || ea[1].GetErrorCode() != "ABORTED" {
		t.Fatalf("earlier attempts = %v, want the two ABORTED failures", ea)
	}

	// Defaults: one failure with UNAVAILABLE; no attempt header counts as attempt 1.
	r = execute(ident(run, "root/s1.t0"), t, e.tools, "fail", `{}`)
	meshtest.WantCode(t, r.err, codes.Unavailable)
	if r = execute(withAttempt(ident(run, "root/s1.t0"), "2"), t, e.tools, "fail", ``); r.err != nil {
		t.Fatalf("attempt 2 with default times: %v", r.err)
	}
}

func TestDeployCompletes(t *testing.T) {
	e := newEnv(t, mesh.ServerConfig{}, Config{})
	start := time.Now()
	r := execute(ident("r-dep", "root/s0.t0"), t, e.tools, "deploy", `{"duration_ms":150,"poll_ms":30,"abort_ms":500}`)
	if r.err != nil {
		t.Fatal(r.err)
	}
	if d := time.Since(start); d < 140*time.Millisecond || d > 3*time.Second {
		t.Fatalf("deploy of 150ms took %v", d)
	}
	if !strings.Contains(r.out, `"status":"deployed"`) {
		t.Fatalf("output = %q", r.out)
	}
	if len(r.events) != 0 {
		t.Fatalf("events = %v, want none", r.events)
	}
	n := meshtest.WaitNode(t, e.srv.Nodes, "r-dep", "root/s0.t0")
	if n.GetStatus() != meshv1.NodeStatus_NODE_STATUS_SUCCEEDED || n.GetCleanup() != nil {
		t.Fatalf("node = %v, want SUCCEEDED without a cleanup", n)
	}
}

func TestDeployCancelledRunsAbort(t *testing.T) {
	e := newEnv(t, mesh.ServerConfig{}, Config{})
	const run, node = "r-depc", "root/s0.t0"
	ctx, cancel := context.WithCancel(ident(run, node))
	defer cancel()
	st, err := e.tools.Execute(ctx, &toolrunnerv1.ExecuteRequest{Name: "deploy",
		ArgsJson: `{"duration_ms":60000,"poll_ms":20,"abort_ms":300,"cleanup_ms":2000}`})
	if err != nil {
		t.Fatal(err)
	}
	waitRunning(t, e.srv.Nodes, run, node)
	time.Sleep(50 * time.Millisecond) // a few polls
	cancelAt := time.Now()
	cancel()
	r := drain(st)
	if status.Code(r.err) != codes.Canceled {
		t.Fatalf("after cancel: %v, want CANCELED", r.err)
	}
	noOwnEvents(t, r, node)
	if d := time.Since(cancelAt); d > 250*time.Millisecond {
		t.Fatalf("the caller waited %v for a cancelled call; the abort must not hold it", d)
	}

	n := meshtest.WaitNode(t, e.srv.Nodes, run, node)
	if n.GetStatus() != meshv1.NodeStatus_NODE_STATUS_CANCELLED || n.GetCancelledAt() == nil {
		t.Fatalf("node = %v, want CANCELLED with cancelled_at", n)
	}
	c := n.GetCleanup()
	if c == nil || !c.GetCompleted() || c.GetError() != "" || !strings.HasPrefix(c.GetAction(), "abort deploy job") {
		t.Fatalf("cleanup = %v, want a completed abort", c)
	}
	if c.GetBudget().AsDuration() != 2*time.Second {
		t.Fatalf("cleanup budget = %v, want cleanup_ms 2000", c.GetBudget().AsDuration())
	}
	started, ended := c.GetStartedAt().AsTime(), c.GetEndedAt().AsTime()
	if started.Before(cancelAt) || !ended.After(cancelAt) {
		t.Fatalf("cleanup ran %v..%v, want after the cancel at %v", started, ended, cancelAt)
	}
	// The abort ran its full 300 ms although the caller's context was already cancelled.
	if d := ended.Sub(started); d < 280*time.Millisecond || d > 2*time.Second {
		t.Fatalf("abort took %v, want about abort_ms 300", d)
	}
	// The node ends only after its teardown.
	if n.GetEndedAt().AsTime().Before(ended) {
		t.Fatalf("node ended at %v, before its cleanup at %v", n.GetEndedAt().AsTime(), ended)
	}
}

func TestDeployCleanupBudgetExhausted(t *testing.T) {
	e := newEnv(t, mesh.ServerConfig{}, Config{})
	ctx, cancel := context.WithCancel(ident("r-depb", "root/s0.t0"))
	defer cancel()
	st, err := e.tools.Execute(ctx, &toolrunnerv1.ExecuteRequest{Name: "deploy",
		ArgsJson: `{"duration_ms":60000,"poll_ms":20,"abort_ms":5000,"cleanup_ms":100}`})
	if err != nil {
		t.Fatal(err)
	}
	waitRunning(t, e.srv.Nodes, "r-depb", "root/s0.t0")
	cancel()
	noOwnEvents(t, drain(st), "root/s0.t0")
	n := meshtest.WaitNode(t, e.srv.Nodes, "r-depb", "root/s0.t0")
	c := n.GetCleanup()
	if c == nil || c.GetCompleted() || c.GetError() == "" {
		t.Fatalf("cleanup = %v, want an abort cut off by its budget", c)
	}
	if d := c.GetEndedAt().AsTime().Sub(c.GetStartedAt().AsTime()); d < 90*time.Millisecond || d > 2*time.Second {
		t.Fatalf("cleanup took %v, want its 100ms budget", d)
	}
}

func TestDeployDeadlineStillCleansUp(t *testing.T) {
	args := `{"duration_ms":60000,"poll_ms":20,"abort_ms":300}`
	checkCleanup := func(t *testing.T, n *meshv1.Node) {
		t.Helper()
		c := n.GetCleanup()
		if c == nil || !c.GetCompleted() {
			t.Fatalf("node = %v, want a completed cleanup although the deadline expired", n)
		}
		if d := c.GetEndedAt().AsTime().Sub(c.GetStartedAt().AsTime()); d < 280*time.Millisecond {
			t.Fatalf("abort took %v, want abort_ms 300", d)
		}
		if c.GetBudget().AsDuration() != 5*time.Second {
			t.Fatalf("cleanup budget = %v, want the 5s default", c.GetBudget().AsDuration())
		}
	}

	t.Run("server deadline", func(t *testing.T) {
		// The server's policy caps the call at 200 ms: the tool's own deadline fires.
		e := newEnv(t, mesh.ServerConfig{Deadline: deadline.Policy{Default: 200 * time.Millisecond, Max: 200 * time.Millisecond}}, Config{})
		ctx, cancel := context.WithTimeout(ident("r-depdl", "root/s0.t0"), 10*time.Second)
		defer cancel()
		r := execute(ctx, t, e.tools, "deploy", args)
		meshtest.WantCode(t, r.err, codes.DeadlineExceeded)
		noOwnEvents(t, r, "root/s0.t0")
		n := meshtest.WaitNode(t, e.srv.Nodes, "r-depdl", "root/s0.t0")
		if n.GetStatus() != meshv1.NodeStatus_NODE_STATUS_DEADLINE_EXCEEDED || n.GetCause() != meshv1.CancelCause_CANCEL_CAUSE_DEADLINE {
			t.Fatalf("node = %v, want DEADLINE_EXCEEDED with cause DEADLINE", n)
		}
		if c := n.GetCleanup(); c != nil && c.GetStartedAt().AsTime().Before(n.GetDeadline().AsTime()) {
			t.Fatalf("cleanup started at %v, before the deadline %v", c.GetStartedAt().AsTime(), n.GetDeadline().AsTime())
		}
		checkCleanup(t, n)
	})

	t.Run("caller deadline", func(t *testing.T) {
		e := newEnv(t, mesh.ServerConfig{}, Config{})
		ctx, cancel := context.WithTimeout(ident("r-depdl2", "root/s0.t0"), 200*time.Millisecond)
		defer cancel()
		start := time.Now()
		r := execute(ctx, t, e.tools, "deploy", args)
		meshtest.WantCode(t, r.err, codes.DeadlineExceeded)
		if d := time.Since(start); d > time.Second {
			t.Fatalf("the caller got its deadline after %v", d)
		}
		noOwnEvents(t, r, "root/s0.t0")
		n := meshtest.WaitNode(t, e.srv.Nodes, "r-depdl2", "root/s0.t0")
		// The caller's RST_STREAM and the server's copy of the deadline race; either way
		// the node is stopped and its abort ran.
		if s := n.GetStatus(); s != meshv1.NodeStatus_NODE_STATUS_DEADLINE_EXCEEDED && s != meshv1.NodeStatus_NODE_STATUS_CANCELLED {
			t.Fatalf("node = %v, want stopped", n)
		}
		checkCleanup(t, n)
	})
}

func TestExecuteValidation(t *testing.T) {
	e := newEnv(t, mesh.ServerConfig{}, Config{})
	ok := ident("r-val", "root/s0.t0")
	for _, tc := range []struct {
		name, tool, args string
		ctx              context.Context
		code             codes.Code
		contains         []string
	}{
		{"no identity", "sleep", `{"ms":1}`, context.Background(), codes.InvalidArgument, []string{md.RunID, md.NodeID}},
		{"no node", "sleep", `{"ms":1}`, md.WithIdentity(context.Background(), md.Identity{RunID: "r-val"}), codes.InvalidArgument, []string{md.NodeID}},
		{"no run", "sleep", `{"ms":1}`, md.WithIdentity(context.Background(), md.Identity{NodeID: "root/s0.t0"}), codes.InvalidArgument, []string{md.RunID}},
		{"unknown tool", "rm_rf", `{}`, ok, codes.NotFound, []string{`"rm_rf"`}},
		{"no name", "", `{}`, ok, codes.InvalidArgument, []string{"name"}},
		{"sleep ms type", "sleep", `{"ms":"long"}`, ok, codes.InvalidArgument, []string{"args.ms"}},
		{"sleep ms zero", "sleep", `{"ms":0}`, ok, codes.InvalidArgument, []string{"args.ms"}},
		{"sleep unknown field", "sleep", `{"ms":1,"sec":2}`, ok, codes.InvalidArgument, []string{"unknown field", "sec"}},
		{"sleep bad json", "sleep", `{"ms":`, ok, codes.InvalidArgument, []string{"args"}},
		{"deploy duration", "deploy", `{"poll_ms":10}`, ok, codes.InvalidArgument, []string{"args.duration_ms"}},
		{"fail code", "fail", `{"code":"SOMETIMES"}`, ok, codes.InvalidArgument, []string{"args.code", "SOMETIMES"}},
		{"spawn bad plan", "spawn_subagent", `{"plan":{"steps":[]}}`, ok, codes.InvalidArgument, []string{"steps"}},
		{"spawn with task and plan", "spawn_subagent", `{"task":"t","plan":{"steps":[{"answer_tokens":1}]}}`, ok, codes.InvalidArgument, []string{"args.task", "not both"}},
		{"spawn bad reserve", "spawn_subagent", `{"task":"t","reserve":"later"}`, ok, codes.InvalidArgument, []string{"args.reserve"}},
		{"spawn without subagent service", "spawn_subagent", `{"plan":{"steps":[{"answer_tokens":1}]}}`, ok, codes.FailedPrecondition, []string{"no subagent service"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := execute(tc.ctx, t, e.tools, tc.tool, tc.args)
			meshtest.WantCode(t, r.err, tc.code, tc.contains...)
			if len(r.events) != 0 {
				t.Fatalf("a refused call emitted %v", r.events)
			}
		})
	}
	if ns, _ := e.srv.Nodes.List(context.Background(), "r-val", nil, 0); len(ns) != 0 {
		t.Fatalf("refused calls left nodes: %v", ns)
	}
}

// fakeSubagent is a scripted SubagentService that records its nested nodes in a table
// served as its NodeReportService.
type fakeSubagent struct {
	subagentv1.UnimplementedSubagentServiceServer
	table   *nodes.Table
	entered chan spawnCall
	// hold, when not nil, makes Spawn wait until it is closed or the call is cancelled.
	hold chan struct{}
	// teardown is how long a cancelled Spawn takes before its node ends.
	teardown time.Duration
	// cancelFirst, when closed during a hold, ends Spawn CANCELLED while its caller is
	// still alive: the subagent was cancelled by the run's broadcast first.
	cancelFirst chan struct{}
	// progress are the progress events sent for the nested model node while it runs.
	progress []float64
}

// waitEntered waits until a Spawn (what) has reached the fake, bounded.
func (f *fakeSubagent) waitEntered(t *testing.T, what string) {
	t.Helper()
	select {
	case <-f.entered:
	case <-time.After(3 * time.Second):
		t.Fatal(what + " did not reach the subagent")
	}
}

type spawnCall struct {
	id       md.Identity
	task     string
	req      *subagentv1.SpawnRequest
	deadline time.Time
}

func (f *fakeSubagent) Spawn(req *subagentv1.SpawnRequest, stream subagentv1.SubagentService_SpawnServer) error {
	ctx := stream.Context()
	id := md.IdentityFrom(ctx)
	dl, _ := ctx.Deadline()
	send := func(n *meshv1.Node) {
		_ = stream.Send(&subagentv1.SpawnResponse{Event: &subagentv1.SpawnResponse_Node{Node: n}})
	}
	sub := id.NodeID + "/sub"
	send(f.table.Start(id.RunID, &meshv1.Node{Id: sub, Kind: meshv1.NodeKind_NODE_KIND_SUBAGENT}))
	f.entered <- spawnCall{id: id, task: req.GetTask(), req: req, deadline: dl}
	if f.hold != nil {
		select {
		case <-f.hold:
		case <-f.cancelFirst:
			f.table.Finish(ctx, id.RunID, sub, status.Error(codes.Canceled, "cancelled"), nil)
			return status.Error(codes.Canceled, "cancelled")
		case <-ctx.Done():
			time.Sleep(f.teardown)
			f.table.Finish(ctx, id.RunID, sub, ctx.Err(), nil)
			return ctx.Err()
		}
	}
	send(f.table.Start(id.RunID, &meshv1.Node{Id: sub + "/m0", Kind: meshv1.NodeKind_NODE_KIND_MODEL}))
	f.sendProgress(stream, sub+"/m0")
	send(f.table.Finish(ctx, id.RunID, sub+"/m0", nil, nil))
	send(f.table.Finish(ctx, id.RunID, sub, nil, nil))
	return stream.Send(&subagentv1.SpawnResponse{Event: &subagentv1.SpawnResponse_Result{Result: &subagentv1.SpawnResult{Answer: "forty-two"}}})
}

func newSubagentEnv(t *testing.T, f *fakeSubagent, cfg Config) *env {
	t.Helper()
	f.table = nodes.New(0)
	f.entered = make(chan spawnCall, 16)
	cc := meshtest.Serve(t, mesh.ServerConfig{Logger: quiet}, func(gs *grpc.Server) {
		subagentv1.RegisterSubagentServiceServer(gs, f)
		meshv1.RegisterNodeReportServiceServer(gs, &nodes.Server{Table: f.table})
	})
	cfg.Subagent = subagentv1.NewSubagentServiceClient(cc)
	cfg.SubagentNodes = meshv1.NewNodeReportServiceClient(cc)
	cfg.SettleTimeout = 2 * time.Second
	return newEnv(t, mesh.ServerConfig{}, cfg)
}

const spawnArgs = `{"plan":{"steps":[{"answer_tokens":5}]}}`

func TestSpawnSubagentForwardsNodesAndAnswer(t *testing.T) {
	f := &fakeSubagent{}
	e := newSubagentEnv(t, f, Config{})
	ctx, cancel := context.WithTimeout(ident("r-spawn", "root/s0.t1"), 5*time.Second)
	defer cancel()
	r := execute(ctx, t, e.tools, "spawn_subagent", spawnArgs)
	if r.err != nil {
		t.Fatal(r.err)
	}
	if r.out != `{"answer":"forty-two"}` {
		t.Fatalf("output = %q, want the subagent's answer", r.out)
	}
	var got []string
	for _, n := range r.events {
		got = append(got, n.GetId()+" "+strings.TrimPrefix(n.GetStatus().String(), "NODE_STATUS_"))
	}
	// Only the nested nodes stream; the tool's own node is recorded in the table.
	want := []string{
		"root/s0.t1/sub RUNNING",
		"root/s0.t1/sub/m0 RUNNING",
		"root/s0.t1/sub/m0 SUCCEEDED",
		"root/s0.t1/sub SUCCEEDED",
	}
	if strings.Join(got, "\n") != strings.Join(want, "\n") {
		t.Fatalf("events:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
	n := meshtest.WaitNode(t, e.srv.Nodes, "r-spawn", "root/s0.t1")
	if n.GetStatus() != meshv1.NodeStatus_NODE_STATUS_SUCCEEDED || n.GetKind() != meshv1.NodeKind_NODE_KIND_TOOL || n.GetName() != "spawn_subagent" {
		t.Fatalf("tool node = %v, want the succeeded spawn_subagent tool", n)
	}
	// The tool node spans its subagent's: it started before and ended after.
	sub := meshtest.WaitNode(t, f.table, "r-spawn", "root/s0.t1/sub")
	if n.GetStartedAt().AsTime().After(sub.GetStartedAt().AsTime()) || n.GetEndedAt().AsTime().Before(sub.GetEndedAt().AsTime()) {
		t.Fatalf("tool node ran %v..%v, subagent %v..%v: want the tool's span to cover the subagent's",
			n.GetStartedAt().AsTime(), n.GetEndedAt().AsTime(), sub.GetStartedAt().AsTime(), sub.GetEndedAt().AsTime())
	}
	if ns, _ := e.srv.Nodes.List(context.Background(), "r-spawn", nil, 0); len(ns) != 1 {
		t.Fatalf("toolrunner table = %v, want only the tool's own node (nested nodes live in the subagent's)", ns)
	}
	call := <-f.entered
	if call.id.RunID != "r-spawn" || call.id.NodeID != "root/s0.t1" {
		t.Fatalf("subagent called as %+v, want the run and the tool's node", call.id)
	}
	if call.task != `{"steps":[{"answer_tokens":5}]}` {
		t.Fatalf("subagent task = %q, want the plan", call.task)
	}
	callerDL, _ := ctx.Deadline()
	if call.deadline.IsZero() || call.deadline.After(callerDL) {
		t.Fatalf("subagent deadline %v, want set and not after the caller's %v", call.deadline, callerDL)
	}
}

// spawn_subagent's run input reaches the subagent service as given.
func TestSpawnSubagentPassesArgs(t *testing.T) {
	f := &fakeSubagent{}
	e := newSubagentEnv(t, f, Config{})
	ctx, cancel := context.WithTimeout(ident("r-spawnargs", "root/s0.t0"), 5*time.Second)
	defer cancel()
	r := execute(ctx, t, e.tools, "spawn_subagent",
		`{"task":"check the deploy","model":"gpt-4o-mini","tools":["sleep","kv_put"],"max_tokens":64,"reserve":"0.2"}`)
	if r.err != nil {
		t.Fatal(r.err)
	}
	call := <-f.entered
	want := &subagentv1.SpawnRequest{Task: "check the deploy", Model: "gpt-4o-mini", Tools: []string{"sleep", "kv_put"}, MaxTokens: 64, Reserve: "0.2",
		ToolErrors: subagentv1.ToolErrors_TOOL_ERRORS_TO_MODEL}
	if !proto.Equal(call.req, want) {
		t.Fatalf("SpawnRequest = %v, want %v", call.req, want)
	}
	// The caller's tool-error policy, from its header, is the nested loop's.
	r = execute(metadata.AppendToOutgoingContext(ctx, md.ToolErrors, md.ToolErrorsFailRun), t, e.tools, "spawn_subagent", `{"task":"check again"}`)
	if r.err != nil {
		t.Fatal(r.err)
	}
	if call := <-f.entered; call.req.GetToolErrors() != subagentv1.ToolErrors_TOOL_ERRORS_FAIL_RUN {
		t.Fatalf("SpawnRequest under %s: %s = %v, want TOOL_ERRORS_FAIL_RUN", md.ToolErrors, md.ToolErrorsFailRun, call.req)
	}
}

func TestSpawnSubagentDepthLimit(t *testing.T) {
	f := &fakeSubagent{}
	e := newSubagentEnv(t, f, Config{})
	// Three "/sub" segments already: a spawn here would be depth 4.
	r := execute(ident("r-depth", "root/s0.t0/sub/s0.t0/sub/s1.t0/sub/s0.t0"), t, e.tools, "spawn_subagent", spawnArgs)
	meshtest.WantCode(t, r.err, codes.FailedPrecondition, "depth 4", "limit 3")
	// Depth 3 is allowed.
	if r := execute(ident("r-depth", "root/s0.t0/sub/s0.t0/sub/s0.t0"), t, e.tools, "spawn_subagent", spawnArgs); r.err != nil {
		t.Fatalf("spawn at depth 3: %v", r.err)
	}
	if n := len(f.entered); n != 1 {
		t.Fatalf("subagent called %d times, want once (the refused spawn must not reach it)", n)
	}

	e1 := newSubagentEnv(t, &fakeSubagent{}, Config{MaxSubagentDepth: 1})
	r = execute(ident("r-depth1", "root/s0.t0/sub/s0.t0"), t, e1.tools, "spawn_subagent", spawnArgs)
	meshtest.WantCode(t, r.err, codes.FailedPrecondition, "depth 2", "limit 1")
}

func TestSpawnSubagentFanoutLimit(t *testing.T) {
	f := &fakeSubagent{hold: make(chan struct{})}
	e := newSubagentEnv(t, f, Config{MaxSubagentFanout: 1})
	released := false
	release := func() {
		if !released {
			released = true
			close(f.hold)
		}
	}
	defer release()

	first := make(chan result, 1)
	go func() {
		st, err := e.tools.Execute(ident("r-fan", "root/s0.t0"), &toolrunnerv1.ExecuteRequest{Name: "spawn_subagent", ArgsJson: spawnArgs})
		if err != nil {
			first <- result{err: err}
			return
		}
		first <- drain(st)
	}()
	f.waitEntered(t, "the first spawn")
	// The run has its one subagent in flight: a second one is refused.
	r := execute(ident("r-fan", "root/s0.t1"), t, e.tools, "spawn_subagent", spawnArgs)
	meshtest.WantCode(t, r.err, codes.ResourceExhausted, "limit")
	// Another run is not affected.
	other := make(chan result, 1)
	go func() {
		st, err := e.tools.Execute(ident("r-fan-other", "root/s0.t0"), &toolrunnerv1.ExecuteRequest{Name: "spawn_subagent", ArgsJson: spawnArgs})
		if err != nil {
			other <- result{err: err}
			return
		}
		other <- drain(st)
	}()
	f.waitEntered(t, "another run's spawn")
	release()
	for _, c := range []chan result{first, other} {
		r := <-c
		if r.err != nil || r.out != `{"answer":"forty-two"}` {
			t.Fatalf("held spawn = %q, %v", r.out, r.err)
		}
		noOwnEvents(t, r, "root/s0.t0")
	}
	// The slot was given back.
	if r := execute(ident("r-fan", "root/s1.t0"), t, e.tools, "spawn_subagent", spawnArgs); r.err != nil {
		t.Fatalf("spawn after the first ended: %v", r.err)
	}
}

func TestSpawnSubagentCancelWaitsForTeardown(t *testing.T) {
	f := &fakeSubagent{hold: make(chan struct{}), teardown: 200 * time.Millisecond}
	e := newSubagentEnv(t, f, Config{})
	const run, node = "r-spawnc", "root/s0.t0"
	ctx, cancel := context.WithCancel(ident(run, node))
	defer cancel()
	st, err := e.tools.Execute(ctx, &toolrunnerv1.ExecuteRequest{Name: "spawn_subagent", ArgsJson: spawnArgs})
	if err != nil {
		t.Fatal(err)
	}
	f.waitEntered(t, "the spawn")
	cancelAt := time.Now()
	cancel()
	r := drain(st)
	if status.Code(r.err) != codes.Canceled {
		t.Fatalf("after cancel: %v, want CANCELED", r.err)
	}
	noOwnEvents(t, r, node)
	n := meshtest.WaitNode(t, e.srv.Nodes, run, node)
	if n.GetStatus() != meshv1.NodeStatus_NODE_STATUS_CANCELLED || n.GetCancelledAt() == nil {
		t.Fatalf("tool node = %v, want CANCELLED", n)
	}
	sub := meshtest.WaitNode(t, f.table, run, node+"/sub")
	if sub.GetStatus() != meshv1.NodeStatus_NODE_STATUS_CANCELLED {
		t.Fatalf("subagent node = %v, want CANCELLED", sub)
	}
	// The tool node ends only after the subagent's teardown (200 ms after the cancel).
	if toolEnd, subEnd := n.GetEndedAt().AsTime(), sub.GetEndedAt().AsTime(); toolEnd.Before(subEnd) || toolEnd.Sub(cancelAt) < 180*time.Millisecond {
		t.Fatalf("tool node ended at %v (+%v after cancel), subagent at %v: want the tool after the subagent's teardown",
			toolEnd, toolEnd.Sub(cancelAt), subEnd)
	}
}

// A subagent cancelled before its spawn_subagent call (the run's broadcast can reach
// subagent before toolrunner) is the run's cancel on its way: the tool node waits for its
// own cancel and records the run's cause, not a CANCELLED without one.
func TestSpawnSubagentCancelledFirstWaitsForOwnCancel(t *testing.T) {
	f := &fakeSubagent{hold: make(chan struct{}), cancelFirst: make(chan struct{})}
	e := newSubagentEnv(t, f, Config{})
	const run, node = "r-spawnfirst", "root/s0.t0"
	st, err := e.tools.Execute(ident(run, node), &toolrunnerv1.ExecuteRequest{Name: "spawn_subagent", ArgsJson: spawnArgs})
	if err != nil {
		t.Fatal(err)
	}
	f.waitEntered(t, "the spawn")
	close(f.cancelFirst)
	time.Sleep(100 * time.Millisecond) // the broadcast reaches toolrunner a moment later
	told := time.Now()
	if n := e.srv.Nodes.Cancel(run, nil, cancel.ErrClientDisconnect); n != 1 {
		t.Fatalf("the broadcast cancelled %d nodes, want the tool node", n)
	}
	if r := drain(st); status.Code(r.err) != codes.Canceled {
		t.Fatalf("Execute: %v, want CANCELED", r.err)
	}
	n := meshtest.WaitNode(t, e.srv.Nodes, run, node)
	if n.GetStatus() != meshv1.NodeStatus_NODE_STATUS_CANCELLED || n.GetCause() != meshv1.CancelCause_CANCEL_CAUSE_CLIENT_DISCONNECT {
		t.Fatalf("tool node = %v, want CANCELLED with the broadcast's cause", n)
	}
	if n.GetEndedAt().AsTime().Before(told) {
		t.Fatalf("tool node ended %v before its own cancel", told.Sub(n.GetEndedAt().AsTime()))
	}
}

// withKey sends an idempotency key with the call.
func withKey(ctx context.Context, key string) context.Context {
	return metadata.AppendToOutgoingContext(ctx, md.IdempotencyKey, key)
}

// effects returns curfew_tool_effects_total{tool="deploy"} as gathered from reg (0 when
// the series does not exist yet).
func effects(t *testing.T, reg *prometheus.Registry) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != "curfew_tool_effects_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "tool" && l.GetValue() == "deploy" {
					return m.GetCounter().GetValue()
				}
			}
		}
	}
	return 0
}

func wantEffects(t *testing.T, reg *prometheus.Registry, want float64) {
	t.Helper()
	if got := effects(t, reg); got != want {
		t.Fatalf("curfew_tool_effects_total{tool=\"deploy\"} = %v, want %v", got, want)
	}
}

// deployOut is deploy's result.
type deployOut struct {
	Job    int64  `json:"job"`
	Status string `json:"status"`
	Polls  int    `json:"polls"`
	Starts int    `json:"starts"`
}

func parseDeploy(t *testing.T, out string) deployOut {
	t.Helper()
	var d deployOut
	if err := json.Unmarshal([]byte(out), &d); err != nil || d.Status != "deployed" || d.Job == 0 {
		t.Fatalf("deploy output %q (%v), want a deployed job", out, err)
	}
	return d
}

func TestIdempotencyKeyReplaysDoneCall(t *testing.T) {
	reg := prometheus.NewRegistry()
	e := newEnv(t, mesh.ServerConfig{}, Config{Registerer: reg})
	const run, node = "r-idem", "root/s0.t0"
	ctx := withKey(ident(run, node), "deploy-1")
	args := `{"duration_ms":120,"poll_ms":20}`

	r1 := execute(ctx, t, e.tools, "deploy", args)
	if r1.err != nil {
		t.Fatal(r1.err)
	}
	d1 := parseDeploy(t, r1.out)
	if d1.Starts != 1 || d1.Polls < 2 {
		t.Fatalf("first call = %+v, want one start and several polls", d1)
	}
	noOwnEvents(t, r1, node)
	wantEffects(t, reg, 1)

	// The same key again: the stored result is replayed. A second run would attach to the
	// (finished) job and report a single poll, so an identical result means no second run.
	start := time.Now()
	r2 := execute(ctx, t, e.tools, "deploy", args)
	if r2.err != nil {
		t.Fatal(r2.err)
	}
	if r2.out != r1.out {
		t.Fatalf("second call = %q, want the first's result %q replayed", r2.out, r1.out)
	}
	if len(r2.events) != 0 {
		t.Fatalf("replay events = %v, want none", r2.events)
	}
	if d := time.Since(start); d > 2*time.Second {
		t.Fatalf("replay took %v", d)
	}
	wantEffects(t, reg, 1)
	n := meshtest.WaitNode(t, e.srv.Nodes, run, node)
	if n.GetStatus() != meshv1.NodeStatus_NODE_STATUS_SUCCEEDED || len(n.GetEarlierAttempts()) != 0 {
		t.Fatalf("node = %v, want one SUCCEEDED run and no second attempt", n)
	}
}

func TestIdempotencyKeyJoinsCallInProgress(t *testing.T) {
	reg := prometheus.NewRegistry()
	e := newEnv(t, mesh.ServerConfig{}, Config{Registerer: reg})
	const run, node = "r-idem-join", "root/s0.t0"
	ctx, cancel := context.WithTimeout(withKey(ident(run, node), "deploy-join"), 10*time.Second)
	defer cancel()
	args := `{"duration_ms":500,"poll_ms":20}`

	first := make(chan result, 1)
	go func() {
		st, err := e.tools.Execute(ctx, &toolrunnerv1.ExecuteRequest{Name: "deploy", ArgsJson: args})
		if err != nil {
			first <- result{err: err}
			return
		}
		first <- drain(st)
	}()
	waitRunning(t, e.srv.Nodes, run, node)

	// A duplicate while the first is in progress joins it.
	dupStart := time.Now()
	r2 := execute(ctx, t, e.tools, "deploy", args)
	dupEnd := time.Now()
	r1 := <-first
	if r1.err != nil || r2.err != nil {
		t.Fatalf("first = %v, duplicate = %v", r1.err, r2.err)
	}
	d1, d2 := parseDeploy(t, r1.out), parseDeploy(t, r2.out)
	if r2.out != r1.out || d2.Job != d1.Job || d1.Starts != 1 {
		t.Fatalf("first = %q, duplicate = %q: want the same result of one job", r1.out, r2.out)
	}
	noOwnEvents(t, r1, node)
	if len(r2.events) != 0 {
		t.Fatalf("joined call events = %v, want none", r2.events)
	}
	wantEffects(t, reg, 1)
	n := meshtest.WaitNode(t, e.srv.Nodes, run, node)
	if n.GetStatus() != meshv1.NodeStatus_NODE_STATUS_SUCCEEDED || len(n.GetEarlierAttempts()) != 0 {
		t.Fatalf("node = %v, want the one SUCCEEDED run and no second attempt", n)
	}
	// The duplicate was sent while the first ran and got its answer only once the first ended.
	if ended := n.GetEndedAt().AsTime(); !dupStart.Before(ended) || dupEnd.Before(ended) {
		t.Fatalf("duplicate ran %v..%v, first ended %v: want it to wait for the first", dupStart, dupEnd, ended)
	}
}

func TestIdempotencyKeyConcurrentDuplicates(t *testing.T) {
	reg := prometheus.NewRegistry()
	e := newEnv(t, mesh.ServerConfig{}, Config{Registerer: reg})
	const run, node = "r-idem-many", "root/s0.t0"
	ctx, cancel := context.WithTimeout(withKey(ident(run, node), "deploy-many"), 10*time.Second)
	defer cancel()
	const calls = 8
	var wg sync.WaitGroup
	results := make([]result, calls)
	for i := range calls {
		wg.Go(func() {
			st, err := e.tools.Execute(ctx, &toolrunnerv1.ExecuteRequest{Name: "deploy", ArgsJson: `{"duration_ms":200,"poll_ms":20}`})
			if err != nil {
				results[i] = result{err: err}
				return
			}
			results[i] = drain(st)
		})
	}
	wg.Wait()
	for i, r := range results {
		if r.err != nil || r.out != results[0].out {
			t.Fatalf("call %d = %q, %v; want %q like call 0", i, r.out, r.err, results[0].out)
		}
		noOwnEvents(t, r, node)
	}
	if d := parseDeploy(t, results[0].out); d.Starts != 1 {
		t.Fatalf("result = %+v, want one start", d)
	}
	wantEffects(t, reg, 1)
}

func TestIdempotencyKeyIsPerTenant(t *testing.T) {
	reg := prometheus.NewRegistry()
	e := newEnv(t, mesh.ServerConfig{}, Config{Registerer: reg})
	const run = "r-idem-tenant"
	args := `{"duration_ms":50,"poll_ms":10}`
	rA := execute(withKey(ident(run, "root/s0.t0"), "shared"), t, e.tools, "deploy", args)
	if rA.err != nil {
		t.Fatal(rA.err)
	}
	wantEffects(t, reg, 1)
	// The same key under another tenant is another call: it runs and starts its own job.
	ctxB := metadata.AppendToOutgoingContext(withKey(ident(run, "root/s0.t1"), "shared"), md.Tenant, "acme")
	rB := execute(ctxB, t, e.tools, "deploy", args)
	if rB.err != nil {
		t.Fatal(rB.err)
	}
	dA, dB := parseDeploy(t, rA.out), parseDeploy(t, rB.out)
	if dA.Job == dB.Job || dA.Starts != 1 || dB.Starts != 1 {
		t.Fatalf("tenant default = %+v, tenant acme = %+v: want separate jobs, one start each", dA, dB)
	}
	wantEffects(t, reg, 2)
	if n := meshtest.WaitNode(t, e.srv.Nodes, run, "root/s0.t1"); n.GetStatus() != meshv1.NodeStatus_NODE_STATUS_SUCCEEDED {
		t.Fatalf("acme's node = %v, want it run", n)
	}
	// Each tenant's key still replays its own result.
	if r := execute(ctxB, t, e.tools, "deploy", args); r.err != nil || r.out != rB.out {
		t.Fatalf("acme's retry = %q, %v; want %q", r.out, r.err, rB.out)
	}
	if r := execute(withKey(ident(run, "root/s0.t0"), "shared"), t, e.tools, "deploy", args); r.err != nil || r.out != rA.out {
		t.Fatalf("default's retry = %q, %v; want %q", r.out, r.err, rA.out)
	}
	wantEffects(t, reg, 2)
}

// jobOf returns the job id that deploy's lost-acknowledgement error names.
func jobOf(t *testing.T, err error) int64 {
	t.Helper()
	var job int64
	if _, serr := fmt.Sscanf(status.Convert(err).Message(), "deploy: job %d started", &job); serr != nil {
		t.Fatalf("error %v names no job: %v", err, serr)
	}
	return job
}

func TestDeployLostAckRetry(t *testing.T) {
	args := `{"duration_ms":100,"poll_ms":20,"fail_attempts":1}`

	t.Run("with key", func(t *testing.T) {
		reg := prometheus.NewRegistry()
		e := newEnv(t, mesh.ServerConfig{}, Config{Registerer: reg})
		const run, node = "r-ack", "root/s0.t0"
		ctx := withKey(ident(run, node), "deploy-ack")
		r := execute(withAttempt(ctx, "1"), t, e.tools, "deploy", args)
		meshtest.WantCode(t, r.err, codes.Unavailable, "acknowledgement was lost")
		noOwnEvents(t, r, node)
		job := jobOf(t, r.err)
		wantEffects(t, reg, 1) // the job started although the call failed
		if n := meshtest.WaitNode(t, e.srv.Nodes, run, node); n.GetStatus() != meshv1.NodeStatus_NODE_STATUS_FAILED || n.GetErrorCode() != "UNAVAILABLE" {
			t.Fatalf("node after attempt 1 = %v, want FAILED with UNAVAILABLE", n)
		}

		// The retry carries the same key: it attaches to the job attempt 1 started.
		r = execute(withAttempt(ctx, "2"), t, e.tools, "deploy", args)
		if r.err != nil {
			t.Fatalf("attempt 2: %v", r.err)
		}
		noOwnEvents(t, r, node)
		d := parseDeploy(t, r.out)
		if d.Job != job || d.Starts != 1 {
			t.Fatalf("attempt 2 = %+v, want job %d with starts 1", d, job)
		}
		wantEffects(t, reg, 1)
		n := meshtest.WaitNode(t, e.srv.Nodes, run, node)
		if n.GetStatus() != meshv1.NodeStatus_NODE_STATUS_SUCCEEDED {
			t.Fatalf("node after attempt 2 = %v, want SUCCEEDED", n)
		}
		if ea := n.GetEarlierAttempts(); len(ea) != 1 || ea[0].GetStatus() != meshv1.NodeStatus_NODE_STATUS_FAILED || ea[0].GetErrorCode() != "UNAVAILABLE" {
			t.Fatalf("earlier attempts = %v, want attempt 1's UNAVAILABLE", ea)
		}
	})

	t.Run("without key", func(t *testing.T) {
		reg := prometheus.NewRegistry()
		e := newEnv(t, mesh.ServerConfig{}, Config{Registerer: reg})
		ctx := ident("r-ack-nokey", "root/s0.t0")
		r := execute(withAttempt(ctx, "1"), t, e.tools, "deploy", args)
		meshtest.WantCode(t, r.err, codes.Unavailable, "acknowledgement was lost")
		job := jobOf(t, r.err)
		wantEffects(t, reg, 1)
		// Without a key nothing ties the retry to the first job: the effect is duplicated.
		r = execute(withAttempt(ctx, "2"), t, e.tools, "deploy", args)
		if r.err != nil {
			t.Fatalf("attempt 2: %v", r.err)
		}
		if d := parseDeploy(t, r.out); d.Job == job {
			t.Fatalf("attempt 2 = %+v, want a second job (not %d)", d, job)
		}
		wantEffects(t, reg, 2)
	})
}
