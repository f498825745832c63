package orchestrator

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	modelproxyv1 "github.com/curfew-mesh/curfew/gen/curfew/modelproxy/v1"
	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	toolrunnerv1 "github.com/curfew-mesh/curfew/gen/curfew/toolrunner/v1"
	"github.com/curfew-mesh/curfew/mesh"
	"github.com/curfew-mesh/curfew/mesh/agent"
	"github.com/curfew-mesh/curfew/mesh/breaker"
	"github.com/curfew-mesh/curfew/mesh/md"
	"github.com/curfew-mesh/curfew/mesh/meshtest"
	"github.com/curfew-mesh/curfew/mesh/nodes"
	"github.com/curfew-mesh/curfew/mesh/plan"
)

// The package tests' environment: fakes of modelproxy and toolrunner that run sim plans,
// and a server on them (newEnv), with helpers to follow its runs.

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

var quiet = slog.New(slog.DiscardHandler)

// ledger records token instants per run and node, like modelproxy's, so that the fakes'
// reports carry token figures split at the run's cancel instant.
type ledger struct {
	mu     sync.Mutex
	m      map[string][]time.Time
	prompt map[string]int64
}

// charge records n prompt tokens of the node.
func (l *ledger) charge(run, node string, n int64) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.prompt == nil {
		l.prompt = map[string]int64{}
	}
	l.prompt[run+"|"+node] += n
}

func (l *ledger) record(run, node string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.m == nil {
		l.m = map[string][]time.Time{}
	}
	l.m[run+"|"+node] = append(l.m[run+"|"+node], time.Now())
}

func (l *ledger) count(run, node string) int64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	return int64(len(l.m[run+"|"+node]))
}

func (l *ledger) report(tbl *nodes.Table) *nodes.Server {
	return &nodes.Server{Table: tbl, Decorate: func(run string, req *meshv1.ListNodesRequest, n *meshv1.Node) {
		l.mu.Lock()
		defer l.mu.Unlock()
		ts := l.m[run+"|"+n.GetId()]
		n.Tokens = int64(len(ts))
		n.PromptTokens = l.prompt[run+"|"+n.GetId()]
		if req.GetCancelAt() == nil {
			return
		}
		at := req.GetCancelAt().AsTime()
		for _, x := range ts {
			if x.After(at) {
				n.TokensAfterCancel++
			} else {
				n.TokensAtCancel++
			}
		}
	}}
}

// fakeModel is a ModelProxyService that decodes the plan in the conversation like the sim
// model (step by assistant turns, tokens at tokens_per_second, then the step's tools).
type fakeModel struct {
	modelproxyv1.UnimplementedModelProxyServiceServer
	table  *nodes.Table
	ledger ledger
	// started receives the node id of every decoder that starts.
	started chan string
	// orphan is how many tokens a cancelled decoder still spends after it saw the cancel:
	// only the decoder's own record knows them.
	orphan int

	mu   sync.Mutex
	reqs []*modelproxyv1.GenerateRequest // every request, in arrival order
}

// requests returns the requests the fake received so far.
func (f *fakeModel) requests() []*modelproxyv1.GenerateRequest {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.reqs)
}

func (f *fakeModel) Generate(req *modelproxyv1.GenerateRequest, stream modelproxyv1.ModelProxyService_GenerateServer) error {
	ctx := stream.Context()
	id := md.IdentityFrom(ctx)
	f.mu.Lock()
	f.reqs = append(f.reqs, req)
	f.mu.Unlock()
	turns, task := 0, ""
	for _, m := range req.GetMessages() {
		switch m.GetRole() {
		case modelproxyv1.Role_ROLE_ASSISTANT:
			turns++
		case modelproxyv1.Role_ROLE_USER:
			if task == "" {
				task = m.GetContent()
			}
		}
	}
	p, err := plan.Parse([]byte(task))
	if err != nil || turns >= len(p.Steps) {
		return status.Error(codes.InvalidArgument, "fake model: bad conversation")
	}
	st := p.Steps[turns]
	// Begun, as modelproxy begins its decoders: the orchestrator's cancel broadcast
	// (CancelNodes) cancels the decoder itself, before anything else hears of the cancel.
	ctx, _ = f.table.Begin(ctx, id.RunID, &meshv1.Node{Id: id.NodeID, Kind: meshv1.NodeKind_NODE_KIND_MODEL, Name: req.GetModel()})
	f.started <- id.NodeID
	err = f.decode(ctx, stream, id, turns, p, st)
	f.table.Finish(ctx, id.RunID, id.NodeID, err, nil)
	return err
}

