package e2e

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/proto"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	modelproxyv1 "github.com/curfew-mesh/curfew/gen/curfew/modelproxy/v1"
	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	"github.com/curfew-mesh/curfew/internal/meshproc"
	"github.com/curfew-mesh/curfew/mesh/meshtls"
)

// upstream is an openaitest server process: an HTTP server that speaks the OpenAI chat
// completions streaming format, scripted through its control API.
type upstream struct {
	url string // the API base, ending in /v1
}

var (
	openaitestOnce sync.Once
	openaitestBin  string
	openaitestErr  error
)

// startUpstream builds (once) and starts an openaitest process for the test; args are
// openaitest's flags (-api-key K).
func startUpstream(t *testing.T, args ...string) *upstream {
	t.Helper()
	openaitestOnce.Do(func() {
		repo, err := meshproc.Repo()
		if err != nil {
			openaitestErr = err
			return
		}
		dir, err := os.MkdirTemp("", "curfew-openaitest-")
		if err != nil {
			openaitestErr = err
			return
		}
		openaitestBin = filepath.Join(dir, "openaitest")
		cmd := exec.Command("go", "build", "-o", openaitestBin, "./services/modelproxy/internal/provider/openaitest/cmd/openaitest")
		cmd.Dir = repo
		if out, err := cmd.CombinedOutput(); err != nil {
			openaitestErr = fmt.Errorf("build openaitest: %w\n%s", err, out)
		}
	})
	if openaitestErr != nil {
		t.Fatal(openaitestErr)
	}
	cmd := exec.Command(openaitestBin, append([]string{"-addr", "127.0.0.1:0"}, args...)...)
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Signal(os.Interrupt)
		_ = cmd.Wait()
	})
	line, err := bufio.NewReader(stdout).ReadString('\n')
	if err != nil {
		t.Fatalf("openaitest printed no URL: %v", err)
	}
	go func() { _, _ = io.Copy(io.Discard, stdout) }()
	return &upstream{url: strings.TrimSpace(line)}
}

func (u *upstream) control() string { return strings.TrimSuffix(u.url, "/v1") + "/_openaitest" }

// timeNote is how the agent loop's time-left note starts: a system message after each
// model request's conversation (docs/reserve.md).
const timeNote = "[curfew] Time left for this task"

// chatMessage is a message of a chat completions request as the model server received it.
type chatMessage struct {
	Role       string `json:"role"`
	Content    any    `json:"content"`
	ToolCallID string `json:"tool_call_id"`
}

// withoutTimeNote returns a request's messages without the time-left note that ends
// them, and whether it was there.
func withoutTimeNote(msgs []chatMessage) ([]chatMessage, bool) {
	if len(msgs) == 0 {
		return msgs, false
	}
	last := msgs[len(msgs)-1]
	if s, _ := last.Content.(string); last.Role != "system" || !strings.HasPrefix(s, timeNote) {
		return msgs, false
	}
	return msgs[:len(msgs)-1], true
}

// enqueue scripts the next replies, one per request, as openaitest.Reply JSON objects.
func (u *upstream) enqueue(t *testing.T, replies ...string) {
	t.Helper()
	body := "[" + strings.Join(replies, ",") + "]"
	resp, err := http.Post(u.control()+"/replies", "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK && resp.StatusCode != http.StatusNoContent {
		b, _ := io.ReadAll(resp.Body)
		t.Fatalf("enqueue: %s: %s", resp.Status, b)
	}
}

// upstreamCall is what the control API reports of one request.
type upstreamCall struct {
	Request struct {
		Body []byte
	}
}

// calls returns the requests the server has received.
func (u *upstream) calls(t *testing.T) []upstreamCall {
	t.Helper()
	resp, err := http.Get(u.control() + "/calls")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var cs []upstreamCall
	if err := json.NewDecoder(resp.Body).Decode(&cs); err != nil {
		t.Fatal(err)
	}
	return cs
}

