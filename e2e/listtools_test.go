package e2e

import (
	"context"
	"encoding/json"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"

	meshv1 "github.com/curfew-mesh/curfew/gen/curfew/mesh/v1"
	orchestratorv1 "github.com/curfew-mesh/curfew/gen/curfew/orchestrator/v1"
	toolv1 "github.com/curfew-mesh/curfew/gen/curfew/tool/v1"
	toolrunnerv1 "github.com/curfew-mesh/curfew/gen/curfew/toolrunner/v1"
	"github.com/curfew-mesh/curfew/mesh/meshtls"
	"github.com/curfew-mesh/curfew/mesh/toolserver"
)

// Over the real processes: a real model (an OpenAI-format HTTP server behind modelproxy)
// is told of a team's gRPC tool as a function whose parameters are the tool's input
// schema, calls it by its model-visible name, and the run ends with its answer; a tool
// of another tenant's is not offered.
func TestModelCallsTeamToolOverRealProcesses(t *testing.T) {
	t.Parallel()
	const schema = `{"type": "object", "required": ["id"], "properties": {"id": {"type": "string", "description": "the order id"}}}`
	var mu sync.Mutex
	var seen []toolserver.Call
	srv := toolserver.New(
		toolserver.Tool{Name: "lookup", Description: "Looks an order up by its id.", InputSchema: json.RawMessage(schema),
			SideEffects: toolv1.SideEffects_SIDE_EFFECTS_NONE,
			Handler: func(_ context.Context, c toolserver.Call, _ func(done, total float64, msg string)) (json.RawMessage, error) {
				mu.Lock()
				seen = append(seen, c)
				mu.Unlock()
				return json.RawMessage(`{"order": "o-7", "state": "shipped"}`), nil
			}},
		toolserver.Tool{Name: "secret", Description: "Only acme's.", SideEffects: toolv1.SideEffects_SIDE_EFFECTS_NONE,
			Handler: func(context.Context, toolserver.Call, func(done, total float64, msg string)) (json.RawMessage, error) {
				return json.RawMessage(`1`), nil
			}})
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	gs := grpc.NewServer()
	srv.Register(gs)
	go func() { _ = gs.Serve(lis) }()
	t.Cleanup(gs.Stop)
	tools := filepath.Join(t.TempDir(), "tools.json")
	if err := os.WriteFile(tools, []byte(`{"sources": [{"name": "team", "kind": "grpc", "address": "`+lis.Addr().String()+`", "trusted": true,
	  "tools": {"secret": {"tenants": ["acme"]}}}]}`), 0o600); err != nil {
		t.Fatal(err)
	}
	up := startUpstream(t)
	m := startProviderMesh(t, `{"providers": [{"name": "primary", "base_url": "{primary}", "models": ["big"]}], "models": {"agent": {"chain": ["primary/big"]}}}`,
		map[string]*upstream{"primary": up}, "CURFEW_TOOLS_CONFIG="+tools)
	up.enqueue(t,
		`{"content": ["Looking"], "tool_calls": [{"id": "call_1", "name": "team__lookup", "arguments": "{\"id\": \"o-7\"}"}], "finish_reason": "tool_calls"}`,
		`{"content": ["o-7", " has", " shipped"]}`)
	oc, err := m.Orchestrator()
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	// toolrunner lists the source in the background: wait until it lists the tool (asked
	// as the orchestrator asks), so that the run's first model step is told of it.
	conn, err := m.ConnAs(meshtls.Orchestrator, "toolrunner")
	if err != nil {
		t.Fatal(err)
	}
	tr := toolrunnerv1.NewToolRunnerServiceClient(conn)
	for end := time.Now().Add(30 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		resp, err := tr.ListTools(ctx, &toolrunnerv1.ListToolsRequest{})
		if err == nil && slices.ContainsFunc(resp.GetTools(), func(ti *toolrunnerv1.ToolInfo) bool { return ti.GetName() == "team__lookup" }) {
			break
		}
		if time.Now().After(end) {
			t.Fatalf("toolrunner did not list team__lookup: %v %v", resp, err)
		}
	}
	fin := runToSummary(ctx, t, oc, &orchestratorv1.RunRequest{Task: "where is order o-7?", Model: "agent"})
	if fin.GetStatus() != orchestratorv1.RunStatus_RUN_STATUS_SUCCEEDED || fin.GetAnswer() != "o-7 has shipped" {
		t.Fatalf("run ended %v: %s", fin.GetStatus(), dump(fin))
	}
	if n := nodeMap(fin)["root/s0.t0"]; n.GetName() != "team__lookup" || n.GetStatus() != meshv1.NodeStatus_NODE_STATUS_SUCCEEDED {
		t.Fatalf("tool node = %v\n%s", n, dump(fin))
	}
	mu.Lock()
	last := seen[len(seen)-1]
	mu.Unlock()
	if last.RunID != fin.GetRunId() || string(last.Args) != `{"id": "o-7"}` {
		t.Errorf("the tool server saw %+v, want run %s with the model's arguments", last, fin.GetRunId())
	}

	// The model's first request of the run told it of the tool, as OpenAI's function
	// tool with the tool's schema as its parameters.
	calls := up.calls(t)
	var req struct {
		Tools []struct {
			Type     string `json:"type"`
			Function struct {
				Name        string          `json:"name"`
				Description string          `json:"description"`
				Parameters  json.RawMessage `json:"parameters"`
			} `json:"function"`
		} `json:"tools"`
	}
	if err := json.Unmarshal(calls[len(calls)-2].Request.Body, &req); err != nil {
		t.Fatal(err)
	}
	var names []string
	found := false
	for _, tl := range req.Tools {
		names = append(names, tl.Function.Name)
		if tl.Function.Name != "team__lookup" {
			continue
		}
		found = true
		var got, want any
		_ = json.Unmarshal(tl.Function.Parameters, &got)
		_ = json.Unmarshal([]byte(schema), &want)
		gb, _ := json.Marshal(got)
		wb, _ := json.Marshal(want)
		if tl.Type != "function" || tl.Function.Description != "Looks an order up by its id." || string(gb) != string(wb) {
			t.Errorf("team__lookup was offered as %+v, want a function with the tool's description and schema", tl)
		}
	}
	if !found || !strings.Contains(strings.Join(names, ","), "sleep") {
		t.Errorf("the model was told of %v, want the built-ins and team__lookup", names)
	}
	if strings.Contains(strings.Join(names, ","), "team__secret") {
		t.Errorf("the default tenant's model was told of team__secret, a tool of acme's only: %v", names)
	}
}
