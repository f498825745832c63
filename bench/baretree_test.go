package bench

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	modelproxyv1 "github.com/curfew-mesh/curfew/gen/curfew/modelproxy/v1"
	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	subagentv1 "github.com/curfew-mesh/curfew/gen/curfew/subagent/v1"
	toolrunnerv1 "github.com/curfew-mesh/curfew/gen/curfew/toolrunner/v1"
	"github.com/curfew-mesh/curfew/mesh/plan"
)

// The bare tree is the floor that the throughput and cancel benchmarks compare curfew
// with: the same four processes (this test binary started once per role), the same
// services and messages (curfew's generated protos), the same plans, but bare grpc-go
// on plaintext loopback with no interceptor, no store, no ledger, no node tables, no
// events beyond a run's first and last. It is a benchmark harness, not a second
// product: each role does the least its curfew counterpart must do for the plan to run.
//
//   - orchestrator: Run executes the plan's loop: per step one Generate stream to the
//     model process, read to its end, then the step's tools as parallel Execute calls
//     to the tool process.
//   - toolrunner: Execute runs "sleep" (waits args.ms, or until cancelled) and
//     "spawn_subagent" (one Spawn call to the subagent process with args.plan, read to
//     its end).
//   - subagent: Spawn runs the same loop as the orchestrator on the child plan.
//   - modelproxy: Generate streams max_tokens tokens, one message each, at the rate
//     bareTPSEnv gives, on an absolute schedule as the sim model does.
//
// Cancellation is grpc-go's own: a cancelled call's context cancels the calls made
// under it, hop by hop (RST_STREAM).
const (
	bareRoleEnv  = "CURFEW_BENCH_BARE"        // the role this process serves
	bareAddrsEnv = "CURFEW_BENCH_BARE_ADDRS"  // role=addr,... of all four processes
	bareTPSEnv   = "CURFEW_BENCH_BARE_TPS"    // the model's decode rate, tokens/s
	bareEventEnv = "CURFEW_BENCH_BARE_EVENTS" // "1": the model prints decoder events
)

// Decoder events the bare model prints on stdout when bareEventEnv is 1: its first
// token sent, and a cancelled stream's end with the instant its context was seen done.
const (
	bareDecoding = "decoding"
	bareEnded    = "ended" // followed by Unix ns
)

// bareTree is a started bare tree, as the benchmark process sees it.
type bareTree struct {
	pids   [4]int // indexed as serviceNames
	orch   orchestratorv1.OrchestratorServiceClient
	events chan string // the model's decoder events (with bareEventEnv)
}

// startBareTree starts the four roles as child processes with the model decoding at tps,
// and stops them when tb ends. With events, the model reports its decoders' starts and
// cancelled ends on bareTree.events.
func startBareTree(tb testing.TB, tps float64, events bool) *bareTree {
	tb.Helper()
	addrs := make([]string, len(serviceNames))
	for i, name := range serviceNames {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			tb.Fatal(err)
		}
		addrs[i] = name + "=" + l.Addr().String()
		_ = l.Close() // picked free, bound by the child: a lost race fails the start loudly
	}
	t := &bareTree{events: make(chan string, 4096)}
	env := append(os.Environ(), bareAddrsEnv+"="+strings.Join(addrs, ","), bareTPSEnv+"="+strconv.FormatFloat(tps, 'f', -1, 64))
	if events {
		env = append(env, bareEventEnv+"=1")
	}
	for i, name := range serviceNames {
		cmd := exec.Command(os.Args[0], "-test.run", "^$") //nolint:noctx // stopped in Cleanup
		cmd.Env = append(slices.Clone(env), bareRoleEnv+"="+name)
		cmd.Stderr = os.Stderr
		out, err := cmd.StdoutPipe()
		if err != nil {
			tb.Fatal(err)
		}
		if err := cmd.Start(); err != nil {
			tb.Fatal(err)
		}
		tb.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
		t.pids[i] = cmd.Process.Pid
		go func() {
			sc := bufio.NewScanner(out)
			for sc.Scan() {
				t.events <- sc.Text()
			}
		}()
	}
	_, orchAddr, _ := strings.Cut(addrs[0], "=")
	for end := time.Now().Add(30 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		ready := true
		for _, a := range addrs {
			_, addr, _ := strings.Cut(a, "=")
			c, err := net.DialTimeout("tcp", addr, time.Second)
			if err != nil {
				ready = false
				break
			}
			_ = c.Close()
		}
		if ready {
			break
		}
		if time.Now().After(end) {
			tb.Fatal("the bare tree did not start")
		}
	}
	conn, err := grpc.NewClient(orchAddr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { _ = conn.Close() })
	t.orch = orchestratorv1.NewOrchestratorServiceClient(conn)
	return t
}