func (f *fakeModel) decode(ctx context.Context, stream modelproxyv1.ModelProxyService_GenerateServer, id md.Identity, turns int, p *plan.Plan, st plan.Step) error {
	n := st.ThinkTokens
	if st.AnswerTokens > 0 {
		n = st.AnswerTokens
	}
	tick := time.NewTicker(time.Duration(float64(time.Second) / p.TPS()))
	defer tick.Stop()
	for i := 0; i < n; i++ {
		select {
		case <-ctx.Done():
			for j := 0; j < f.orphan; j++ {
				f.ledger.record(id.RunID, id.NodeID)
			}
			return ctx.Err()
		case <-tick.C:
		}
		f.ledger.record(id.RunID, id.NodeID)
		if err := stream.Send(&modelproxyv1.GenerateResponse{Delta: "w ", Tokens: 1}); err != nil {
			return err
		}
	}
	final := &modelproxyv1.GenerateResponse{FinishReason: "stop"}
	if st.AnswerTokens == 0 {
		final.FinishReason = "tool_calls"
		for j, tl := range st.Tools {
			final.ToolCalls = append(final.ToolCalls, &modelproxyv1.ToolCall{Id: fmt.Sprintf("call_%d_%d", turns, j), Name: tl.Name, ArgsJson: string(tl.Args)})
		}
	}
	// Like a provider's usage, the prompt is charged with the final chunk: fakePromptTokens
	// per turn of the conversation.
	f.ledger.charge(id.RunID, id.NodeID, fakePromptTokens*int64(turns+1))
	final.Usage = &modelproxyv1.Usage{PromptTokens: fakePromptTokens * int64(turns+1), CompletionTokens: int64(n)}
	return stream.Send(final)
}

// fakePromptTokens is the prompt tokens fakeModel charges per turn of a conversation.
const fakePromptTokens = 10

// fakeTools is a ToolRunnerService: sleep waits args.ms (cancellable), anything else
// succeeds at once.
type fakeTools struct {
	toolrunnerv1.UnimplementedToolRunnerServiceServer
	table *nodes.Table

	mu    sync.Mutex
	calls map[string]int // calls per run and node
}

// call counts a call of node and returns how many there were before it.
func (f *fakeTools) call(id md.Identity) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.calls == nil {
		f.calls = map[string]int{}
	}
	n := f.calls[id.RunID+"|"+id.NodeID]
	f.calls[id.RunID+"|"+id.NodeID]++
	return n
}

func (f *fakeTools) Execute(req *toolrunnerv1.ExecuteRequest, stream toolrunnerv1.ToolRunnerService_ExecuteServer) error {
	ctx := stream.Context()
	id := md.IdentityFrom(ctx)
	send := func(n *meshv1.Node) {
		_ = stream.Send(&toolrunnerv1.ExecuteResponse{Event: &toolrunnerv1.ExecuteResponse_Node{Node: n}})
	}
	before := f.call(id)
	if req.GetName() == plan.ToolFail { // fails with args.code on its first args.times calls
		var a plan.FailArgs
		_ = plan.Args([]byte(req.GetArgsJson()), &a)
		if before < a.Times {
			if a.RetryInfoMS != nil { // here: refused as an open breaker in front of it refuses
				st, _ := status.New(codes.Unavailable, "breaker open").WithDetails(
					&errdetails.ErrorInfo{Reason: breaker.Reason, Domain: breaker.Domain, Metadata: map[string]string{"target": "toolrunner", "state": "open"}},
					&errdetails.RetryInfo{RetryDelay: durationpb.New(time.Duration(*a.RetryInfoMS) * time.Millisecond)})
				return st.Err()
			}
			var c codes.Code
			_ = c.UnmarshalJSON([]byte(`"` + a.Code + `"`))
			return status.Error(c, "fail: not yet")
		}
	}
	send(f.table.Start(id.RunID, &meshv1.Node{Id: id.NodeID, Kind: meshv1.NodeKind_NODE_KIND_TOOL, Name: req.GetName()}))
	var err error
	if req.GetName() == plan.ToolSleep {
		var a plan.SleepArgs
		_ = plan.Args([]byte(req.GetArgsJson()), &a)
		t := time.NewTimer(time.Duration(a.MS) * time.Millisecond)
		select {
		case <-ctx.Done():
			err = ctx.Err()
		case <-t.C:
		}
		t.Stop()
	}
	send(f.table.Finish(ctx, id.RunID, id.NodeID, err, nil))
	if err != nil {
		return err
	}
	return stream.Send(&toolrunnerv1.ExecuteResponse{Event: &toolrunnerv1.ExecuteResponse_Result{Result: &toolrunnerv1.ExecuteResult{OutputJson: `{"ok":true}`}}})
}

type env struct {
	srv   *Server
	orch  orchestratorv1.OrchestratorServiceClient
	model *fakeModel
	tools *fakeTools
}

func newEnv(t *testing.T, scfg mesh.ServerConfig, fm *fakeModel) *env {
	t.Helper()
	return newEnvWith(t, scfg, fm, nil)
}

