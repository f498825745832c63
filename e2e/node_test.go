package e2e

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	"github.com/curfew-mesh/curfew/internal/meshproc"
	"github.com/curfew-mesh/curfew/mesh/md"
)

// The Node tests drive examples/node, a Node client built on
// Connect's gRPC transport and the TypeScript generated into gen/ts, against the shared
// mesh, and read what the run did through the Go client. scripts/node.sh installs the
// example's pinned dependencies (npm ci, only when its lock changed) and builds it; without
// Node.js the tests skip locally and fail under CI=true.

var (
	nodeOnce   sync.Once
	nodeScript string
	nodeErr    error
)

// nodeClient returns the path of the built example (dist/client.js), building it once.
func nodeClient(t *testing.T) string {
	t.Helper()
	nodeOnce.Do(func() {
		if _, err := exec.LookPath("node"); err != nil && os.Getenv("CI") != "true" {
			nodeErr = errors.New("skip: node is not installed")
			return
		}
		repo, err := meshproc.Repo()
		if err != nil {
			nodeErr = err
			return
		}
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
		defer cancel()
		cmd := exec.CommandContext(ctx, "bash", filepath.Join(repo, "scripts", "node.sh"), "example")
		cmd.Dir = repo
		if out, err := cmd.CombinedOutput(); err != nil {
			nodeErr = fmt.Errorf("scripts/node.sh example: %w\n%s", err, out)
			return
		}
		nodeScript = filepath.Join(repo, "examples", "node", "dist", "client.js")
	})
	if nodeErr != nil {
		if strings.HasPrefix(nodeErr.Error(), "skip: ") && os.Getenv("CI") != "true" {
			t.Skip(nodeErr.Error()[len("skip: "):])
		}
		t.Fatal(nodeErr)
	}
	return nodeScript
}

// nodeEvent is one JSON line the example prints with --json.
type nodeEvent struct {
	Event            string   `json:"event"`
	RunID            string   `json:"run_id"`
	Created          *bool    `json:"created"`
	DeadlineMS       int64    `json:"deadline_ms"`
	ClientDeadlineMS int64    `json:"client_deadline_ms"`
	AtMS             int64    `json:"at_ms"`
	Code             string   `json:"code"`
	Message          string   `json:"message"`
	RetryDelayMS     *int64   `json:"retry_delay_ms"`
	Reasons          []string `json:"reasons"`
	Domain           string   `json:"domain"`
	Status           string   `json:"status"`
	Cause            string   `json:"cause"`
	Nodes            []struct {
		ID                string `json:"id"`
		Kind              string `json:"kind"`
		TokensAfterCancel int64  `json:"tokens_after_cancel"`
	} `json:"nodes"`
}

// nodeProc is a running example process whose JSON events arrive on a channel.
type nodeProc struct {
	cmd    *exec.Cmd
	events chan nodeEvent
	done   chan error
	stderr strings.Builder
}

// nodeKey is the API key the Node example sends, made once.
var (
	nodeKeyOnce sync.Once
	nodeKey     string
)

func startNode(t *testing.T, args ...string) *nodeProc {
	t.Helper()
	script := nodeClient(t)
	addr := mesh.Endpoints.Services["orchestrator"].Addr
	base := []string{script, "--addr", addr, "--json"}
	if mesh.TLS() { // TLS trusting the mesh CA; the public API needs no client certificate
		base = append(base, "--ca", filepath.Join(mesh.Endpoints.TLSDir, "ca.crt"))
	}
	cmd := exec.Command("node", append(base, args...)...) //nolint:noctx // the test signals and kills it itself
	// A caller from outside the mesh: it authenticates with an API key, of tenant
	// "default" so that the Go client of the other checks (a mesh peer naming no tenant)
	// sees its runs.
	nodeKeyOnce.Do(func() { nodeKey = tenantKey(context.Background(), t, md.DefaultTenant, false) })
	cmd.Env = append(os.Environ(), "CURFEW_API_KEY="+nodeKey)
	p := &nodeProc{cmd: cmd, events: make(chan nodeEvent, 4096), done: make(chan error, 1)}
	cmd.Stderr = &p.stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() {
		sc := bufio.NewScanner(out)
		sc.Buffer(make([]byte, 1<<20), 1<<20)
		for sc.Scan() {
			var ev nodeEvent
			if err := json.Unmarshal(sc.Bytes(), &ev); err == nil {
				p.events <- ev
			}
		}
		close(p.events)
		p.done <- cmd.Wait()
	}()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
	})
	return p
}