// run makes one Run call of task and reads it to its end.
func (t *bareTree) run(ctx context.Context, task string) error {
	return runToEnd(ctx, t.orch, task, orchestratorv1.RunEvents_RUN_EVENTS_UNSPECIFIED)
}

// bareServe is the body of a bare-tree child process (see TestMain): it serves its
// role until killed and returns the exit code.
func bareServe(role string) int {
	addrs := map[string]string{}
	for _, kv := range strings.Split(os.Getenv(bareAddrsEnv), ",") {
		k, v, _ := strings.Cut(kv, "=")
		addrs[k] = v
	}
	tps, err := strconv.ParseFloat(os.Getenv(bareTPSEnv), 64)
	if err != nil || tps <= 0 {
		fmt.Fprintln(os.Stderr, "bare tree: bad", bareTPSEnv, err)
		return 2
	}
	dial := func(name string) *grpc.ClientConn {
		c, err := grpc.NewClient(addrs[name], grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			panic(err) // only a malformed address fails here
		}
		return c
	}
	l := &bareLoop{
		model: modelproxyv1.NewModelProxyServiceClient(dial("modelproxy")),
		tools: toolrunnerv1.NewToolRunnerServiceClient(dial("toolrunner")),
	}
	srv := grpc.NewServer()
	switch role {
	case "orchestrator":
		orchestratorv1.RegisterOrchestratorServiceServer(srv, &bareOrchestrator{loop: l})
	case "subagent":
		subagentv1.RegisterSubagentServiceServer(srv, &bareSubagent{loop: l})
	case "toolrunner":
		toolrunnerv1.RegisterToolRunnerServiceServer(srv, &bareToolrunner{sub: subagentv1.NewSubagentServiceClient(dial("subagent"))})
	case "modelproxy":
		m := &bareModel{interval: time.Duration(float64(time.Second) / tps), events: os.Getenv(bareEventEnv) == "1"}
		modelproxyv1.RegisterModelProxyServiceServer(srv, m)
	default:
		fmt.Fprintln(os.Stderr, "bare tree: unknown role", role)
		return 2
	}
	lis, err := net.Listen("tcp", addrs[role])
	if err != nil {
		fmt.Fprintln(os.Stderr, "bare tree:", err)
		return 1
	}
	if err := srv.Serve(lis); err != nil {
		fmt.Fprintln(os.Stderr, "bare tree:", err)
		return 1
	}
	return 0
}

// bareLoop is the agent loop of the bare orchestrator and subagent.
type bareLoop struct {
	model modelproxyv1.ModelProxyServiceClient
	tools toolrunnerv1.ToolRunnerServiceClient
}

// run executes task, a plan (bench's planJSON): each step decodes its tokens, then runs
// its tools in parallel; the first error ends the run.
func (l *bareLoop) run(ctx context.Context, task string) error {
	var p planJSON
	if err := json.Unmarshal([]byte(task), &p); err != nil {
		return err
	}
	for _, st := range p.Steps {
		n := st.ThinkTokens
		if st.AnswerTokens > 0 {
			n = st.AnswerTokens
		}
		gen, err := l.model.Generate(ctx, &modelproxyv1.GenerateRequest{Model: "bare", MaxTokens: int32(n), //nolint:gosec // plan sizes
			Messages: []*modelproxyv1.Message{{Role: modelproxyv1.Role_ROLE_USER, Content: task}}})
		if err != nil {
			return err
		}
		if err := drain(gen.Recv); err != nil {
			return err
		}
		errs := make(chan error, len(st.Tools))
		for _, tool := range st.Tools {
			go func() {
				args, err := json.Marshal(tool.Args)
				if err != nil {
					errs <- err
					return
				}
				ex, err := l.tools.Execute(ctx, &toolrunnerv1.ExecuteRequest{Name: tool.Name, ArgsJson: string(args)})
				if err != nil {
					errs <- err
					return
				}
				errs <- drain(ex.Recv)
			}()
		}
		for range st.Tools {
			if err := <-errs; err != nil {
				return err
			}
		}
	}
	return nil
}

// drain reads a server stream to its end; io.EOF is success.
func drain[T any](recv func() (T, error)) error {
	for {
		if _, err := recv(); err != nil {
			if errors.Is(err, io.EOF) {
				return nil
			}
			return err
		}
	}
}

type bareOrchestrator struct {
	orchestratorv1.UnimplementedOrchestratorServiceServer
	loop *bareLoop
}