// startProviderMesh starts a mesh whose modelproxy has the providers file fileJSON, with
// {name} replaced by each upstream's URL; env is more of curfew up's environment.
func startProviderMesh(t *testing.T, fileJSON string, ups map[string]*upstream, env ...string) *meshproc.Mesh {
	t.Helper()
	for name, u := range ups {
		fileJSON = strings.ReplaceAll(fileJSON, "{"+name+"}", u.url)
	}
	cfg := filepath.Join(t.TempDir(), "providers.json")
	if err := os.WriteFile(cfg, []byte(fileJSON), 0o600); err != nil {
		t.Fatal(err)
	}
	return startOwnMesh(t, append([]string{"CURFEW_PROVIDERS_CONFIG=" + cfg}, env...)...)
}

const e2eProviders = `{"providers": [
    {"name": "primary", "base_url": "{primary}", "models": ["big"]},
    {"name": "backup", "base_url": "{backup}", "models": ["big", "small"]}],
  "models": {"agent": {"chain": ["primary/big", "backup/big"], "degrade_to": "backup/small"}},
  "breaker": {"failures": 3, "open_timeout": "1s", "jitter": 0.01}}`

// Over the real processes: a real model (an OpenAI-format HTTP server) drives a run's
// tools; a failing primary falls back and its breaker opens, then a probe closes it; a
// schema-bound answer that fails validation degrades; a retried deterministic prompt is
// answered from the cache.
func TestProvidersOverRealProcesses(t *testing.T) {
	t.Parallel()
	ups := map[string]*upstream{"primary": startUpstream(t), "backup": startUpstream(t)}
	m := startProviderMesh(t, e2eProviders, ups)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()

	t.Run("model drives tools", func(t *testing.T) {
		ups["primary"].enqueue(t,
			`{"content": ["Let", " me", " wait"], "tool_calls": [{"id": "call_1", "name": "sleep", "arguments": "{\"ms\": 30}", "fragments": 2}], "finish_reason": "tool_calls",
			  "usage": {"prompt_tokens": 100, "completion_tokens": 5}}`,
			`{"content": ["waited", " 30", " ms"], "usage": {"prompt_tokens": 120, "completion_tokens": 3}}`)
		oc, err := m.Orchestrator()
		if err != nil {
			t.Fatal(err)
		}
		st, err := oc.Run(ctx, &orchestratorv1.RunRequest{Task: "wait for 30 ms, then say so", Model: "agent"})
		if err != nil {
			t.Fatal(err)
		}
		var fin *orchestratorv1.Run
		for {
			ev, err := st.Recv()
			if err != nil {
				t.Fatalf("run: %v", err)
			}
			if f := ev.GetFinished(); f != nil {
				fin = f
				break
			}
		}
		if fin.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_SUCCEEDED || !strings.Contains(fin.GetAnswer(), "waited 30 ms") {
			t.Fatalf("run ended %v: %s", fin.GetStatus(), dump(fin))
		}
		nm := nodeMap(fin)
		if n := nm["root/m0"]; n.GetProvider() != "primary" || n.GetServedModel() != "big" {
			t.Fatalf("root/m0 = %v", n)
		}
		if n := nm["root/s0.t0"]; n.GetName() != "sleep" || n.GetStatus() != meshv1.NodeStatus_NODE_STATUS_SUCCEEDED {
			t.Fatalf("tool node = %v\n%s", n, dump(fin))
		}
		// The provider's usage.prompt_tokens is each model node's prompt_tokens.
		if p0, p1 := nm["root/m0"].GetPromptTokens(), nm["root/m1"].GetPromptTokens(); p0 != 100 || p1 != 120 || fin.GetPromptTokens() != 220 {
			t.Fatalf("prompt tokens root/m0 %d, root/m1 %d, run %d: want the usage's 100, 120 and their sum", p0, p1, fin.GetPromptTokens())
		}
		calls := ups["primary"].calls(t)
		if len(calls) < 2 {
			t.Fatalf("primary saw %d requests", len(calls))
		}
		first, second := string(calls[len(calls)-2].Request.Body), string(calls[len(calls)-1].Request.Body)
		for _, tool := range []string{`"sleep"`, `"deploy"`, `"spawn_subagent"`} {
			if !strings.Contains(first, tool) {
				t.Errorf("the model was not told about %s: %s", tool, first)
			}
		}
		if !strings.Contains(second, `"tool_call_id":"call_1"`) {
			t.Errorf("the second step does not carry the tool's result: %s", second)
		}
	})

	conn, err := m.ConnAs(meshtls.Orchestrator, "modelproxy") // as a caller of Generate
	if err != nil {
		t.Fatal(err)
	}
	mp := modelproxyv1.NewModelProxyServiceClient(conn)
	gen := func(t *testing.T, node string, req *modelproxyv1.GenerateRequest) (*modelproxyv1.GenerateResponse, string, error) {
		t.Helper()
		cctx := metadata.AppendToOutgoingContext(ctx, "curfew-run-id", "e2e-providers", "curfew-node-id", node)
		st, err := mp.Generate(cctx, req)
		if err != nil {
			return nil, "", err
		}
		var text bytes.Buffer
		var last *modelproxyv1.GenerateResponse
		for {
			r, err := st.Recv()
			if errors.Is(err, io.EOF) {
				return last, text.String(), nil
			}
			if err != nil {
				return nil, "", err
			}
			text.WriteString(r.GetDelta())
			last = r
		}
	}
	msgs := []*modelproxyv1.Message{{Role: modelproxyv1.Role_ROLE_USER, Content: "hello"}}

	t.Run("fallback and breaker", func(t *testing.T) {
		before := len(ups["primary"].calls(t))
		ups["primary"].enqueue(t, `{"status": 503}`, `{"status": 503}`, `{"status": 503}`)
		for i := range 3 {
			fin, _, err := gen(t, fmt.Sprintf("fb/m%d", i), &modelproxyv1.GenerateRequest{Model: "agent", Messages: msgs})
			if err != nil || fin.GetProvider() != "backup" {
				t.Fatalf("call %d: %v from %v", i, err, fin)
			}
		}
		if got := len(ups["primary"].calls(t)) - before; got != 3 {
			t.Fatalf("primary saw %d requests, want 3", got)
		}
		// Open: straight to the backup, nothing sent to the primary.
		for i := 3; i < 6; i++ {
			fin, _, err := gen(t, fmt.Sprintf("fb/m%d", i), &modelproxyv1.GenerateRequest{Model: "agent", Messages: msgs})
			if err != nil || fin.GetProvider() != "backup" {
				t.Fatalf("call %d: %v from %v", i, err, fin)
			}
		}
		if got := len(ups["primary"].calls(t)) - before; got != 3 {
			t.Fatalf("primary saw %d requests with its breaker open, want still 3", got)
		}
		if v := sum(scrape(t, m, "modelproxy"), "curfew_circuit_breaker_state", map[string]string{"target": "primary", "state": "open"}); v != 1 {
			t.Fatalf("curfew_circuit_breaker_state{target=primary,state=open} = %v", v)
		}
		report, err := m.Report("modelproxy")
		if err != nil {
			t.Fatal(err)
		}
		lr, err := report.ListNodes(ctx, &meshv1.ListNodesRequest{RunId: "e2e-providers", NodePrefixes: []string{"fb/m4"}})
		if err != nil || len(lr.GetNodes()) != 1 || len(lr.GetNodes()[0].GetFallbacks()) != 1 || lr.GetNodes()[0].GetFallbacks()[0].GetReason() != "breaker_open" {
			t.Fatalf("node fb/m4: %v %v", lr, err)
		}
		// After the open timeout (1 s ± 1 %) the recovered primary gets one probe, which
		// closes the breaker.
		time.Sleep(1200 * time.Millisecond)
		fin, _, err := gen(t, "fb/m6", &modelproxyv1.GenerateRequest{Model: "agent", Messages: msgs})
		if err != nil || fin.GetProvider() != "primary" {
			t.Fatalf("probe: %v from %v", err, fin)
		}
		if got := len(ups["primary"].calls(t)) - before; got != 4 {
			t.Fatalf("primary saw %d requests, want 3 and the probe", got)
		}
		if v := sum(scrape(t, m, "modelproxy"), "curfew_circuit_breaker_state", map[string]string{"target": "primary", "state": "closed"}); v != 1 {
			t.Fatalf("curfew_circuit_breaker_state{target=primary,state=closed} = %v", v)
		}
	})

	t.Run("degrade", func(t *testing.T) {
		ups["primary"].enqueue(t, `{"content": ["{\"answer\": 42"]}`)
		ups["backup"].enqueue(t, `{"content": ["{\"answer\": \"forty-two\"}"]}`)
		fin, text, err := gen(t, "dg/m0", &modelproxyv1.GenerateRequest{Model: "agent", Messages: msgs,
			ResponseSchema: &modelproxyv1.ResponseSchema{Name: "a", SchemaJson: `{"type": "object", "required": ["answer"], "properties": {"answer": {"type": "string"}}}`}})
		if err != nil || fin.GetServedModel() != "small" || text != `{"answer": "forty-two"}` {
			t.Fatalf("degrade: %v, %q from %v", err, text, fin)
		}
		report, err := m.Report("modelproxy")
		if err != nil {
			t.Fatal(err)
		}
		lr, err := report.ListNodes(ctx, &meshv1.ListNodesRequest{RunId: "e2e-providers", NodePrefixes: []string{"dg/m0"}})
		if err != nil || len(lr.GetNodes()) != 1 {
			t.Fatal(lr, err)
		}
		if n := lr.GetNodes()[0]; n.GetServedModel() != "small" || len(n.GetFallbacks()) != 1 || n.GetFallbacks()[0].GetReason() != "invalid_output" {
			t.Fatalf("node dg/m0 = %v", n)
		}
		if v := sum(scrape(t, m, "modelproxy"), "curfew_model_output_validation_failures_total", map[string]string{"provider": "primary"}); v != 1 {
			t.Fatalf("validation failures = %v", v)
		}
	})

	t.Run("cache", func(t *testing.T) {
		before := len(ups["primary"].calls(t))
		req := &modelproxyv1.GenerateRequest{Model: "agent", Messages: []*modelproxyv1.Message{{Role: modelproxyv1.Role_ROLE_USER, Content: "cache me"}}, Temperature: proto.Float64(0)}
		fin1, text1, err := gen(t, "ca/m0", req)
		if err != nil || fin1.GetCached() {
			t.Fatal(err, fin1)
		}
		fin2, text2, err := gen(t, "ca/m1", req)
		if err != nil || !fin2.GetCached() || text2 != text1 {
			t.Fatalf("retry: %v, %q (first %q), %v", err, text2, text1, fin2)
		}
		if got := len(ups["primary"].calls(t)) - before; got != 1 {
			t.Fatalf("upstream saw %d requests, want 1", got)
		}
		report, err := m.Report("modelproxy")
		if err != nil {
			t.Fatal(err)
		}
		lr, err := report.ListNodes(ctx, &meshv1.ListNodesRequest{RunId: "e2e-providers", NodePrefixes: []string{"ca/m1"}})
		if err != nil || len(lr.GetNodes()) != 1 || lr.GetNodes()[0].GetTokens() != 0 || !lr.GetNodes()[0].GetCached() {
			t.Fatalf("cached node: %v %v", lr, err)
		}
	})
}