// next returns the next event named name, failing after timeout.
func (p *nodeProc) next(t *testing.T, name string, timeout time.Duration) nodeEvent {
	t.Helper()
	deadline := time.After(timeout)
	for {
		select {
		case ev, ok := <-p.events:
			if !ok {
				t.Fatalf("node exited before a %q event; stderr:\n%s", name, p.stderr.String())
			}
			if ev.Event == name {
				return ev
			}
			if ev.Event == "error" {
				t.Fatalf("node: %s: %s (while waiting for %q)", ev.Code, ev.Message, name)
			}
		case <-deadline:
			t.Fatalf("no %q event from node within %v", name, timeout)
		}
	}
}

// wait waits for the process to exit and returns its exit code.
func (p *nodeProc) wait(t *testing.T, timeout time.Duration) int {
	t.Helper()
	for range p.events { //nolint:revive // drain
	}
	select {
	case err := <-p.done:
		if err == nil {
			return 0
		}
		if ee, ok := err.(*exec.ExitError); ok { //nolint:errorlint // exec returns it unwrapped
			return ee.ExitCode()
		}
		t.Fatalf("node: %v", err)
	case <-time.After(timeout):
		t.Fatalf("node did not exit within %v", timeout)
	}
	return -1
}

// nodeRunNodes is a plan whose run has three decoders at work 1.5 s in: the root's first
// step (0.5 s at 40 tokens/s) then two subagents decoding 400 tokens (10 s) in parallel.
const nodeRunNodes = `{"tokens_per_second": 40, "steps": [
  {"think_tokens": 20, "tools": [
    {"name": "spawn_subagent", "args": {"plan": {"steps": [{"think_tokens": 400}, {"answer_tokens": 5}]}}},
    {"name": "spawn_subagent", "args": {"plan": {"steps": [{"think_tokens": 400}, {"answer_tokens": 5}]}}}]},
  {"answer_tokens": 5}]}`

// checkFrozen fails unless every decoder of r spent at most 1 token after the cancel, and
// at least one decoder was live at the cancel (it ended cancelled).
func checkFrozen(t *testing.T, r *orchestratorv1.Run) {
	t.Helper()
	live := 0
	for _, n := range r.GetNodes() {
		if n.GetKind() != meshv1.NodeKind_NODE_KIND_MODEL {
			continue
		}
		if n.GetTokensAfterCancel() > 1 {
			t.Errorf("decoder %s spent %d tokens after the cancel (at most 1)", n.GetId(), n.GetTokensAfterCancel())
		}
		if n.GetStatus() == meshv1.NodeStatus_NODE_STATUS_CANCELLED {
			live++ // it was decoding when the cancel came
		}
	}
	if live == 0 {
		t.Errorf("no decoder was live at the cancel:\n%s", dump(r))
	}
}