// Run sends a started event, runs the plan and sends the finished run.
func (o *bareOrchestrator) Run(req *orchestratorv1.RunRequest, st grpc.ServerStreamingServer[orchestratorv1.RunResponse]) error {
	if err := st.Send(&orchestratorv1.RunResponse{Event: &orchestratorv1.RunResponse_Started{Started: &orchestratorv1.RunStarted{RunId: "bare"}}}); err != nil {
		return err
	}
	if err := o.loop.run(st.Context(), req.GetTask()); err != nil {
		return err
	}
	return st.Send(&orchestratorv1.RunResponse{Event: &orchestratorv1.RunResponse_Finished{Finished: &orchestratorv1.Run{
		RunId: "bare", Status: orchestratorv1.RunStatus_RUN_STATUS_SUCCEEDED}}})
}

type bareSubagent struct {
	subagentv1.UnimplementedSubagentServiceServer
	loop *bareLoop
}

// Spawn runs the child plan and sends its result.
func (s *bareSubagent) Spawn(req *subagentv1.SpawnRequest, st grpc.ServerStreamingServer[subagentv1.SpawnResponse]) error {
	if err := s.loop.run(st.Context(), req.GetTask()); err != nil {
		return err
	}
	return st.Send(&subagentv1.SpawnResponse{Event: &subagentv1.SpawnResponse_Result{Result: &subagentv1.SpawnResult{Answer: "done"}}})
}

type bareToolrunner struct {
	toolrunnerv1.UnimplementedToolRunnerServiceServer
	sub subagentv1.SubagentServiceClient
}

// Execute runs the sleep tool or spawns a subagent, and sends the result.
func (t *bareToolrunner) Execute(req *toolrunnerv1.ExecuteRequest, st grpc.ServerStreamingServer[toolrunnerv1.ExecuteResponse]) error {
	ctx := st.Context()
	switch req.GetName() {
	case plan.ToolSleep:
		var args struct{ MS int }
		if err := json.Unmarshal([]byte(req.GetArgsJson()), &args); err != nil {
			return err
		}
		tm := time.NewTimer(time.Duration(args.MS) * time.Millisecond)
		defer tm.Stop()
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-tm.C:
		}
	case plan.ToolSpawnSubagent:
		var args struct{ Plan json.RawMessage }
		if err := json.Unmarshal([]byte(req.GetArgsJson()), &args); err != nil {
			return err
		}
		sp, err := t.sub.Spawn(ctx, &subagentv1.SpawnRequest{Task: string(args.Plan)})
		if err != nil {
			return err
		}
		if err := drain(sp.Recv); err != nil {
			return err
		}
	default:
		return fmt.Errorf("bare tree: no tool %q", req.GetName())
	}
	return st.Send(&toolrunnerv1.ExecuteResponse{Event: &toolrunnerv1.ExecuteResponse_Result{Result: &toolrunnerv1.ExecuteResult{OutputJson: `{"ok":true}`}}})
}

type bareModel struct {
	modelproxyv1.UnimplementedModelProxyServiceServer
	interval time.Duration
	events   bool
	mu       sync.Mutex // serialises event lines
}

// Generate streams max_tokens tokens at the model's rate, then a final chunk.
func (m *bareModel) Generate(req *modelproxyv1.GenerateRequest, st grpc.ServerStreamingServer[modelproxyv1.GenerateResponse]) (err error) {
	ctx := st.Context()
	defer func() {
		// A decoder that stops early was cancelled, whether it saw the cancel in its
		// context or as a failed Send (which grpc-go may report before the context is
		// done): it reports when it stopped.
		if err != nil {
			m.event(bareEnded + " " + strconv.FormatInt(time.Now().UnixNano(), 10))
		}
	}()
	start := time.Now()
	var tm *time.Timer
	for i := range int(req.GetMaxTokens()) {
		if wait := time.Until(start.Add(time.Duration(i+1) * m.interval)); wait > 0 {
			if tm == nil {
				tm = time.NewTimer(wait)
				defer tm.Stop()
			} else {
				tm.Reset(wait)
			}
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-tm.C:
			}
		}
		if err := st.Send(&modelproxyv1.GenerateResponse{Delta: "tok ", Tokens: 1}); err != nil {
			return err
		}
		if i == 0 {
			m.event(bareDecoding)
		}
	}
	return st.Send(&modelproxyv1.GenerateResponse{FinishReason: "stop", Usage: &modelproxyv1.Usage{CompletionTokens: int64(req.GetMaxTokens())}})
}

func (m *bareModel) event(s string) {
	if !m.events {
		return
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	fmt.Println(s)
}
