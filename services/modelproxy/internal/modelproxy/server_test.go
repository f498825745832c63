package modelproxy

import (
	"context"
	"log/slog"
	"testing"
	"time"

	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/timestamppb"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	modelproxyv1 "github.com/curfew-mesh/curfew/gen/curfew/modelproxy/v1"
	"github.com/curfew-mesh/curfew/mesh"
	"github.com/curfew-mesh/curfew/mesh/deadline"
	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/mesh/meshtest"
	"github.com/curfew-mesh/curfew/mesh/nodes"
	"github.com/curfew-mesh/curfew/mesh/store/storetest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// env is a modelproxy served on loopback with the mesh server chain, and clients of it.
type env struct {
	srv    *Server
	model  modelproxyv1.ModelProxyServiceClient
	report meshv1.NodeReportServiceClient
}

func newEnv(t *testing.T, cfg mesh.ServerConfig) *env {
	t.Helper()
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	srv := newServer(t)
	cc := meshtest.Serve(t, cfg, func(gs *grpc.Server) {
		modelproxyv1.RegisterModelProxyServiceServer(gs, srv)
		meshv1.RegisterNodeReportServiceServer(gs, srv.Report())
	})
	return &env{srv: srv, model: modelproxyv1.NewModelProxyServiceClient(cc), report: meshv1.NewNodeReportServiceClient(cc)}
}

// newServer returns New on a memory store of its own, as a modelproxy without --store
// has, flushed before the store closes (cleanups run last-in first-out).
func newServer(t testing.TB) *Server {
	t.Helper()
	srv := New(storetest.OpenMemory(t))
	t.Cleanup(func() { flush(t, srv) })
	return srv
}

// ident returns a context whose outgoing calls carry run and node.
func ident(run, node string) context.Context {
	return md.WithIdentity(context.Background(), md.Identity{RunID: run, NodeID: node})
}

// conversation is the plan as the first user message followed by turns assistant turns.
func conversation(planJSON string, turns int) []*modelproxyv1.Message {
	msgs := []*modelproxyv1.Message{{Role: modelproxyv1.Role_ROLE_USER, Content: planJSON}}
	for i := 0; i < turns; i++ {
		msgs = append(msgs,
			&modelproxyv1.Message{Role: modelproxyv1.Role_ROLE_ASSISTANT, Content: "thinking"},
			&modelproxyv1.Message{Role: modelproxyv1.Role_ROLE_TOOL, Content: "{}"})
	}
	return msgs
}

func generate(ctx context.Context, t *testing.T, c modelproxyv1.ModelProxyServiceClient, req *modelproxyv1.GenerateRequest) ([]*modelproxyv1.GenerateResponse, error) {
	t.Helper()
	st, err := c.Generate(ctx, req)
	if err != nil {
		return nil, err
	}
	return meshtest.Drain(st)
}

const toolPlan = `{"tokens_per_second":200,"steps":[
  {"think_tokens":20,"tools":[{"name":"sleep","args":{"ms":5}},{"name":"fail"}]},
  {"answer_tokens":7}]}`

func TestGenerateThinkStepDecodesAtRateAndCallsTools(t *testing.T) {
	e := newEnv(t, mesh.ServerConfig{})
	start := time.Now()
	chunks, err := generate(ident("r-think", "root/m0"), t, e.model, &modelproxyv1.GenerateRequest{Messages: conversation(toolPlan, 0)})
	elapsed := time.Since(start)
	if err != nil {
		t.Fatal(err)
	}
	if len(chunks) != 21 {
		t.Fatalf("got %d chunks, want 20 tokens and a final chunk", len(chunks))
	}
	for i, c := range chunks[:20] {
		if c.GetTokens() != 1 || c.GetDelta() == "" || c.GetFinishReason() != "" {
			t.Fatalf("chunk %d = %v, want one token of text and no finish reason", i, c)
		}
	}
	// 20 tokens at 200/s take 100 ms on the decoder's absolute schedule.
	if elapsed < 90*time.Millisecond || elapsed > 3*time.Second {
		t.Fatalf("decode took %v, want about 100ms", elapsed)
	}
	final := chunks[20]
	if final.GetFinishReason() != "tool_calls" || final.GetTokens() != 0 {
		t.Fatalf("final chunk = %v, want finish_reason tool_calls", final)
	}
	if final.GetUsage().GetCompletionTokens() != 20 {
		t.Fatalf("usage = %v, want 20 completion tokens", final.GetUsage())
	}
	tc := final.GetToolCalls()
	if len(tc) != 2 {
		t.Fatalf("tool calls = %v, want sleep and fail", tc)
	}
	if tc[0].GetName() != "sleep" || tc[0].GetArgsJson() != `{"ms":5}` || tc[0].GetId() != "call_0_0" {
		t.Fatalf("tool call 0 = %v", tc[0])
	}
	if tc[1].GetName() != "fail" || tc[1].GetArgsJson() != "{}" || tc[1].GetId() != "call_0_1" {
		t.Fatalf("tool call 1 = %v (a tool without args gets {})", tc[1])
	}
	n := meshtest.WaitNode(t, e.srv.Nodes, "r-think", "root/m0")
	if n.GetStatus() != meshv1.NodeStatus_NODE_STATUS_SUCCEEDED || n.GetKind() != meshv1.NodeKind_NODE_KIND_MODEL || n.GetName() != SimModel {
		t.Fatalf("node = %v, want a succeeded sim model node", n)
	}
	if n.GetCancelledAt() != nil {
		t.Fatalf("node %v has cancelled_at though nothing was cancelled", n)
	}
	if total, before, after := e.srv.Ledger.Figures("r-think", "root/m0", time.Time{}); total != 20 || before != 20 || after != 0 {
		t.Fatalf("ledger figures = %d, %d, %d, want 20, 20, 0", total, before, after)
	}
}

func TestGenerateStepChosenByAssistantTurns(t *testing.T) {
	e := newEnv(t, mesh.ServerConfig{})
	chunks, err := generate(ident("r-ans", "root/m1"), t, e.model, &modelproxyv1.GenerateRequest{Model: SimModel, Messages: conversation(toolPlan, 1)})
	if err != nil {
		t.Fatal(err)
	}
	if len(chunks) != 8 {
		t.Fatalf("got %d chunks, want 7 answer tokens and a final chunk", len(chunks))
	}
	final := chunks[7]
	if final.GetFinishReason() != "stop" || len(final.GetToolCalls()) != 0 || final.GetUsage().GetCompletionTokens() != 7 {
		t.Fatalf("final chunk = %v, want finish_reason stop, no tools, 7 tokens", final)
	}

	// More assistant turns than the plan has steps.
	_, err = generate(ident("r-ans", "root/m2"), t, e.model, &modelproxyv1.GenerateRequest{Messages: conversation(toolPlan, 2)})
	meshtest.WantCode(t, err, codes.InvalidArgument, "2 assistant turns", "2 steps")
}

func TestGenerateValidation(t *testing.T) {
	e := newEnv(t, mesh.ServerConfig{})
	ctx := ident("r-bad", "root/m0")
	for _, tc := range []struct {
		name     string
		req      *modelproxyv1.GenerateRequest
		code     codes.Code
		contains []string
	}{
		{"unknown model", &modelproxyv1.GenerateRequest{Model: "gpt-9", Messages: conversation(toolPlan, 0)}, codes.NotFound, []string{`"gpt-9"`}},
		{"no user message", &modelproxyv1.GenerateRequest{Messages: []*modelproxyv1.Message{{Role: modelproxyv1.Role_ROLE_SYSTEM, Content: toolPlan}}}, codes.InvalidArgument, []string{"no user message"}},
		{"not json", &modelproxyv1.GenerateRequest{Messages: conversation("write me a poem", 0)}, codes.InvalidArgument, []string{"invalid JSON"}},
		{"bad rate", &modelproxyv1.GenerateRequest{Messages: conversation(`{"tokens_per_second":-1,"steps":[{"answer_tokens":1}]}`, 0)}, codes.InvalidArgument, []string{"tokens_per_second"}},
		{"last step without answer", &modelproxyv1.GenerateRequest{Messages: conversation(`{"steps":[{"think_tokens":3}]}`, 0)}, codes.InvalidArgument, []string{"steps[0].answer_tokens"}},
		{"bad tool args", &modelproxyv1.GenerateRequest{Messages: conversation(`{"steps":[{"think_tokens":1,"tools":[{"name":"sleep","args":{"ms":0}}]},{"answer_tokens":1}]}`, 0)}, codes.InvalidArgument, []string{"steps[0].tools[0].args.ms"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			chunks, err := generate(ctx, t, e.model, tc.req)
			meshtest.WantCode(t, err, tc.code, tc.contains...)
			if len(chunks) != 0 {
				t.Fatalf("got %d chunks before the error, want none", len(chunks))
			}
		})
	}
	// A refused request starts no decoder.
	if ns, _ := e.srv.Nodes.List(context.Background(), "r-bad", nil, 0); len(ns) != 0 {
		t.Fatalf("refused requests left nodes: %v", ns)
	}
}

func TestGenerateCancelStopsDecoder(t *testing.T) {
	e := newEnv(t, mesh.ServerConfig{})
	const run, node = "r-cancel", "root/m0"
	// 20 tokens/s: 50 ms between tokens, ample time for the RST_STREAM to arrive.
	p := `{"tokens_per_second":20,"steps":[{"think_tokens":1000,"tools":[{"name":"sleep","args":{"ms":1}}]},{"answer_tokens":1}]}`
	ctx, cancel := context.WithCancel(ident(run, node))
	defer cancel()
	st, err := e.model.Generate(ctx, &modelproxyv1.GenerateRequest{Messages: conversation(p, 0)})
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 3; i++ {
		if _, err := st.Recv(); err != nil {
			t.Fatalf("token %d: %v", i, err)
		}
	}
	cancelAt := time.Now()
	cancel()
	if _, err := meshtest.Drain(st); status.Code(err) != codes.Canceled {
		t.Fatalf("stream after cancel: %v, want CANCELED", err)
	}

	n := meshtest.WaitNode(t, e.srv.Nodes, run, node)
	if n.GetStatus() != meshv1.NodeStatus_NODE_STATUS_CANCELLED {
		t.Fatalf("node = %v, want CANCELLED", n)
	}
	if n.GetCancelledAt() == nil || n.GetCancelledAt().AsTime().Before(cancelAt) {
		t.Fatalf("cancelled_at = %v, want set, not before the cancel at %v", n.GetCancelledAt(), cancelAt)
	}
	if stop := n.GetEndedAt().AsTime().Sub(cancelAt); stop > time.Second {
		t.Fatalf("decoder ended %v after the cancel, want promptly", stop)
	}
	total, before, after := e.srv.Ledger.Figures(run, node, cancelAt)
	if before < 3 || after > 1 {
		t.Fatalf("ledger: %d tokens before the cancel, %d after; want >= 3 before and at most 1 after", before, after)
	}
	// The decoder is gone: four token intervals later the ledger has not grown.
	time.Sleep(200 * time.Millisecond)
	if again, _, _ := e.srv.Ledger.Figures(run, node, cancelAt); again != total {
		t.Fatalf("ledger grew from %d to %d tokens after the cancel", total, again)
	}

	// The report splits the decoder's tokens at the caller's cancel instant.
	resp, err := e.report.ListNodes(context.Background(), &meshv1.ListNodesRequest{RunId: run, CancelAt: timestamppb.New(cancelAt)})
	if err != nil {
		t.Fatal(err)
	}
	if len(resp.GetNodes()) != 1 || !resp.GetSettled() {
		t.Fatalf("report = %v, want one settled node", resp)
	}
	rn := resp.GetNodes()[0]
	if rn.GetTokens() != total || rn.GetTokensAtCancel() != before || rn.GetTokensAfterCancel() != after ||
		rn.GetTokensAtCancel()+rn.GetTokensAfterCancel() != rn.GetTokens() {
		t.Fatalf("reported tokens %d = %d at + %d after cancel, want %d = %d + %d",
			rn.GetTokens(), rn.GetTokensAtCancel(), rn.GetTokensAfterCancel(), total, before, after)
	}
}

func TestGenerateDeadlineEndsNodeDeadlineExceeded(t *testing.T) {
	// The server's policy caps the caller's 10 s deadline at 300 ms, so the decoder's own
	// copy of the deadline fires (no race with the caller's RST_STREAM).
	e := newEnv(t, mesh.ServerConfig{Deadline: deadline.Policy{Default: 300 * time.Millisecond, Max: 300 * time.Millisecond}})
	const run, node = "r-dl", "root/m0"
	p := `{"tokens_per_second":50,"steps":[{"answer_tokens":1000}]}`
	ctx, cancel := context.WithTimeout(ident(run, node), 10*time.Second)
	defer cancel()
	start := time.Now()
	chunks, err := generate(ctx, t, e.model, &modelproxyv1.GenerateRequest{Messages: conversation(p, 0)})
	elapsed := time.Since(start)
	meshtest.WantCode(t, err, codes.DeadlineExceeded)
	if elapsed < 250*time.Millisecond || elapsed > 3*time.Second {
		t.Fatalf("call took %v, want about the capped 300ms", elapsed)
	}
	if len(chunks) == 0 || len(chunks) > 20 {
		t.Fatalf("got %d tokens in 300ms at 50/s", len(chunks))
	}
	n := meshtest.WaitNode(t, e.srv.Nodes, run, node)
	if n.GetStatus() != meshv1.NodeStatus_NODE_STATUS_DEADLINE_EXCEEDED || n.GetCause() != meshv1.CancelCause_CANCEL_CAUSE_DEADLINE {
		t.Fatalf("node = %v, want DEADLINE_EXCEEDED with cause DEADLINE", n)
	}
	if n.GetCancelledAt() == nil {
		t.Fatalf("node %v has no cancelled_at", n)
	}
	if dl := n.GetDeadline().AsTime(); dl.Before(start) || dl.After(start.Add(time.Second)) {
		t.Fatalf("node deadline %v, want the capped one near %v", dl, start.Add(300*time.Millisecond))
	}
	total, _, _ := e.srv.Ledger.Figures(run, node, time.Time{})
	if total != int64(len(chunks)) && total != int64(len(chunks))+1 {
		t.Fatalf("ledger has %d tokens, the caller received %d", total, len(chunks))
	}
}

func TestGenerateModelErrorFault(t *testing.T) {
	e := newEnv(t, mesh.ServerConfig{})
	const run, node = "r-fault", "root/m0"
	p := `{"tokens_per_second":1000,"steps":[{"answer_tokens":3,"model_error":{"attempts":2,"code":"RESOURCE_EXHAUSTED"}}]}`
	req := &modelproxyv1.GenerateRequest{Messages: conversation(p, 0)}
	attempt := func(a string) context.Context {
		ctx := ident(run, node)
		if a != "" {
			ctx = metadata.AppendToOutgoingContext(ctx, md.Attempt, a)
		}
		return ctx
	}
	for _, a := range []string{"", "1", "2"} {
		chunks, err := generate(attempt(a), t, e.model, req)
		meshtest.WantCode(t, err, codes.ResourceExhausted, "injected error")
		if len(chunks) != 0 {
			t.Fatalf("attempt %q streamed %d chunks before failing", a, len(chunks))
		}
		n := meshtest.WaitNode(t, e.srv.Nodes, run, node)
		if n.GetStatus() != meshv1.NodeStatus_NODE_STATUS_FAILED || n.GetErrorCode() != "RESOURCE_EXHAUSTED" {
			t.Fatalf("attempt %q: node = %v, want FAILED with RESOURCE_EXHAUSTED", a, n)
		}
	}
	chunks, err := generate(attempt("3"), t, e.model, req)
	if err != nil {
		t.Fatalf("attempt 3: %v, want success after 2 failed attempts", err)
	}
	if len(chunks) != 4 || chunks[3].GetFinishReason() != "stop" {
		t.Fatalf("attempt 3: chunks = %v", chunks)
	}
	if n := meshtest.WaitNode(t, e.srv.Nodes, run, node); n.GetStatus() != meshv1.NodeStatus_NODE_STATUS_SUCCEEDED {
		t.Fatalf("attempt 3: node = %v, want SUCCEEDED", n)
	}
	if total, _, _ := e.srv.Ledger.Figures(run, node, time.Time{}); total != 3 {
		t.Fatalf("ledger has %d tokens, want only the 3 of the successful attempt", total)
	}

	// Without a code the fault is UNAVAILABLE.
	p = `{"steps":[{"answer_tokens":1,"model_error":{"attempts":1}}]}`
	_, err = generate(ident(run, "root/m9"), t, e.model, &modelproxyv1.GenerateRequest{Messages: conversation(p, 0)})
	meshtest.WantCode(t, err, codes.Unavailable)
}

func TestGenerateFirstTokenDelay(t *testing.T) {
	e := newEnv(t, mesh.ServerConfig{})
	first := func(p string) time.Duration {
		t.Helper()
		start := time.Now()
		st, err := e.model.Generate(ident("r-delay", "root/m0"), &modelproxyv1.GenerateRequest{Messages: conversation(p, 0)})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := st.Recv(); err != nil {
			t.Fatal(err)
		}
		d := time.Since(start)
		if _, err := meshtest.Drain(st); err != nil {
			t.Fatal(err)
		}
		return d
	}
	fast := `{"tokens_per_second":1000,"steps":[{"answer_tokens":2}]}`
	slow := `{"tokens_per_second":1000,"steps":[{"answer_tokens":2,"first_token_delay_ms":400}]}`
	first(fast) // connect
	if d := first(fast); d > 300*time.Millisecond {
		t.Fatalf("first token without delay after %v", d)
	}
	if d := first(slow); d < 390*time.Millisecond || d > 3*time.Second {
		t.Fatalf("first token with first_token_delay_ms=400 after %v", d)
	}
}

func TestGenerateUnattributed(t *testing.T) {
	e := newEnv(t, mesh.ServerConfig{})
	p := `{"tokens_per_second":1000,"steps":[{"answer_tokens":2}]}`
	if _, err := generate(context.Background(), t, e.model, &modelproxyv1.GenerateRequest{Messages: conversation(p, 0)}); err != nil {
		t.Fatal(err)
	}
	if total, _, _ := e.srv.Ledger.Figures(unattributed, unattributed, time.Time{}); total != 2 {
		t.Fatalf("unattributed ledger has %d tokens, want 2", total)
	}
}

func TestLedgerFigures(t *testing.T) {
	l := NewLedger()
	base := time.Unix(1_700_000_000, 0)
	for i := 0; i < 5; i++ { // tokens at +0, +10, +20, +30, +40 ms
		l.Record("r", "n", base.Add(time.Duration(i)*10*time.Millisecond))
	}
	l.Record("r", "other", base)
	for _, tc := range []struct {
		name                 string
		cancelAt             time.Time
		total, before, after int64
	}{
		{"no cancel", time.Time{}, 5, 5, 0},
		{"between tokens", base.Add(25 * time.Millisecond), 5, 3, 2},
		{"at a token", base.Add(20 * time.Millisecond), 5, 3, 2},
		{"before all", base.Add(-time.Millisecond), 5, 0, 5},
		{"after all", base.Add(time.Second), 5, 5, 0},
	} {
		total, before, after := l.Figures("r", "n", tc.cancelAt)
		if total != tc.total || before != tc.before || after != tc.after {
			t.Errorf("%s: figures = %d, %d, %d, want %d, %d, %d", tc.name, total, before, after, tc.total, tc.before, tc.after)
		}
	}
	if total, _, _ := l.Figures("r", "missing", time.Time{}); total != 0 {
		t.Errorf("unknown node has %d tokens", total)
	}
	if total, _, _ := l.Figures("missing", "n", base); total != 0 {
		t.Errorf("unknown run has %d tokens", total)
	}
	l.Forget("r")
	if runs := l.Runs(); len(runs) != 0 {
		t.Errorf("runs after Forget = %v", runs)
	}
}

func TestReportListNodes(t *testing.T) {
	e := newEnv(t, mesh.ServerConfig{})
	base := time.Now().Add(-time.Minute)
	e.srv.Nodes.Start("r-rep", &meshv1.Node{Id: "root/m0", Kind: meshv1.NodeKind_NODE_KIND_MODEL})
	for i := 0; i < 6; i++ {
		e.srv.Ledger.Record("r-rep", "root/m0", base.Add(time.Duration(i)*time.Second))
	}
	e.srv.Nodes.End("r-rep", "root/m0", meshv1.NodeStatus_NODE_STATUS_CANCELLED, 0, "CANCELLED", "cancelled", nil)

	resp, err := e.report.ListNodes(context.Background(), &meshv1.ListNodesRequest{RunId: "r-rep", CancelAt: timestamppb.New(base.Add(3500 * time.Millisecond))})
	if err != nil {
		t.Fatal(err)
	}
	if len(resp.GetNodes()) != 1 {
		t.Fatalf("nodes = %v", resp.GetNodes())
	}
	if n := resp.GetNodes()[0]; n.GetTokens() != 6 || n.GetTokensAtCancel() != 4 || n.GetTokensAfterCancel() != 2 {
		t.Fatalf("node = %v, want 6 tokens, 4 at and 2 after the cancel", n)
	}
	resp, err = e.report.ListNodes(context.Background(), &meshv1.ListNodesRequest{RunId: "r-rep"})
	if err != nil {
		t.Fatal(err)
	}
	if n := resp.GetNodes()[0]; n.GetTokens() != 6 || n.GetTokensAtCancel() != 0 || n.GetTokensAfterCancel() != 0 {
		t.Fatalf("without cancel_at node = %v, want 6 tokens and no split", n)
	}
	_, err = e.report.ListNodes(context.Background(), &meshv1.ListNodesRequest{})
	meshtest.WantCode(t, err, codes.InvalidArgument, "run_id")
}

func TestSweepForgetsOldRuns(t *testing.T) {
	e := newEnv(t, mesh.ServerConfig{})
	p := `{"tokens_per_second":1000,"steps":[{"answer_tokens":2}]}`
	if _, err := generate(ident("r-old", "root/m0"), t, e.model, &modelproxyv1.GenerateRequest{Messages: conversation(p, 0)}); err != nil {
		t.Fatal(err)
	}
	// A decoder still running, and ledger records of a run with no nodes.
	e.srv.Nodes.Start("r-live", &meshv1.Node{Id: "root/m0", Kind: meshv1.NodeKind_NODE_KIND_MODEL})
	e.srv.Ledger.Record("r-live", "root/m0", time.Now())
	e.srv.Ledger.Record("r-stray", "root/m0", time.Now())

	has := func(runs []string, r string) bool {
		for _, x := range runs {
			if x == r {
				return true
			}
		}
		return false
	}
	e.srv.Sweep(time.Now())
	if !has(e.srv.Nodes.Runs(), "r-old") || !has(e.srv.Ledger.Runs(), "r-old") {
		t.Fatalf("a run that just ended was swept: nodes %v, ledger %v", e.srv.Nodes.Runs(), e.srv.Ledger.Runs())
	}
	e.srv.Sweep(time.Now().Add(nodes.DefaultRetention + time.Minute))
	if has(e.srv.Nodes.Runs(), "r-old") || has(e.srv.Ledger.Runs(), "r-old") || has(e.srv.Ledger.Runs(), "r-stray") {
		t.Fatalf("old runs kept: nodes %v, ledger %v", e.srv.Nodes.Runs(), e.srv.Ledger.Runs())
	}
	if !has(e.srv.Nodes.Runs(), "r-live") || !has(e.srv.Ledger.Runs(), "r-live") {
		t.Fatalf("a running decoder's run was swept: nodes %v, ledger %v", e.srv.Nodes.Runs(), e.srv.Ledger.Runs())
	}
}