// A Node deadline of 5 s becomes the run's absolute deadline, no later than the Node
// client's own deadline and at most 500 ms earlier (the time the call took to arrive),
// and the run ends DEADLINE_EXCEEDED within 1 s of it, its decoders frozen.
func TestNodeDeadline(t *testing.T) {
	t.Parallel()
	p := startNode(t, "run", "--deadline", "5s", "--task", `{"tokens_per_second": 40, "steps": [{"think_tokens": 400}, {"answer_tokens": 5}]}`)
	st := p.next(t, "started", 30*time.Second)
	early := time.Duration(st.ClientDeadlineMS-st.DeadlineMS) * time.Millisecond
	t.Logf("run %s: Node's deadline %d, the run's %d: %v earlier", st.RunID, st.ClientDeadlineMS, st.DeadlineMS, early)
	// -1 ms: Node rounds the deadline's nanoseconds to the nearest millisecond.
	if early < -time.Millisecond || early > 500*time.Millisecond {
		t.Errorf("the run's deadline is %v before Node's, want within [0, 500ms]", early)
	}
	ended := p.next(t, "ended", 15*time.Second)
	if ended.Code != "DEADLINE_EXCEEDED" {
		t.Errorf("Node's call ended with %s, want DEADLINE_EXCEEDED", ended.Code)
	}
	sum := p.next(t, "summary", 35*time.Second)
	if code := p.wait(t, 10*time.Second); code != 1 {
		t.Errorf("exit code %d, want 1", code)
	}
	if sum.Status != "DEADLINE_EXCEEDED" {
		t.Errorf("Node's summary says %s", sum.Status)
	}
	r := summary(context.Background(), t, client(t), st.RunID)
	if r.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_DEADLINE_EXCEEDED || r.GetErrorCode() != "DEADLINE_EXCEEDED" {
		t.Fatalf("run ended %s (%s), want DEADLINE_EXCEEDED:\n%s", r.GetStatus(), r.GetErrorCode(), dump(r))
	}
	if d := r.GetDeadline().AsTime().Sub(time.UnixMilli(st.DeadlineMS)); d < -time.Millisecond || d > time.Millisecond {
		t.Errorf("stored deadline %v differs from the started event's %d", r.GetDeadline().AsTime(), st.DeadlineMS)
	}
	late := r.GetEndedAt().AsTime().Sub(r.GetDeadline().AsTime())
	t.Logf("run ended %v after its deadline; %d tokens, %d after the deadline", late, r.GetTokens(), r.GetTokensAfterCancel())
	if late > time.Second {
		t.Errorf("run ended %v after its deadline, want within 1s", late)
	}
	for _, n := range r.GetNodes() {
		if n.GetKind() == meshv1.NodeKind_NODE_KIND_MODEL && n.GetTokensAfterCancel() > 1 {
			t.Errorf("decoder %s spent %d tokens after the deadline", n.GetId(), n.GetTokensAfterCancel())
		}
	}
}

// Ctrl-C (SIGINT) in the Node client 1.5 s into a run cancels it: cause
// client_disconnect, at most 1 token after the cancel per decoder, and the summary the
// client prints (GetRun) says so.
func TestNodeCancel(t *testing.T) {
	t.Parallel()
	p := startNode(t, "run", "--deadline", "60s", "--task", nodeRunNodes)
	st := p.next(t, "started", 30*time.Second)
	time.Sleep(1500 * time.Millisecond)
	sent := time.Now()
	if err := p.cmd.Process.Signal(syscall.SIGINT); err != nil {
		t.Fatal(err)
	}
	p.next(t, "cancel", 10*time.Second)
	sum := p.next(t, "summary", 35*time.Second)
	exited := p.wait(t, 10*time.Second)
	t.Logf("Node exited %v after the SIGINT with code %d", time.Since(sent).Round(time.Millisecond), exited)
	if sum.Status != "CANCELLED" || sum.Cause != "CLIENT_DISCONNECT" {
		t.Errorf("Node's summary: %s (%s), want CANCELLED (CLIENT_DISCONNECT)", sum.Status, sum.Cause)
	}
	for _, n := range sum.Nodes {
		if n.Kind == "MODEL" && n.TokensAfterCancel > 1 {
			t.Errorf("Node's summary: decoder %s spent %d tokens after the cancel", n.ID, n.TokensAfterCancel)
		}
	}
	r := summary(context.Background(), t, client(t), st.RunID)
	if r.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_CANCELLED || r.GetCause() != meshv1.CancelCause_CANCEL_CAUSE_CLIENT_DISCONNECT {
		t.Fatalf("run ended %s (%s), want CANCELLED by client_disconnect:\n%s", r.GetStatus(), r.GetCause(), dump(r))
	}
	t.Logf("cancel reached the orchestrator %v after the SIGINT; %d tokens, %d after the cancel",
		r.GetCancelledAt().AsTime().Sub(sent).Round(time.Millisecond), r.GetTokens(), r.GetTokensAfterCancel())
	checkFrozen(t, r)
}

// Killing the Node process (SIGKILL) 1.5 s into a run does the same: the kernel closes
// its connection, the orchestrator sees the disconnect and cancels the tree.
func TestNodeProcessKill(t *testing.T) {
	t.Parallel()
	p := startNode(t, "run", "--deadline", "60s", "--task", nodeRunNodes)
	st := p.next(t, "started", 30*time.Second)
	time.Sleep(1500 * time.Millisecond)
	killed := time.Now()
	if err := p.cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	if code := p.wait(t, 10*time.Second); code != -1 {
		t.Logf("exit code %d", code)
	}
	r := summary(context.Background(), t, client(t), st.RunID)
	if r.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_CANCELLED || r.GetCause() != meshv1.CancelCause_CANCEL_CAUSE_CLIENT_DISCONNECT {
		t.Fatalf("run ended %s (%s), want CANCELLED by client_disconnect:\n%s", r.GetStatus(), r.GetCause(), dump(r))
	}
	t.Logf("disconnect seen %v after the SIGKILL; %d tokens, %d after the cancel",
		r.GetCancelledAt().AsTime().Sub(killed).Round(time.Millisecond), r.GetTokens(), r.GetTokensAfterCancel())
	if d := r.GetCancelledAt().AsTime().Sub(killed); d > 2*time.Second {
		t.Errorf("the orchestrator cancelled the run %v after the kill, want within 2s", d)
	}
	checkFrozen(t, r)
}