// newEnvWith is newEnv with a hook on the server's Config (nil: none).
func newEnvWith(t *testing.T, scfg mesh.ServerConfig, fm *fakeModel, hook func(*Config)) *env {
	t.Helper()
	if fm == nil {
		fm = &fakeModel{}
	}
	fm.table, fm.started = nodes.New(0), make(chan string, 256)
	ft := &fakeTools{table: nodes.New(0)}
	mc := meshtest.Serve(t, mesh.ServerConfig{Logger: quiet}, func(gs *grpc.Server) {
		modelproxyv1.RegisterModelProxyServiceServer(gs, fm)
		meshv1.RegisterNodeReportServiceServer(gs, fm.ledger.report(fm.table))
	})
	tc := meshtest.Serve(t, mesh.ServerConfig{Logger: quiet}, func(gs *grpc.Server) {
		toolrunnerv1.RegisterToolRunnerServiceServer(gs, ft)
		meshv1.RegisterNodeReportServiceServer(gs, &nodes.Server{Table: ft.table})
	})
	modelNodes, toolNodes := meshv1.NewNodeReportServiceClient(mc), meshv1.NewNodeReportServiceClient(tc)
	cfg := Config{
		Loop: agent.Config{
			Model:         modelproxyv1.NewModelProxyServiceClient(mc),
			ModelNodes:    modelNodes,
			Tools:         toolrunnerv1.NewToolRunnerServiceClient(tc),
			ToolNodes:     toolNodes,
			SettleTimeout: time.Second,
		},
		Reports:       []meshv1.NodeReportServiceClient{modelNodes, toolNodes},
		SettleTimeout: time.Second,
		Log:           quiet,
		Store:         privateStore(t),
	}
	if hook != nil {
		hook(&cfg)
	}
	srv := New(cfg)
	scfg.Logger = quiet
	oc := meshtest.Serve(t, scfg, func(gs *grpc.Server) { orchestratorv1.RegisterOrchestratorServiceServer(gs, srv) })
	ctx, stop := context.WithCancel(context.Background())
	srv.Start(ctx)
	t.Cleanup(func() { srv.Shutdown(time.Now()); srv.Wait(); stop() }) // runs first: the fakes are still serving
	return &env{srv: srv, orch: orchestratorv1.NewOrchestratorServiceClient(oc), model: fm, tools: ft}
}

// runStream is a Run call's stream; events come in as they are received.
type runStream struct {
	st     grpc.ServerStreamingClient[orchestratorv1.RunResponse]
	cancel context.CancelFunc
}

func (e *env) start(ctx context.Context, t *testing.T, req *orchestratorv1.RunRequest) (*runStream, *orchestratorv1.RunStarted) {
	t.Helper()
	ctx, cancel := context.WithCancel(ctx)
	t.Cleanup(cancel)
	st, err := e.orch.Run(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	ev, err := st.Recv()
	if err != nil {
		t.Fatalf("first event: %v", err)
	}
	if ev.GetStarted() == nil || ev.GetStarted().GetRunId() == "" || ev.GetStarted().GetDeadline() == nil {
		t.Fatalf("first event = %v, want started with the run id and deadline", ev)
	}
	return &runStream{st: st, cancel: cancel}, ev.GetStarted()
}

// rest reads the stream to its end.
func (r *runStream) rest() ([]*orchestratorv1.RunResponse, error) {
	return meshtest.Drain(r.st)
}

// waitEnded polls GetRun until the run is no longer running.
func (e *env) waitEnded(t *testing.T, id string) *orchestratorv1.Run {
	t.Helper()
	until := time.Now().Add(4 * time.Second)
	for {
		resp, err := e.orch.GetRun(context.Background(), &orchestratorv1.GetRunRequest{RunId: id})
		if err != nil {
			t.Fatal(err)
		}
		if r := resp.GetRun(); r.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_RUNNING {
			return r
		}
		if time.Now().After(until) {
			t.Fatalf("run %s still running after 4s", id)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func (e *env) waitDecoder(t *testing.T) string {
	t.Helper()
	select {
	case n := <-e.model.started:
		return n
	case <-time.After(3 * time.Second):
		t.Fatal("no decoder started")
		return ""
	}
}

func nodeOf(t *testing.T, r *orchestratorv1.Run, id string) *meshv1.Node {
	t.Helper()
	for _, n := range r.GetNodes() {
		if n.GetId() == id {
			return n
		}
	}
	t.Fatalf("run has no node %s: %v", id, r.GetNodes())
	return nil
}

const (
	fastPlan = `{"tokens_per_second":200,"steps":[
	  {"think_tokens":10,"tools":[{"name":"sleep","args":{"ms":30}},{"name":"sleep","args":{"ms":10}}]},
	  {"answer_tokens":5}]}`
	// slowPlan decodes for 50 s unless stopped.
	slowPlan = `{"tokens_per_second":20,"steps":[
	  {"think_tokens":1000,"tools":[{"name":"sleep","args":{"ms":1}}]},
	  {"answer_tokens":1}]}`
	tinyPlan = `{"tokens_per_second":1000,"steps":[{"answer_tokens":1}]}`
)
