package meshtest_test

import (
	"context"
	"testing"
	"time"

	"go.uber.org/goleak"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	modelproxyv1 "github.com/curfew-mesh/curfew/gen/curfew/modelproxy/v1"
	toolrunnerv1 "github.com/curfew-mesh/curfew/gen/curfew/toolrunner/v1"
	"github.com/curfew-mesh/curfew/mesh"
	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/mesh/meshtest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func ctxFor(t *testing.T, node string) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(md.WithIdentity(context.Background(), md.Identity{RunID: "r", NodeID: node}), 3*time.Second)
	t.Cleanup(cancel)
	return ctx
}

func generate(ctx context.Context, c modelproxyv1.ModelProxyServiceClient, assistantTurns int) (text string, final *modelproxyv1.GenerateResponse, err error) {
	msgs := []*modelproxyv1.Message{{Role: modelproxyv1.Role_ROLE_USER, Content: "task"}}
	for range assistantTurns {
		msgs = append(msgs, &modelproxyv1.Message{Role: modelproxyv1.Role_ROLE_ASSISTANT})
	}
	st, err := c.Generate(ctx, &modelproxyv1.GenerateRequest{Model: "sim", Messages: msgs})
	if err != nil {
		return "", nil, err
	}
	chunks, err := meshtest.Drain(st)
	for _, r := range chunks {
		text += r.GetDelta()
		if r.GetFinishReason() != "" {
			final = r
		}
	}
	return text, final, err
}

func TestModelFollowsTheScript(t *testing.T) {
	m := meshtest.NewModel(
		meshtest.ModelStep{Text: "a b", ToolCalls: []*modelproxyv1.ToolCall{{Id: "c0", Name: "x"}}},
		meshtest.ModelStep{Text: "done"},
	)
	cc := meshtest.Serve(t, mesh.ServerConfig{}, m.Register)
	c := modelproxyv1.NewModelProxyServiceClient(cc)

	text, final, err := generate(ctxFor(t, "root/m0"), c, 0)
	if err != nil || text != "a b" || final.GetFinishReason() != "tool_calls" || len(final.GetToolCalls()) != 1 {
		t.Fatalf("step 0 = %q, %v, %v", text, final, err)
	}
	text, final, err = generate(ctxFor(t, "root/m1"), c, 1)
	if err != nil || text != "done" || final.GetFinishReason() != "stop" {
		t.Fatalf("step 1 = %q, %v, %v", text, final, err)
	}
	if _, _, err := generate(ctxFor(t, "root/m2"), c, 2); status.Code(err) != codes.OutOfRange {
		t.Fatalf("beyond the script: %v, want OUT_OF_RANGE", err)
	}
	calls := m.Calls()
	if len(calls) != 3 || calls[1].ID.NodeID != "root/m1" || calls[2].Err == nil || calls[0].End.IsZero() {
		t.Fatalf("calls = %+v", calls)
	}
	// The nodes are served as NodeReportService on the same connection.
	resp, err := meshv1.NewNodeReportServiceClient(cc).ListNodes(ctxFor(t, ""), &meshv1.ListNodesRequest{RunId: "r"})
	if err != nil || !resp.GetSettled() || len(resp.GetNodes()) != 3 || resp.GetNodes()[2].GetStatus() != meshv1.NodeStatus_NODE_STATUS_FAILED {
		t.Fatalf("ListNodes = %v, %v", resp, err)
	}
}

func TestToolsRunFuncsByName(t *testing.T) {
	tools := meshtest.NewTools(map[string]meshtest.ToolFunc{
		"echo": func(_ context.Context, args string) (string, error) { return args, nil },
	})
	cc := meshtest.Serve(t, mesh.ServerConfig{}, tools.Register)
	c := toolrunnerv1.NewToolRunnerServiceClient(cc)
	exec := func(name string) (string, error) {
		st, err := c.Execute(ctxFor(t, "root/s0.t0"), &toolrunnerv1.ExecuteRequest{Name: name, ArgsJson: `{"a":1}`})
		if err != nil {
			return "", err
		}
		ev, err := st.Recv()
		return ev.GetResult().GetOutputJson(), err
	}
	if out, err := exec("echo"); err != nil || out != `{"a":1}` {
		t.Fatalf("echo = %q, %v", out, err)
	}
	if _, err := exec("missing"); status.Code(err) != codes.NotFound {
		t.Fatalf("unknown tool: %v, want NOT_FOUND", err)
	}
	if calls := tools.Calls(); len(calls) != 2 || calls[0].Name != "echo" || calls[0].Args != `{"a":1}` {
		t.Fatalf("calls = %+v", calls)
	}
}

func TestToolsCanBeCancelledWithACause(t *testing.T) {
	started := make(chan struct{})
	tools := meshtest.NewTools(map[string]meshtest.ToolFunc{
		"block": func(ctx context.Context, _ string) (string, error) {
			close(started)
			<-ctx.Done()
			return "", ctx.Err()
		},
	})
	cc := meshtest.Serve(t, mesh.ServerConfig{}, tools.Register)
	st, err := toolrunnerv1.NewToolRunnerServiceClient(cc).Execute(ctxFor(t, "root/s0.t0"), &toolrunnerv1.ExecuteRequest{Name: "block"})
	if err != nil {
		t.Fatal(err)
	}
	select {
	case <-started:
	case <-time.After(3 * time.Second):
		t.Fatal("tool did not start")
	}
	resp, err := meshv1.NewNodeReportServiceClient(cc).CancelNodes(ctxFor(t, ""), &meshv1.CancelNodesRequest{
		RunId: "r", Cause: meshv1.CancelCause_CANCEL_CAUSE_OPERATOR})
	if err != nil || resp.GetCancelled() != 1 {
		t.Fatalf("CancelNodes = %v, %v", resp, err)
	}
	if _, err := st.Recv(); status.Code(err) != codes.Canceled {
		t.Fatalf("Execute after CancelNodes: %v, want CANCELED", err)
	}
	ns, settled := tools.Table().List(ctxFor(t, ""), "r", nil, 2*time.Second)
	if !settled || len(ns) != 1 || ns[0].GetCause() != meshv1.CancelCause_CANCEL_CAUSE_OPERATOR {
		t.Fatalf("node = %v (settled %v), want cancelled with cause operator", ns, settled)
	}
}