// A sheddable run with less than the cancel grace (1 s) of deadline slack is shed by the
// overflow pool: Node gets RESOURCE_EXHAUSTED and reads the retry delay from the
// google.rpc.RetryInfo in grpc-status-details-bin, and the shed's ErrorInfo reason.
func TestNodeShedIsResourceExhaustedWithRetryInfo(t *testing.T) {
	t.Parallel()
	p := startNode(t, "run", "--deadline", "800ms", "--criticality", "sheddable",
		"--task", `{"steps": [{"think_tokens": 40}, {"answer_tokens": 5}]}`)
	ev := p.next(t, "error", 30*time.Second)
	if code := p.wait(t, 10*time.Second); code != 1 {
		t.Errorf("exit code %d, want 1", code)
	}
	if ev.Code != "RESOURCE_EXHAUSTED" {
		t.Fatalf("code %s (%q), want RESOURCE_EXHAUSTED", ev.Code, ev.Message)
	}
	if ev.RetryDelayMS == nil {
		t.Fatal("no RetryInfo delay in the status details")
	}
	t.Logf("Node saw %s %q, retry delay %d ms, reasons %v", ev.Code, ev.Message, *ev.RetryDelayMS, ev.Reasons)
	if *ev.RetryDelayMS <= 0 || *ev.RetryDelayMS > 60_000 {
		t.Errorf("retry delay %d ms, want a RetryInfo delay in (0, 60s]", *ev.RetryDelayMS)
	}
	if len(ev.Reasons) == 0 || !strings.HasPrefix(ev.Reasons[0], "SHED_") || ev.Domain != "curfew.dev" {
		t.Errorf("ErrorInfo reasons %v domain %q, want SHED_… first, domain curfew.dev", ev.Reasons, ev.Domain)
	}
}

// StartRun from Node with an idempotency key, sent twice, starts one run; CancelRun from
// Node then stops it.
func TestNodeIdempotentStartRun(t *testing.T) {
	t.Parallel()
	key := fmt.Sprintf("node-e2e-%d", time.Now().UnixNano())
	task := `{"tokens_per_second": 40, "steps": [{"think_tokens": 400}, {"answer_tokens": 5}]}`
	var ids []string
	for i, want := range []bool{true, false} {
		p := startNode(t, "start", "--key", key, "--timeout", "60s", "--task", task)
		ev := p.next(t, "started", 30*time.Second)
		if code := p.wait(t, 10*time.Second); code != 0 {
			t.Fatalf("start %d: exit code %d", i+1, code)
		}
		if ev.Created == nil || *ev.Created != want {
			t.Errorf("start %d: created=%v, want %v", i+1, ev.Created, want)
		}
		ids = append(ids, ev.RunID)
	}
	if ids[0] == "" || ids[0] != ids[1] {
		t.Fatalf("two starts with key %q gave runs %v, want one", key, ids)
	}
	// One run with the key in the store.
	resp, err := client(t).ListRuns(context.Background(), &orchestratorv1.ListRunsRequest{PageSize: 500})
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, r := range resp.GetRuns() {
		if r.GetIdempotencyKey() == key {
			n++
		}
	}
	if n != 1 {
		t.Errorf("%d runs with key %q, want 1", n, key)
	}
	p := startNode(t, "cancel", ids[0], "--reason", "e2e")
	sum := p.next(t, "summary", 35*time.Second)
	if code := p.wait(t, 10*time.Second); code != 0 {
		t.Errorf("cancel: exit code %d", code)
	}
	if sum.Status != "CANCELLED" || sum.Cause != "OPERATOR" {
		t.Errorf("after CancelRun: %s (%s), want CANCELLED (OPERATOR)", sum.Status, sum.Cause)
	}
}
